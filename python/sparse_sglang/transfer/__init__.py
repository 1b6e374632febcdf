"""KV transfer between the pinned host store and the GPU page cache.

- :class:`FlashH2D`: load selected blocks host->GPU in one UVA kernel launch.
- :class:`FlashD2H`: save new K/V: one D2H copy into a staging ring + native CPU scatter threads.
- :class:`DirectD2H`: the alternative save path, a UVA kernel writing host memory.
- :func:`gather_blocks_reference`, :func:`scatter_tokens_reference`: pure-torch semantics.
- :func:`alloc_host_store`: the pinned host store (layout in :mod:`sparse_sglang.transfer.layout`).
"""

from sparse_sglang.transfer.d2h import DirectD2H, FlashD2H, default_num_threads, scatter_rows_cpu
from sparse_sglang.transfer.h2d import FlashH2D, copy_blocks_memcpy, cuda_view
from sparse_sglang.transfer.layout import PinnedMemoryError, alloc_host_store, alloc_host_tensor, block_bytes
from sparse_sglang.transfer.reference import gather_blocks_reference, scatter_tokens_reference

__all__ = [
    "DirectD2H",
    "FlashD2H",
    "FlashH2D",
    "PinnedMemoryError",
    "alloc_host_store",
    "alloc_host_tensor",
    "block_bytes",
    "copy_blocks_memcpy",
    "cuda_view",
    "default_num_threads",
    "gather_blocks_reference",
    "scatter_rows_cpu",
    "scatter_tokens_reference",
]
