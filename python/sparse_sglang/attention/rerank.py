"""Re-ranking candidate pages by their attention mass (``--sparse-rerank-factor``).

Summaries score pages from a bound or a sketch of their keys, and on real text that ranking loses
answers the true mass keeps (docs/decisions/0017-rerank-candidates-by-exact-mass.md). With a
factor ``F > 1`` a decode step selects ``F x K`` candidate pages per (request, kv head) from the
summaries, loads them into the request's cache row like any selection, and then keeps the ``K``
with the most attention mass, computed from their keys against the step's queries:

1. :func:`candidate_page_lse`: per candidate page and query head of the group, the log of
   ``sum_t exp(s * q_g . k_t)`` over the page's tokens (a Triton program per row and about 128
   candidate keys, one dot; the keys are read from the page cache, never the values);
2. :func:`choose_reranked`, one Triton program per row: each head's masses as shares of that
   head's total over the candidates (the newest page's left out), summed over the group (the
   oracle's ranking, with the candidates' total standing in for the whole context's); the sink
   and recent pages rank first, as in every selection; the ``K`` best, in ascending page order
   (FlashInfer's fixed order).

Two launches and one small count per layer: the re-rank adds to a step about the read of its
candidates' keys.

With ``--sparse-rerank-by quantized``, :func:`choose_by_codes` estimates the same mass from the
candidates' low-bit key codes on the GPU (:mod:`~sparse_sglang.mem_cache.key_codes`) before any is
loaded, and only the ``K`` chosen are (two launches: the log-sum-exp, then the choice). With
``sketch``, :func:`choose_by_sketch` scores each candidate by its best token's key sketch.

Contracts
---------
- Candidate rows are laid out densely, ``[rows, Kc]`` with ``rows = B * Hkv``: row ``r``'s first
  ``count[r]`` entries are its candidates' cache slots (``slots``) and logical pages
  (``pages``), ascending by page; entries past ``count[r]`` may hold anything and are never read.
- Every output has fixed shapes (CUDA-graph steps replay them); a row with fewer than ``K``
  candidates keeps them all and pads with ``-1``.

The torch references are :func:`~sparse_sglang.attention.reference.candidate_page_lse_reference`,
:func:`~sparse_sglang.attention.reference.choose_reranked_reference`,
:func:`~sparse_sglang.attention.reference.choose_by_codes_reference` and
:func:`~sparse_sglang.attention.reference.choose_by_sketch_reference` (beside the other kernels'
references); the CPU tests run the kernels in Triton's interpreter against them.
"""

from __future__ import annotations

import torch

try:  # Triton comes with CUDA builds of torch (and runs on the CPU in its interpreter).
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


