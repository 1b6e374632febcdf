"""The KV layout contract of the transfer engines, its checks, and the pinned host store.

Host KV store: K and V are each one pinned CPU tensor ``[num_layers, num_kv_heads,
num_host_pages, page_size, head_dim]``; one (layer, head, page) block of ``page_size * head_dim``
elements is contiguous and has the flat index ``(layer * num_kv_heads + head) * num_host_pages +
page``. GPU page cache: K and V each a CUDA tensor ``[num_slots, page_size, head_dim]``; a slot
holds one block. A token's destination in the host store is its slot ``page * page_size + offset``.
All engines copy bytes, so any element type works (bf16, fp16, ``torch.float8_e4m3fn``) as long as
a block is a multiple of 16 bytes.
"""

from __future__ import annotations

import logging
import math
import os

import torch

from sparse_sglang.config import GIB
from sparse_sglang.transfer.native import host_ext


class PinnedMemoryError(RuntimeError):
    """Pinned (page-locked) host memory for the KV store could not be allocated."""


def block_bytes(kv: torch.Tensor) -> int:
    """Bytes of one (layer, head, page) block of a host store or page cache: ``page_size * head_dim * itemsize``."""
    return kv.shape[-2] * kv.shape[-1] * kv.element_size()


def _check_pair(a: torch.Tensor, b: torch.Tensor, names: str, dims: int, layout: str) -> None:
    if a.dim() != dims:
        raise ValueError(f"{names.split('/')[0]} must be {layout}, got shape {tuple(a.shape)}")
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        raise ValueError(
            f"{names} differ: {tuple(a.shape)} {a.dtype} {a.device} vs {tuple(b.shape)} {b.dtype} {b.device}"
        )
    if not (a.is_contiguous() and b.is_contiguous()):
        raise ValueError(f"{names} must be contiguous")


def check_host_store(host_k: torch.Tensor, host_v: torch.Tensor) -> None:
    """Raise ValueError unless host_k/host_v are one valid host store layout (see module doc)."""
    _check_pair(host_k, host_v, "host_k/host_v", 5, "[num_layers, num_kv_heads, num_host_pages, page_size, head_dim]")
    if block_bytes(host_k) % 16:
        raise ValueError(
            f"block bytes (page_size * head_dim * itemsize = {block_bytes(host_k)}) must be a multiple of 16"
        )


def check_page_cache(gpu_k: torch.Tensor, gpu_v: torch.Tensor, host_k: torch.Tensor) -> None:
    """Raise ValueError unless gpu_k/gpu_v are a page cache ``[num_slots, page_size, head_dim]`` matching host_k."""
    _check_pair(gpu_k, gpu_v, "gpu_k/gpu_v", 3, "[num_slots, page_size, head_dim]")
    if gpu_k.shape[1:] != host_k.shape[3:] or gpu_k.dtype != host_k.dtype:
        raise ValueError(
            f"page cache blocks {tuple(gpu_k.shape[1:])} {gpu_k.dtype} do not match host blocks "
            f"{tuple(host_k.shape[3:])} {host_k.dtype}"
        )


