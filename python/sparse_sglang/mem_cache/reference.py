"""Torch references apart from the code the server runs: the GPU page cache's replacement order,
the summaries' ArkVale radius, and the index kernel's (:func:`index_runs_reference`, which the
CPU store runs instead).

The server orders a row's slots by :meth:`GPUPageCache.recency
<sparse_sglang.mem_cache.gpu_cache.GPUPageCache.recency>` and takes a stable sort's first victims
(the retrieve kernel, :mod:`sparse_sglang.attention.retrieval`, does the same on the device). What
that order must choose is defined here: :func:`exact_lru_evict_reference`, exact LRU (SPIN's
histogram eviction over timestamp buckets, which the bucketed recency must match, lives in
``test/test_bucketed_lru.py``); and what narrowing rows for a new request must do, one row at a
time (:func:`shrink_rows_reference`). :func:`page_mean_abs_deviation` is the dense form of the
radius ``PageSummaries(with_radius=True)`` keeps as keys arrive. The CPU tests hold the cache's
and the summaries' results against these; the server runs none of this module.
"""

from __future__ import annotations

import torch


def exact_lru_evict_reference(
    last_used: torch.Tensor, candidates: torch.Tensor, n: int, mandatory: torch.Tensor | None = None
) -> torch.Tensor:
    """Exact LRU for one row: the ``n`` eligible candidates with the smallest exact last-use step
    (``last_used[slot]``, -1 = empty), ties by position. Returns a ``[C]`` bool mask."""
    cand = candidates.long()
    excluded = cand < 0 if mandatory is None else (cand < 0) | mandatory
    stamp = torch.where(excluded, torch.iinfo(torch.int64).max, last_used[cand.clamp_min(0)].long())
    order = stamp.argsort(stable=True)[: min(n, int((~excluded).sum()))]
    victims = torch.zeros_like(excluded)
    victims[order] = True
    return victims


def page_mean_abs_deviation(k: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, page_size: int) -> torch.Tensor:
    """ArkVale's cuboid-mean radius: per page and channel, the mean of ``|k - c|`` over the page's
    keys, ``c = (kmax + kmin) / 2``.

    Parameters
    ----------
    k : torch.Tensor
        ``[..., T, D]`` keys of consecutive pages (token ``t`` in page ``t // page_size``); a last
        partial page averages over the tokens it has.
    kmin, kmax : torch.Tensor
        ``[..., N, D]`` with ``N >= ceil(T / page_size)``; pages past the keys get radius 0.
    page_size : int

    Returns
    -------
    torch.Tensor
        ``[..., N, D]`` float32.
    """
    *lead, num_tokens, dim = k.shape
    num_pages = kmin.shape[-2]
    pad = num_pages * page_size - num_tokens
    assert pad >= 0, "summaries cover fewer pages than the keys"
    k = torch.nn.functional.pad(k.float(), (0, 0, 0, pad), value=float("nan"))
    center = (kmax.float() + kmin.float()) / 2
    dev = (k.view(*lead, num_pages, page_size, dim) - center.unsqueeze(-2)).abs()
    return dev.nanmean(dim=-2).nan_to_num(0.0)


def index_runs_reference(summaries, cache, layer: int, k: torch.Tensor, v: torch.Tensor, token_slots: torch.Tensor,
                         runs) -> None:  # fmt: skip
    """What :func:`~sparse_sglang.mem_cache.kernels.index_runs` does in one kernel, in torch: fold
    the new keys into the page summaries, then write K/V into the cached blocks of their pages."""
    summaries.update(layer, k, token_slots)
    cache.store(layer, runs.token_req_slots, runs.token_positions, k, v)


def shrink_rows_reference(cache, widths: dict[int, int]) -> None:
    """``GPUPageCache._shrink_rows`` one row at a time: in each (layer, head) of each row, a
    stable sort of its slots by recency, most recent first; the first ``width`` stay, the rest
    are unmapped and freed (pushed row after row, in ``widths``' order)."""
    layers, heads = cache._layers.view(-1, 1, 1), cache._heads.view(1, -1, 1)
    for req, width in widths.items():
        row = cache.rows[req, :, :, : cache._width[req]]
        order = cache.recency(cache.last_used[row]).argsort(dim=-1, descending=True, stable=True)
        keep, drop = row.gather(-1, order[..., :width]), row.gather(-1, order[..., width:])
        cache.page_table.invalidate(req, layers, heads, cache.slot_page[drop])
        cache.slot_page[drop] = -1
        cache.last_used[drop] = -1
        cache.rows[req, :, :, :width] = keep
        cache.rows[req, :, :, width:] = -1
        cache._free.push(drop.reshape(-1))
        cache._width[req] = cache._filled[req] = width


def encode_codes_reference(codes, layer: int, k: torch.Tensor, token_slots: torch.Tensor, runs=None) -> None:
    """What :func:`~sparse_sglang.mem_cache.kernels.encode_runs` does (its signature; the runs are
    not needed), page by page in Python: the tokens ``[T, Hkv, D]`` at host slots ``token_slots``
    (``-1``: padding) of each page, in
    position order, widen its frame (a token at offset 0 starts it anew), the page's earlier tokens
    are re-coded from their decoded values and the new ones coded
    (:mod:`~sparse_sglang.mem_cache.key_codes`)."""
    from sparse_sglang.mem_cache.key_codes import decode_codes, encode, pack_codes, unpack_codes

    t = codes.layer(layer)
    size, bits = codes.page_size, codes.bits
    slots = token_slots.long().tolist()
    for page in dict.fromkeys(s // size for s in slots if s >= 0):
        mine = [i for i, s in enumerate(slots) if s >= 0 and s // size == page]
        offsets = [slots[i] % size for i in mine]
        first = min(offsets)
        x = k[mine].float().transpose(0, 1)  # [H, n, D]
        lo, hi = x.amin(1), x.amax(1)
        keys = torch.zeros(x.shape[0], size, x.shape[2], device=x.device)
        if first > 0:
            old_lo, old_hi = t["lo"][:, page].float(), t["hi"][:, page].float()
            lo, hi = torch.minimum(lo, old_lo), torch.maximum(hi, old_hi)
            keys[:, :first] = decode_codes(t["codes"][:, page], t["lo"][:, page], t["hi"][:, page], bits)[:, :first]
        keys[:, offsets] = x
        lo, hi = lo.to(t["lo"].dtype), hi.to(t["hi"].dtype)
        filled = first + len(mine)
        values = unpack_codes(t["codes"][:, page], bits, x.shape[2])
        values[:, :filled] = encode(keys[:, :filled], lo, hi, bits)
        t["codes"][:, page] = pack_codes(values, bits)
        t["lo"][:, page], t["hi"][:, page] = lo, hi
