"""How the server's KV memory is split: host pages, GPU summaries, page cache, request rows.

:func:`plan_memory` turns the sparse config, the model's KV shape and the GPU bytes SGLang leaves
for KV into a :class:`~sparse_sglang.mem_cache.kv_store.StoreShape` and the number of requests
that may run at once (each running request owns a cache row per layer and kv head). Pure
arithmetic: every sizing error is raised here, at start-up, naming the flag to change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sparse_sglang.config import GIB, HOST_STORE_RAM_SHARE, SparseConfig
from sparse_sglang.mem_cache.bounds import bound_dtype
from sparse_sglang.mem_cache.gpu_cache import slot_bytes
from sparse_sglang.mem_cache.host_pool import RESERVED_PAGES, host_page_bytes, pages_for_budget
from sparse_sglang.mem_cache.key_codes import code_row_bytes
from sparse_sglang.mem_cache.key_sketch import SKETCH_DTYPE
from sparse_sglang.mem_cache.kv_store import StoreShape
from sparse_sglang.mem_cache.utils import kv_compute_dtype


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (Triton block sizes)."""
    return 1 << max(0, (n - 1).bit_length())


# The retrieve kernel (attention/retrieval.py) compares a row's slots with its selected pages in
# one program: (K x row) pairs, rounded to powers of two. This is the largest tile it has run at
# (docs/results.md, "Decode step"); wider rows take the torch path (and decode outside CUDA graphs).
MAX_RETRIEVE_CELLS = 256 * 256


def fits_fused_retrieve(selected_pages: int, row_width: int) -> bool:
    """Whether the retrieve kernel (:func:`~sparse_sglang.attention.retrieval.retrieve_pages`)
    takes rows of ``row_width`` slots with ``selected_pages`` selections."""
    return next_pow2(selected_pages) * next_pow2(row_width) <= MAX_RETRIEVE_CELLS


# Widest row (rows grow into slots no other request needs), over the selection: SPIN found ~5x
# buffer over mandatory pages a sweet spot, and the retrieve kernel's work per row (a sort of the
# row, a selection x row comparison) grows with the row.
MAX_AUTO_ROW_RATIO = 4
SAVE_CHUNK_TOKENS = 8192  # tokens per FlashD2H staging buffer (larger prefill batches go in parts)


