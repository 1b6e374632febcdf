"""Page scores for a decode batch, straight from the host-page-indexed summaries.

:func:`score_pages` is one Triton kernel that reads the summaries of the pages each
request holds and writes the group-reduced scores, never materializing the gathered copies
(at 128K tokens and batch 32 those would be ~1 GiB per layer). When requests reuse their
selection (``--sparse-reselect-interval``), those not due for a full one read no summaries there;
a second, row-sized kernel scores only the pages their cache rows hold.

Its torch reference, :func:`~sparse_sglang.attention.reference.score_pages_reference`, gathers
each request's page summaries into dense ``[B, Hkv, N, D]`` tensors and calls the
:class:`~sparse_sglang.attention.Selector`. Both return ``[B, Hkv, N]`` float32 with ``-inf``
past each request's pages (the kernel may leave whole blocks there unwritten when asked:
``fill_tail=False``).
"""

from __future__ import annotations

import math

import torch

from sparse_sglang.attention.selection import NOT_CACHED
from sparse_sglang.attention.selectors import DEFAULT_GROUP_REDUCE
from sparse_sglang.mem_cache.gpu_cache import CachedRows

try:  # Triton comes with CUDA builds of torch (and runs on the CPU in its interpreter).
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

KERNEL_SELECTORS = ("quest", "arkvale", "mean", "sketch")