def check_block_lists(src_blocks: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """Raise ValueError unless src_blocks/dst_slots are 1-D int32/int64 tensors of one length."""
    for name, t in (("src_blocks", src_blocks), ("dst_slots", dst_slots)):
        if t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be a 1-D int32/int64 tensor, got {tuple(t.shape)} {t.dtype}")
    if src_blocks.shape != dst_slots.shape:
        raise ValueError(f"src_blocks and dst_slots differ in length: {src_blocks.numel()} vs {dst_slots.numel()}")


def check_tokens(k: torch.Tensor, v: torch.Tensor, host_k: torch.Tensor, token_slots: torch.Tensor) -> None:
    """Raise ValueError unless k/v ``[num_tokens, num_kv_heads, head_dim]`` and token_slots fit the host store."""
    _check_pair(k, v, "k/v", 3, "[num_tokens, num_kv_heads, head_dim]")
    if k.shape[1] != host_k.shape[1] or k.shape[2] != host_k.shape[4] or k.dtype != host_k.dtype:
        raise ValueError(
            f"k/v rows {tuple(k.shape[1:])} {k.dtype} do not match the host store "
            f"(num_kv_heads={host_k.shape[1]}, head_dim={host_k.shape[4]}, {host_k.dtype})"
        )
    index_dtype = token_slots.dtype in (torch.int32, torch.int64)
    if token_slots.dim() != 1 or token_slots.numel() != k.shape[0] or not index_dtype:
        raise ValueError(
            f"token_slots must be a 1-D int32/int64 tensor with one entry per token ({k.shape[0]}), "
            f"got {tuple(token_slots.shape)} {token_slots.dtype}"
        )


# Pinning in parallel (alloc_pinned_parallel): threads fault in chunks of whole huge pages (2 MiB,
# what the mapping asks transparent huge pages for), a few chunks each so that one slow chunk does
# not hold the rest; a store below PARALLEL_PIN_MIN_BYTES is pinned by one cudaHostAlloc.
HUGE_PAGE_BYTES = 2 << 20
PARALLEL_PIN_MIN_BYTES = 1 << 30
CHUNKS_PER_THREAD = 4
MAX_PIN_THREADS = 16


def pin_threads() -> int:
    return max(1, min(MAX_PIN_THREADS, os.cpu_count() or 1))


def plan_pin_chunks(nbytes: int, num_threads: int, align: int = HUGE_PAGE_BYTES) -> list[tuple[int, int]]:
    """``(offset, size)`` chunks tiling ``[0, nbytes)`` in order, each a multiple of ``align`` but
    the last, about :data:`CHUNKS_PER_THREAD` per thread (fewer when ``nbytes`` holds fewer
    ``align`` units)."""
    if nbytes <= 0 or align <= 0 or num_threads <= 0:
        raise ValueError(
            f"plan_pin_chunks: nbytes, align and num_threads must be positive, got {nbytes}, {align}, {num_threads}"
        )
    units = math.ceil(nbytes / align)
    count = max(1, min(units, num_threads * CHUNKS_PER_THREAD))
    chunks, offset = [], 0
    for i in range(count):
        end = min(nbytes, (units * (i + 1) // count) * align)
        chunks.append((offset, end - offset))
        offset = end
    return chunks


def alloc_host_tensor(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    pin: bool = True,
    what: str = "the host KV store",
) -> torch.Tensor:
    """An uninitialized CPU tensor, page-locked when ``pin`` (exact size, unlike torch's pinned
    allocator, which rounds up to a power of two). From :data:`PARALLEL_PIN_MIN_BYTES` on,
    :func:`pin_threads` threads fault it in (zero-filled, in :func:`plan_pin_chunks`' chunks; one
    thread alone does that slowly) before one ``cudaHostRegister`` pins it whole, falling back to
    one ``cudaHostAlloc`` if that fails. Raises :class:`PinnedMemoryError` naming the size."""
    if not pin:
        return torch.empty(shape, dtype=dtype)
    if torch.cuda.is_available():
        # torch's is_pinned() says False for every pointer until torch itself has initialized CUDA
        # (at::Context::isPinnedPtr), and FlashD2H checks it; the extension pins without torch.
        torch.cuda.init()
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes >= PARALLEL_PIN_MIN_BYTES:
        threads = pin_threads()
        try:
            buf = host_ext().alloc_pinned_parallel(nbytes, plan_pin_chunks(nbytes, threads), threads)
            return buf.view(dtype).view(shape)
        except RuntimeError as err:
            logging.getLogger(__name__).warning("pinning %s in parallel failed (%s); pinning it in one call", what, err)
    try:
        buf = host_ext().alloc_pinned(nbytes)
    except RuntimeError as err:
        raise PinnedMemoryError(
            f"could not allocate {nbytes / GIB:.2f} GiB of pinned host memory for {what} ({err}); "
            "lower --sparse-host-cache-gb, or raise the locked-memory limit (ulimit -l) of this process"
        ) from err
    return buf.view(dtype).view(shape)


def alloc_host_store(
    num_layers: int,
    num_kv_heads: int,
    num_host_pages: int,
    page_size: int,
    head_dim: int,
    dtype: torch.dtype,
    pin: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocate the host KV store.

    Returns
    -------
    host_k, host_v : torch.Tensor
        Each ``[num_layers, num_kv_heads, num_host_pages, page_size, head_dim]`` of ``dtype`` on the
        CPU, pinned when ``pin`` (uninitialized).
    """
    shape = (num_layers, num_kv_heads, num_host_pages, page_size, head_dim)
    meta = torch.empty(shape, dtype=dtype, device="meta")
    check_host_store(meta, meta)
    what = f"K or V of the host KV store ({2 * meta.nbytes / GIB:.2f} GiB for both)"
    return alloc_host_tensor(shape, dtype, pin, what), alloc_host_tensor(shape, dtype, pin, what)
