"""Two-level GPU page table (SPIN §5.4): (request slot, layer, kv head, logical page) -> GPU cache
slot, or -1 when the page is only on the host.

A dense table would take ``max_requests * num_layers * num_kv_heads * max_pages`` entries. Here a
small directory ``[max_requests, num_layers, num_kv_heads, max_pages / segment_pages]`` points to
segments of ``segment_pages`` entries taken from a shared, preallocated segment pool only for the
logical pages a request has, so the table grows with the pages in use, not the worst case.

Where the work happens
----------------------
- ``lookup``/``assign``/``invalidate`` are tensor ops on the table's device: no host
  synchronization, fine inside a CUDA graph (padding entries with request slot or page ``-1``
  read -1 and write nothing).
- ``resize`` (segment allocation and release) runs on the host between steps: the scheduler
  calls it when a request's length crosses a segment boundary (where SGLang allocates KV for the
  next batch) and on finish/abort/retraction. The segment free list and the ids each request owns
  stay on the device, its page count on the host; ``resize`` only writes the device tables, never
  reads them back.
"""

from __future__ import annotations

import math

import torch

from sparse_sglang.mem_cache.utils import FreeStack

ENTRY_BYTES = 4  # int32 entries


def _index(x: int | torch.Tensor) -> torch.Tensor:
    """An index argument as an int64 tensor; an int becomes a 0-dim CPU tensor, which CUDA ops take
    as a scalar argument (no copy to the device, nothing a CUDA graph could not capture)."""
    return x.long() if isinstance(x, torch.Tensor) else torch.scalar_tensor(x, dtype=torch.int64)


class SegmentPoolExhausted(RuntimeError):
    """The page table's segment pool has fewer free segments than a resize needs."""