if triton is not None:
    from sparse_sglang.mem_cache.bounds import pow2

    _NOT_CACHED = tl.constexpr(NOT_CACHED)

    @triton.jit
    def _bound_scores(
        q_ptr, bh, kmin_ptr, kmax_ptr, exp_ptr, mean_ptr, radius_ptr, sketch_ptr, rows, exp_rows, held,
        D: tl.constexpr, G: tl.constexpr, BLOCK_N: tl.constexpr, KIND: tl.constexpr, GROUP_MAX: tl.constexpr,
        INT8_BOUNDS: tl.constexpr, R: tl.constexpr,
    ):  # fmt: skip
        # Group-reduced scores of BLOCK_N pages whose summary rows start at ``rows`` ([BLOCK_N, D]
        # offsets; ``exp_rows`` [BLOCK_N]: their int8 bounds' scale exponents). KIND 0 quest,
        # 1 arkvale, 2 mean, 3 sketch (a row is a page's D // R token sketches of R numbers, the
        # query ``[R]`` the projected one, read tiled over them, G = 1). Pages not ``held`` score
        # anything: callers mask them.
        offs_d = tl.arange(0, D)
        mask = held[:, None]
        if not GROUP_MAX:
            # Summed over the group, q_g . c + |q_g| . r is linear in the query: one pass with
            # qs = sum of q_g and qa = sum of |q_g| instead of G passes and G reductions.
            qs = tl.zeros([D], dtype=tl.float32)
            qa = tl.zeros([D], dtype=tl.float32)
            for g in tl.static_range(G):
                if KIND == 3:  # the projected query's R numbers, read once per token of the row
                    qg = tl.load(q_ptr + bh * R + offs_d % R).to(tl.float32)
                else:
                    qg = tl.load(q_ptr + (bh * G + g) * D + offs_d).to(tl.float32)
                qs += qg
                qa += tl.abs(qg)
            if KIND == 0:
                # Quest: c = (hi + lo) / 2, r = (hi - lo) / 2, so qs . c + qa . r = hi . u + lo . v;
                # int8 levels take their page's 2**e once, on the sum.
                u, v = (qs + qa) * 0.5, (qs - qa) * 0.5
                hi = tl.load(kmax_ptr + rows, mask=mask).to(tl.float32)
                lo = tl.load(kmin_ptr + rows, mask=mask).to(tl.float32)
                acc = tl.sum(hi * u[None, :] + lo * v[None, :], axis=1)
                if INT8_BOUNDS:
                    acc = acc * pow2(tl.load(exp_ptr + exp_rows, mask=held, other=0).to(tl.int32))
            elif KIND == 1:
                lo = tl.load(kmin_ptr + rows, mask=mask).to(tl.float32)
                hi = tl.load(kmax_ptr + rows, mask=mask).to(tl.float32)
                half = tl.full([BLOCK_N], 0.5, dtype=tl.float32)
                if INT8_BOUNDS:
                    half = half * pow2(tl.load(exp_ptr + exp_rows, mask=held, other=0).to(tl.int32))
                radius = tl.load(radius_ptr + rows, mask=mask, other=0.0).to(tl.float32)
                acc = tl.sum((hi + lo) * qs[None, :], axis=1) * half + tl.sum(radius * qa[None, :], axis=1)
            elif KIND == 3:  # the page's best token: max over its tokens of the R-term dot products
                sk = tl.load(sketch_ptr + rows, mask=mask, other=0.0).to(tl.float32)
                acc = tl.max(tl.sum(tl.reshape(sk * qs[None, :], (BLOCK_N, D // R, R)), axis=2), axis=1)
            else:
                centre = tl.load(mean_ptr + rows, mask=mask, other=0.0).to(tl.float32)
                acc = tl.sum(centre * qs[None, :], axis=1)
        else:
            acc = _group_max_scores(q_ptr, bh, kmin_ptr, kmax_ptr, exp_ptr, mean_ptr, radius_ptr, rows, exp_rows, held,
                                    D, G, BLOCK_N, KIND, INT8_BOUNDS)  # fmt: skip
        return acc

    @triton.jit
    def _group_max_scores(
        q_ptr, bh, kmin_ptr, kmax_ptr, exp_ptr, mean_ptr, radius_ptr, rows, exp_rows, held,
        D: tl.constexpr, G: tl.constexpr, BLOCK_N: tl.constexpr, KIND: tl.constexpr, INT8_BOUNDS: tl.constexpr,
    ):  # fmt: skip
        # The group's max is not linear: the cuboid bound per query head, then the max.
        offs_d = tl.arange(0, D)
        mask = held[:, None]
        if KIND == 2:
            centre = tl.load(mean_ptr + rows, mask=mask, other=0.0).to(tl.float32)
            radius = tl.zeros([BLOCK_N, D], dtype=tl.float32)
        else:
            lo = tl.load(kmin_ptr + rows, mask=mask).to(tl.float32)
            hi = tl.load(kmax_ptr + rows, mask=mask).to(tl.float32)
            if INT8_BOUNDS:  # levels times the page's 2**e (bounds.dequantize_bounds)
                e = tl.load(exp_ptr + exp_rows, mask=held, other=0).to(tl.int32)
                scale = pow2(e)[:, None]
                lo, hi = lo * scale, hi * scale
            centre = (hi + lo) * 0.5
            if KIND == 1:
                radius = tl.load(radius_ptr + rows, mask=mask, other=0.0).to(tl.float32)
            else:
                radius = (hi - lo) * 0.5
        acc = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
        for g in tl.static_range(G):
            qg = tl.load(q_ptr + (bh * G + g) * D + offs_d).to(tl.float32)
            # q . c + |q| . r: the max of q . k over the cuboid (selectors.cuboid_score).
            acc = tl.maximum(acc, tl.sum(centre * qg[None, :] + radius * tl.abs(qg)[None, :], axis=1))
        return acc

    @triton.jit
    def _score_kernel(
        q_ptr, kmin_ptr, kmax_ptr, exp_ptr, mean_ptr, radius_ptr, sketch_ptr, pages_ptr, num_pages_ptr, out_ptr, reselect_ptr,
        num_kv_heads, max_pages, pages_stride, page_step, head_stride, exp_head_stride, sink_pages, recent_pages,
        D: tl.constexpr, G: tl.constexpr, BLOCK_N: tl.constexpr, KIND: tl.constexpr, GROUP_MAX: tl.constexpr,
        INT8_BOUNDS: tl.constexpr, FORCE: tl.constexpr, REUSE: tl.constexpr, FILL_TAIL: tl.constexpr,
        ONLY_REUSED: tl.constexpr = False, R: tl.constexpr = 1,
    ):  # fmt: skip
        # One (request, kv head) per grid row, its pages split among the grid's columns: column c
        # scores blocks c, c + columns, ... of BLOCK_N pages up to the request's own page count,
        # then writes -inf over its share of the rest of the row. A CUDA-graph step sizes the row
        # for the longest context a request may reach, so the pages past a request's end cost a
        # store, not a program each. REUSE: a request not due for a full selection
        # (reselect[b] false) reads no summary here: its pages get NOT_CACHED (forced ones +inf)
        # and _score_cached_kernel then scores the pages its cache row holds (keep_cached).
        # FILL_TAIL false leaves the row past the request's last block unwritten (a ragged
        # top-k reads each row only up to its request's pages). ONLY_REUSED (with REUSE): rows due
        # for a full selection are left alone (the coarse path scores them). Page j of request b
        # is host page pages_ptr[b * pages_stride + j * page_step] (page_step > 1: the last pages
        # of super-pages, whose rows hold the coarse bounds).
        bh = tl.program_id(0)
        column, columns = tl.program_id(1), tl.num_programs(1)
        b = bh // num_kv_heads
        h = bh % num_kv_heads
        n = tl.load(num_pages_ptr + b)
        offs_d = tl.arange(0, D)
        scored = True
        if REUSE:
            scored = tl.load(reselect_ptr + b).to(tl.int32) != 0
        if ONLY_REUSED and scored:
            n = 0
        blocks_held = tl.cdiv(n, BLOCK_N)
        for blk in range(column, blocks_held, columns):
            offs_n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
            held = offs_n < n
            if scored:
                page = tl.load(pages_ptr + b * pages_stride + offs_n * page_step, mask=held, other=0).to(tl.int64)
                rows = h.to(tl.int64) * head_stride + page[:, None] * D + offs_d[None, :]
                acc = _bound_scores(q_ptr, bh, kmin_ptr, kmax_ptr, exp_ptr, mean_ptr, radius_ptr, sketch_ptr, rows,
                                    h.to(tl.int64) * exp_head_stride + page, held,
                                    D, G, BLOCK_N, KIND, GROUP_MAX, INT8_BOUNDS, R)  # fmt: skip
            else:
                acc = tl.full([BLOCK_N], _NOT_CACHED, dtype=tl.float32)
            if FORCE:  # selection priority: sink and recent pages above every score
                acc = tl.where((offs_n < sink_pages) | (offs_n >= n - recent_pages), float("inf"), acc)
            tl.store(out_ptr + bh * max_pages + offs_n, tl.where(held, acc, float("-inf")), mask=offs_n < max_pages)
        if FILL_TAIL:
            for blk in range(blocks_held + column, tl.cdiv(max_pages, BLOCK_N), columns):
                offs_n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
                tl.store(out_ptr + bh * max_pages + offs_n, tl.full([BLOCK_N], float("-inf"), dtype=tl.float32),
                         mask=offs_n < max_pages)  # fmt: skip

    @triton.jit
    def _score_cached_kernel(
        q_ptr, kmin_ptr, kmax_ptr, exp_ptr, mean_ptr, radius_ptr, sketch_ptr, pages_ptr, num_pages_ptr, out_ptr, reselect_ptr,
        rows_ptr, req_slots_ptr, slot_page_ptr, row_stride, row_width,
        num_kv_heads, max_pages, head_stride, exp_head_stride, sink_pages, recent_pages,
        D: tl.constexpr, G: tl.constexpr, BLOCK_N: tl.constexpr, KIND: tl.constexpr, GROUP_MAX: tl.constexpr,
        INT8_BOUNDS: tl.constexpr, FORCE: tl.constexpr, R: tl.constexpr = 1,
    ):  # fmt: skip
        # After _score_kernel, one (request, kv head) per grid row and BLOCK_N slots of its cache
        # row per column: a request not due for a full selection gets the scores of the pages its
        # row holds (rows_ptr: this layer's [max_requests, Hkv, W] slots at request stride
        # row_stride; slot_page_ptr: each slot's logical page). A program per block, not per row:
        # each block is a chain of dependent gathers (slot, page, host page, summaries), so many
        # short programs hide their latency where a loop over the row would wait on each. The
        # pages are distinct, so the stores do not race.
        bh = tl.program_id(0)
        b = bh // num_kv_heads
        h = bh % num_kv_heads
        if tl.load(reselect_ptr + b).to(tl.int32) == 0:
            n = tl.load(num_pages_ptr + b)
            row = tl.load(req_slots_ptr + b).to(tl.int64) * row_stride + h * row_width
            offs_w = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            slot = tl.load(rows_ptr + row + offs_w, mask=offs_w < row_width, other=-1)
            page = tl.load(slot_page_ptr + slot, mask=slot >= 0, other=-1)
            held = (page >= 0) & (page < n)
            host = tl.load(pages_ptr + b * max_pages + page, mask=held, other=0).to(tl.int64)
            rows = h.to(tl.int64) * head_stride + host[:, None] * D + tl.arange(0, D)[None, :]
            acc = _bound_scores(q_ptr, bh, kmin_ptr, kmax_ptr, exp_ptr, mean_ptr, radius_ptr, sketch_ptr, rows,
                                h.to(tl.int64) * exp_head_stride + host, held,
                                D, G, BLOCK_N, KIND, GROUP_MAX, INT8_BOUNDS, R)  # fmt: skip
            if FORCE:
                acc = tl.where((page < sink_pages) | (page >= n - recent_pages), float("inf"), acc)
            tl.store(out_ptr + bh * max_pages + page, acc, mask=held)

    @triton.jit
    def _score_candidates_kernel(
        q_ptr, kmin_ptr, kmax_ptr, exp_ptr, mean_ptr, radius_ptr, sketch_ptr, pages_ptr, num_pages_ptr, out_ptr, reselect_ptr,
        supers_ptr, built_ptr, num_kv_heads, max_pages, pages_stride, head_stride, exp_head_stride,
        sink_pages, recent_pages, num_supers, tail,
        S: tl.constexpr, D: tl.constexpr, G: tl.constexpr, BLOCK_N: tl.constexpr, KIND: tl.constexpr,
        GROUP_MAX: tl.constexpr, INT8_BOUNDS: tl.constexpr, REUSE: tl.constexpr, R: tl.constexpr = 1,
    ):  # fmt: skip
        # One (request, kv head) per grid row, BLOCK_N candidate pages per column: candidate j <
        # num_supers * S is page j % S of the row's (j // S)-th chosen super-page (supers_ptr,
        # [rows, num_supers]: -1 or >= built = none), the next `tail` ones are the pages from
        # built * S on (the recent and partial pages no super-page covers). Each candidate's
        # selection priority (forced pages +inf) lands at its page in out_ptr, whose other entries
        # the caller filled with -inf. Rows reusing their selection (REUSE) are left alone.
        bh = tl.program_id(0)
        b = bh // num_kv_heads
        h = bh % num_kv_heads
        due = True
        if REUSE:
            due = tl.load(reselect_ptr + b).to(tl.int32) != 0
        if due:
            n = tl.load(num_pages_ptr + b)
            built = tl.load(built_ptr + b)
            j = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            in_supers = j < num_supers * S
            sp = tl.load(supers_ptr + bh * num_supers + j // S, mask=in_supers, other=-1)
            page = tl.where(in_supers, sp * S + j % S, built * S + j - num_supers * S)
            held = tl.where(in_supers, (sp >= 0) & (sp < built), j < num_supers * S + tail) & (page < n)
            page = tl.where(held, page, 0)
            host = tl.load(pages_ptr + b * pages_stride + page, mask=held, other=0).to(tl.int64)
            rows = h.to(tl.int64) * head_stride + host[:, None] * D + tl.arange(0, D)[None, :]
            acc = _bound_scores(q_ptr, bh, kmin_ptr, kmax_ptr, exp_ptr, mean_ptr, radius_ptr, sketch_ptr, rows,
                                h.to(tl.int64) * exp_head_stride + host, held,
                                D, G, BLOCK_N, KIND, GROUP_MAX, INT8_BOUNDS, R)  # fmt: skip
            acc = tl.where((page < sink_pages) | (page >= n - recent_pages), float("inf"), acc)
            tl.store(out_ptr + bh * max_pages + page, acc, mask=held)


# Programs one score launch aims for (grid rows x columns): ~16 per SM of an H100's 132, enough to
# keep the memory system busy; a batch with fewer (request, kv head) rows splits each row wider.
SCORE_PROGRAMS = 2048


def score_columns(pages: int, rows: int, block_n: int) -> int:
    """Grid columns of a score launch over ``rows`` (request, kv head) rows of up to ``pages``
    pages: about ``SCORE_PROGRAMS`` programs in all, never more columns than blocks of a row."""
    return max(1, min(triton.cdiv(pages, block_n), triton.cdiv(SCORE_PROGRAMS, rows)))


# The score kernels' summary arguments, in order; a selector's missing ones take a placeholder.
SUMMARY_ARGS = ("kmin", "kmax", "bound_exp", "mean", "radius", "sketch")


def summary_args(layer_summaries: dict[str, torch.Tensor], placeholder: torch.Tensor) -> list[torch.Tensor]:
    return [layer_summaries.get(name, placeholder) for name in SUMMARY_ARGS]


def sketch_block_pages(row: int) -> int:
    """Pages a sketch score program takes: a ``[pages, row]`` block of about 4K numbers (a sketch
    row is ``page_size * rank`` of them, a power of two)."""
    return max(1, min(32, 4096 // row))


def score_launch() -> tuple[int, int]:
    """Pages a score program takes and its warps: 32 pages, 4 warps, at any head_dim
    (``docs/decisions/0004-score-kernel-launch.md``)."""
    return 32, 4


def score_pages(
    selector: str,
    q: torch.Tensor,
    layer_summaries: dict[str, torch.Tensor],
    host_pages: torch.Tensor,
    num_pages: torch.Tensor,
    group_reduce: str = DEFAULT_GROUP_REDUCE,
    out: torch.Tensor | None = None,
    forced: tuple[int, int] | None = None,
    reuse: CachedRows | None = None,
    fill_tail: bool = True,
    block_n: int | None = None,
    num_warps: int | None = None,
    only_reused: bool = False,
) -> torch.Tensor:
    """:func:`~sparse_sglang.attention.reference.score_pages_reference` in one Triton kernel (on CPU
    tensors it runs in Triton's interpreter).

    ``host_pages`` is ``[B, N]`` int32/int64 and contiguous; ``out`` (optional) a ``[B, Hkv, N]``
    float32 buffer to write into (e.g. inside a CUDA graph). ``forced = (sink, recent)`` makes
    the output a selection priority: pages ``[0, sink)`` and ``[n - recent, n)`` score ``+inf``
    (what :func:`~sparse_sglang.attention.select_pages` forces), so a plain top-k selects.
    ``reuse`` (``--sparse-reselect-interval``) restricts the requests not due for a full
    selection to the pages their cache rows hold, as :func:`keep_cached` does; the kernel path
    then reads only those pages' summaries for them (a second, row-sized launch).
    ``fill_tail=False`` lets the kernel leave each row past its request's pages unwritten (for a
    ragged top-k that reads only up to each request's pages; the torch path writes ``-inf`` anyway).
    ``block_n`` (pages per program) and ``num_warps`` override the launch (``benchmark/decode_kernels.py``
    sweeps them). ``only_reused`` (kernel path, with ``reuse``) writes only the rows reusing their
    selection (:func:`score_candidates` scores the others).
    """
    batch, heads = q.shape[:2]
    max_pages = host_pages.shape[1]
    if out is None:
        out = torch.empty(batch, heads, max_pages, dtype=torch.float32, device=q.device)
    ref = layer_summaries["mean" if selector == "mean" else "sketch" if selector == "sketch" else "kmin"]
    dummy = ref
    kind = KERNEL_SELECTORS.index(selector)
    default_block_n, default_warps = score_launch()
    group, dim, rank = *q.shape[2:], 1
    if selector == "sketch":  # the projected query [B, Hkv, 1, r]; a row holds page_size sketches of r
        dim, rank = ref.shape[-1], q.shape[-1]
        default_block_n = sketch_block_pages(dim)
    block_n, num_warps = block_n or default_block_n, num_warps or default_warps
    grid = (batch * heads, score_columns(max_pages, batch * heads, block_n))
    q, host_pages, num_pages = q.contiguous(), host_pages.contiguous(), num_pages.to(torch.int32)
    summaries = summary_args(layer_summaries, dummy)
    exp_head_stride = summaries[2].stride(0)
    reselect = dummy if reuse is None else reuse.reselect
    meta = dict(D=dim, G=group, BLOCK_N=block_n, KIND=kind, GROUP_MAX=group_reduce == "max",
                INT8_BOUNDS="bound_exp" in layer_summaries and kind in (0, 1), FORCE=forced is not None, R=rank,
                num_warps=num_warps)  # fmt: skip
    _score_kernel[grid](
        q, *summaries, host_pages, num_pages, out, reselect,
        heads, max_pages, host_pages.stride(0), 1, ref.stride(0), exp_head_stride, *(forced or (0, 0)),
        REUSE=reuse is not None, FILL_TAIL=fill_tail, ONLY_REUSED=only_reused, **meta,
    )  # fmt: skip
    if reuse is not None:
        rows = reuse.rows
        if rows.stride(2) != 1 or rows.stride(1) != rows.shape[2]:
            raise ValueError("reuse.rows must be [max_requests, Hkv, W] with contiguous (head, slot) rows")
        _score_cached_kernel[(batch * heads, triton.cdiv(rows.shape[2], block_n))](
            q, *summaries, host_pages, num_pages, out, reselect, rows, reuse.req_slots, reuse.slot_page,
            rows.stride(0), rows.shape[2], heads, max_pages, ref.stride(0), exp_head_stride, *(forced or (0, 0)), **meta,
        )  # fmt: skip
    return out


def coarse_host_pages(host_pages: torch.Tensor, coarse_pages: int) -> torch.Tensor:
    """``[B, N // S]`` host page of the last page of each super-page (its rows hold the coarse
    bounds; a strided view of ``host_pages``)."""
    return host_pages[:, coarse_pages - 1 :: coarse_pages][:, : host_pages.shape[1] // coarse_pages]


def score_coarse(
    q: torch.Tensor,
    coarse_summaries: dict[str, torch.Tensor],
    host_pages: torch.Tensor,
    built: torch.Tensor,
    coarse_pages: int,
    sink_pages: int,
    group_reduce: str = DEFAULT_GROUP_REDUCE,
    out: torch.Tensor | None = None,
    reselect: torch.Tensor | None = None,
) -> torch.Tensor:
    """Quest scores of each request's first ``built[b]`` super-pages of ``coarse_pages`` pages,
    from their coarse bounds (:meth:`PageSummaries.coarse_layer`), whatever the selector (the
    bounds bound every key of the super-page, so its score bounds its pages'); the super-pages
    holding sink pages score ``+inf``. ``[B, Hkv, N // S]`` float32, ``-inf`` past ``built``.
    ``reselect`` (``[B]`` bool): rows of requests reusing their selection are not read (any value).
    Its reference: :func:`~sparse_sglang.attention.reference.score_coarse_reference`.
    """
    supers = coarse_host_pages(host_pages, coarse_pages)
    sink_supers = -(-sink_pages // coarse_pages)
    batch, heads, group, dim = q.shape
    width = supers.shape[1]
    if out is None:
        out = torch.empty(batch, heads, width, dtype=torch.float32, device=q.device)
    block_n, num_warps = score_launch()
    summaries = summary_args(coarse_summaries, coarse_summaries["kmin"])  # quest reads kmin, kmax, bound_exp
    _score_kernel[(batch * heads, score_columns(width, batch * heads, block_n))](
        q.contiguous(), *summaries, supers, built, out, summaries[0] if reselect is None else reselect,
        heads, width, supers.stride(0), supers.stride(1), summaries[0].stride(0), summaries[2].stride(0), sink_supers, 0,
        D=dim, G=group, BLOCK_N=block_n, KIND=0, GROUP_MAX=group_reduce == "max", INT8_BOUNDS="bound_exp" in coarse_summaries,
        FORCE=sink_supers > 0, REUSE=reselect is not None, FILL_TAIL=True, num_warps=num_warps,
    )  # fmt: skip
    return out


def candidate_pages(supers: torch.Tensor, built: torch.Tensor, num_pages: torch.Tensor, coarse_pages: int,
                    max_pages: int) -> torch.Tensor:  # fmt: skip
    """``[B, Hkv, max_pages]`` bool: the pages of the chosen super-pages ``supers`` ``[B, Hkv, M]``
    (``-1`` or ``>= built`` = none) and every page from ``built * S`` on, within each request's pages."""
    batch, heads, _ = supers.shape
    device = supers.device
    page = torch.arange(max_pages, device=device)
    chosen = torch.zeros(batch, heads, max_pages // coarse_pages + 1, dtype=torch.bool, device=device)
    valid = (supers >= 0) & (supers < built.view(-1, 1, 1).to(device))
    chosen.scatter_(-1, torch.where(valid, supers, chosen.shape[-1] - 1).long(), True)
    chosen[..., -1].fill_(False)  # fill_, not `= False`: see sparse_sglang.mem_cache.utils
    start = (built.to(device).long() * coarse_pages).view(-1, 1, 1)
    keep = chosen[..., (page // coarse_pages).clamp(max=chosen.shape[-1] - 1)] | (page >= start)
    return keep & (page < num_pages.to(device).view(-1, 1, 1))


def score_candidates(
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
    out: torch.Tensor | None = None,
    forced: tuple[int, int] = (0, 1),
    reuse: CachedRows | None = None,
) -> torch.Tensor:
    """Selection priorities (:func:`score_pages` with ``forced``) of only the candidate pages
    (:func:`candidate_pages`), ``-inf`` elsewhere: the second, fine pass of a coarse-first
    selection. Rows reusing their selection (``reuse``) get :func:`score_pages`'s priorities.
    ``tail`` is the most pages a request holds from ``built * S`` on (``S + recent_pages - 1``
    when ``built`` is :func:`~sparse_sglang.mem_cache.summaries.coarse_built`'s). Its reference:
    :func:`~sparse_sglang.attention.reference.score_candidates_reference`."""
    if selector == "sketch":  # (the config refuses the pair)
        raise ValueError("coarse-first selection scores pages from key bounds, not from key sketches")
    host_pages, max_pages = host_pages.contiguous(), host_pages.shape[1]
    batch, heads, group, dim = q.shape
    if out is None:
        out = torch.empty(batch, heads, max_pages, dtype=torch.float32, device=q.device)
    out.fill_(-math.inf)
    kind = KERNEL_SELECTORS.index(selector)
    block_n, num_warps = score_launch()
    summaries = summary_args(layer_summaries, layer_summaries["kmin"])
    int8 = "bound_exp" in layer_summaries and kind in (0, 1)
    reselect = summaries[0] if reuse is None else reuse.reselect
    num_pages, num_supers = num_pages.to(torch.int32), supers.shape[-1]
    _score_candidates_kernel[(batch * heads, triton.cdiv(num_supers * coarse_pages + tail, block_n))](
        q.contiguous(), *summaries, host_pages, num_pages, out, reselect, supers, built,
        heads, max_pages, host_pages.stride(0), summaries[0].stride(0), summaries[2].stride(0), *forced, num_supers, tail,
        S=coarse_pages, D=dim, G=group, BLOCK_N=block_n, KIND=kind, GROUP_MAX=group_reduce == "max",
        INT8_BOUNDS=int8, REUSE=reuse is not None, num_warps=num_warps,
    )  # fmt: skip
    if reuse is not None:  # the rows reusing their selection, as score_pages scores them
        score_pages(selector, q, layer_summaries, host_pages, num_pages, group_reduce, out=out, forced=forced,
                    reuse=reuse, fill_tail=False, only_reused=True)  # fmt: skip
    return out
