"""Fused Triton kernels of the save path, each one launch per layer:

- :func:`index_runs` (the *Index* half of a save): fold new keys into the page summaries (min/max
  bounds, or mean/std corners merged with Chan's update) and write new K/V into the cached blocks
  of their pages. Its reference is
  :meth:`PageSummaries.update` + :meth:`GPUPageCache.store` (dozens of torch ops with atomics
  when a page's tokens contend: too slow for a long prefill).
- :func:`encode_runs`: new keys into their pages' low-bit key codes (the quantized re-rank's;
  :mod:`~sparse_sglang.mem_cache.key_codes`). Its reference is
  :func:`~sparse_sglang.mem_cache.reference.encode_codes_reference`.
- :func:`build_coarse`: the coarse bounds of the super-pages not built yet, every layer at once.
  Its reference is :meth:`PageSummaries.build_coarse`.

(The decode step's retrieve kernel lives with the decode path:
:mod:`sparse_sglang.attention.retrieval`.)

:func:`index_runs` works on *runs*: tokens are saved in runs of consecutive positions of one
request inside one page (:class:`SaveRuns`), so one program owns one (page, kv head) and needs no
atomics. A page's tokens arrive in position order (SGLang appends), so a run starting at page
offset ``o`` finds ``o`` tokens in the page already: that is the page's old count.

Without CUDA, the CPU tests run these kernels in Triton's interpreter (``TRITON_INTERPRET=1``,
set by ``test/conftest.py``) and compare them with the torch references.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparse_sglang.mem_cache.utils import host_to_device

try:  # Triton comes with CUDA builds of torch (and runs on the CPU in its interpreter).
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


@dataclass(frozen=True, slots=True)
class SaveRuns:
    """The tokens one forward saves, as runs of consecutive positions of one request in one page.

    Attributes
    ----------
    start, length : torch.Tensor
        ``[R]`` int32: first token (index into the forward's token order) and token count
        (``1..page_size``) of each run.
    req_slot, logical_page, page_offset : torch.Tensor
        ``[R]`` int32: request slot, logical page (``position // page_size``) and offset of the
        run's first token in the page (``position % page_size``).
    token_req_slots, token_positions : torch.Tensor
        ``[T]`` int64: the same per token (the torch reference path reads these).
    """

    start: torch.Tensor
    length: torch.Tensor
    req_slot: torch.Tensor
    logical_page: torch.Tensor
    page_offset: torch.Tensor
    token_req_slots: torch.Tensor
    token_positions: torch.Tensor

    @property
    def num_runs(self) -> int:
        return self.start.shape[0]

    @classmethod
    def for_extend(cls, req_slots: list[int], prefix_lens: list[int], extend_lens: list[int], page_size: int,
                   device: torch.device | str) -> SaveRuns:  # fmt: skip
        """Runs of an extend batch: request ``i`` saves positions ``[prefix_lens[i], prefix_lens[i] +
        extend_lens[i])``, its tokens following request ``i - 1``'s. Built on the host from the
        scheduler's lengths (no device reads), copied to ``device`` from pinned memory."""
        slots = torch.tensor(req_slots, dtype=torch.int64)
        starts = torch.tensor(prefix_lens, dtype=torch.int64)
        lens = torch.tensor(extend_lens, dtype=torch.int64)
        ends = starts + lens
        has = lens > 0
        first = starts // page_size
        nruns = torch.where(has, (ends - 1) // page_size - first + 1, 0)
        owner = torch.repeat_interleave(torch.arange(len(req_slots)), nruns)
        run_base = torch.cumsum(nruns, 0) - nruns
        page = first[owner] + torch.arange(int(nruns.sum())) - run_base[owner]
        lo = torch.maximum(page * page_size, starts[owner])
        hi = torch.minimum((page + 1) * page_size, ends[owner])
        token_base = torch.cumsum(lens, 0) - lens
        token_req = torch.repeat_interleave(slots, lens)
        token_pos = (
            torch.cat([torch.arange(s, e) for s, e in zip(starts.tolist(), ends.tolist())]) if len(req_slots) else lens
        )
        runs = (token_base[owner] + lo - starts[owner], hi - lo, slots[owner], page, lo % page_size)
        to = lambda t, dtype: host_to_device(t, device, dtype)  # noqa: E731
        return cls(*(to(t, torch.int32) for t in runs), to(token_req, torch.int64), to(token_pos, torch.int64))

    @classmethod
    def for_decode(cls, req_slots: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> SaveRuns:
        """Runs of a decode batch (one token per request, at position ``seq_lens - 1``), on the
        device from device tensors: no host synchronization, fine inside a CUDA graph."""
        pos = seq_lens.long() - 1
        batch = req_slots.shape[0]
        i32 = torch.int32
        return cls(torch.arange(batch, dtype=i32, device=req_slots.device), torch.ones(batch, dtype=i32, device=req_slots.device),
                   req_slots.to(i32), (pos // page_size).to(i32), (pos % page_size).to(i32), req_slots.long(), pos)  # fmt: skip


if triton is not None:
    from sparse_sglang.mem_cache.bounds import pow2, quantize_nearest, quantize_outward
    from sparse_sglang.mem_cache.key_codes import frame_step_tl

    @triton.jit
    def _run_page(r, run_start_ptr, run_len_ptr, run_offset_ptr, token_slots_ptr, P: tl.constexpr):
        # Run r: its first token's row, its length, its page offset, whether it saves anything
        # (padding runs, CUDA-graph filler, save nothing) and its host page.
        start = tl.load(run_start_ptr + r).to(tl.int64)
        n = tl.load(run_len_ptr + r)
        offset = tl.load(run_offset_ptr + r)
        first_slot = tl.load(token_slots_ptr + start)
        ok = first_slot >= 0
        return start, n, offset, ok, tl.where(ok, first_slot // P, 0)

    @triton.jit
    def _index_runs_kernel(
        k_ptr, v_ptr, token_slots_ptr,
        run_start_ptr, run_len_ptr, run_req_ptr, run_page_ptr, run_offset_ptr,
        kmin_ptr, kmax_ptr, exp_ptr, mean_ptr, radius_ptr, count_ptr, coarse_first_ptr,
        directory_ptr, segments_ptr, cache_k_ptr, cache_v_ptr,
        layer, num_layers, num_heads, num_dir, summary_head_stride, exp_head_stride, spread,
        P: tl.constexpr, D: tl.constexpr, SEG: tl.constexpr, WITH_MEAN: tl.constexpr, WITH_RADIUS: tl.constexpr,
        STORE_CACHE: tl.constexpr, INT8_BOUNDS: tl.constexpr, COARSE: tl.constexpr, MEANSTD: tl.constexpr,
    ):  # fmt: skip
        # One program: one run (<= P tokens of one page) of one kv head.
        r = tl.program_id(0)
        h = tl.program_id(1)
        start, n, offset, ok, page = _run_page(r, run_start_ptr, run_len_ptr, run_offset_ptr, token_slots_ptr, P)
        t = tl.arange(0, P)
        d = tl.arange(0, D)
        tok = ok & (t < n)
        rows = (start + t)[:, None] * (num_heads * D) + h * D + d[None, :]
        x = tl.load(k_ptr + rows, mask=tok[:, None], other=0.0).to(tl.float32)

        # Summaries: the page held `offset` tokens before this run (see module doc).
        s = h.to(tl.int64) * summary_head_stride + page * D + d
        keep = ok & (offset > 0) & (d < D)  # merge with the old values; offset 0 starts the page
        # The identities fill in float32: as `other` they would be cast to the bounds' type, and
        # fp8 e4m3 has no infinity (NaN).
        old_min = tl.load(kmin_ptr + s, mask=keep).to(tl.float32)  # masked lanes: replaced below
        old_max = tl.load(kmax_ptr + s, mask=keep).to(tl.float32)
        if INT8_BOUNDS:  # levels times the page's scale 2**e (bounds.dequantize_bounds): exact
            e_at = h.to(tl.int64) * exp_head_stride + page
            old_exp = tl.load(exp_ptr + e_at, mask=ok & (offset > 0), other=0).to(tl.int32)
            old_min, old_max = old_min * pow2(old_exp), old_max * pow2(old_exp)
        c = offset.to(tl.float32)
        total = c + n.to(tl.float32)
        if MEANSTD:  # PageSummaries._merge_moments: the old moments from the corners, Chan's update
            old_mean = tl.where(keep, (old_min + old_max) * 0.5, 0.0)
            old_std = tl.where(keep, (old_max - old_min) * (0.5 / spread), 0.0)
            sums = tl.sum(tl.where(tok[:, None], x, 0.0), axis=0)
            squares = tl.sum(tl.where(tok[:, None], x * x, 0.0), axis=0)
            mean = (old_mean * c + sums) / total
            second = (c * (old_std * old_std + old_mean * old_mean) + squares) / total
            std = tl.sqrt(tl.maximum(second - mean * mean, 0.0))
            lo, hi = mean - spread * std, mean + spread * std
        else:
            old_min = tl.where(keep, old_min, float("inf"))
            old_max = tl.where(keep, old_max, float("-inf"))
            lo = tl.minimum(old_min, tl.min(tl.where(tok[:, None], x, float("inf")), axis=0))
            hi = tl.maximum(old_max, tl.max(tl.where(tok[:, None], x, float("-inf")), axis=0))
        store = ok & (d < D)
        if INT8_BOUNDS:  # requantized (bounds.quantize_bounds or quantize_corners, bit for bit)
            if MEANSTD:
                lo, hi, e = quantize_nearest(lo, hi)
            else:
                lo, hi, e = quantize_outward(lo, hi)
            tl.store(exp_ptr + h.to(tl.int64) * exp_head_stride + page, e.to(tl.int8), mask=ok)
            lo_value, hi_value = lo * pow2(e), hi * pow2(e)
        else:
            lo_value = lo.to(kmin_ptr.dtype.element_ty).to(tl.float32)
            hi_value = hi.to(kmax_ptr.dtype.element_ty).to(tl.float32)
        tl.store(kmin_ptr + s, lo.to(kmin_ptr.dtype.element_ty), mask=store)
        tl.store(kmax_ptr + s, hi.to(kmax_ptr.dtype.element_ty), mask=store)
        if WITH_MEAN:
            old_mean = tl.load(mean_ptr + s, mask=keep, other=0.0)
            tl.store(mean_ptr + s, (old_mean * c + tl.sum(x, axis=0)) / total, mask=store)
        if WITH_RADIUS:  # ArkVale: mean |k - centre| against the updated (stored) cuboid
            centre = (lo_value + hi_value) * 0.5
            old_radius = tl.load(radius_ptr + s, mask=keep, other=0.0)
            dev = tl.sum(tl.where(tok[:, None], tl.abs(x - centre[None, :]), 0.0), axis=0)
            tl.store(radius_ptr + s, (old_radius * c + dev) / total, mask=store)
        if h == 0:
            tl.store(count_ptr + page, (offset + n).to(tl.int32), mask=ok)
            if COARSE:  # a page started anew ends no built super-page (PageSummaries.update)
                tl.store(coarse_first_ptr + page, -1, mask=ok & (offset == 0))

        if STORE_CACHE:  # write-through into the page's cache block, if the page is cached
            req = tl.load(run_req_ptr + r).to(tl.int64)
            lpage = tl.load(run_page_ptr + r).to(tl.int64)
            entry = ((req * num_layers + layer) * num_heads + h) * num_dir + lpage // SEG
            seg = tl.load(directory_ptr + entry, mask=ok & (req >= 0), other=0).to(tl.int64)
            slot = tl.load(segments_ptr + seg * SEG + lpage % SEG, mask=ok & (req >= 0), other=-1).to(tl.int64)
            dst = (slot * P + offset + t)[:, None] * D + d[None, :]
            cached = tok[:, None] & (slot >= 0)
            tl.store(cache_k_ptr + dst, x.to(cache_k_ptr.dtype.element_ty), mask=cached)
            xv = tl.load(v_ptr + rows, mask=cached, other=0.0)
            tl.store(cache_v_ptr + dst, xv, mask=cached)


if triton is not None:

    @triton.jit
    def _encode_runs_kernel(
        k_ptr, token_slots_ptr, run_start_ptr, run_len_ptr, run_offset_ptr, codes_ptr, lo_ptr, hi_ptr,
        num_heads, codes_head_stride, frame_head_stride,
        P: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr,
    ):  # fmt: skip
        # One program: one run (<= P tokens of one page) of one kv head; the page's frame widened
        # by the run's keys, its earlier tokens re-coded from their decoded values (key_codes).
        r = tl.program_id(0)
        h = tl.program_id(1)
        start, n, offset, ok, page = _run_page(r, run_start_ptr, run_len_ptr, run_offset_ptr, token_slots_ptr, P)
        LEVELS: tl.constexpr = (1 << BITS) - 1
        PER_BYTE: tl.constexpr = 8 // BITS
        t = tl.arange(0, P)
        d = tl.arange(0, D)
        new = ok & (t >= offset) & (t < offset + n)  # page positions the run writes
        rows = (start + t - offset)[:, None] * (num_heads * D) + h * D + d[None, :]
        x = tl.load(k_ptr + rows, mask=new[:, None], other=0.0).to(tl.float32)

        f = h.to(tl.int64) * frame_head_stride + page * D + d
        had = ok & (offset > 0)  # offset 0 starts the page: a previous owner's frame is not read
        old_lo = tl.load(lo_ptr + f, mask=had, other=0.0).to(tl.float32)
        old_hi = tl.load(hi_ptr + f, mask=had, other=0.0).to(tl.float32)
        lo = tl.min(tl.where(new[:, None], x, float("inf")), axis=0)
        hi = tl.max(tl.where(new[:, None], x, float("-inf")), axis=0)
        lo = tl.where(had, tl.minimum(lo, old_lo), lo)
        hi = tl.where(had, tl.maximum(hi, old_hi), hi)
        # Stored in the keys' type: a min or max is a key, so this changes nothing but the type.
        lo = lo.to(lo_ptr.dtype.element_ty).to(tl.float32)
        hi = hi.to(hi_ptr.dtype.element_ty).to(tl.float32)

        W: tl.constexpr = D // PER_BYTE  # bytes per token: byte w holds channels w, w + W, ... (key_codes)
        base = h.to(tl.int64) * codes_head_stride + page * (P * W)
        byte = base + t[:, None] * W + (d % W)[None, :]
        shift = (d // W) * BITS
        old = ok & (t < offset)
        old_codes = (tl.load(codes_ptr + byte, mask=old[:, None], other=0).to(tl.int32) >> shift[None, :]) & LEVELS
        # Torch's arithmetic exactly (frame_step's product, a correctly rounded division, nothing fused:
        # enable_fp_fusion=False at the launch): keys on a rounding boundary (common with fp8 keys)
        # get the reference's code, not its neighbour.
        old_step = frame_step_tl(old_lo, old_hi, LEVELS)
        value = tl.where(new[:, None], x, old_lo[None, :] + old_codes.to(tl.float32) * old_step[None, :])
        step = frame_step_tl(lo, hi, LEVELS)
        codes = tl.floor(tl.math.div_rn(value - lo[None, :], step[None, :]) + 0.5)
        codes = tl.minimum(tl.maximum(codes, 0.0), LEVELS).to(tl.int32) << shift[None, :]
        packed = tl.sum(tl.reshape(codes, (P, PER_BYTE, W)), axis=1)
        written = ok & (t < offset + n)
        w = tl.arange(0, W)
        tl.store(codes_ptr + base + t[:, None] * W + w[None, :], packed.to(tl.uint8), mask=written[:, None])
        tl.store(lo_ptr + f, lo.to(lo_ptr.dtype.element_ty), mask=ok & (d < D))
        tl.store(hi_ptr + f, hi.to(hi_ptr.dtype.element_ty), mask=ok & (d < D))

    @triton.jit
    def _build_coarse_kernel(
        host_pages_ptr, built_ptr, kmin_ptr, kmax_ptr, exp_ptr, ckmin_ptr, ckmax_ptr, cexp_ptr, first_ptr,
        host_pages_stride, num_layers, num_heads, layer_stride, head_stride, exp_layer_stride, exp_head_stride,
        S: tl.constexpr, D: tl.constexpr, INT8_BOUNDS: tl.constexpr,
    ):  # fmt: skip
        # One program: super-page s of request b, built unless its last page's coarse_first names
        # its first page already (then nothing since has changed its pages: PageSummaries.update).
        # Requests sharing a radix prefix may build the same super-page at once: same values.
        b = tl.program_id(0)
        sp = tl.program_id(1)
        if sp < tl.load(built_ptr + b):
            row = b.to(tl.int64) * host_pages_stride + sp * S
            pages = tl.load(host_pages_ptr + row + tl.arange(0, S)).to(tl.int64)
            first = tl.load(host_pages_ptr + row).to(tl.int32)
            last = tl.load(host_pages_ptr + row + S - 1).to(tl.int64)
            if tl.load(first_ptr + last) != first:
                d = tl.arange(0, D)
                for lh in range(num_layers * num_heads):
                    layer = lh // num_heads
                    h = lh % num_heads
                    base = layer.to(tl.int64) * layer_stride + h.to(tl.int64) * head_stride
                    rows = base + pages[:, None] * D + d[None, :]
                    lo = tl.load(kmin_ptr + rows).to(tl.float32)
                    hi = tl.load(kmax_ptr + rows).to(tl.float32)
                    out = base + last * D + d
                    if INT8_BOUNDS:
                        e_at = layer.to(tl.int64) * exp_layer_stride + h.to(tl.int64) * exp_head_stride
                        scale = pow2(tl.load(exp_ptr + e_at + pages).to(tl.int32))[:, None]
                        lo_q, hi_q, e = quantize_outward(tl.min(lo * scale, axis=0), tl.max(hi * scale, axis=0))
                        tl.store(ckmin_ptr + out, lo_q.to(tl.int8))
                        tl.store(ckmax_ptr + out, hi_q.to(tl.int8))
                        tl.store(cexp_ptr + e_at + last, e.to(tl.int8))
                    else:  # the min of stored values is a stored value: exact in the bounds' type
                        tl.store(ckmin_ptr + out, tl.min(lo, axis=0).to(ckmin_ptr.dtype.element_ty))
                        tl.store(ckmax_ptr + out, tl.max(hi, axis=0).to(ckmax_ptr.dtype.element_ty))
                tl.store(first_ptr + last, first)


def build_coarse(summaries, host_pages: torch.Tensor, built: torch.Tensor, max_built: int) -> None:
    """:meth:`PageSummaries.build_coarse <sparse_sglang.mem_cache.PageSummaries.build_coarse>` in
    one launch, every layer at once: only the super-pages not built yet read their pages' bounds
    (after a prefill, all of a request's; then one every ``coarse_pages`` pages). ``max_built``
    (a host int, at least every ``built[b]``) sizes the grid."""
    if max_built <= 0:
        return
    t = summaries.all_layers()
    kmin, kmax = t["kmin"], t["kmax"]
    int8 = "bound_exp" in t
    exp = t["bound_exp"] if int8 else t["count"]  # count: a placeholder the kernel does not read
    cexp = t["coarse_bound_exp"] if int8 else exp
    assert host_pages.stride(1) == 1 and kmin.is_contiguous() and exp.is_contiguous()
    layers, heads, _, dim = kmin.shape
    _build_coarse_kernel[(host_pages.shape[0], max_built)](
        host_pages, built, kmin, kmax, exp, t["coarse_kmin"], t["coarse_kmax"], cexp, t["coarse_first"],
        host_pages.stride(0), layers, heads, kmin.stride(0), kmin.stride(1), exp.stride(0), exp.stride(1),
        S=summaries.coarse_pages, D=dim, INT8_BOUNDS=int8,
    )  # fmt: skip


def index_runs(summaries, cache, layer: int, k: torch.Tensor, v: torch.Tensor, token_slots: torch.Tensor,
               runs: SaveRuns, *, store_cache: bool = True) -> None:  # fmt: skip
    """Fold one layer's new keys into ``summaries`` and write new K/V into ``cache`` (one launch).

    Parameters
    ----------
    summaries : PageSummaries
    cache : GPUPageCache
    layer : int
    k, v : torch.Tensor
        ``[T, Hkv, D]`` contiguous, of the cache dtype.
    token_slots : torch.Tensor
        ``[T]`` int64 host token slots (``-1`` = padding: the run saves nothing).
    runs : SaveRuns
        The forward's runs (their tokens are ``k``'s rows).
    store_cache : bool
        Also write the cached blocks (the reference: :meth:`GPUPageCache.store`).
    """
    if runs.num_runs == 0:
        return
    num_tokens, heads, dim = k.shape
    assert k.is_contiguous() and v.is_contiguous() and dim & (dim - 1) == 0, (
        "k/v [T, H, D] contiguous, D a power of two"
    )
    pt = cache.page_table
    lay = summaries.layer(layer)
    kmin, count = lay["kmin"], summaries.layer_count(layer)
    exp = lay.get("bound_exp", count)  # count: a placeholder the kernel does not read (exact bounds)
    coarse_first = summaries.all_layers().get("coarse_first", count)  # likewise without coarse bounds
    _index_runs_kernel[(runs.num_runs, heads)](
        k, v, token_slots, runs.start, runs.length, runs.req_slot, runs.logical_page, runs.page_offset,
        kmin, lay["kmax"], exp, lay.get("mean", kmin), lay.get("radius", kmin), count, coarse_first, pt.directory, pt.segments,
        cache.k_with_scratch, cache.v_with_scratch,
        layer, pt.num_layers, heads, pt.directory.shape[-1], kmin.stride(0), exp.stride(0), summaries.bound_spread,
        P=cache.page_size, D=dim, SEG=pt.segment_pages, WITH_MEAN="mean" in lay, WITH_RADIUS="radius" in lay,
        STORE_CACHE=store_cache, INT8_BOUNDS="bound_exp" in lay, COARSE=summaries.coarse_first is not None,
        MEANSTD=summaries.page_bounds == "meanstd",
    )  # fmt: skip


def encode_runs(codes, layer: int, k: torch.Tensor, token_slots: torch.Tensor, runs: SaveRuns) -> None:
    """Code one layer's new keys into their pages' key codes (one launch; :mod:`~sparse_sglang.mem_cache.key_codes`).

    Parameters
    ----------
    codes : PageKeyCodes
    layer : int
    k : torch.Tensor
        ``[T, Hkv, D]`` contiguous, of the store's dtype.
    token_slots : torch.Tensor
        ``[T]`` int64 host token slots (``-1`` = padding: the run saves nothing).
    runs : SaveRuns
        The forward's runs (their tokens are ``k``'s rows).
    """
    if runs.num_runs == 0:
        return
    heads, dim = k.shape[1], k.shape[2]
    assert k.is_contiguous() and dim & (dim - 1) == 0, "k [T, H, D] contiguous, D a power of two"
    t = codes.layer(layer)
    _encode_runs_kernel[(runs.num_runs, heads)](
        k, token_slots, runs.start, runs.length, runs.page_offset, t["codes"], t["lo"], t["hi"],
        heads, t["codes"].stride(0), t["lo"].stride(0), P=codes.page_size, D=dim, BITS=codes.bits,
        enable_fp_fusion=False,
    )  # fmt: skip