class TwoLevelPageTable:
    """Per-head page table: directory + on-demand segments.

    Parameters
    ----------
    max_requests : int
        Request slots (SGLang's ``req_pool_idx`` range).
    num_layers, num_kv_heads : int
    max_pages : int
        Most logical pages one request may have (max context / page size).
    num_segments : int
        Segments in the pool (see :meth:`segments_needed`).
    segment_pages : int
        Entries per segment.
    device : torch.device or str
    debug : bool
        Make ``assign`` raise when a target page has no segment (costs a host sync); otherwise such
        writes land in a scratch segment that lookups never read.

    Attributes
    ----------
    directory : torch.Tensor
        ``[max_requests, num_layers, num_kv_heads, num_dir]`` int32 segment ids; unallocated
        entries point to the all ``-1`` null segment ``num_segments``.
    segments : torch.Tensor
        ``[num_segments + 2, segment_pages]`` int32 slots; row ``num_segments`` is the null segment,
        row ``num_segments + 1`` the scratch segment.
    """

    def __init__(
        self,
        max_requests: int,
        num_layers: int,
        num_kv_heads: int,
        max_pages: int,
        num_segments: int,
        segment_pages: int = 128,
        device: torch.device | str = "cpu",
        debug: bool = False,
    ):
        sizes = {
            "max_requests": max_requests,
            "num_layers": num_layers,
            "num_kv_heads": num_kv_heads,
            "max_pages": max_pages,
            "num_segments": num_segments,
            "segment_pages": segment_pages,
        }
        for name, value in sizes.items():
            if value < 1:
                raise ValueError(f"{name} must be positive, got {value}")
        self.max_requests, self.num_layers, self.num_kv_heads = max_requests, num_layers, num_kv_heads
        self.max_pages, self.num_segments, self.segment_pages = max_pages, num_segments, segment_pages
        self.null, self.scratch = num_segments, num_segments + 1
        self.debug = debug
        num_dir = math.ceil(max_pages / segment_pages)
        self.directory = torch.full(
            (max_requests, num_layers, num_kv_heads, num_dir), self.null, dtype=torch.int32, device=device
        )
        self.segments = torch.full((num_segments + 2, segment_pages), -1, dtype=torch.int32, device=device)
        # The free segments and per request slot its segment ids [L, H, n] (ids on the device:
        # growing a table needs no sync), and its page count (on the host).
        self._free = FreeStack(torch.arange(num_segments, device=device))
        self._owned = [torch.empty(num_layers, num_kv_heads, 0, dtype=torch.int64, device=device)] * max_requests
        self.num_pages = [0] * max_requests

    @staticmethod
    def segments_needed(
        num_layers: int,
        num_kv_heads: int,
        total_pages: int,
        max_requests: int,
        segment_pages: int,
    ) -> int:
        """Pool size that always suffices for ``max_requests`` requests holding ``total_pages``
        logical pages together (each request wastes at most one partial segment per head)."""
        return num_layers * num_kv_heads * (math.ceil(total_pages / segment_pages) + max_requests)

    # Device side: lookups and updates.

    def _locate(self, req_slots, layer, heads, logical_pages) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Segment id, flat ``segments`` index and validity of each entry (broadcast shapes).

        Arguments are tensors or Python ints (see :func:`_index`). A flat gather into the directory,
        then one into the segments: no host synchronization.
        """
        _, layers, kv_heads, num_dir = self.directory.shape
        req, page = _index(req_slots).clamp_min(0), _index(logical_pages).clamp_min(0)
        entry = ((req * layers + _index(layer)) * kv_heads + _index(heads)) * num_dir + page // self.segment_pages
        seg = self.directory.view(-1)[entry].long()
        valid = (_index(req_slots) >= 0) & (_index(logical_pages) >= 0)
        return seg, page % self.segment_pages, valid

    def lookup(self, req_slots, layer, heads, logical_pages) -> torch.Tensor:
        """GPU cache slot of each (request slot, layer, head, logical page), -1 when not cached.

        Parameters
        ----------
        req_slots, layer, heads, logical_pages : int or torch.Tensor
            Broadcast to one shape ``[...]``; entries with a negative request slot or page are
            padding and read -1. Pages must be below ``max_pages``.

        Returns
        -------
        torch.Tensor
            ``[...]`` int32 slots.
        """
        seg, column, valid = self._locate(req_slots, layer, heads, logical_pages)
        return torch.where(valid, self.segments.view(-1)[seg * self.segment_pages + column], -1)

    def assign(self, req_slots, layer, heads, logical_pages, slots) -> None:
        """Map each (request slot, layer, head, logical page) to ``slots`` (broadcast like
        :meth:`lookup`). Targets must be distinct and below the request's size (see :meth:`resize`)."""
        seg, column, valid = self._locate(req_slots, layer, heads, logical_pages)
        unmapped = valid & (seg == self.null)
        if self.debug and unmapped.any():
            raise IndexError("assign to a logical page beyond its request's size (resize the request first)")
        seg = torch.where(valid & ~unmapped, seg, self.scratch)
        if isinstance(slots, torch.Tensor):
            values = slots.to(torch.int32)
        else:  # a fill, not a copy from a CPU tensor (which CUDA-graph capture refuses)
            values = torch.full((), slots, dtype=torch.int32, device=self.segments.device)
        self.segments.view(-1)[seg * self.segment_pages + column] = values

    def invalidate(self, req_slots, layer, heads, logical_pages) -> None:
        """Mark the pages as on the host only (slot -1), e.g. after eviction."""
        self.assign(req_slots, layer, heads, logical_pages, -1)

    # Host side: segment allocation between steps.

    def resize(self, req_slot: int, num_pages: int) -> None:
        """Give request slot ``req_slot`` exactly ``num_pages`` logical pages in every layer and head.

        Growing takes segments from the pool when the size crosses a segment boundary (new pages
        read -1). Shrinking (``0`` on finish or abort) returns whole segments and clears the dropped
        entries of the kept last one. It does not free the GPU slots those entries mapped: the page
        cache does that first (see ``GPUPageCache.resize_request``).

        Raises
        ------
        ValueError
            When ``num_pages`` is outside ``[0, max_pages]``.
        SegmentPoolExhausted
            When the pool lacks the segments to grow; nothing changes then.
        """
        if not 0 <= num_pages <= self.max_pages:
            raise ValueError(f"num_pages must be in [0, {self.max_pages}], got {num_pages}")
        owned = self._owned[req_slot]
        have, need = owned.shape[-1], math.ceil(num_pages / self.segment_pages)
        if need > have:
            count = self.num_layers * self.num_kv_heads * (need - have)
            if count > len(self._free):
                raise SegmentPoolExhausted(
                    f"page table segment pool exhausted: request slot {req_slot} needs {count} segments "
                    f"to grow to {num_pages} pages, {len(self._free)} free of {self.num_segments}"
                )
            ids = self._free.pop(count).view(self.num_layers, self.num_kv_heads, need - have)
            self.directory[req_slot, :, :, have:need] = ids.to(torch.int32)
            self._owned[req_slot] = torch.cat([owned, ids], dim=-1)
        elif need < have:
            ids = owned[:, :, need:]
            # fill_ and index_fill_, not `= -1`: see mem_cache.utils (the ids are on the device).
            self.segments.index_fill_(0, ids.reshape(-1), -1)  # free segments are all -1
            self.directory[req_slot, :, :, need:have].fill_(self.null)
            self._free.push(ids.reshape(-1))
            self._owned[req_slot] = owned[:, :, :need].clone()
        tail = num_pages % self.segment_pages
        if num_pages < self.num_pages[req_slot] and tail:
            last = self._owned[req_slot][:, :, need - 1].reshape(-1)
            self.segments[:, tail:].index_fill_(0, last, -1)
        self.num_pages[req_slot] = num_pages

    def release(self, req_slot: int) -> None:
        """``resize(req_slot, 0)``: the request finished or was aborted."""
        self.resize(req_slot, 0)

    # Memory accounting.

    @property
    def segments_in_use(self) -> int:
        return self.num_segments - len(self._free)

    def memory_report(self, dense_requests: int | None = None, dense_pages: int | None = None) -> dict[str, int]:
        """Bytes of the table vs a dense ``[requests, layers, heads, pages]`` int32 table.

        Returns
        -------
        dict
            ``directory`` (always resident), ``segments_in_use`` (what the mapped pages take),
            ``used`` (their sum), ``pool`` (the preallocated segment pool) and ``dense`` (a dense table
            for ``dense_requests`` x ``dense_pages``, default max_requests x max_pages).
        """
        directory = self.directory.numel() * ENTRY_BYTES
        in_use = self.segments_in_use * self.segment_pages * ENTRY_BYTES
        dense = (
            (dense_requests or self.max_requests)
            * (dense_pages or self.max_pages)
            * self.num_layers
            * self.num_kv_heads
            * ENTRY_BYTES
        )
        return {
            "directory": directory,
            "segments_in_use": in_use,
            "used": directory + in_use,
            "pool": self.segments.numel() * ENTRY_BYTES,
            "dense": dense,
        }
