"""Plain-torch references of the decode path's kernels, apart from them (as
:mod:`sparse_sglang.transfer.reference` is for the transfer kernels).

- :func:`retrieve_reference`: :func:`~sparse_sglang.attention.retrieval.retrieve_pages`'s choices
  (hits, LRU victims, table updates) in torch ops over the cache's public methods. The decoder
  also runs it for rows too wide for the kernel's one program
  (:func:`~sparse_sglang.attention.retrieval.fits_fused_retrieve`).

The CPU tests compare each kernel (run in Triton's interpreter) with its reference here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sparse_sglang.mem_cache.gpu_cache import GPUPageCache


def retrieve_reference(
    cache: GPUPageCache, layer: int, req_slots: torch.Tensor, page_ids: torch.Tensor, host_pages: torch.Tensor,
    load: Callable[[torch.Tensor, torch.Tensor], None], num_host_pages: int,
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
    src = (layer * cache.num_kv_heads + head) * num_host_pages + host_page
    load(src.reshape(-1), dst.reshape(-1))
    return torch.where(miss, dst, hit)
