"""Plain-torch references of the decode path's kernels, apart from them (as
:mod:`sparse_sglang.transfer.reference` is for the transfer kernels).

- :func:`score_pages_reference`, :func:`score_coarse_reference`, :func:`score_candidates_reference`:
  the score kernels of :mod:`sparse_sglang.attention.scoring` (summaries gathered into dense
  tensors, scored by the :class:`~sparse_sglang.attention.Selector`).
- :func:`candidate_page_lse_reference`: :func:`~sparse_sglang.attention.rerank.candidate_page_lse`
  (the re-rank's per-page log-masses from the cached keys).
- :func:`choose_reranked_reference`: :func:`~sparse_sglang.attention.rerank.choose_reranked` (the
  re-rank's priorities, :func:`rerank_priority_reference`, and its choice of the best).
- :func:`choose_by_sketch_reference`: :func:`~sparse_sglang.attention.rerank.choose_by_sketch`
  (candidates re-ranked by their key sketches).
- :func:`choose_by_codes_reference`: :func:`~sparse_sglang.attention.rerank.choose_by_codes`
  (candidates re-ranked by their mass from their low-bit key codes).
- :func:`share_budget_reference`: :func:`~sparse_sglang.attention.budget_share.share_budget` (a
  layer's pages shared among its kv heads by estimated mass), request by request and head by head.
- :func:`retrieve_reference`: :func:`~sparse_sglang.attention.retrieval.retrieve_pages`'s choices
  (hits, LRU victims, table updates) in torch ops over the cache's public methods. The decoder
  also runs it for rows too wide for the kernel's one program
  (:func:`~sparse_sglang.attention.retrieval.fits_fused_retrieve`).

The CPU tests compare each kernel (run in Triton's interpreter) with its reference here.

Evaluation references, which no kernel implements and the server never runs (the CPU tests, the
GPU tests' ground truth, ``benchmark/quality.py``):

- :func:`sparse_attention_reference`: decode attention over the tokens of the selected pages
  (float32 math; ``page_ids=None`` is dense attention), what the GPU decode path must return.
- :func:`attention_mass_recall`: the share of each query head's dense softmax mass on the
  selected tokens (:func:`selected_token_mask`).
- :func:`max_reduce_logical`: LServe's hierarchical paging; score small *logical* pages, keep
  *physical* pages by the max over the logical pages they hold.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from sparse_sglang.attention.budget_share import CAP_UNITS, FLOOR_UNITS, UNITS, SharedSelection, unit_pages
from sparse_sglang.attention.scoring import candidate_pages, coarse_host_pages
from sparse_sglang.attention.selection import force_pages, keep_cached
from sparse_sglang.attention.selectors import DEFAULT_GROUP_REDUCE, get_selector
from sparse_sglang.mem_cache.bounds import dequantize_bounds
from sparse_sglang.mem_cache.gpu_cache import CachedRows, GPUPageCache
from sparse_sglang.mem_cache.host_pool import host_block
from sparse_sglang.mem_cache.key_codes import decode_codes
from sparse_sglang.mem_cache.key_sketch import project_query, sketch_page_scores


def gather_layer(summary: torch.Tensor, host_pages: torch.Tensor) -> torch.Tensor:
    """``[Hkv, num_host_pages, D]`` summaries of one layer -> ``[B, Hkv, N, D]`` for the pages
    ``host_pages`` ``[B, N]`` (entries past a request's pages may be any valid page id)."""
    return summary[:, host_pages.long()].permute(1, 0, 2, 3)


def score_pages_reference(
    selector: str,
    q: torch.Tensor,
    layer_summaries: dict[str, torch.Tensor],
    host_pages: torch.Tensor,
    num_pages: torch.Tensor,
    group_reduce: str = DEFAULT_GROUP_REDUCE,
    forced: tuple[int, int] | None = None,
    reuse: CachedRows | None = None,
) -> torch.Tensor:
    """Scores of every page of every request (plain torch): what
    :func:`~sparse_sglang.attention.scoring.score_pages` computes.

    Parameters
    ----------
    selector : str
        A registered selector name.
    q : torch.Tensor
        ``[B, Hkv, G, D]`` decode queries.
    layer_summaries : dict
        ``kmin``/``kmax``/``mean``/``radius`` of one layer, each ``[Hkv, num_host_pages, D]``
        (only those the selector reads are needed), and ``bound_exp`` ``[Hkv, num_host_pages]``
        when the bounds are int8 levels (:meth:`PageSummaries.layer <sparse_sglang.mem_cache.PageSummaries.layer>`).
    host_pages : torch.Tensor
        ``[B, N]`` host page id of each logical page (anything valid past ``num_pages``).
    num_pages : torch.Tensor
        ``[B]`` pages each request holds.
    forced : (int, int), optional
        ``(sink, recent)``: the output is a selection priority, those pages ``+inf``
        (:func:`~sparse_sglang.attention.selection.force_pages`).
    reuse : CachedRows, optional
        Requests not due for a full selection choose only among the pages their rows hold
        (:func:`~sparse_sglang.attention.selection.keep_cached`).
    """
    sel = get_selector(selector)
    gathered = {name: gather_layer(layer_summaries[name], host_pages) for name in sel.summaries}
    if "bound_exp" in layer_summaries and "kmin" in gathered:  # int8 levels -> values
        e = layer_summaries["bound_exp"][:, host_pages.long()].permute(1, 0, 2)
        for name in ("kmin", "kmax"):
            gathered[name] = dequantize_bounds(gathered[name], e)
    scores = sel.score(q, gathered.get("kmin"), gathered.get("kmax"), gathered.get("mean"), group_reduce,
                       radius=gathered.get("radius"), sketch=gathered.get("sketch"))  # fmt: skip
    held = torch.arange(host_pages.shape[1], device=q.device) < num_pages.to(q.device).view(-1, 1)
    scores = scores.masked_fill(~held.unsqueeze(1), -math.inf)
    scores = scores if forced is None else force_pages(scores, num_pages, *forced)
    return scores if reuse is None else keep_cached(scores, reuse.held(scores.shape[-1]), reuse.reselect)


def score_coarse_reference(
    q: torch.Tensor,
    coarse_summaries: dict[str, torch.Tensor],
    host_pages: torch.Tensor,
    built: torch.Tensor,
    coarse_pages: int,
    sink_pages: int,
    group_reduce: str = DEFAULT_GROUP_REDUCE,
) -> torch.Tensor:
    """:func:`~sparse_sglang.attention.scoring.score_coarse` in plain torch (same arguments)."""
    supers = coarse_host_pages(host_pages, coarse_pages)
    sink_supers = -(-sink_pages // coarse_pages)
    scores = score_pages_reference("quest", q, coarse_summaries, supers, built, group_reduce)
    return force_pages(scores, built, sink_supers, 0) if sink_supers else scores


def score_candidates_reference(
    selector: str,
    q: torch.Tensor,
    layer_summaries: dict[str, torch.Tensor],
    host_pages: torch.Tensor,
    num_pages: torch.Tensor,
    supers: torch.Tensor,
    built: torch.Tensor,
    coarse_pages: int,
    tail: int,
    group_reduce: str = DEFAULT_GROUP_REDUCE,
    forced: tuple[int, int] = (0, 1),
    reuse: CachedRows | None = None,
) -> torch.Tensor:
    """:func:`~sparse_sglang.attention.scoring.score_candidates` in plain torch (same arguments;
    ``tail`` is not needed here)."""
    host_pages, max_pages = host_pages.contiguous(), host_pages.shape[1]
    scores = score_pages_reference(selector, q, layer_summaries, host_pages, num_pages, group_reduce, forced=forced,
                                   reuse=reuse)  # fmt: skip
    keep = candidate_pages(supers, built, num_pages, coarse_pages, max_pages)
    if reuse is not None:  # rows reusing their selection keep score_pages' priorities
        keep = keep | ~reuse.reselect.to(keep.device).view(-1, 1, 1)
    return scores.masked_fill(~keep, -math.inf)


def share_budget_reference(log_shares: torch.Tensor, num_pages: torch.Tensor, budget_pages: int, sink_pages: int,
                           recent_pages: int) -> SharedSelection:  # fmt: skip
    """:func:`~sparse_sglang.attention.budget_share.share_budget`, one request and one head at a
    time (its parameters and result; ties between equal shares may break otherwise)."""
    batch, heads, _ = log_shares.shape
    u = unit_pages(budget_pages)
    page_ids = torch.full((batch, heads, CAP_UNITS * u), -1, dtype=torch.int32)
    widths = torch.zeros(batch, heads, dtype=torch.int32)
    for b in range(batch):
        n = int(num_pages[b])
        if n <= budget_pages:  # every page on every head
            page_ids[b, :, :n], widths[b] = torch.arange(n, dtype=torch.int32), n
            continue
        kept, units = [], []  # per head: its floor pages; its next units (pages, mass), best first
        for h in range(heads):
            s = log_shares[b, h, :n].float()
            forced = sorted(set(range(min(sink_pages, n))) | set(range(n - recent_pages, n)))
            rest = [p for p in s.argsort(descending=True).tolist() if p not in forced]
            kept.append(forced + rest[: FLOOR_UNITS * u - len(forced)])
            share = s.exp()
            others = [p for p in share.argsort(descending=True).tolist() if p not in kept[h]]
            units.append([(others[i : i + u], float(share[others[i : i + u]].sum()))
                          for i in range(0, (CAP_UNITS - FLOOR_UNITS) * u, u) if i + u <= len(others)])  # fmt: skip
        ranked = sorted(((mass, h, i) for h in range(heads) for i, (_, mass) in enumerate(units[h])), reverse=True)
        count = [0] * heads
        for _, h, _ in ranked[: heads * (UNITS - FLOOR_UNITS)]:
            count[h] += 1
        for h in range(heads):
            pages = sorted(kept[h] + [p for unit, _ in units[h][: count[h]] for p in unit])
            page_ids[b, h, : len(pages)], widths[b, h] = torch.tensor(pages, dtype=torch.int32), len(pages)
    return SharedSelection(page_ids, widths)


def retrieve_reference(
    cache: GPUPageCache,
    layer: int,
    req_slots: torch.Tensor,
    page_ids: torch.Tensor,
    host_pages: torch.Tensor,
    load: Callable[[torch.Tensor, torch.Tensor], None],
    num_host_pages: int,
) -> torch.Tensor:
    """Slots holding the selected pages of one layer, loading the misses from the host.

    Parameters
    ----------
    cache : GPUPageCache
    layer : int
    req_slots : torch.Tensor
        ``[B]`` request slots (each open).
    page_ids : torch.Tensor
        ``[B, Hkv, K]`` selected logical pages, ``-1`` padded; ``K <= row_width``.
    host_pages : torch.Tensor
        ``[B, N]`` host page id of each logical page of each request.
    load : callable
        ``load(src_blocks, dst_slots)`` copies host blocks into slots, skipping ``dst < 0``
        (FlashH2D, or ``gather_blocks_reference`` on the CPU).
    num_host_pages : int
        Pages in the host store (its flat block index is ``(layer * Hkv + head) * N + page``).

    Returns
    -------
    torch.Tensor
        ``[B, Hkv, K]`` int64 slots, ``-1`` where ``page_ids`` is.

    Notes
    -----
    Hits are marked used in this step first; the row's other slots, sorted by last use
    (empty ones first), are the victims, and the ``i``-th miss of a row takes its ``i``-th
    victim. Every row has at least ``K - hits >= misses`` such slots.
    """
    batch, heads, width = page_ids.shape
    assert width <= cache.row_width, f"{width} selected pages exceed the cache row ({cache.row_width})"
    req = req_slots.long().view(batch, 1, 1)
    head = torch.arange(heads, device=cache.rows.device).view(1, heads, 1)
    page = page_ids.long()
    hit = cache.page_table.lookup(req, layer, head, page).long()  # [B, H, K]
    cache.last_used[cache.scratch(hit)] = cache.step
    miss = (page >= 0) & (hit < 0)
    cache.counters += torch.stack([(page >= 0).sum(), miss.sum()])

    row = cache.rows[req_slots.long(), layer]  # [B, H, W], -1 past the row's width
    never = torch.iinfo(torch.int64).max  # columns past the width are never victims
    recency = cache.recency(cache.last_used[cache.scratch(row)])
    victims = row.gather(-1, torch.where(row >= 0, recency, never).argsort(dim=-1, stable=True))
    rank = (miss.long().cumsum(-1) - 1).clamp(0, cache.row_width - 1)
    dst = torch.where(miss, victims.gather(-1, rank), -1)  # [B, H, K]

    # Unmap what the victims held, map the misses, then fill them.
    old = torch.where(dst >= 0, cache.slot_page[cache.scratch(dst)], -1)
    cache.page_table.invalidate(req, layer, head, old)
    cache.page_table.assign(req, layer, head, torch.where(miss, page, -1), dst)
    cache.slot_page[cache.scratch(dst)] = torch.where(miss, page, -1)
    cache.last_used[cache.scratch(dst)] = cache.step
    host_page = host_pages.long().gather(1, page.clamp_min(0).view(batch, -1)).view(batch, heads, width)
    src = host_block(layer, head, host_page, cache.num_kv_heads, num_host_pages)
    load(src.reshape(-1), dst.reshape(-1))
    return torch.where(miss, dst, hit)


def candidate_page_lse_reference(q: torch.Tensor, k_cache: torch.Tensor, slots: torch.Tensor, count: torch.Tensor,
                                 sm_scale: float, k_scale: float | None = None,
                                 logits_soft_cap: float | None = None) -> torch.Tensor:  # fmt: skip
    """:func:`~sparse_sglang.attention.rerank.candidate_page_lse` in torch: the candidates' keys
    gathered ``[rows, Kc, P, D]``, logits against the group's queries, a log-sum-exp per page."""
    rows, kc = slots.shape
    valid = torch.arange(kc, device=slots.device).view(1, -1) < count.view(-1, 1)
    stored = k_cache[torch.where(valid, slots, 0).long()]
    keys = stored.float() * (1.0 if k_scale is None else float(k_scale))
    logits = torch.einsum("rgd,rjpd->rjgp", q.float(), keys) * sm_scale
    if logits_soft_cap:
        logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
    return torch.logsumexp(logits, dim=-1).masked_fill(~valid.unsqueeze(-1), -math.inf)


def rerank_priority_reference(lse: torch.Tensor, pages: torch.Tensor, count: torch.Tensor, num_pages: torch.Tensor,
                              forced: tuple[int, int]) -> torch.Tensor:  # fmt: skip
    """``[rows, Kc]`` float32 priorities of a re-rank's candidates (``pages`` ``[rows, Kc]``, each
    row's first ``count`` valid, ascending): ``log sum_g share_g``, with ``share_g`` a page's mass
    for query head ``g`` over that head's total over the row's candidates, the request's newest
    page left out of the total (its partial page is read whole, so its mass is not known; it is
    attended anyway); ``+inf`` for the forced pages (``forced = (sink, recent)``: the first
    ``sink`` and last ``recent`` of a request's ``num_pages`` ``[rows]``), ``-inf`` past ``count``."""
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


def choose_reranked_reference(candidates: torch.Tensor, row_pages: torch.Tensor, lse: torch.Tensor,
                              slots: torch.Tensor, k: int,
                              forced: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """:func:`~sparse_sglang.attention.rerank.choose_reranked` in torch: the valid candidates
    sorted, their priorities, the ``k`` best by ``torch.topk`` (at equal priorities any of them),
    ascending by page, ``-1`` padded."""
    kc = candidates.shape[1]
    valid = (candidates >= 0) & (candidates < row_pages.view(-1, 1))
    pages = torch.where(valid, candidates.long(), torch.iinfo(torch.int64).max).sort(dim=-1).values
    count = valid.sum(dim=-1)
    priority = rerank_priority_reference(lse, pages, count, row_pages, forced)
    if k >= kc:
        keep = priority > -math.inf
        return torch.where(keep, pages, -1), torch.where(keep, slots, -1)
    top = torch.topk(priority, k, dim=1, sorted=False)
    position = torch.where(top.values > -math.inf, top.indices, kc).sort(dim=1).values  # kc: none
    chosen = position < kc
    at = position.clamp(max=kc - 1)
    return (torch.where(chosen, pages.gather(1, at), -1), torch.where(chosen, slots.gather(1, at), -1))


def choose_by_sketch_reference(qg: torch.Tensor, query_basis: torch.Tensor, sketch: torch.Tensor,
                               host_pages: torch.Tensor, candidates: torch.Tensor, num_pages: torch.Tensor, k: int,
                               forced: tuple[int, int]) -> torch.Tensor:  # fmt: skip
    """:func:`~sparse_sglang.attention.rerank.choose_by_sketch` in torch: the projected query
    (:func:`~sparse_sglang.mem_cache.key_sketch.project_query`), the candidates' sketch rows
    gathered and scored by :func:`~sparse_sglang.mem_cache.key_sketch.sketch_page_scores`, the
    forced pages first, ``torch.topk`` (at equal scores any of them); ``[B, Hkv, k]`` int32 in
    ascending page order, ``-1`` padded."""
    batch, heads, kc = candidates.shape
    n = num_pages.view(-1, 1, 1)
    valid = (candidates >= 0) & (candidates < n)
    page = torch.where(valid, candidates, 0).long()
    host = host_pages.long().gather(1, page.view(batch, -1)).view(batch, heads, kc)
    rows = sketch[torch.arange(heads, device=sketch.device).view(1, -1, 1), host]  # [B, Hkv, Kc, P * R]
    score = sketch_page_scores(project_query(qg, query_basis), rows).squeeze(2)  # [B, Hkv, Kc]
    sink, recent = forced
    is_forced = (page < sink) | (page >= n - recent)
    priority = torch.where(is_forced, torch.full_like(score, math.inf), score).masked_fill(~valid, -math.inf)
    top = torch.topk(priority, min(k, kc), dim=-1)
    chosen = torch.where(
        top.values > -math.inf, candidates.gather(-1, top.indices).long(), torch.iinfo(torch.int64).max
    )
    chosen = chosen.sort(dim=-1).values
    chosen = torch.where(chosen < torch.iinfo(torch.int64).max, chosen, -1)
    return F.pad(chosen, (0, k - chosen.shape[-1]), value=-1).to(torch.int32)


def choose_by_codes_reference(qg: torch.Tensor, codes: dict[str, torch.Tensor], bits: int,
                              host_pages: torch.Tensor, candidates: torch.Tensor, num_pages: torch.Tensor, k: int,
                              forced: tuple[int, int], sm_scale: float, k_scale: float | None = None,
                              logits_soft_cap: float | None = None) -> torch.Tensor:  # fmt: skip
    """:func:`~sparse_sglang.attention.rerank.choose_by_codes` in torch: each row's valid
    candidates sorted, their keys decoded from their codes
    (:func:`~sparse_sglang.mem_cache.key_codes.decode_codes`), their log-masses as
    :func:`candidate_page_lse_reference` takes them, the priorities of
    :func:`rerank_priority_reference` and ``torch.topk`` (at equal priorities any of them);
    ``[B, Hkv, k]`` int32 in ascending page order, ``-1`` padded."""
    batch, heads, group, dim = qg.shape
    kc = candidates.shape[-1]
    n = num_pages.view(-1, 1, 1).long()
    valid = (candidates >= 0) & (candidates < n)
    none = torch.iinfo(torch.int64).max
    pages = torch.where(valid, candidates.long(), none).sort(dim=-1).values  # [B, Hkv, Kc]
    listed = pages != none
    page = torch.where(listed, pages, 0)
    host = host_pages.long().gather(1, page.view(batch, -1)).view(batch, heads, kc)
    head = torch.arange(heads, device=qg.device).view(1, -1, 1)
    keys = decode_codes(codes["codes"][head, host], codes["lo"][head, host], codes["hi"][head, host], bits)
    keys = keys * (1.0 if k_scale is None else float(k_scale))  # [B, Hkv, Kc, P, D]
    logits = torch.einsum("bhgd,bhjpd->bhjgp", qg.float(), keys) * sm_scale
    if logits_soft_cap:
        logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
    lse = torch.logsumexp(logits, dim=-1).masked_fill(~listed.unsqueeze(-1), -math.inf)
    rows = batch * heads
    priority = rerank_priority_reference(lse.view(rows, kc, group), page.view(rows, kc),
                                         listed.view(rows, kc).sum(-1), n.expand(batch, heads, 1).reshape(rows),
                                         forced).view(batch, heads, kc)  # fmt: skip
    top = torch.topk(priority, min(k, kc), dim=-1)
    chosen = torch.where(top.values > -math.inf, pages.gather(-1, top.indices), none).sort(dim=-1).values
    chosen = torch.where(chosen < none, chosen, -1)
    return F.pad(chosen, (0, k - chosen.shape[-1]), value=-1).to(torch.int32)


# Evaluation references: attention over a page selection and the mass it keeps (the accuracy
# suite's CPU decoder, the GPU tests' ground truth), and LServe's logical-page max.


def max_reduce_logical(
    scores: torch.Tensor,
    logical_per_physical: int,
    num_logical: torch.Tensor | None = None,
) -> torch.Tensor:
    """Physical-page scores from logical-page scores by max (LServe §3.5.2, hierarchical paging).

    Parameters
    ----------
    scores : torch.Tensor
        ``[B, Hkv, Nl]`` scores of logical pages; logical page ``j`` lies in physical page
        ``j // logical_per_physical``.
    logical_per_physical : int
        ``g = physical_page_size / logical_page_size``.
    num_logical : torch.Tensor, optional
        ``[B]`` logical pages each request holds; later ones (e.g. the empty tail of the newest
        physical page, whose summaries are empty) are left out of the max.

    Returns
    -------
    torch.Tensor
        ``[B, Hkv, ceil(Nl / g)]`` float32.
    """
    batch, heads, n_logical = scores.shape
    g = logical_per_physical
    scores = scores.float()
    if num_logical is not None:
        held = torch.arange(n_logical, device=scores.device).view(1, 1, -1) < num_logical.to(scores.device).view(
            -1, 1, 1
        )
        scores = torch.where(held, scores, -math.inf)
    scores = F.pad(scores, (0, -n_logical % g), value=-math.inf)
    return scores.view(batch, heads, -1, g).amax(dim=-1)


def selected_token_mask(
    page_ids: torch.Tensor | None, page_size: int, seq_len: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """``[B, Hkv or 1, T]`` bool: token ``t < seq_len`` lies in a selected page (all of them when
    ``page_ids`` is None)."""
    token = torch.arange(num_tokens, device=seq_len.device)
    in_seq = token.view(1, 1, -1) < seq_len.view(-1, 1, 1)
    if page_ids is None:
        return in_seq
    num_pages = -(-num_tokens // page_size)
    ids = page_ids.long().to(seq_len.device)
    ids = torch.where(ids >= 0, ids, num_pages)  # padding -> a spare slot
    chosen = torch.zeros(*ids.shape[:2], num_pages + 1, dtype=torch.bool, device=ids.device)
    chosen.scatter_(-1, ids, True)
    return in_seq & chosen[..., token // page_size]


def _logits(q: torch.Tensor, k: torch.Tensor, seq_len: torch.Tensor, scale: float | None) -> torch.Tensor:
    """``[B, Hkv, G, T]`` float32 scaled ``q . k``, ``-inf`` past ``seq_len``."""
    batch, q_heads, dim = q.shape
    kv_heads, num_tokens = k.shape[1], k.shape[2]
    scale = dim**-0.5 if scale is None else scale
    qg = q.float().view(batch, kv_heads, q_heads // kv_heads, dim)
    logits = (qg @ k.float().transpose(-1, -2)) * scale
    return logits.masked_fill(~selected_token_mask(None, 1, seq_len, num_tokens).unsqueeze(2), -math.inf)


def sparse_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    page_ids: torch.Tensor | None,
    page_size: int,
    seq_len: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Decode attention over the tokens of the selected pages only (float32 math).

    Parameters
    ----------
    q : torch.Tensor
        ``[B, Hq, D]`` one decode query per request (post-RoPE); ``Hq = G * Hkv``, query head
        ``h`` reads kv head ``h // G``.
    k, v : torch.Tensor
        ``[B, Hkv, T, D]`` keys and values of each request, token ``t`` in page ``t // page_size``;
        tokens at or past ``seq_len`` are padding.
    page_ids : torch.Tensor or None
        ``[B, Hkv, K]`` selected pages, ``-1`` padded (:func:`select_pages`); None = dense.
    page_size : int
    seq_len : torch.Tensor
        ``[B]`` tokens each request holds.
    scale : float, optional
        Softmax scale; ``D ** -0.5`` by default.

    Returns
    -------
    torch.Tensor
        ``[B, Hq, D]`` in ``q``'s dtype.
    """
    batch, q_heads, _ = q.shape
    logits = _logits(q, k, seq_len, scale)
    keep = selected_token_mask(page_ids, page_size, seq_len, k.shape[2]).unsqueeze(2)
    probs = logits.masked_fill(~keep, -math.inf).softmax(dim=-1)
    return (probs @ v.float()).reshape(batch, q_heads, -1).to(q.dtype)


def attention_mass_recall(
    q: torch.Tensor,
    k: torch.Tensor,
    page_ids: torch.Tensor,
    page_size: int,
    seq_len: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Share of each query head's dense softmax mass on the selected tokens.

    Parameters are those of :func:`sparse_attention_reference`.

    Returns
    -------
    torch.Tensor
        ``[B, Hq]`` float32 in ``[0, 1]``; 1 when every page is selected.
    """
    batch, q_heads, _ = q.shape
    probs = _logits(q, k, seq_len, scale).softmax(dim=-1)
    keep = selected_token_mask(page_ids, page_size, seq_len, k.shape[2]).unsqueeze(2)
    return (probs * keep).sum(dim=-1).reshape(batch, q_heads)
