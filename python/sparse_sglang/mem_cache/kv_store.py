"""The sparse KV store: everything the server keeps for KV, in one object.

- the pinned host store holding every token's K/V (:class:`HostKVPool`), addressed by SGLang's
  token locations (``host page * page_size + offset``);
- the per-page key summaries on the GPU (:class:`PageSummaries`);
- the GPU page cache of selected pages (:class:`GPUPageCache`);
- the transfer engines: FlashD2H saves prefill KV, the direct-write kernel saves decode tokens
  (a few rows, stream-ordered, CUDA-graph safe), FlashH2D loads cache misses.

:meth:`SparseKVStore.save` is what SGLang's ``set_kv_buffer`` becomes. It needs each token's
request slot and position (for the page cache), which the attention backend binds once per
forward as :class:`~sparse_sglang.mem_cache.kernels.SaveRuns` (:meth:`bind_runs`), before the
layers run.

Contract: the store owns the KV's memory (host pages, summaries, cache slots) and the
``saved_tokens`` counter; the page cache inside it owns the rows' lifetime
(:mod:`~sparse_sglang.mem_cache.gpu_cache`). What a forward saves is what was bound last
(:meth:`SparseKVStore.bind_runs`, by the runtime as a step begins).

On a CPU device (tests) the store is built with the engines' pure-torch references
(``transfer/reference.py``) and the index kernel's (``mem_cache/reference.py``): the choice is
made once, here, and the methods run whichever they were given.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from sparse_sglang.mem_cache.gpu_cache import GPUPageCache
from sparse_sglang.mem_cache.host_pool import HostKVPool
from sparse_sglang.mem_cache.kernels import SaveRuns, encode_runs, index_runs
from sparse_sglang.mem_cache.key_sketch import KeyBasis
from sparse_sglang.mem_cache.reference import encode_codes_reference, index_runs_reference
from sparse_sglang.mem_cache.summaries import PageSummaries
from sparse_sglang.transfer import gather_blocks_reference
from sparse_sglang.transfer.reference import FlashD2HReference


@dataclass(frozen=True, slots=True)
class StoreShape:
    """Sizes of a :class:`SparseKVStore` (see :func:`sparse_sglang.mem_cache.plan.plan_memory`)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype
    num_host_pages: int  # page 0 included (reserved: SGLang pads with it)
    num_slots: int  # GPU page cache slots
    max_requests: int  # request slots, SGLang's padding row 0 included
    row_width: int  # most cache slots per (request, layer, kv head)
    max_pages: int  # logical pages of the longest request
    max_save_tokens: int  # tokens one FlashD2H submit takes (longer batches go in parts)
    min_row_width: int | None = None  # fewest cache slots per (request, layer, kv head); None = row_width


