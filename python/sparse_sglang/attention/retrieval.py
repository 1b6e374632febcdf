"""Retrieval, the decode step's third stage: the selected pages of one layer found in the GPU page
cache or loaded into it, and FlashInfer's page indices written for them.

:func:`retrieve_pages` is one Triton launch per layer: for each (request, kv head) row it looks
up the page table, chooses LRU victims in the request's cache row for the misses, updates the
table, writes the row's FlashInfer indices (the newest page last) and the FlashH2D copy list. It
reads the cache through :class:`~sparse_sglang.mem_cache.gpu_cache.CacheView`, never its
privates. Its torch reference is :func:`sparse_sglang.attention.reference.retrieve_reference`
(the decoder's path for rows too wide for one program, :func:`fits_fused_retrieve`).

Invariants: a step selects at most ``row_width`` pages per row, so the misses always fit in the
row's slots that hold no selected page; request slot 0 (SGLang's CUDA-graph padding) has no row
and changes nothing.
"""

from __future__ import annotations

import torch

from sparse_sglang.mem_cache.gpu_cache import CacheView
from sparse_sglang.mem_cache.plan import MAX_RETRIEVE_CELLS, fits_fused_retrieve, next_pow2

try:  # Triton comes with CUDA builds of torch (and runs on the CPU in its interpreter).
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

__all__ = ["MAX_RETRIEVE_CELLS", "fits_fused_retrieve", "next_pow2", "retrieve_pages"]


