"""The host KV pool: the pinned store holding all KV, and the allocator of its page ids.

A *host page id* ``p`` names the same page index in every (layer, kv head): token slot
``p * page_size + offset`` holds that token's K/V for all layers and heads. These ids are the
index space SGLang's token allocator and radix cache see (token location = page * page_size +
offset), so prefix sharing can reuse pages without copying: pages are reference counted and
return to the free list only when their count drops to zero. Page 0 is reserved (SGLang pads with
it) and never handed out.

All bookkeeping here is host-side (CPU tensors), done by the scheduler between steps.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from sparse_sglang.mem_cache.utils import FreeStack, check_kv_shape, units_for_budget
from sparse_sglang.transfer.layout import alloc_host_store

RESERVED_PAGES = 1  # page 0: the padding page


class HostMemoryExhausted(RuntimeError):
    """The host KV store has fewer free pages than requested."""


def host_page_bytes(num_layers: int, num_kv_heads: int, page_size: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one host page id: its K and V blocks in every (layer, kv head)."""
    return 2 * num_layers * num_kv_heads * page_size * head_dim * dtype.itemsize


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


class HostPageAllocator:
    """Reference-counted free list of host page ids, with a per-request view.

    Parameters
    ----------
    num_pages : int
        Host page ids ``[0, num_pages)``; page 0 is reserved, so ``num_pages - 1`` are usable.

    Notes
    -----
    ``alloc`` sets a page's count to 1; ``incref`` adds a holder (e.g. the radix cache sharing a
    prefix); ``free``/``decref`` drop one holder per occurrence and return pages whose count
    reaches 0 to the free list. Every call checks its arguments before changing any state, so a
    failed call leaves the allocator as it was.
    """

    def __init__(self, num_pages: int):
        if num_pages < RESERVED_PAGES + 1:
            raise ValueError(f"num_pages must be >= {RESERVED_PAGES + 1} (page 0 is reserved), got {num_pages}")
        self.num_pages = num_pages
        self.refcount = torch.zeros(num_pages, dtype=torch.int32)
        self._free = FreeStack(torch.arange(RESERVED_PAGES, num_pages))
        self._requests: dict[Hashable, list[torch.Tensor]] = {}

    def available(self) -> int:
        """Free page ids."""
        return len(self._free)

    @property
    def capacity(self) -> int:
        """Usable page ids (all but the reserved ones)."""
        return self.num_pages - RESERVED_PAGES

    def alloc(self, n: int) -> torch.Tensor:
        """Take ``n`` free pages (``[n]`` int64), each with reference count 1.

        Raises
        ------
        HostMemoryExhausted
            When fewer than ``n`` pages are free.
        """
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n > self.available():
            raise HostMemoryExhausted(
                f"host KV store exhausted: requested {n} pages, {self.available()} free of {self.capacity}"
            )
        pages = self._free.pop(n)
        self.refcount[pages] = 1
        return pages

    def incref(self, pages: torch.Tensor) -> None:
        """Add one holder to each entry of ``pages`` (all must be allocated)."""
        uniq, counts = self._held(pages, "incref")
        self.refcount[uniq] += counts.to(torch.int32)

    def free(self, pages: torch.Tensor) -> torch.Tensor:
        """Drop one holder per entry of ``pages``; return the pages freed now (count reached 0).

        Raises
        ------
        ValueError
            When a page is out of range, reserved, or freed more times than it is held
            (double free).
        """
        uniq, counts = self._held(pages, "free")
        over = counts > self.refcount[uniq]
        if over.any():
            bad = uniq[over].tolist()
            raise ValueError(f"double free of host pages {bad[:8]}{' ...' if len(bad) > 8 else ''}")
        self.refcount[uniq] -= counts.to(torch.int32)
        freed = uniq[self.refcount[uniq] == 0]
        self._free.push(freed)
        return freed

    decref = free

    def _held(self, pages: torch.Tensor, op: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Distinct ids of ``pages`` and their multiplicities; checks range and that each is held."""
        pages = torch.as_tensor(pages).reshape(-1).long().cpu()
        bad = (pages < RESERVED_PAGES) | (pages >= self.num_pages)
        if bad.any():
            raise ValueError(
                f"{op}: unknown host pages {pages[bad][:8].tolist()} (valid ids are "
                f"[{RESERVED_PAGES}, {self.num_pages}); page 0 is reserved)"
            )
        uniq, counts = torch.unique(pages, return_counts=True)
        unheld = self.refcount[uniq] == 0
        if unheld.any():
            what = "double free of" if op == "free" else "not allocated:"
            raise ValueError(f"{op}: {what} host pages {uniq[unheld][:8].tolist()}")
        return uniq, counts

    # Per-request view: the scheduler frees everything a request holds on finish or abort.

    def alloc_for_request(self, rid: Hashable, n: int) -> torch.Tensor:
        """``alloc(n)`` and record the pages as held by request ``rid``."""
        pages = self.alloc(n)
        self._requests.setdefault(rid, []).append(pages)
        return pages

    def share_with_request(self, rid: Hashable, pages: torch.Tensor) -> None:
        """``incref(pages)`` on behalf of request ``rid`` (e.g. a cached prefix it reuses)."""
        self.incref(pages)
        self._requests.setdefault(rid, []).append(torch.as_tensor(pages).reshape(-1).long().cpu())

    def request_pages(self, rid: Hashable) -> torch.Tensor:
        """Pages request ``rid`` holds, in the order it got them (``[n]`` int64)."""
        held = self._requests.get(rid, [])
        return torch.cat(held) if held else torch.empty(0, dtype=torch.int64)

    def free_request(self, rid: Hashable) -> torch.Tensor:
        """Drop every hold of request ``rid`` (finish or abort); return the pages freed now.

        Raises
        ------
        KeyError
            When ``rid`` holds nothing (unknown, or already freed).
        """
        if rid not in self._requests:
            raise KeyError(f"request {rid!r} holds no host pages (unknown or already freed)")
        freed = self.free(self.request_pages(rid))
        del self._requests[rid]
        return freed


class HostKVPool:
    """The pinned host KV store (layout of :mod:`sparse_sglang.transfer.layout`) and its allocator.

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
    allocator : HostPageAllocator
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
        self.allocator = HostPageAllocator(num_pages)
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
        """Flat block index ``(layer * num_kv_heads + head) * num_pages + page`` (FlashH2D's
        ``src_blocks``); arguments broadcast, result int64."""
        heads = torch.as_tensor(heads).long()
        return (layer * self.num_kv_heads + heads) * self.num_pages + torch.as_tensor(pages, device=heads.device).long()