class SparseKVStore:
    """Host store, summaries, page cache and transfer engines (see module doc).

    Parameters
    ----------
    shape : StoreShape
    device : torch.device or str
        The GPU (or ``"cpu"`` for tests: unpinned host store, reference transfers).
    with_radius, with_mean : bool
        Keep ArkVale's radius summary (the ``arkvale`` selector) and the mean key (the ``mean``
        selector); ``sparse_sglang.attention.kept_summaries(selector)`` gives both.
    fused : bool
        Index new tokens with the fused kernel (default: on CUDA; on CPU it runs in Triton's
        interpreter) instead of the torch reference.
    lru_buckets, lru_steps_per_bucket : int
        The GPU page cache's replacement order (:meth:`GPUPageCache.recency`; 0 = exact LRU).
    bound_format : {"exact", "int8", "auto"}
        How the summaries store page key bounds (``--sparse-bound-format``; :class:`PageSummaries`).
    page_bounds : {"minmax", "meanstd"}
        Which two corners a page's bounds are, and ``bound_spread`` the std multiple of meanstd's
        (``--sparse-page-bounds``, ``--sparse-bound-spread``; :class:`PageSummaries`).
    coarse_pages : int
        Also keep coarse bounds of super-pages of this many pages (``--sparse-coarse-pages``; 0 = none).
    key_basis : KeyBasis, optional
        Keep every token's key sketch (the ``sketch`` selector; :class:`PageSummaries`).
    key_bits : int
        Keep every key's low-bit code (the quantized re-rank; :class:`PageSummaries`); 0 = none.
    d2h_threads : int, optional
        FlashD2H's scatter threads (default: the transfer module's, for one scheduler per host).
    d2h_buffers : int
        FlashD2H's staging buffers (``--sparse-save-staging-buffers``): how many layers' saves a
        prefill can have in flight before its launch waits for the scatter.
    """

    def __init__(self, shape: StoreShape, device: torch.device | str, *, with_radius: bool = False,
                 with_mean: bool = True, fused: bool | None = None, lru_buckets: int = 0,
                 lru_steps_per_bucket: int = 1, bound_format: str = "auto", page_bounds: str = "minmax",
                 bound_spread: float = 1.0, coarse_pages: int = 0,
                 key_basis: KeyBasis | None = None, key_bits: int = 0,
                 d2h_threads: int | None = None, d2h_buffers: int = 4):  # fmt: skip
        self.shape = shape
        self.device = torch.device(device)
        on_gpu = self.device.type == "cuda"
        s = shape
        self.host = HostKVPool(
            s.num_layers, s.num_kv_heads, s.num_host_pages, s.page_size, s.head_dim, s.dtype, pin=on_gpu
        )
        self.summaries = PageSummaries(s.num_layers, s.num_kv_heads, s.num_host_pages, s.page_size, s.head_dim, s.dtype,
                                       self.device, with_radius=with_radius, with_mean=with_mean,
                                       bound_format=bound_format, page_bounds=page_bounds,
                                       bound_spread=bound_spread, coarse_pages=coarse_pages,
                                       key_basis=key_basis, key_bits=key_bits)  # fmt: skip
        self.cache = GPUPageCache(
            s.num_slots, s.num_layers, s.num_kv_heads, s.page_size, s.head_dim, s.dtype,
            max_requests=s.max_requests, row_width=s.row_width, max_pages=s.max_pages,
            total_pages=s.num_host_pages, device=self.device, min_row_width=s.min_row_width,
            lru_buckets=lru_buckets, lru_steps_per_bucket=lru_steps_per_bucket,
        )  # fmt: skip
        if on_gpu:
            from sparse_sglang.transfer import DirectD2H, FlashD2H, FlashH2D

            self.load = FlashH2D(self.host.k, self.host.v, self.cache.k, self.cache.v)
            self.flash_d2h = FlashD2H(self.host.k, self.host.v, s.max_save_tokens, device=self.device,
                                      num_threads=d2h_threads, num_buffers=d2h_buffers)  # fmt: skip
            self.direct_d2h = DirectD2H(self.host.k, self.host.v, device=self.device)
        else:
            self.load = lambda src, dst: gather_blocks_reference(
                self.host.k, self.host.v, self.cache.k, self.cache.v, src, dst
            )
            self.flash_d2h = self.direct_d2h = FlashD2HReference(self.host.k, self.host.v)
        fused = on_gpu if fused is None else fused
        self.index_runs = index_runs if fused else index_runs_reference
        self.encode_runs = encode_runs if fused else encode_codes_reference
        self.runs: SaveRuns | None = None  # the current forward's tokens (bind_runs)
        # The stream the forwards run on (note_forward_stream): SGLang's overlap scheduler runs
        # them on a stream of their own, and what changes the cache between them goes there too.
        self.forward_stream: torch.cuda.Stream | None = None
        # Tokens whose KV went to the host (every layer). This store is its one writer: prefill
        # saves count in save(), a decode step's in count_decode_saves(), which the step's owner
        # (SparseRuntime.begin_decode) calls once per step (a CUDA-graph replay runs no Python).
        self.saved_tokens = 0

    @property
    def gpu_bytes(self) -> int:
        cache = (self.cache.k.numel() + self.cache.v.numel()) * self.shape.dtype.itemsize
        return self.summaries.nbytes + cache

    def note_forward_stream(self) -> None:
        """Remember the current stream as the one forwards run on (the backend calls this as each
        forward begins)."""
        if self.device.type == "cuda":
            self.forward_stream = torch.cuda.current_stream(self.device)

    def on_forward_stream(self):
        """A context that queues GPU work behind the forwards queued so far: the scheduler frees a
        finished request's row while, under overlap, the next forward (which still decodes it) may
        be running, and it must not change that forward's rows and tables under it."""
        return contextlib.nullcontext() if self.forward_stream is None else torch.cuda.stream(self.forward_stream)

    def bind_runs(self, runs: SaveRuns) -> None:
        """The tokens the next forward saves (their request slots and positions, as runs)."""
        self.runs = runs

    def index(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """The GPU side of a save (SPIN's *Index*): fold keys ``[T, Hkv, D]`` (store dtype,
        contiguous) into the page summaries and write K/V into the cached blocks of their pages."""
        self.index_runs(self.summaries, self.cache, layer, k, v, loc, self.runs)
        if self.summaries.key_codes is not None:
            self.encode_runs(self.summaries.key_codes, layer, k, loc, self.runs)
        if self.summaries.sketch is not None:
            self.summaries.update_sketch(layer, k, loc)

    def save(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, staged: bool) -> None:
        """Save one layer's new K/V ``[T, Hkv, D]`` at host token slots ``loc`` ``[T]``.

        Summaries and cached pages are updated on the current stream. The host copy goes through
        FlashD2H when ``staged`` (prefill: large, off the GPU's SMs, finished by CPU threads;
        :meth:`wait_saves` before reading those pages from the host) and through the direct-write
        kernel otherwise (decode: a few rows, stream-ordered, capturable in a CUDA graph).
        """
        k, v = self.to_store_dtype(k), self.to_store_dtype(v)
        if staged and layer == 0:
            self.saved_tokens += k.shape[0]
        self.index(layer, loc, k, v)
        if staged:
            step = self.shape.max_save_tokens
            for start in range(0, k.shape[0], step):
                self.flash_d2h.submit(
                    layer, k[start : start + step], v[start : start + step], loc[start : start + step]
                )
        else:
            self.direct_d2h(layer, k, v, loc)

    def count_decode_saves(self, tokens: int) -> None:
        """A decode step's new tokens (one per real request), for ``stats``: the direct-write
        kernel saves them inside CUDA graphs, where no Python runs, so the step's owner reports
        them here once per step. This store is the counter's one writer."""
        self.saved_tokens += tokens

    def to_store_dtype(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as the store's dtype, contiguous. Into fp8 the cast saturates at the format's
        largest value: torch turns anything beyond it into NaN, which one token would spread
        through every later attention over its page."""
        dtype = self.shape.dtype
        if dtype.itemsize == 1 and x.dtype != dtype:
            top = torch.finfo(dtype).max
            x = x.clamp(-top, top)
        return x.to(dtype).contiguous()

    def stats(self, window: int = 12) -> dict:
        """Counters for metrics: the GPU page cache's (slots, rows, pages selected and loaded, hit
        ratio, the running requests' ``window``-step working sets), bytes loaded from the host (H2D)
        and saved to it (D2H) since start."""
        s = self.shape
        block = s.page_size * s.head_dim * s.dtype.itemsize * 2  # one (layer, head, page) of K and V
        out = self.cache.stats(window)
        out["h2d_bytes"] = out["pages_loaded"] * block
        out["d2h_tokens"] = self.saved_tokens
        out["d2h_bytes"] = self.saved_tokens * s.num_layers * s.num_kv_heads * s.head_dim * s.dtype.itemsize * 2
        out["gpu_bytes"] = self.gpu_bytes
        return out

    def wait_saves(self) -> None:
        """Block until every staged save is in the host store."""
        self.flash_d2h.synchronize()

    def close(self) -> None:
        self.flash_d2h.close()