if triton is not None:

    @triton.jit
    def _retrieve_kernel(
        pages_ptr, num_pages_ptr, req_slots_ptr, host_pages_ptr,
        directory_ptr, segments_ptr, rows_ptr, slot_page_ptr, last_used_ptr, step_ptr,
        indptr_ptr, indices_ptr, miss_src_ptr, miss_dst_ptr, counters_ptr,
        layer, num_layers, num_heads, num_dir, host_pages_stride, num_host_pages,
        K: tl.constexpr, KP: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, SEG: tl.constexpr,
        LRU_BUCKETS: tl.constexpr, LRU_STEPS: tl.constexpr,
    ):  # fmt: skip
        # One program: one (request, kv head) row of the selection.
        bh = tl.program_id(0)
        b = bh // num_heads
        h = bh % num_heads
        req = tl.load(req_slots_ptr + b).to(tl.int64)
        n = tl.load(num_pages_ptr + b).to(tl.int64)
        step = tl.load(step_ptr)
        j = tl.arange(0, KP)
        # Ascending pages (the top-k's order is arbitrary): FlashInfer then sums the row's pages in
        # one fixed order, so a step's output does not depend on the top-k's order. The lanes past
        # K load a page past every request's end, so they sort last and the K entries stay in
        # lanes 0..K-1 (the miss list's).
        page = tl.sort(tl.load(pages_ptr + bh * K + j, mask=j < K, other=2147483647).to(tl.int64))
        row_base = ((req * num_layers + layer) * num_heads + h) * W
        # A request without a cache row (slot 0: SGLang's CUDA-graph padding) selects nothing.
        has_row = tl.load(rows_ptr + row_base) >= 0
        valid = (page >= 0) & (page < n) & has_row
        page = tl.where(valid, page, 0)
        dir_base = ((req * num_layers + layer) * num_heads + h) * num_dir
        seg = tl.load(directory_ptr + dir_base + page // SEG, mask=valid, other=0).to(tl.int64)
        entry = seg * SEG + page % SEG
        hit = tl.load(segments_ptr + entry, mask=valid, other=-1).to(tl.int64)
        is_hit = valid & (hit >= 0)
        miss = valid & (hit < 0)

        # A row whose pages all hit (most rows of a warm step, every row of a step reusing its
        # selection) skips the victim search: a chain of dependent loads and a sort of the row.
        dst = tl.full([KP], -1, rows_ptr.dtype.element_ty)
        if tl.sum(miss.to(tl.int32), axis=0) > 0:
            # Victims: the row's slots by last use (hits count as used now), oldest first; ties by position.
            w = tl.arange(0, WP)
            row = tl.load(rows_ptr + row_base + w, mask=w < W, other=-1)
            # Columns past the row's width (and a padding request's whole row) hold -1: never victims,
            # and their last_used[-1] loads (outside the tensor: an illegal address when the
            # allocation starts a mapping) stay masked.
            in_row = (w < W) & (row >= 0)
            used = tl.load(last_used_ptr + row, mask=in_row, other=0)
            hit_now = tl.max(((row[:, None] == hit[None, :]) & is_hit[None, :]).to(tl.int32), axis=1) > 0
            used = tl.where(hit_now, step, used)
            if LRU_BUCKETS > 0:  # bucketed LRU: GPUPageCache.recency
                oldest = step // LRU_STEPS - (LRU_BUCKETS - 1)
                used = tl.where(used >= 0, tl.maximum(used // LRU_STEPS, oldest), -1)
            order = tl.sort(tl.where(in_row, (used + 1) * WP + w, (step + 2) * WP + w))
            rank = tl.cumsum(miss.to(tl.int32), axis=0) - 1
            victim = tl.gather(order % WP, tl.where(miss, rank, 0), 0)
            dst = tl.load(rows_ptr + row_base + victim, mask=miss, other=-1)

            # Unmap what the victims held, map the misses.
            old = tl.load(slot_page_ptr + dst, mask=miss, other=-1)
            had = miss & (old >= 0)
            old_c = tl.where(had, old, 0)
            old_seg = tl.load(directory_ptr + dir_base + old_c // SEG, mask=had, other=0).to(tl.int64)
            tl.store(segments_ptr + old_seg * SEG + old_c % SEG, tl.full([KP], -1, tl.int32), mask=had)
            tl.store(segments_ptr + entry, dst.to(tl.int32), mask=miss)
            tl.store(slot_page_ptr + dst, page, mask=miss)
        # Stamp the use.
        slot = tl.where(miss, dst, hit)
        tl.store(last_used_ptr + slot, tl.full([KP], 0, tl.int64) + step, mask=valid)

        # FlashInfer's page indices for this row: the newest page last (last_page_len covers it).
        count = tl.sum(valid.to(tl.int32), axis=0)
        tl.atomic_add(counters_ptr, count.to(tl.int64))  # metrics: pages selected, pages missed
        tl.atomic_add(counters_ptr + 1, tl.sum(miss.to(tl.int64), axis=0))
        newest = valid & (page == n - 1)
        other = valid & (page != n - 1)
        pos = tl.where(newest, count - 1, tl.cumsum(other.to(tl.int32), axis=0) - 1)
        base = tl.load(indptr_ptr + bh)
        tl.store(indices_ptr + base + pos, slot.to(tl.int32), mask=valid)
        if not has_row:  # a padding row still gets the entries its indptr counts: any valid slot
            span = tl.load(indptr_ptr + bh + 1) - base
            tl.store(indices_ptr + base + j, tl.zeros([KP], tl.int32), mask=j < span)

        # FlashH2D's copy list: flat host block (mem_cache.host_pool.host_block) -> slot; -1 = nothing.
        host_page = tl.load(host_pages_ptr + b * host_pages_stride + page, mask=miss, other=0).to(tl.int64)
        tl.store(miss_src_ptr + bh * K + j, ((layer * num_heads + h) * num_host_pages + host_page), mask=j < K)
        tl.store(miss_dst_ptr + bh * K + j, tl.where(miss, dst, -1), mask=j < K)


def retrieve_pages(
    cache: CacheView,
    layer: int,
    req_slots: torch.Tensor,
    page_ids: torch.Tensor,
    num_pages: torch.Tensor,
    host_pages: torch.Tensor,
    num_host_pages: int,
    indptr: torch.Tensor,
    indices: torch.Tensor,
    miss_src: torch.Tensor,
    miss_dst: torch.Tensor,
) -> None:
    """Hits, LRU victims, table updates, FlashInfer indices and the miss list of one layer (one launch).

    Parameters
    ----------
    cache : CacheView
        The GPU page cache's tensors (:attr:`GPUPageCache.view <sparse_sglang.mem_cache.GPUPageCache.view>`).
    layer : int
    req_slots : torch.Tensor
        ``[B]`` request slots (each open).
    page_ids : torch.Tensor
        ``[B, Hkv, K]`` selected logical pages in any order (any strides); ``-1`` or ``>= num_pages`` = none.
        ``K <= row_width``; the newest page ``num_pages - 1`` should be among them.
    num_pages : torch.Tensor
        ``[B]`` pages each request holds.
    host_pages : torch.Tensor
        ``[B, N]`` host page id of each logical page.
    num_host_pages : int
        Pages per (layer, head) of the host store (the flat block index's stride).
    indptr : torch.Tensor
        ``[B * Hkv + 1]`` int32 FlashInfer indptr: row ``b * Hkv + h`` holds ``min(num_pages, K)``.
    indices : torch.Tensor
        int32 FlashInfer page indices, written at ``indptr[row] ..`` (the newest page last).
    miss_src, miss_dst : torch.Tensor
        ``[B * Hkv * K]`` int64 outputs: the copies FlashH2D must do (``miss_dst < 0`` = none).

    Notes
    -----
    Same choices as :func:`~sparse_sglang.attention.reference.retrieve_reference` (its reference): hits are stamped used now, the
    row's other slots sorted by last use (stable; by its bucket with bucketed LRU) are the victims,
    the ``i``-th miss of a row (in ascending page order: the kernel sorts each row of ``page_ids``
    first, so the reference gives the same choices for rows passed in ascending order) takes the
    ``i``-th victim. The row's FlashInfer indices follow ascending page order too, and
    ``miss_src``/``miss_dst`` entry ``j`` is the row's ``j``-th smallest entry of ``page_ids``.
    One call per (layer, cache step): a row has slots enough for its misses among those not stamped
    in the step only once, so a second call under the same step with other pages may evict a slot
    the first stamped and the second hits (the step's owner calls ``GPUPageCache.next_step`` once
    per decode step).
    """
    batch, heads, width = page_ids.shape
    assert width <= cache.row_width, f"{width} selected pages exceed the cache row ({cache.row_width})"
    page_ids = page_ids.contiguous()  # the kernel reads rows at bh * K (the exact shortcut's is expanded over heads)
    _retrieve_kernel[(batch * heads,)](
        page_ids, num_pages, req_slots, host_pages, cache.directory, cache.segments, cache.rows, cache.slot_page,
        cache.last_used, cache.step, indptr, indices, miss_src, miss_dst, cache.counters,
        layer, cache.num_layers, heads, cache.directory.shape[-1], host_pages.stride(0), num_host_pages,
        K=width, KP=next_pow2(width), W=cache.row_width, WP=next_pow2(cache.row_width), SEG=cache.segment_pages,
        LRU_BUCKETS=cache.lru_buckets, LRU_STEPS=cache.lru_steps_per_bucket,
    )  # fmt: skip
