"""Re-ranking candidate pages by their exact attention mass (``--sparse-rerank-factor``).

Summaries score pages from a bound or a sketch of their keys, and on real text that ranking loses
answers the true mass keeps (docs/decisions/0017-rerank-candidates-by-exact-mass.md). With a
factor ``F > 1`` a decode step selects ``F x K`` candidate pages per (request, kv head) from the
summaries, loads them into the request's cache row like any selection, and then keeps the ``K``
with the most attention mass, computed from their keys against the step's queries:

1. :func:`candidate_page_lse`: per candidate page and query head of the group, the log of
   ``sum_t exp(s * q_g . k_t)`` over the page's tokens (one Triton program per candidate; the keys
   are read from the page cache, never the values);
2. :func:`rerank_priority`: each head's masses as shares of that head's total over the
   candidates (the newest page's left out), summed over the group (the oracle's ranking, with the
   candidates' total standing in for the whole context's); the sink and recent pages rank first,
   as in every selection;
3. :func:`choose_reranked`: the ``K`` best, in ascending page order (FlashInfer's fixed order).

Contracts
---------
- Candidate rows are laid out densely, ``[rows, Kc]`` with ``rows = B * Hkv``: row ``r``'s first
  ``count[r]`` entries are its candidates' cache slots (``slots``) and logical pages
  (``pages``), ascending by page; entries past ``count[r]`` may hold anything and are never read.
- Every output has fixed shapes (CUDA-graph steps replay them); a row with fewer than ``K``
  candidates keeps them all and pads with ``-1``.

The torch references are :func:`~sparse_sglang.attention.reference.candidate_page_lse_reference`
(beside the other kernels' references); the CPU tests run the kernel in Triton's interpreter
against it.
"""

from __future__ import annotations

import math

import torch

try:  # Triton comes with CUDA builds of torch (and runs on the CPU in its interpreter).
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


if triton is not None:

    @triton.jit
    def _candidate_lse_kernel(
        q_ptr, k_ptr, slots_ptr, count_ptr, out_ptr, scale, soft_cap,
        KC: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, P: tl.constexpr, D: tl.constexpr,
        SOFT_CAP: tl.constexpr,
    ):  # fmt: skip
        # One program per (row, candidate j): the page's keys [P, D] against the row's G queries.
        row = tl.program_id(0)
        j = tl.program_id(1)
        offs_g = tl.arange(0, GP)
        g_ok = offs_g < G
        valid = j < tl.load(count_ptr + row)
        slot = tl.load(slots_ptr + row * KC + j, mask=valid, other=0).to(tl.int64)
        offs_p = tl.arange(0, P)
        offs_d = tl.arange(0, D)
        k = tl.load(k_ptr + slot * P * D + offs_p[:, None] * D + offs_d[None, :], mask=valid, other=0.0)  # [P, D]
        q = tl.load(q_ptr + (row * G + offs_g[:, None]) * D + offs_d[None, :], mask=g_ok[:, None], other=0.0)
        # fp32 operands and sums (exact, as the reference: a ranking near a tie must not turn on tf32)
        logits = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee") * scale  # [GP, P]
        if SOFT_CAP:
            logits = soft_cap * (2.0 / (1.0 + tl.exp(-2.0 * logits / soft_cap)) - 1.0)  # cap * tanh(x / cap)
        top = tl.max(logits, axis=1)
        lse = top + tl.log(tl.sum(tl.exp(logits - top[:, None]), axis=1))
        lse = tl.where(valid, lse, float("-inf"))
        out = out_ptr + (row * KC + j) * G + offs_g
        tl.store(out, lse, mask=g_ok)


def candidate_page_lse(q: torch.Tensor, k_cache: torch.Tensor, slots: torch.Tensor, count: torch.Tensor,
                       sm_scale: float, k_scale: float | None = None,
                       logits_soft_cap: float | None = None) -> torch.Tensor:  # fmt: skip
    """``[rows, Kc, G]`` float32: per candidate page and query head, ``log sum_t exp(x_t)`` with
    ``x_t = sm_scale * q_g . k_t`` (soft-capped when the model caps its logits) over the page's
    ``page_size`` tokens; ``-inf`` past each row's ``count``.

    Parameters
    ----------
    q : torch.Tensor
        ``[rows, G, D]`` the step's queries, a row's ``G`` query heads sharing its kv head.
    k_cache : torch.Tensor
        ``[num_slots, page_size, D]`` the page cache's keys (any float dtype; fp8 keys are scaled
        by ``k_scale``).
    slots, count : torch.Tensor
        ``[rows, Kc]`` int32 cache slots of the candidates and ``[rows]`` int32 how many each row has.

    A candidate page that is a request's newest one is read whole, tokens past its fill included:
    that page is always attended, so its mass is never compared.
    """
    rows, group, dim = q.shape
    kc = slots.shape[1]
    if not k_cache.is_contiguous():
        raise ValueError("the page cache's keys must be contiguous [num_slots, page_size, D]")
    page = k_cache.shape[1]
    out = torch.empty(rows, kc, group, dtype=torch.float32, device=q.device)
    if rows == 0 or kc == 0:
        return out
    scale = sm_scale * (1.0 if k_scale is None else float(k_scale))
    _candidate_lse_kernel[(rows, kc)](
        q.contiguous(), k_cache, slots.contiguous(), count.contiguous(), out, scale, float(logits_soft_cap or 0.0),
        KC=kc, G=group, GP=max(16, triton.next_power_of_2(group)), P=page, D=dim, SOFT_CAP=bool(logits_soft_cap),
    )  # fmt: skip
    return out