def save_staging_bytes(buffers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Pinned bytes of FlashD2H's ring: each buffer one layer's K and V of :data:`SAVE_CHUNK_TOKENS`
    tokens and their int64 slots."""
    return buffers * SAVE_CHUNK_TOKENS * (2 * num_kv_heads * head_dim * dtype.itemsize + 8)


class MemoryPlanError(ValueError):
    """The memory budgets cannot hold the model's sparse KV; one line naming the flag."""


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    shape: StoreShape
    max_running_requests: int
    selection_pages: int  # pages one decode step loads per (request, kv head): attended, or re-ranked
    summary_bytes: int
    cache_bytes: int
    staging_bytes: (
        int  # the buffer cached-prefix KV is staged into, one piece at a time (--sparse-prefix-staging-tokens)
    )
    table_bytes: int  # the page table's directory and segments (an upper estimate)
    host_store_reason: str = ""  # how the host store was sized: the flag, or the need and its cap
    resident_bytes: int = 0  # the prefilling prompt's prefix kept between its chunks, out of the page cache's share
    save_staging_bytes: int = 0  # pinned host memory of FlashD2H's staging ring (--sparse-save-staging-buffers)

    @property
    def max_total_tokens(self) -> int:
        """Token locations SGLang's allocator hands out (every host page but the reserved page 0)."""
        return (self.shape.num_host_pages - 1) * self.shape.page_size

    def describe(self) -> str:
        s = self.shape
        return (
            f"host store {s.num_host_pages - 1} pages ({self.max_total_tokens} tokens; {self.host_store_reason}), "
            f"save staging {self.save_staging_bytes / 2**20:.0f} MiB pinned; GPU: summaries "
            f"{self.summary_bytes / GIB:.2f} GiB, page cache {self.cache_bytes / GIB:.2f} GiB ({s.num_slots} slots, "
            f"rows of {s.min_row_width}-{s.row_width} pages), prefix staging {self.staging_bytes / GIB:.2f} GiB"
            + (f", resident prefix {self.resident_bytes / GIB:.2f} GiB" if self.resident_bytes else "")
            + "; "
            f"{self.max_running_requests} requests at once, {self.selection_pages} pages per kv head per step"
        )


def row_width_for(selection_pages: int, max_pages: int | None = None, ratio: float = 1.25) -> int:
    """Cache slots per (request, layer, kv head) for a selection of ``selection_pages``
    (``--sparse-cache-row-ratio`` times it, at most every page a request can hold)."""
    width = max(selection_pages, math.ceil(selection_pages * ratio))
    return width if max_pages is None else min(width, max_pages)


def widest_row_width(row_width: int, selection_pages: int, max_pages: int) -> int:
    """How wide a row of at least ``row_width`` slots may grow: :data:`MAX_AUTO_ROW_RATIO` x the
    selection, never past every page a request can hold, and still within the fused retrieve
    kernel when ``row_width`` is."""
    width = min(max_pages, max(row_width, MAX_AUTO_ROW_RATIO * selection_pages))
    if fits_fused_retrieve(selection_pages, row_width):
        width = min(width, MAX_RETRIEVE_CELLS // next_pow2(selection_pages))
    return max(row_width, width)


# Prefix staging buffers, used in turn: one loads from the host while the other is attended
# (attention/prefix.py). --sparse-prefix-staging-tokens is their sum.
STAGING_BUFFERS = 2


def staging_buffer_pages(staging_tokens: int, page_size: int) -> int:
    """Pages of each staging buffer, for ``staging_tokens`` in all (at least one page each)."""
    return max(1, staging_tokens // page_size // STAGING_BUFFERS)


def prefix_staging_tokens(config: SparseConfig, context_len: int) -> int:
    """Tokens the staging buffers hold together, per kv head: the configured tokens, no more than
    one context holds, in whole pages split evenly between the buffers."""
    configured = math.ceil(min(config.prefix_staging_tokens, context_len) / config.page_size) * config.page_size
    return STAGING_BUFFERS * staging_buffer_pages(configured, config.page_size) * config.page_size


def resident_prefix_tokens(config: SparseConfig, context_len: int) -> int:
    """Prefix tokens kept in GPU memory between a prompt's chunks: the configured ones, no more
    than one context holds, in whole pages (0: off)."""
    return min(config.resident_prefix_tokens, context_len) // config.page_size * config.page_size


def resident_prefix_bytes(tokens: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """GPU bytes of ``tokens`` resident prefix tokens: K and V of every layer as the host stores
    them, and one layer's copy in the dtype they are attended in, when that differs."""
    attend = kv_compute_dtype(dtype)
    per_layer = tokens * num_kv_heads * head_dim * 2
    return per_layer * (num_layers * dtype.itemsize + (attend.itemsize if attend != dtype else 0))


def fixed_gpu_bytes(
    host_pages: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    staging_tokens: int,
    with_radius: bool = False,
    with_mean: bool = True,
    bound_format: str = "exact",
    coarse_pages: int = 0,
    key_row_bytes: int = 0,
    page_bounds: str = "minmax",
) -> tuple[int, int, int]:
    """GPU bytes besides the page cache: ``(summaries, prefix staging, page table)`` for a host
    store of ``host_pages`` pages (summaries of every host page stay resident; with key sketches
    or key codes, ``key_row_bytes`` more per (layer, kv head, page))."""
    bounds = bound_dtype(dtype, bound_format, page_bounds)
    bound_bytes = head_dim * 2 * bounds.itemsize + (1 if bounds == torch.int8 else 0)  # + int8 scale exponent
    float32_bytes = head_dim * ((4 if with_mean else 0) + (4 if with_radius else 0))
    per_page = float32_bytes + bound_bytes * (2 if coarse_pages else 1) + key_row_bytes  # coarse: bounds twice
    summary = num_layers * num_kv_heads * (host_pages + 1) * per_page + num_layers * (host_pages + 1) * 4
    summary += (host_pages + 1) * 4 if coarse_pages else 0  # coarse_first
    attend = kv_compute_dtype(dtype)  # + the copy the prefix is attended from, when it has another dtype
    staging = (
        2 * staging_tokens * num_kv_heads * head_dim * (dtype.itemsize + (attend.itemsize if attend != dtype else 0))
    )
    table = num_layers * num_kv_heads * (host_pages + 64) * 4 * 2  # segments + directory, roughly
    return summary, staging, table


def host_store_by_need(requests: int, max_pages: int, page_size: int, page_bytes: int,
                       ram_bytes: int) -> tuple[int, str]:  # fmt: skip
    """``(host pages, why)`` of a store sized by need: every page ``requests`` requests of
    ``max_pages`` pages can hold, plus the reserved page 0, and at most
    :data:`~sparse_sglang.config.HOST_STORE_RAM_SHARE` of ``ram_bytes`` (the RAM this scheduler may
    take a share of: tensor-parallel ranks and data-parallel replicas split it; servers starting
    together on one host size and pin their stores in turn, integration/memory_pool.py, so each
    sees what those before it took). ``why`` says which bound it took, for the start-up log."""
    need = requests * max_pages + RESERVED_PAGES
    cap = int(ram_bytes * HOST_STORE_RAM_SHARE) // page_bytes
    gib = min(need, cap) * page_bytes / GIB
    what = f"{requests} requests x {max_pages * page_size} tokens x {page_bytes / page_size / 1024:.1f} KiB a token"
    share = f"{HOST_STORE_RAM_SHARE:.0%} of {ram_bytes / GIB:.1f} GiB RAM available"
    if need <= cap:
        return need, f"{gib:.2f} GiB by need: {what} (at most {share})"
    return cap, f"{gib:.2f} GiB, {share}; the need is {need * page_bytes / GIB:.1f} GiB ({what})"


def plan_memory(
    config: SparseConfig,
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    context_len: int,
    gpu_kv_bytes: int,
    max_running_requests: int | None = None,
    max_total_tokens: int | None = None,
    with_radius: bool = False,
    with_mean: bool = True,
    sketch_rank: int = 0,
    host_ram_bytes: int | None = None,
) -> MemoryPlan:
    """Split the budgets (see module doc).

    Parameters
    ----------
    config : SparseConfig
    num_layers, num_kv_heads, head_dim : int
        KV shape of the model (per tensor-parallel rank).
    dtype : torch.dtype
        KV dtype.
    context_len : int
        The model's (or ``--context-length``) longest request.
    gpu_kv_bytes : int
        GPU bytes SGLang leaves for KV after weights and activations (``--mem-fraction-static``).
    max_running_requests, max_total_tokens : int, optional
        SGLang's caps, when the user set them.
    with_radius, with_mean : bool
        Summaries include ArkVale's radius, the mean key (see ``kept_summaries``).
    sketch_rank : int
        The sketch selector's key basis rank (0: no key sketches).
    host_ram_bytes : int, optional
        The host RAM this scheduler may take a share of, when ``config.host_cache_gb`` is ``None``
        (sized by need: :func:`host_store_by_need`, for the requests the GPU page cache runs at
        once, or ``max_running_requests`` when fewer).
    """
    layout = _Layout(config, num_layers, num_kv_heads, head_dim, dtype, context_len, gpu_kv_bytes,
                     max_running_requests, with_radius, with_mean, sketch_rank)  # fmt: skip
    page = config.page_size

    def capped(host_pages: int) -> int:
        return host_pages if max_total_tokens is None else min(host_pages, math.ceil(max_total_tokens / page) + 1)

    if config.host_cache_gb is not None:
        try:
            host_pages = pages_for_budget(config.host_cache_gb, num_layers, num_kv_heads, page, head_dim, dtype)
        except ValueError as err:
            raise MemoryPlanError(f"--sparse-host-cache-gb: {err}") from None
        return layout.plan(capped(host_pages), f"{config.host_cache_gb:g} GiB (--sparse-host-cache-gb)")
    if host_ram_bytes is None:
        raise ValueError("plan_memory: host_ram_bytes is needed to size the host store by need")
    page_bytes = host_page_bytes(num_layers, num_kv_heads, page, head_dim, dtype)
    cap = int(host_ram_bytes * HOST_STORE_RAM_SHARE) // page_bytes
    if cap < RESERVED_PAGES + 1:
        raise MemoryPlanError(
            f"--sparse-host-cache-gb: {HOST_STORE_RAM_SHARE:.0%} of the {host_ram_bytes / GIB:.2f} GiB RAM available "
            f"holds no host page ({page_bytes / (1 << 20):.2f} MiB); free some, or set it"
        )
    # The requests the GPU page cache runs at once beside the smallest store's summaries: at most
    # what it runs beside the store sized for them.
    requests = layout.plan(RESERVED_PAGES + 1, "").max_running_requests
    host_pages, reason = host_store_by_need(requests, layout.max_pages, page, page_bytes, host_ram_bytes)
    return layout.plan(capped(host_pages), reason)


@dataclass(frozen=True)
class _Layout:
    """The GPU side of a plan, for a host store of a given size (:func:`plan_memory`'s arguments)."""

    config: SparseConfig
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    context_len: int
    gpu_kv_bytes: int
    max_running_requests: int | None
    with_radius: bool
    with_mean: bool
    sketch_rank: int

    @property
    def max_pages(self) -> int:
        return math.ceil(self.context_len / self.config.page_size)

    @property
    def key_row_bytes(self) -> int:
        """GPU bytes per (layer, kv head, host page) of key sketches and key codes."""
        page, bits = self.config.page_size, self.config.key_code_bits
        codes = code_row_bytes(page, self.head_dim, bits, self.dtype) if bits else 0
        return page * self.sketch_rank * SKETCH_DTYPE.itemsize + codes

    def plan(self, host_pages: int, host_store_reason: str) -> MemoryPlan:
        config, page, max_pages = self.config, self.config.page_size, self.max_pages
        num_layers, num_kv_heads, head_dim, dtype = self.num_layers, self.num_kv_heads, self.head_dim, self.dtype
        selection = min(config.candidate_pages, max_pages)  # pages a step loads per (layer, kv head)
        min_row_width = row_width_for(selection, max_pages, config.cache_row_ratio)
        if config.rerank_factor > 1 and not fits_fused_retrieve(selection, min_row_width):
            raise MemoryPlanError(
                f"--sparse-rerank-factor {config.rerank_factor}: {selection} candidate pages per kv head in rows of "
                f"{min_row_width} exceed the fused decode kernels ({MAX_RETRIEVE_CELLS} page pairs), which "
                "re-ranking runs; lower it, --sparse-token-budget or --sparse-cache-row-ratio"
            )
        staging_tokens = prefix_staging_tokens(config, self.context_len)
        summary_bytes, staging_bytes, table_bytes = fixed_gpu_bytes(host_pages, num_layers, num_kv_heads, head_dim,
                                                                    dtype, staging_tokens, self.with_radius,
                                                                    self.with_mean, config.bound_format,
                                                                    config.coarse_pages,
                                                                    self.key_row_bytes, config.page_bounds)  # fmt: skip
        resident_bytes = resident_prefix_bytes(resident_prefix_tokens(config, self.context_len), num_layers,
                                               num_kv_heads, head_dim, dtype)  # fmt: skip
        if config.gpu_cache_gb is not None:
            cache_bytes = int(config.gpu_cache_gb * GIB) - resident_bytes
            if cache_bytes <= 0:
                raise MemoryPlanError(
                    f"--sparse-resident-prefix-tokens: its {resident_bytes / GIB:.2f} GiB take the whole page cache "
                    f"(--sparse-gpu-cache-gb {config.gpu_cache_gb:g}); lower it or raise --sparse-gpu-cache-gb"
                )
        else:
            cache_bytes = self.gpu_kv_bytes - summary_bytes - staging_bytes - table_bytes - resident_bytes
            if 0 < cache_bytes + resident_bytes and cache_bytes <= 0:
                raise MemoryPlanError(
                    f"--sparse-resident-prefix-tokens: its {resident_bytes / GIB:.2f} GiB leave no GPU memory for "
                    f"the page cache ({self.gpu_kv_bytes / GIB:.2f} GiB for KV); lower it, or raise --mem-fraction-static"
                )
            if cache_bytes <= 0:
                host_gib = host_pages * host_page_bytes(num_layers, num_kv_heads, page, head_dim, dtype) / GIB
                raise MemoryPlanError(
                    f"--sparse-host-cache-gb: the page summaries of {host_gib:.2f} GiB of host KV "
                    f"({summary_bytes / GIB:.2f} GiB) and the prefix staging buffer ({staging_bytes / GIB:.2f} GiB) "
                    f"leave no GPU memory for the page cache ({self.gpu_kv_bytes / GIB:.2f} GiB for KV); lower it, "
                    "or raise --mem-fraction-static"
                )
        num_slots = cache_bytes // slot_bytes(page, head_dim, dtype)
        row = num_layers * num_kv_heads * min_row_width
        fits = num_slots // row
        if fits < 1:
            need = row * slot_bytes(page, head_dim, dtype) / GIB
            raise MemoryPlanError(
                f"--sparse-gpu-cache-gb: the GPU page cache ({cache_bytes / GIB:.2f} GiB) holds no request; one "
                f"request needs {need:.2f} GiB ({min_row_width} pages x {num_layers} layers x {num_kv_heads} kv "
                "heads); raise it (or --mem-fraction-static), or lower --sparse-token-budget or "
                "--sparse-cache-row-ratio"
            )
        running = min(fits, self.max_running_requests) if self.max_running_requests else fits
        # Rows are elastic: each takes at least min_row_width slots and grows into slots no other
        # request needs (fewer requests running than fit), up to row_width.
        row_width = widest_row_width(min_row_width, selection, max_pages)
        shape = StoreShape(
            num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page, dtype=dtype,
            num_host_pages=host_pages, num_slots=num_slots, max_requests=running + 1, row_width=row_width,
            max_pages=max_pages, max_save_tokens=SAVE_CHUNK_TOKENS, min_row_width=min_row_width,
        )  # fmt: skip
        save_staging = save_staging_bytes(config.save_staging_buffers, num_kv_heads, head_dim, dtype)
        return MemoryPlan(shape, running, selection, summary_bytes, num_slots * slot_bytes(page, head_dim, dtype),
                          staging_bytes, table_bytes, host_store_reason, resident_bytes, save_staging)  # fmt: skip