if triton is not None:
    from sparse_sglang.mem_cache.key_codes import frame_step_tl

    @triton.jit
    def _candidate_lse_kernel(
        q_ptr, k_ptr, slots_ptr, count_ptr, out_ptr, scale, soft_cap,
        KC: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, P: tl.constexpr, D: tl.constexpr,
        BC: tl.constexpr, SOFT_CAP: tl.constexpr, NATIVE_DOT: tl.constexpr,
    ):  # fmt: skip
        # One program per (row, BC candidates): their BC * P keys [BC*P, D] against the row's G
        # queries in one dot, a log-sum-exp per (query head, page).
        row = tl.program_id(0)
        first = tl.program_id(1) * BC
        count = tl.load(count_ptr + row)
        offs_t = tl.arange(0, BC * P)
        page_of = first + offs_t // P  # the candidate each key row belongs to
        valid = page_of < count
        slot = tl.load(slots_ptr + row * KC + page_of, mask=valid, other=0).to(tl.int64)
        offs_d = tl.arange(0, D)
        k = tl.load(k_ptr + (slot * P + offs_t % P)[:, None] * D + offs_d[None, :], mask=valid[:, None], other=0.0)
        offs_g = tl.arange(0, GP)
        g_ok = offs_g < G
        q = tl.load(q_ptr + (row * G + offs_g[:, None]) * D + offs_d[None, :], mask=g_ok[:, None], other=0.0)
        if NATIVE_DOT:
            # 16-bit queries, keys of that type or fp8: every product is exact in the fp32
            # accumulator, so the tensor-core dot ranks as the fp32 reference does.
            logits = tl.dot(q, tl.trans(k.to(q.dtype))) * scale  # [GP, BC*P]
        else:
            logits = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
        offs_c = tl.arange(0, BC)
        _store_page_lse(logits, first + offs_c < count, out_ptr, row, first, soft_cap,
                        KC, G, GP, P, BC, SOFT_CAP)  # fmt: skip

    @triton.jit
    def _store_page_lse(logits, valid, out_ptr, row, first, soft_cap, KC: tl.constexpr, G: tl.constexpr,
                        GP: tl.constexpr, P: tl.constexpr, BC: tl.constexpr, SOFT_CAP: tl.constexpr):  # fmt: skip
        # logits [GP, BC * P] (candidate c's keys at c P ...) -> each candidate's log-sum-exp per
        # query head at out[row, first + c, g]; -inf where not ``valid`` [BC]
        if SOFT_CAP:
            logits = soft_cap * (2.0 / (1.0 + tl.exp(-2.0 * logits / soft_cap)) - 1.0)  # cap * tanh(x / cap)
        logits = tl.reshape(logits, (GP, BC, P))
        top = tl.max(logits, axis=2)  # [GP, BC]
        lse = top + tl.log(tl.sum(tl.exp(logits - top[:, :, None]), axis=2))
        lse = tl.where(valid[None, :], lse, float("-inf"))
        offs_c = tl.arange(0, BC)
        offs_g = tl.arange(0, GP)
        out = out_ptr + (row * KC + first + offs_c[None, :]) * G + offs_g[:, None]
        tl.store(out, lse, mask=(offs_g < G)[:, None] & (first + offs_c < KC)[None, :])

    @triton.jit
    def _logsumexp(x, axis: tl.constexpr):
        # log sum exp along one axis of a 2-D block; -inf where every entry is
        top = tl.max(x, axis=axis)
        finite = top > float("-inf")
        shift = tl.where(finite, top, 0.0)
        total = tl.sum(tl.exp(x - tl.expand_dims(shift, axis)), axis=axis)
        return tl.where(finite, shift + tl.log(tl.where(finite, total, 1.0)), float("-inf"))

    @triton.jit
    def _mass_priority(lse, pages, listed, n, sink, recent):
        # rerank_priority_reference: each candidate's mass [KCP, GP] as a share of its head's total
        # over the candidates, summed over the group; the newest page (partial: its mass is not
        # known) left out of the totals; the forced pages first; -inf where not listed.
        lse = tl.where((pages != n - 1)[:, None], lse, float("-inf"))
        total = _logsumexp(lse, 0)  # [GP], -inf for a head with no compared candidate
        some = total > float("-inf")
        share = tl.where(some[None, :], lse - tl.where(some, total, 0.0)[None, :], float("-inf"))
        priority = _logsumexp(share, 1)  # [KCP]
        priority = tl.where((pages < sink) | (pages >= n - recent), float("inf"), priority)
        return tl.where(listed, priority, float("-inf"))

    @triton.jit
    def _best_k(priority, offs, k):
        # Which of a block's entries are its k highest: the k-th highest priority found by a sort;
        # above it all kept, at it the first ones (in block order) up to k; never a -inf one.
        ranked = tl.sort(priority, descending=True)
        threshold = tl.max(tl.where(offs == k - 1, ranked, float("-inf")))
        above = priority > threshold
        tied = (priority == threshold) & (priority > float("-inf"))
        return above | (tied & (tl.cumsum(tied.to(tl.int32), axis=0) <= k - tl.sum(above.to(tl.int32))))

    @triton.jit
    def _rerank_choose_kernel(
        cand_ptr, row_pages_ptr, lse_ptr, slots_ptr, pages_out_ptr, slots_out_ptr, sink, recent, k,
        KC: tl.constexpr, KCP: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, KP: tl.constexpr,
    ):  # fmt: skip
        # One program per row: its candidates sorted, their priorities (rerank_priority_reference),
        # the k best kept (ties at the threshold: the lower pages), written ascending.
        row = tl.program_id(0)
        offs = tl.arange(0, KCP)
        n = tl.load(row_pages_ptr + row)
        cand = tl.load(cand_ptr + row * KC + offs, mask=offs < KC, other=-1)
        ok = (cand >= 0) & (cand < n)
        pages = tl.sort(tl.where(ok, cand, n + KCP).to(tl.int64))  # valid pages ascending, the rest after
        count = tl.sum(ok.to(tl.int32))
        listed = offs < count
        offs_g = tl.arange(0, GP)
        g_ok = offs_g < G
        lse = tl.load(lse_ptr + (row * KC + offs[:, None]) * G + offs_g[None, :], mask=listed[:, None] & g_ok[None, :],
                      other=float("-inf"))  # fmt: skip
        priority = _mass_priority(lse, pages, listed, n, sink, recent)
        keep = _best_k(priority, offs, k) & listed  # at equal priorities the lower pages
        position = tl.cumsum(keep.to(tl.int32), axis=0) - 1
        slot = tl.load(slots_ptr + row * KC + offs, mask=listed, other=-1)
        tl.store(pages_out_ptr + row * k + position, pages, mask=keep)
        tl.store(slots_out_ptr + row * k + position, slot, mask=keep)
        offs_k = tl.arange(0, KP)
        pad = (offs_k >= tl.sum(keep.to(tl.int32))) & (offs_k < k)
        tl.store(pages_out_ptr + row * k + offs_k, -1, mask=pad)
        tl.store(slots_out_ptr + row * k + offs_k, -1, mask=pad)

    @triton.jit
    def _sketch_choose_kernel(
        q_ptr, wq_ptr, sketch_ptr, host_pages_ptr, cand_ptr, num_pages_ptr, out_ptr,
        num_heads, sketch_rows, host_pages_stride, sink, recent, k,
        KC: tl.constexpr, KCP: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
        R: tl.constexpr, P: tl.constexpr, KP: tl.constexpr,
    ):  # fmt: skip
        # One program per (request, kv head) row: the group's summed query projected by the
        # layer's Wq, each candidate scored by its best token's sketch, the k best kept.
        row = tl.program_id(0)
        b = row // num_heads
        h = row % num_heads
        n = tl.load(num_pages_ptr + b)
        offs = tl.arange(0, KCP)
        cand = tl.load(cand_ptr + row * KC + offs, mask=offs < KC, other=-1)
        ok = (cand >= 0) & (cand < n)
        offs_g = tl.arange(0, GP)
        offs_d = tl.arange(0, D)
        q = tl.load(q_ptr + (row * G + offs_g[:, None]) * D + offs_d[None, :], mask=(offs_g < G)[:, None], other=0.0)
        q_sum = tl.sum(q.to(tl.float32), axis=0)  # [D]
        offs_r = tl.arange(0, R)
        wq = tl.load(wq_ptr + (h * D + offs_d[:, None]) * R + offs_r[None, :])  # [D, R] float32
        qp = tl.sum(q_sum[:, None] * wq, axis=0)  # [R]
        host = tl.load(host_pages_ptr + b * host_pages_stride + cand, mask=ok, other=0).to(tl.int64)
        base = (h * sketch_rows + host) * (P * R)
        score = tl.full((KCP,), float("-inf"), tl.float32)
        for t in range(P):  # a page's best token
            s = tl.load(sketch_ptr + base[:, None] + t * R + offs_r[None, :], mask=ok[:, None], other=0.0)
            score = tl.maximum(score, tl.sum(s.to(tl.float32) * qp[None, :], axis=1))
        forced = (cand < sink) | (cand >= n - recent)
        priority = tl.where(forced, float("inf"), score)
        priority = tl.where(ok, priority, float("-inf"))
        keep = _best_k(priority, offs, k) & ok  # at equal scores the earlier candidates
        position = tl.cumsum(keep.to(tl.int32), axis=0) - 1
        tl.store(out_ptr + row * k + position, cand, mask=keep)
        offs_k = tl.arange(0, KP)
        pad = (offs_k >= tl.sum(keep.to(tl.int32))) & (offs_k < k)
        tl.store(out_ptr + row * k + offs_k, -1, mask=pad)