def rerank_priority(lse: torch.Tensor, pages: torch.Tensor, count: torch.Tensor, num_pages: torch.Tensor,
                    forced: tuple[int, int]) -> torch.Tensor:  # fmt: skip
    """``[rows, Kc]`` float32 priorities of the candidates: ``log sum_g share_g``, with ``share_g``
    a page's mass for query head ``g`` over that head's total over the row's candidates, the
    request's newest page left out of the total (the kernel reads that partial page whole, so its
    mass is not known; it is attended anyway); ``+inf`` for the forced pages (``forced = (sink,
    recent)``: the first ``sink`` and last ``recent`` of a request's ``num_pages`` ``[rows]``),
    ``-inf`` past ``count``."""
    kc = pages.shape[1]
    valid = torch.arange(kc, device=pages.device).view(1, -1) < count.view(-1, 1)
    newest = pages == num_pages.view(-1, 1) - 1
    lse = lse.masked_fill(~(valid & ~newest).unsqueeze(-1), -math.inf)
    total = torch.logsumexp(lse, dim=1, keepdim=True)  # [rows, 1, G]
    share = torch.where(torch.isfinite(total), lse - total, torch.full_like(lse, -math.inf))
    priority = torch.logsumexp(share, dim=2)  # [rows, Kc]
    sink, recent = forced
    is_forced = (pages < sink) | (pages >= num_pages.view(-1, 1) - recent)
    priority = torch.where(valid & is_forced, torch.full_like(priority, math.inf), priority)
    return priority.masked_fill(~valid, -math.inf)


def choose_reranked(priority: torch.Tensor, pages: torch.Tensor, slots: torch.Tensor,
                    k: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The ``k`` highest-priority candidates of each row, ascending by page: ``([rows, k]`` logical
    pages, ``[rows, k]`` cache slots), ``-1`` where a row has fewer than ``k`` (equal priorities:
    any of them, as ``torch.topk`` picks)."""
    kc = priority.shape[1]
    if k >= kc:
        keep = priority > -math.inf
        return torch.where(keep, pages, -1), torch.where(keep, slots, -1)
    top = torch.topk(priority, k, dim=1, sorted=False)
    position = torch.where(top.values > -math.inf, top.indices, kc).sort(dim=1).values  # kc: none
    chosen = position < kc
    at = position.clamp(max=kc - 1)
    return (torch.where(chosen, pages.gather(1, at), -1), torch.where(chosen, slots.gather(1, at), -1))


def rerank_candidates(candidates: torch.Tensor, row_pages: torch.Tensor, slots: torch.Tensor, q: torch.Tensor,
                      k_cache: torch.Tensor, k: int, forced: tuple[int, int], sm_scale: float,
                      k_scale: float | None = None,
                      logits_soft_cap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One layer's re-rank after its candidates are loaded: ``([rows, k]`` pages, ``[rows, k]`` cache
    slots) to attend, ascending by page, ``-1`` padded.

    ``candidates`` ``[B, Hkv, Kc]``: the selection's pages in any order (``-1`` or ``>= row_pages``,
    the pages of each row's request ``[rows]``: none); ``slots`` ``[rows, Kc]``: their cache slots
    as the retrieve kernel writes a row, the valid pages' in ascending page order; ``q``
    ``[rows, G, D]``.
    """
    kc = candidates.shape[-1]
    candidates = candidates.reshape(-1, kc)
    valid = (candidates >= 0) & (candidates < row_pages.view(-1, 1))
    # The valid pages sorted (none last) line up with the slots the kernel wrote.
    pages = torch.where(valid, candidates, torch.iinfo(torch.int32).max).sort(dim=-1).values
    count = valid.sum(dim=-1, dtype=torch.int32)
    lse = candidate_page_lse(q, k_cache, slots, count, sm_scale, k_scale, logits_soft_cap)
    priority = rerank_priority(lse, pages, count, row_pages, forced)
    return choose_reranked(priority, pages, slots, k)
