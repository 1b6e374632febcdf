"""The GPU page cache: slots holding (layer, kv head, page) KV blocks, allocated from a free-slot
stack and reclaimed by LRU eviction, mapped through a :class:`TwoLevelPageTable`.

The host store holds every token (FlashD2H writes all new KV there), so the cache is
write-through: new pages are write-allocated into slots (with a big enough cache a decode step
never reads the host), tokens of a page that is not cached just skip the GPU copy, and an evicted
block needs no write-back.

Where the work happens
----------------------
- ``store`` and ``touch`` are device ops without host synchronization (CUDA-graph safe).
- ``admit``/``write_allocate`` take a host-known number of blocks (from the scheduler's lengths,
  or a miss count): the free stack's count lives on the host, so popping needs no sync; when it
  must evict, choosing victims is a device ``topk`` and one host sync checks that enough blocks
  not used in this step exist.
- ``resize_request`` (shrink/finish) finds the request's slots with ``nonzero`` (a host sync);
  the scheduler calls it between steps.
"""

from __future__ import annotations

import torch

from sparse_sglang.mem_cache.page_table import TwoLevelPageTable
from sparse_sglang.mem_cache.utils import FreeStack, check_kv_shape, units_for_budget

NEVER = torch.iinfo(torch.int64).max  # eviction priority of slots that must not be evicted


class GPUCacheFull(RuntimeError):
    """Every cached block was used in this step: no slot can be freed for new blocks."""


def slots_for_budget(gb: float, page_size: int, head_dim: int, dtype: torch.dtype) -> int:
    """Slots (one K and one V block of ``page_size x head_dim``) that fit in ``gb`` GiB."""
    check_kv_shape(page_size, head_dim, dtype)
    what = f"GPU page cache budget (one slot = K+V of {page_size} tokens x {head_dim} dims, {dtype})"
    return units_for_budget(gb, 2 * page_size * head_dim * dtype.itemsize, 1, what)