if triton is not None:

    @triton.jit
    def _code_lse_kernel(
        q_ptr, codes_ptr, lo_ptr, hi_ptr, host_pages_ptr, cand_ptr, num_pages_ptr, out_ptr,
        num_heads, codes_head_stride, frame_head_stride, host_pages_stride, scale, soft_cap,
        KC: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, P: tl.constexpr, D: tl.constexpr,
        BITS: tl.constexpr, BC: tl.constexpr, SOFT_CAP: tl.constexpr, DOT: tl.constexpr,
    ):  # fmt: skip
        # One program per (row, BC candidates), one candidate at a time. With the frame,
        # q . k_t = q . lo + (q * step) . c_t: the codes enter the dot as they are (small integers,
        # exact in bf16) and the frame scales the query. A token's byte w holds channels w, w + W,
        # ... (key_codes), so shift i gives channels [i W, (i + 1) W) whole: one dot per shift,
        # with no reshuffling of the codes. (Decoding the BC candidates' keys into one float32 tile
        # and one dot per shift timed slower: decision 27.)
        row = tl.program_id(0)
        first = tl.program_id(1) * BC
        b = row // num_heads
        h = row % num_heads
        n = tl.load(num_pages_ptr + b)
        LEVELS: tl.constexpr = (1 << BITS) - 1
        PER_BYTE: tl.constexpr = 8 // BITS
        W: tl.constexpr = D // PER_BYTE  # bytes per token
        offs_c = tl.arange(0, BC)
        cands = tl.load(cand_ptr + row * KC + first + offs_c, mask=first + offs_c < KC, other=-1)
        oks = (cands >= 0) & (cands < n)
        hosts = tl.load(host_pages_ptr + b * host_pages_stride + cands, mask=oks, other=0).to(tl.int64)
        offs_g = tl.arange(0, GP)
        g_ok = offs_g < G
        offs_t = tl.arange(0, P)
        offs_w = tl.arange(0, W)
        q_rows = (row * G + offs_g[:, None]) * D + offs_w[None, :]
        for j in tl.static_range(BC):
            ok = tl.max(tl.where(offs_c == j, oks.to(tl.int32), 0)) > 0
            host = tl.sum(tl.where(offs_c == j, hosts, 0))
            frame = h.to(tl.int64) * frame_head_stride + host * D + offs_w
            page = h.to(tl.int64) * codes_head_stride + host * (P * W)
            packed = tl.load(codes_ptr + page + offs_t[:, None] * W + offs_w[None, :], mask=ok, other=0).to(tl.int32)
            scores = tl.zeros((GP, P), dtype=tl.float32)
            base = tl.zeros((GP,), dtype=tl.float32)
            for i in tl.static_range(PER_BYTE):
                q = tl.load(q_ptr + q_rows + i * W, mask=g_ok[:, None], other=0.0).to(tl.float32) * scale
                lo = tl.load(lo_ptr + frame + i * W, mask=ok, other=0.0).to(tl.float32)
                hi = tl.load(hi_ptr + frame + i * W, mask=ok, other=0.0).to(tl.float32)
                q_step = q * frame_step_tl(lo, hi, LEVELS)[None, :]  # [GP, W]
                codes = (packed >> (i * BITS)) & LEVELS  # [P, W]: channels i W + w
                if DOT:  # the scaled query as two bf16 parts: products about fp32's precision
                    c16 = tl.trans(codes.to(tl.bfloat16))
                    q_high = q_step.to(tl.bfloat16)
                    q_low = (q_step - q_high.to(tl.float32)).to(tl.bfloat16)
                    scores += tl.dot(q_high, c16) + tl.dot(q_low, c16)
                else:
                    scores += tl.sum(q_step[:, None, :] * codes.to(tl.float32)[None, :, :], axis=2)
                base += tl.sum(q * lo[None, :], axis=1)
            valid = (tl.zeros((1,), dtype=tl.int32) + ok.to(tl.int32)) > 0
            _store_page_lse(scores + base[:, None], valid, out_ptr, row, first + j, soft_cap,
                            KC, G, GP, P, 1, SOFT_CAP)  # fmt: skip

    @triton.jit
    def _mass_choose_kernel(
        cand_ptr, num_pages_ptr, lse_ptr, out_ptr, num_heads, sink, recent, k,
        KC: tl.constexpr, KCP: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, KP: tl.constexpr,
    ):  # fmt: skip
        # One program per row: candidates in the top-k's order, their priorities
        # (rerank_priority_reference), the k best kept (ties: the earlier candidates).
        row = tl.program_id(0)
        n = tl.load(num_pages_ptr + row // num_heads)
        offs = tl.arange(0, KCP)
        cand = tl.load(cand_ptr + row * KC + offs, mask=offs < KC, other=-1)
        ok = (cand >= 0) & (cand < n)
        offs_g = tl.arange(0, GP)
        g_ok = offs_g < G
        lse = tl.load(lse_ptr + (row * KC + offs[:, None]) * G + offs_g[None, :], mask=ok[:, None] & g_ok[None, :],
                      other=float("-inf"))  # fmt: skip
        priority = _mass_priority(lse, cand, ok, n, sink, recent)
        keep = _best_k(priority, offs, k) & ok
        position = tl.cumsum(keep.to(tl.int32), axis=0) - 1
        tl.store(out_ptr + row * k + position, cand, mask=keep)
        offs_k = tl.arange(0, KP)
        pad = (offs_k >= tl.sum(keep.to(tl.int32))) & (offs_k < k)
        tl.store(out_ptr + row * k + offs_k, -1, mask=pad)


def _exact_in_fp32_products(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether ``q . k`` in ``q``'s dtype with fp32 accumulation is exact per product: 16-bit
    queries against keys of the same type or fp8 (whose values both 16-bit types hold)."""
    fp8 = {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)}
    return q.dtype in (torch.bfloat16, torch.float16) and (k_cache.dtype == q.dtype or k_cache.dtype in fp8)


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
    per_program = max(1, 128 // page)  # candidates per program: about 128 keys in one dot
    _candidate_lse_kernel[(rows, triton.cdiv(kc, per_program))](
        q.contiguous(), k_cache, slots.contiguous(), count.contiguous(), out, scale, float(logits_soft_cap or 0.0),
        KC=kc, G=group, GP=max(16, triton.next_power_of_2(group)), P=page, D=dim, BC=per_program,
        SOFT_CAP=bool(logits_soft_cap), NATIVE_DOT=_exact_in_fp32_products(q, k_cache),
    )  # fmt: skip
    return out


def choose_reranked(candidates: torch.Tensor, row_pages: torch.Tensor, lse: torch.Tensor, slots: torch.Tensor,
                    k: int, forced: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The ``k`` candidates of each row with the highest priority, ascending by page: ``([rows, k]``
    logical pages, ``[rows, k]`` cache slots), ``-1`` padded where a row has fewer.

    ``candidates`` ``[rows, Kc]`` (any order, ``-1`` or ``>= row_pages`` ``[rows]``: none);
    ``lse`` ``[rows, Kc, G]`` and ``slots`` ``[rows, Kc]`` in the row's ascending order of its valid
    candidates. A priority is ``log sum_g share_g`` (:func:`rerank_priority_reference`); the forced
    pages (``forced = (sink, recent)``) rank first; at equal priorities the lower pages are kept.
    """
    rows, kc = candidates.shape
    pages_out = torch.empty(rows, k, dtype=torch.int64, device=candidates.device)
    slots_out = torch.empty(rows, k, dtype=slots.dtype, device=candidates.device)
    if rows == 0 or k == 0:
        return pages_out, slots_out
    group = lse.shape[-1]
    _rerank_choose_kernel[(rows,)](
        candidates.contiguous(), row_pages.contiguous(), lse.contiguous(), slots.contiguous(), pages_out, slots_out,
        int(forced[0]), int(forced[1]), int(k), KC=kc, KCP=triton.next_power_of_2(kc), G=group,
        GP=triton.next_power_of_2(group), KP=triton.next_power_of_2(k),
    )  # fmt: skip
    return pages_out, slots_out


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
    count = ((candidates >= 0) & (candidates < row_pages.view(-1, 1))).sum(dim=-1, dtype=torch.int32)
    lse = candidate_page_lse(q, k_cache, slots, count, sm_scale, k_scale, logits_soft_cap)
    return choose_reranked(candidates, row_pages, lse, slots, k, forced)


def choose_by_sketch(qg: torch.Tensor, query_basis: torch.Tensor, sketch: torch.Tensor, host_pages: torch.Tensor,
                     candidates: torch.Tensor, num_pages: torch.Tensor, k: int,
                     forced: tuple[int, int]) -> torch.Tensor:  # fmt: skip
    """The ``k`` of each row's candidate pages whose best token's key sketch scores highest
    against the group's summed query: ``[B, Hkv, k]`` int32 logical pages (any order), ``-1``
    padded where a row has fewer valid candidates. One Triton program per row.

    Parameters
    ----------
    qg : torch.Tensor
        ``[B, Hkv, G, D]`` the step's queries.
    query_basis : torch.Tensor
        ``[Hkv, D, R]`` float32, the layer's ``Wq`` (:class:`~sparse_sglang.mem_cache.key_sketch.KeyBasis`).
    sketch : torch.Tensor
        ``[Hkv, N + 1, P * R]`` the layer's key sketches by host page (``PageSummaries.layer(l)["sketch"]``).
    host_pages : torch.Tensor
        ``[B, max_pages]`` int32 host page of each logical page.
    candidates : torch.Tensor
        ``[B, Hkv, Kc]`` distinct logical pages (any order; ``-1`` or ``>= num_pages``: none), as
        the top-k gives them.
    num_pages : torch.Tensor
        ``[B]`` int32 pages each request holds.

    The forced pages (``forced = (sink, recent)``) rank first; at equal scores the earlier
    candidates are kept. The newest page's tokens past its fill read 0; it is a forced page,
    whose score is not read.
    """
    batch, heads, group, dim = qg.shape
    kc, rank = candidates.shape[-1], query_basis.shape[-1]
    out = torch.empty(batch, heads, k, dtype=torch.int32, device=qg.device)
    if batch * heads == 0 or k == 0:
        return out
    if not (sketch.is_contiguous() and host_pages.stride(1) == 1):
        raise ValueError("the sketches must be contiguous and host_pages' rows dense")
    _sketch_choose_kernel[(batch * heads,)](
        qg.contiguous(), query_basis.contiguous(), sketch, host_pages, candidates.contiguous(), num_pages.contiguous(),
        out, heads, sketch.shape[1], host_pages.stride(0), int(forced[0]), int(forced[1]), int(k),
        KC=kc, KCP=triton.next_power_of_2(kc), G=group, GP=max(2, triton.next_power_of_2(group)), D=dim, R=rank,
        P=sketch.shape[-1] // rank, KP=triton.next_power_of_2(k),
    )  # fmt: skip
    return out


def choose_by_codes(qg: torch.Tensor, codes: dict[str, torch.Tensor], bits: int, host_pages: torch.Tensor,
                    candidates: torch.Tensor, num_pages: torch.Tensor, k: int, forced: tuple[int, int],
                    sm_scale: float, k_scale: float | None = None, logits_soft_cap: float | None = None, *,
                    keys_per_program: int = 128, num_warps: int = 4) -> torch.Tensor:  # fmt: skip
    """The ``k`` of each row's candidate pages with the most attention mass estimated from their
    keys' low-bit codes: ``[B, Hkv, k]`` int32 logical pages (any order), ``-1`` padded where a row
    has fewer valid candidates. Two launches: the candidates' log-sum-exp per query head over
    their keys as the codes give them back (``lo + code * step`` per channel; what
    :func:`candidate_page_lse` computes from the keys themselves), then one program per row ranks
    them as :func:`choose_reranked` does.

    Parameters
    ----------
    qg : torch.Tensor
        ``[B, Hkv, G, D]`` the step's queries.
    codes : dict
        The layer's ``codes``, ``lo``, ``hi`` by host page
        (:meth:`PageKeyCodes.layer <sparse_sglang.mem_cache.key_codes.PageKeyCodes.layer>`),
        ``bits`` per channel.
    host_pages : torch.Tensor
        ``[B, max_pages]`` int32 host page of each logical page.
    candidates : torch.Tensor
        ``[B, Hkv, Kc]`` distinct logical pages (any order; ``-1`` or ``>= num_pages``: none).
    num_pages : torch.Tensor
        ``[B]`` int32 pages each request holds.
    sm_scale, k_scale, logits_soft_cap : float
        The layer's softmax scale, fp8 keys' per-tensor scale, logit cap.
    keys_per_program, num_warps : int
        The first launch's tile: keys (whole candidate pages, one page after another) one
        program scores, and its warps. The choice does not depend on them.

    The forced pages (``forced = (sink, recent)``) rank first; the newest page's mass is not
    compared (its tokens past the fill hold stale codes); at equal priorities the earlier
    candidates are kept.
    """
    batch, heads, group, dim = qg.shape
    kc = candidates.shape[-1]
    rows = batch * heads
    out = torch.empty(batch, heads, k, dtype=torch.int32, device=qg.device)
    if rows == 0 or k == 0:
        return out
    if host_pages.stride(1) != 1 or not all(t.stride(-1) == 1 for t in codes.values()):
        raise ValueError("the codes' rows and host_pages' rows must be dense")
    page = codes["codes"].shape[-1] * 8 // bits // dim
    lse = torch.empty(rows, kc, group, dtype=torch.float32, device=qg.device)
    cands, lengths = candidates.contiguous(), num_pages.contiguous()
    per_program = min(triton.next_power_of_2(kc), triton.next_power_of_2(max(1, keys_per_program // page)))
    scale = sm_scale * (1.0 if k_scale is None else float(k_scale))
    # 16-bit queries: tensor-core dots (their smallest tile: 16 rows, 16 keys, 16 channels);
    # float32 ones, the products summed in float32.
    dot = qg.dtype in (torch.bfloat16, torch.float16) and page >= 16 and dim * bits // 8 >= 16
    gp = max(16, triton.next_power_of_2(group)) if dot else triton.next_power_of_2(group)
    _code_lse_kernel[(rows, triton.cdiv(kc, per_program))](
        qg.contiguous(), codes["codes"], codes["lo"], codes["hi"], host_pages, cands, lengths, lse,
        heads, codes["codes"].stride(0), codes["lo"].stride(0), host_pages.stride(0), scale,
        float(logits_soft_cap or 0.0), KC=kc, G=group, GP=gp, P=page, D=dim, BITS=bits, BC=per_program,
        SOFT_CAP=bool(logits_soft_cap), DOT=dot, num_warps=num_warps,
    )  # fmt: skip
    _mass_choose_kernel[(rows,)](
        cands, lengths, lse, out, heads, int(forced[0]), int(forced[1]), int(k),
        KC=kc, KCP=triton.next_power_of_2(kc), G=group, GP=triton.next_power_of_2(group),
        KP=triton.next_power_of_2(k),
    )  # fmt: skip
    return out
