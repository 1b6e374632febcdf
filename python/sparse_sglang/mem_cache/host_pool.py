"""The host KV pool: the pinned store holding all KV.

A *host page id* ``p`` names the same page index in every (layer, kv head): token slot
``p * page_size + offset`` holds that token's K/V for all layers and heads. These ids are the
index space SGLang's token allocator and radix cache see (token location = page * page_size +
offset): SGLang's paged allocator hands them out and its radix cache shares a cached prefix's
pages between requests without copying (``integration/memory_pool.py``). Page 0 is reserved
(SGLang pads with it) and never handed out.
"""

from __future__ import annotations

import contextlib
import fcntl
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from sparse_sglang.mem_cache.utils import check_kv_shape, units_for_budget
from sparse_sglang.transfer.layout import alloc_host_store

RESERVED_PAGES = 1  # page 0: the padding page


def host_page_bytes(num_layers: int, num_kv_heads: int, page_size: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one host page id: its K and V blocks in every (layer, kv head)."""
    return 2 * num_layers * num_kv_heads * page_size * head_dim * dtype.itemsize


def host_block(layer, head, page, num_kv_heads: int, num_pages: int):
    """Flat index of host page ``page``'s block of ``(layer, head)``: blocks are laid out layer by
    layer, kv head by kv head, page by page (FlashH2D's ``src_blocks``; the Triton retrieval kernel
    computes the same). Ints or int64 tensors, broadcast. Layer ``l``'s blocks are layer 0's shifted
    by ``host_block(l, 0, 0, ...)``."""
    return (layer * num_kv_heads + head) * num_pages + page


def pages_for_budget(
    gb: float,
    num_layers: int,
    num_kv_heads: int,
    page_size: int,
    head_dim: int,
    dtype: torch.dtype,
) -> int:
    """Host page ids (the reserved page 0 included) that fit in ``gb`` GiB of host memory.

    Raises
    ------
    ValueError
        On a bad shape, or when the budget holds fewer than 2 pages (page 0 plus one usable page,
        each one block per layer and kv head for K and V).
    """
    check_kv_shape(page_size, head_dim, dtype, num_layers=num_layers, num_kv_heads=num_kv_heads)
    what = (
        f"host KV budget (one host page = K+V of {page_size} tokens in {num_layers} layers x "
        f"{num_kv_heads} kv heads; page 0 is reserved)"
    )
    page = host_page_bytes(num_layers, num_kv_heads, page_size, head_dim, dtype)
    return units_for_budget(gb, page, RESERVED_PAGES + 1, what)


# Servers starting together on one host take their turn to size and pin their host stores: a store
# sized from the RAM available must see what the stores before it took (MemAvailable falls as their
# pages are pinned), or two servers each take the same share and the OOM killer ends both.
HOST_MEMORY_TURN_FILE = Path(tempfile.gettempdir()) / "sparse-sglang-host-store.lock"


@contextlib.contextmanager
def host_memory_turn(path: Path = HOST_MEMORY_TURN_FILE) -> Iterator[None]:
    """Hold this host's turn to size and allocate a host store (an exclusive ``flock`` on
    ``path``, released on exit, and by the kernel if the process dies)."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class HostKVPool:
    """The pinned host KV store (layout of :mod:`sparse_sglang.transfer.layout`).

    Parameters
    ----------
    num_layers, num_kv_heads, num_pages, page_size, head_dim : int
        Store shape; ``page_size`` a power of two, ``num_pages >= 2`` (page 0 is reserved).
    dtype : torch.dtype
        bf16, fp16 or fp8 (``float8_e4m3fn``/``float8_e5m2``, one byte per element).
    pin : bool
        Page-lock the store (needs CUDA); ``False`` for CPU-only tests.

    Attributes
    ----------
    k, v : torch.Tensor
        ``[num_layers, num_kv_heads, num_pages, page_size, head_dim]`` CPU tensors (uninitialized).
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        num_pages: int,
        page_size: int,
        head_dim: int,
        dtype: torch.dtype,
        *,
        pin: bool = True,
    ):
        check_kv_shape(page_size, head_dim, dtype, num_layers=num_layers, num_kv_heads=num_kv_heads)
        if num_pages < RESERVED_PAGES + 1:
            raise ValueError(f"num_pages must be >= {RESERVED_PAGES + 1} (page 0 is reserved), got {num_pages}")
        self.num_layers, self.num_kv_heads, self.num_pages = num_layers, num_kv_heads, num_pages
        self.page_size, self.head_dim, self.dtype = page_size, head_dim, dtype
        self.k, self.v = alloc_host_store(num_layers, num_kv_heads, num_pages, page_size, head_dim, dtype, pin)

    @classmethod
    def from_budget(
        cls,
        host_cache_gb: float,
        num_layers: int,
        num_kv_heads: int,
        page_size: int,
        head_dim: int,
        dtype: torch.dtype,
        *,
        pin: bool = True,
    ) -> HostKVPool:
        """A pool with as many pages as fit in ``host_cache_gb`` GiB (see :func:`pages_for_budget`)."""
        pages = pages_for_budget(host_cache_gb, num_layers, num_kv_heads, page_size, head_dim, dtype)
        return cls(num_layers, num_kv_heads, pages, page_size, head_dim, dtype, pin=pin)

    @property
    def page_bytes(self) -> int:
        """Bytes of one host page id (K and V, all layers and kv heads)."""
        return host_page_bytes(self.num_layers, self.num_kv_heads, self.page_size, self.head_dim, self.dtype)

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.page_bytes

    def block_index(self, layer: int | torch.Tensor, heads: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
        """:func:`host_block` of this pool; arguments broadcast, result int64."""
        heads = torch.as_tensor(heads).long()
        return host_block(
            layer, heads, torch.as_tensor(pages, device=heads.device).long(), self.num_kv_heads, self.num_pages
        )
