"""KV memory management over the per-head GPU/host hierarchy.

- :class:`HostKVPool`: the pinned host store holding all KV, in host page ids (the ids SGLang's
  paged allocator hands out and its radix cache shares).
- :class:`PageSummaries`: per (layer, kv head, page) key min / max / mean on the GPU, for scoring.
- :class:`TwoLevelPageTable`: (request slot, layer, head, logical page) -> GPU slot (SPIN §5.4).
- :class:`GPUPageCache`: the GPU slot pool with write-allocate and LRU eviction.
"""

from sparse_sglang.mem_cache.bounds import bound_dtype, empty_bounds
from sparse_sglang.mem_cache.gpu_cache import GPUCacheFull, GPUPageCache, slots_for_budget
from sparse_sglang.mem_cache.host_pool import (
    HostKVPool,
    host_page_bytes,
    pages_for_budget,
)
from sparse_sglang.mem_cache.page_table import SegmentPoolExhausted, TwoLevelPageTable
from sparse_sglang.mem_cache.summaries import PageSummaries, cuboid_center, cuboid_half_extent

__all__ = [
    "GPUCacheFull",
    "GPUPageCache",
    "HostKVPool",
    "PageSummaries",
    "SegmentPoolExhausted",
    "TwoLevelPageTable",
    "bound_dtype",
    "cuboid_center",
    "cuboid_half_extent",
    "empty_bounds",
    "host_page_bytes",
    "pages_for_budget",
    "slots_for_budget",
]