class GPUPageCache:
    """Slot pool for KV blocks with write-allocate and LRU eviction.

    Parameters
    ----------
    num_slots, page_size, head_dim : int
    dtype : torch.dtype
        KV dtype (matches the host store).
    page_table : TwoLevelPageTable
        Updated on admission and invalidated on eviction; on the same device.

    Attributes
    ----------
    k, v : torch.Tensor
        ``[num_slots, page_size, head_dim]`` (contiguous views; FlashH2D's destination).
    owner : torch.Tensor
        ``[num_slots, 4]`` int64: the (request slot, layer, head, logical page) a slot holds, -1 if free.
    last_used : torch.Tensor
        ``[num_slots]`` int64: the last step that admitted or touched the slot, -1 if free.
    step : torch.Tensor
        0-dim int64 step counter on the device (see :meth:`next_step`).
    """

    def __init__(
        self, num_slots: int, page_size: int, head_dim: int, dtype: torch.dtype, page_table: TwoLevelPageTable,
    ):
        check_kv_shape(page_size, head_dim, dtype, num_slots=num_slots)
        device = page_table.directory.device
        self.num_slots, self.page_size, self.page_table = num_slots, page_size, page_table
        # Row num_slots is a scratch block: padded token writes and touches land there.
        self._k = torch.zeros(num_slots + 1, page_size, head_dim, dtype=dtype, device=device)
        self._v = torch.zeros_like(self._k)
        self.k, self.v = self._k[:num_slots], self._v[:num_slots]
        self._last_used = torch.full((num_slots + 1,), -1, dtype=torch.int64, device=device)
        self.last_used = self._last_used[:num_slots]
        self.owner = torch.full((num_slots, 4), -1, dtype=torch.int64, device=device)
        self.step = torch.zeros((), dtype=torch.int64, device=device)
        self._free = FreeStack(torch.arange(num_slots, device=device))

    @classmethod
    def from_budget(
        cls, gpu_cache_gb: float, page_size: int, head_dim: int, dtype: torch.dtype, page_table: TwoLevelPageTable,
    ) -> GPUPageCache:
        return cls(slots_for_budget(gpu_cache_gb, page_size, head_dim, dtype), page_size, head_dim, dtype, page_table)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def next_step(self) -> None:
        """Advance the step counter (once per decode step, on the device)."""
        self.step += 1

    def _scratch(self, slots: torch.Tensor) -> torch.Tensor:
        """``slots`` as int64 with padding (-1) redirected to the scratch row."""
        slots = slots.long()
        return torch.where(slots < 0, self.num_slots, slots)

    def touch(self, slots: torch.Tensor) -> None:
        """Mark ``slots`` (any shape, -1 = padding) as used in this step."""
        self._last_used[self._scratch(slots)] = self.step

    # Allocation and eviction.

    def alloc(self, n: int) -> torch.Tensor:
        """``n`` unmapped slots (``[n]`` int64): free ones first, then LRU victims.

        Raises
        ------
        GPUCacheFull
            When fewer than ``n`` slots are free or evictable; nothing changes then.
        """
        take = min(n, self.num_free)
        victims = self._evict(n - take)
        return torch.cat([self._free.pop(take), victims])

    def select_victims(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Eviction policy hook: the ``n`` least recently used mapped slots, and their priorities
        (``NEVER`` for a slot that may not be evicted: free, or used in this step)."""
        evictable = (self.owner[:, 0] >= 0) & (self.last_used < self.step)
        priority = torch.where(evictable, self.last_used, NEVER)
        victims = torch.topk(priority, n, largest=False, sorted=False).indices
        return victims, priority[victims]

    def _evict(self, n: int) -> torch.Tensor:
        """Unmap ``n`` victims (invalidating their page table entries) and return their slots."""
        if n == 0:
            return torch.empty(0, dtype=torch.int64, device=self.owner.device)
        if n > self.num_slots:
            raise GPUCacheFull(f"GPU page cache: {n} blocks requested beyond the free ones, {self.num_slots} slots in all")
        victims, priority = self.select_victims(n)
        if (priority == NEVER).any():  # the one host sync of the eviction path
            raise GPUCacheFull(
                f"GPU page cache full: {n} blocks to evict but fewer mapped blocks are unused in this step "
                f"({self.num_slots} slots); lower the batch size or raise --sparse-gpu-cache-gb"
            )
        self.page_table.invalidate(*self.owner[victims].unbind(1))
        self.owner[victims] = -1
        self._last_used[victims] = -1
        return victims

    def _release(self, slots: torch.Tensor) -> None:
        """Unmap ``slots`` (owned, distinct) and return them to the free stack."""
        self.page_table.invalidate(*self.owner[slots].unbind(1))
        self.owner[slots] = -1
        self._last_used[slots] = -1
        self._free.push(slots)

    def admit(self, req_slots, layer, heads, logical_pages) -> torch.Tensor:
        """Allocate a slot for each (request slot, layer, head, logical page) and map it.

        Parameters
        ----------
        req_slots, layer, heads, logical_pages : int or torch.Tensor
            Broadcast to one shape ``[...]`` of distinct, currently unmapped blocks (no padding);
            the request's page table must cover the pages (``resize_request``).

        Returns
        -------
        torch.Tensor
            ``[...]`` int64 slots, marked used in this step. The caller fills them: FlashH2D for
            blocks loaded from the host, :meth:`store` for new tokens.
        """
        dev = self.owner.device
        coords = torch.broadcast_tensors(
            *(torch.as_tensor(x, device=dev).long() for x in (req_slots, layer, heads, logical_pages))
        )
        slots = self.alloc(coords[0].numel()).view(coords[0].shape)
        try:
            self.page_table.assign(*coords, slots)
        except IndexError:  # a page beyond the request's size (debug tables check): give the slots back
            self._free.push(slots.view(-1))
            raise
        self.owner[slots] = torch.stack(coords, dim=-1)
        self._last_used[slots] = self.step
        return slots

    def write_allocate(self, layer: int, req_slots: torch.Tensor, logical_pages: torch.Tensor) -> torch.Tensor:
        """Admit new pages ``[n]`` of ``req_slots`` ``[n]`` in every kv head of ``layer``; returns
        slots ``[n, num_kv_heads]`` (the scheduler knows ``n``: the pages its requests start now)."""
        heads = torch.arange(self.page_table.num_kv_heads, device=self.owner.device)
        return self.admit(req_slots.reshape(-1, 1), layer, heads, logical_pages.reshape(-1, 1))

    def resize_request(self, req_slot: int, num_pages: int) -> None:
        """Set a request's logical page count: free the slots of its pages ``>= num_pages`` (host
        sync), then resize its page table. ``num_pages=0`` on finish or abort."""
        drop = (self.owner[:, 0] == req_slot) & (self.owner[:, 3] >= num_pages)
        self._release(drop.nonzero().squeeze(1))
        self.page_table.resize(req_slot, num_pages)

    def free_request(self, req_slot: int) -> None:
        """``resize_request(req_slot, 0)``."""
        self.resize_request(req_slot, 0)

    # Data.

    def store(self, layer: int, req_slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write new tokens into the cached blocks of their pages (write-through: uncached pages
        are skipped, the host store has every token).

        Parameters
        ----------
        layer : int
        req_slots, positions : torch.Tensor
            ``[T]`` request slot and token position of each token; ``-1`` in either = padding.
        k, v : torch.Tensor
            ``[T, num_kv_heads, head_dim]`` of the cache dtype.
        """
        heads = torch.arange(k.shape[1], device=k.device)
        pages = torch.where(positions >= 0, positions // self.page_size, -1)
        slots = self.page_table.lookup(req_slots[:, None], layer, heads[None], pages[:, None])  # [T, H]
        slots = self._scratch(slots)
        offsets = (positions % self.page_size)[:, None].expand_as(slots)
        self._k[slots, offsets] = k
        self._v[slots, offsets] = v
