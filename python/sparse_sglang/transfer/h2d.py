"""FlashH2D: load selected KV blocks from pinned host memory into the GPU page cache in one launch.

The kernel reads host memory directly through unified virtual addressing (SparseServe §3.2.1):
one warp per block, 16-byte loads, K and V in the same launch. Stream-ordered on the current
stream, no host synchronization and no allocation, so it can be captured in a CUDA graph with a
fixed-length (padded) miss list.
"""

from __future__ import annotations

import torch

from sparse_sglang.transfer.layout import check_block_lists, check_host_store, check_page_cache
from sparse_sglang.transfer.native import cuda_ext, host_ext


def cuda_view(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA tensor aliasing the pinned CPU tensor ``host`` through UVA (kept alive by the view)."""
    if host.is_cuda:
        return host
    if not host.is_pinned():
        raise ValueError("host KV store must be in pinned memory (see sparse_sglang.transfer.alloc_host_store)")
    return host_ext().cuda_view_of_host(host, device_index(device))


def device_index(device: torch.device | str | int | None) -> int:
    """CUDA device ordinal of ``device`` (the current device when it names none)."""
    if isinstance(device, int):
        return device
    index = None if device is None else torch.device(device).index
    return torch.cuda.current_device() if index is None else index


class FlashH2D:
    """FlashH2D bound to one host store and one page cache (FlashInfer-style: bind once, run often).

    Parameters
    ----------
    host_k, host_v : torch.Tensor
        Pinned CPU ``[num_layers, num_kv_heads, num_host_pages, page_size, head_dim]``.
    gpu_k, gpu_v : torch.Tensor
        CUDA ``[num_slots, page_size, head_dim]`` of the same dtype (bf16, fp16, fp8, ...).

    Construct it outside CUDA-graph capture; calling it inside a capture is fine.
    """

    def __init__(self, host_k: torch.Tensor, host_v: torch.Tensor, gpu_k: torch.Tensor, gpu_v: torch.Tensor):
        check_host_store(host_k, host_v)
        check_page_cache(gpu_k, gpu_v, host_k)
        if not gpu_k.is_cuda:
            raise ValueError("gpu_k/gpu_v must be CUDA tensors")
        self.gpu_k, self.gpu_v = gpu_k, gpu_v
        self.host_k, self.host_v = cuda_view(host_k, gpu_k.device), cuda_view(host_v, gpu_k.device)
        self._ext = cuda_ext()

    def __call__(self, src_blocks: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Copy ``host.view(-1, page_size, head_dim)[src_blocks[i]]`` to ``gpu[dst_slots[i]]`` for K and V.

        Parameters
        ----------
        src_blocks, dst_slots : torch.Tensor
            ``[n]`` int32/int64 CUDA tensors (dtypes may differ). Flat host block index
            ``(layer * num_kv_heads + head) * num_host_pages + page``; slot id. Entries with
            ``dst_slots[i] < 0`` are padding; out-of-range entries are skipped too.
        """
        check_block_lists(src_blocks, dst_slots)
        self._ext.flash_h2d(self.host_k, self.host_v, self.gpu_k, self.gpu_v, src_blocks, dst_slots)


def copy_blocks_memcpy(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_blocks: torch.Tensor,
    dst_blocks: torch.Tensor,
    block_bytes: int,
) -> None:
    """Baseline: one ``cudaMemcpyAsync`` per block on the current stream.

    ``src``/``dst`` are contiguous tensors (pinned CPU or CUDA) seen as arrays of ``block_bytes``
    blocks; ``src_blocks``/``dst_blocks`` are int64 CPU tensors of block indices.
    """
    cuda_ext().copy_blocks_memcpy(src, dst, src_blocks, dst_blocks, block_bytes)
