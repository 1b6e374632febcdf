"""The GPU page cache: per-head KV slots in HBM, handed to running requests in rows.

Every running request owns a *row* of slots in each (layer, kv head), taken from the shared slot
pool when it starts and returned when it ends. Rows are elastic (SPIN's buffer pages): a row
holds at least ``min_row_width`` slots (the pages a step selects plus a minimum buffer) and grows
up to ``row_width`` while the pool has slots no other request needs; when a new request finds the
pool short, the widest rows give back their least recently used slots. A :class:`TwoLevelPageTable`
maps (request slot, layer, kv head, logical page) to the slot holding that page, or -1 when the page
is only on the host. Rows make the decode path free of host synchronization: a step selects at
most ``budget_pages <= row_width`` pages per (request, layer, head), so the misses always fit in
the row's slots that hold no selected page, and choosing them (least recently used first) is a
per-row sort on the device.

The host store holds every token (the save path writes all new KV there), so the cache is
write-through: new pages are *write-allocated* into a row's free slots while it has some (a
request whose pages all fit never reads the host), tokens of uncached pages just skip the GPU
copy, and an evicted block needs no write-back.

Contract
--------
The cache owns the lifetime of every row: which request slots have one (``is_open``), which
request a row belongs to (the slot's generation when it opened, :meth:`GPUPageCache.hold_row`),
its width and its write-allocated columns. Nothing else keeps a copy of these. Invariants: an
open row's slots are ``rows[req, :, :, :width]`` and no other row's; free slots plus open rows'
slots are the pool. In the server request slot 0 (SGLang's padding row, :data:`PADDING_SLOT`)
never gets a row (the runtime opens none for it; the retrieve kernel skips it).
Rows change only between steps, from the step's owner (``SparseRuntime.begin_decode`` /
``begin_prefill``) and from the request slot's release (``integration/memory_pool.py``).

Where the work happens
----------------------
- ``open_request``/``close_request``/``resize_request``/``write_allocate`` run on the host
  between steps (the scheduler knows request lengths): the host decides how many slots each row
  gets, and the slot ids themselves (the free stack, each row's slots) stay on the device, so
  this bookkeeping never waits for the GPU: it runs while the step before is still computing
  (SGLang's overlap scheduler), and a new request narrows every row it takes slots from in one
  pass.
- ``store`` and the decode step's retrieval (:mod:`sparse_sglang.attention.retrieval`, over
  :attr:`GPUPageCache.view`) are device ops with fixed shapes and no host synchronization, so a
  decode step can run inside a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from sparse_sglang.mem_cache.page_table import TwoLevelPageTable
from sparse_sglang.mem_cache.utils import FreeStack, check_kv_shape, host_to_device, units_for_budget

PADDING_SLOT = 0  # the request slot of CUDA-graph padding rows (SGLang's ReqToTokenPool row 0): no row, kernels skip it


class GPUCacheFull(RuntimeError):
    """The slot pool has no room for another request's row."""


def slot_bytes(page_size: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one slot: the K and V block of one (layer, kv head, page)."""
    return 2 * page_size * head_dim * dtype.itemsize


def slots_for_budget(gb: float, page_size: int, head_dim: int, dtype: torch.dtype) -> int:
    """Slots (one K and one V block of ``page_size x head_dim``) that fit in ``gb`` GiB."""
    check_kv_shape(page_size, head_dim, dtype)
    what = f"GPU page cache budget (one slot = K+V of {page_size} tokens x {head_dim} dims, {dtype})"
    return units_for_budget(gb, slot_bytes(page_size, head_dim, dtype), 1, what)


class CachedRows(NamedTuple):
    """The pages each request's cache row holds in one layer, for the requests that reuse their
    selection this step (``--sparse-reselect-interval``): they choose only among these.

    ``reselect`` ``[B]`` bool (true: a full selection, the rows do not restrict it); ``rows``
    ``[max_requests, Hkv, W]`` slots of the layer (-1 none); ``req_slots`` ``[B]``; ``slot_page``
    ``[num_slots + 1]`` logical page of each slot (-1 none; the last is the scratch slot)."""

    reselect: torch.Tensor | None
    rows: torch.Tensor
    req_slots: torch.Tensor
    slot_page: torch.Tensor

    def held(self, num_pages: int) -> torch.Tensor:
        """``[B, Hkv, num_pages]`` bool: which logical pages ``< num_pages`` the rows hold."""
        row = self.rows[self.req_slots.long()]
        pages = self.slot_page[torch.where(row < 0, self.slot_page.numel() - 1, row)]  # the scratch slot holds -1
        pages = torch.where((pages >= 0) & (pages < num_pages), pages, num_pages)
        held = torch.zeros(*pages.shape[:2], num_pages + 1, dtype=torch.bool, device=pages.device)
        return held.scatter_(-1, pages, True)[..., :num_pages]


@dataclass(frozen=True, slots=True)
class CacheView:
    """What the decode step's retrieve kernel reads and writes of a :class:`GPUPageCache`: its
    device tensors (the same objects, not copies: the kernel updates them in place, as the cache's
    own device ops do) and the sizes that shape the launch. The fields never rebind.

    Attributes
    ----------
    rows : torch.Tensor
        ``[max_requests, num_layers, num_kv_heads, row_width]`` int64 slots of each open request.
    slot_page, last_used : torch.Tensor
        ``[num_slots + 1]`` int64: logical page of each slot, and the step that last used it.
    step : torch.Tensor
        0-dim int64 decode step counter.
    counters : torch.Tensor
        ``[2]`` int64: pages selected and pages loaded since start.
    directory, segments : torch.Tensor
        The page table's (:class:`TwoLevelPageTable`): ``[max_requests, num_layers, num_kv_heads,
        num_dir]`` segment ids and ``[num_segments + 2, segment_pages]`` int32 slots.
    num_layers, segment_pages, row_width : int
    lru_buckets, lru_steps_per_bucket : int
        The replacement order (:meth:`GPUPageCache.recency`).
    """

    rows: torch.Tensor
    slot_page: torch.Tensor
    last_used: torch.Tensor
    step: torch.Tensor
    counters: torch.Tensor
    directory: torch.Tensor
    segments: torch.Tensor
    num_layers: int
    segment_pages: int
    row_width: int
    lru_buckets: int
    lru_steps_per_bucket: int


class GPUPageCache:
    """Slot pool, request rows, page table, and the device-side hit/miss/evict path.

    Parameters
    ----------
    num_slots : int
        Slots in the pool (rows of ``num_layers * num_kv_heads * row_width`` are carved from it).
    num_layers, num_kv_heads, page_size, head_dim : int
    dtype : torch.dtype
        KV dtype (matches the host store).
    max_requests : int
        Request slots (SGLang's ``req_pool_idx`` range, padding row 0 included).
    row_width : int
        Most slots per (request, layer, kv head) (a row's width when slots are plentiful).
    min_row_width : int, optional
        Fewest slots per (request, layer, kv head), at least the pages one decode step selects
        (default ``row_width``: fixed rows).
    max_pages : int
        Most logical pages one request may have (sizes the page table's directory).
    total_pages : int
        Most logical pages all requests hold together (sizes the page table's segment pool).
    device : torch.device or str
    lru_buckets, lru_steps_per_bucket : int
        Replacement order (:meth:`recency`): 0 buckets = exact LRU; else SPIN's bucketed LRU over
        the newest ``lru_buckets`` buckets of ``lru_steps_per_bucket`` decode steps.

    Attributes
    ----------
    k, v : torch.Tensor
        ``[num_slots, page_size, head_dim]`` (views; FlashH2D's and FlashInfer's paged KV).
    rows : torch.Tensor
        ``[max_requests, num_layers, num_kv_heads, row_width]`` int64 slots of each open request:
        its row's width of them first, then -1.
    slot_page : torch.Tensor
        ``[num_slots + 1]`` int64 logical page a slot holds, -1 if none (entry ``num_slots`` is
        the scratch slot that padded writes land in).
    last_used : torch.Tensor
        ``[num_slots + 1]`` int64 step that last read or filled the slot, -1 if empty.
    step : torch.Tensor
        0-dim int64 decode step counter on the device (:meth:`next_step`).
    selected_at : torch.Tensor
        ``[max_requests]`` int64 sequence length at each request's last full page selection, -1
        for none since its row opened (``--sparse-reselect-interval``; written by the decoder).
    """

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        page_size: int,
        head_dim: int,
        dtype: torch.dtype,
        *,
        max_requests: int,
        row_width: int,
        max_pages: int,
        total_pages: int,
        device: torch.device | str = "cpu",
        segment_pages: int = 128,
        min_row_width: int | None = None,
        lru_buckets: int = 0,
        lru_steps_per_bucket: int = 1,
    ):
        check_kv_shape(page_size, head_dim, dtype, num_slots=num_slots, num_layers=num_layers,
                       num_kv_heads=num_kv_heads, max_requests=max_requests, row_width=row_width)  # fmt: skip
        self.num_slots, self.num_layers, self.num_kv_heads = num_slots, num_layers, num_kv_heads
        self.page_size, self.row_width = page_size, row_width
        self.min_row_width = row_width if min_row_width is None else min_row_width
        if lru_buckets < 0 or lru_steps_per_bucket < 1:
            raise ValueError(f"bad LRU order: {lru_buckets} buckets of {lru_steps_per_bucket} steps")
        self.lru_buckets, self.lru_steps_per_bucket = lru_buckets, lru_steps_per_bucket
        if not 1 <= self.min_row_width <= row_width:
            raise ValueError(f"min_row_width must be in [1, row_width={row_width}], got {min_row_width}")
        segment_pages = min(segment_pages, max_pages)
        self.page_table = TwoLevelPageTable(
            max_requests, num_layers, num_kv_heads, max_pages,
            TwoLevelPageTable.segments_needed(num_layers, num_kv_heads, total_pages, max_requests, segment_pages),
            segment_pages, device,
        )  # fmt: skip
        # Row num_slots is the scratch block: padded token writes land there (the kernels that save
        # write through k_with_scratch / v_with_scratch).
        self.k_with_scratch = torch.zeros(num_slots + 1, page_size, head_dim, dtype=dtype, device=device)
        self.v_with_scratch = torch.zeros_like(self.k_with_scratch)
        self.k, self.v = self.k_with_scratch[:num_slots], self.v_with_scratch[:num_slots]
        self.rows = torch.full(
            (max_requests, num_layers, num_kv_heads, row_width), -1, dtype=torch.int64, device=device
        )
        self.slot_page = torch.full((num_slots + 1,), -1, dtype=torch.int64, device=device)
        self.last_used = torch.full((num_slots + 1,), -1, dtype=torch.int64, device=device)
        self.step = torch.zeros((), dtype=torch.int64, device=device)
        self.selected_at = torch.full((max_requests,), -1, dtype=torch.int64, device=device)
        # Since start, on the device (no sync on the hot path; read by stats()): selected pages
        # looked up, and those missed (loaded from the host).
        self.counters = torch.zeros(2, dtype=torch.int64, device=device)
        self._heads = torch.arange(num_kv_heads, device=device)
        self._layers = torch.arange(num_layers, device=device)
        # Free slots (ids on the device: handing them out needs no sync), and per open request
        # its width and write-allocated count (on the host). An open row's slots are
        # rows[req, :, :, :width], nowhere else.
        self._free = FreeStack(torch.arange(num_slots, device=device))
        # Write-allocation fills columns [0, filled) of a row in page order (see write_allocate).
        self._filled: dict[int, int] = {}
        self._width: dict[int, int] = {}
        # The request each open row belongs to: its slot's generation when the row opened (None:
        # opened without one). _width, _filled and _generation have the same keys, the open rows.
        self._generation: dict[int, int | None] = {}

    @property
    def view(self) -> CacheView:
        """The tensors a decode step's retrieve kernel takes (:class:`CacheView`)."""
        pt = self.page_table
        return CacheView(self.rows, self.slot_page, self.last_used, self.step, self.counters, pt.directory, pt.segments,
                         self.num_layers, pt.segment_pages, self.row_width, self.lru_buckets, self.lru_steps_per_bucket)  # fmt: skip

    @property
    def row_slots(self) -> int:
        """Slots one request's row takes in all layers and heads, at its narrowest."""
        return self.num_layers * self.num_kv_heads * self.min_row_width

    @property
    def max_open_requests(self) -> int:
        return self.num_slots // self.row_slots

    def width(self, req_slot: int) -> int:
        """The current width of an open request's rows."""
        return self._width[req_slot]

    @property
    def num_free(self) -> int:
        return len(self._free)

    def is_open(self, req_slot: int) -> bool:
        return req_slot in self._width

    @property
    def num_open(self) -> int:
        return len(self._width)

    def working_set_pages(self, window: int) -> int:
        """Slots of the open rows used (hit, loaded or written) in the last ``window`` steps: the
        running requests' working sets as far as their rows hold them (SparseServe's w-step union,
        read from the LRU stamps the steps leave anyway)."""
        return sum(self.working_set_pages_of(list(self._width), window))

    def working_set_pages_of(self, req_slots: list[int], window: int) -> list[int]:
        """Per open request, the slots of its rows used in the last ``window`` steps (one read of
        the device)."""
        if not req_slots:
            return []
        rows = self.rows[torch.tensor(req_slots, device=self.rows.device)]  # [n, L, H, W], -1 past the width
        used = self.last_used[self.scratch(rows)]  # the scratch slot is never used (-1)
        return ((used >= 0) & (used > self.step - window)).flatten(1).sum(1).tolist()

    def stats(self, window: int = 12) -> dict:
        """Counters for metrics (reads the device counters: a sync, not for the hot path)."""
        selected, loaded = self.counters.tolist()
        return {
            "gpu_cache_slots": self.num_slots, "gpu_cache_slots_free": self.num_free, "gpu_cache_rows_open": self.num_open,
            "gpu_cache_row_width_mean": sum(self._width.values()) / self.num_open if self._width else None,
            "pages_selected": selected, "pages_loaded": loaded,
            "hit_ratio": None if selected == 0 else 1 - loaded / selected,
            "working_set_window": window, "working_set_pages": self.working_set_pages(window),
        }  # fmt: skip

    def recency(self, used: torch.Tensor) -> torch.Tensor:
        """What replacement orders slots by, from their last-use steps ``used`` (-1 = empty, which
        stays lowest): the step itself (exact LRU), or with ``lru_buckets`` > 0 SPIN's bucketed LRU,
        the step's bucket with every use older than the newest ``lru_buckets`` buckets tied at the
        oldest. A stable sort of it takes ties by row position, the victims a histogram over
        the buckets would take (``BucketedLRU`` in ``test/test_bucketed_lru.py``, its reference)."""
        if not self.lru_buckets:
            return used
        oldest = self.step // self.lru_steps_per_bucket - (self.lru_buckets - 1)
        return torch.where(used >= 0, torch.maximum(used // self.lru_steps_per_bucket, oldest), -1)

    def next_step(self) -> None:
        """Advance the step counter (once per decode step, on the device)."""
        self.step += 1

    # Host side: rows and page-table sizes, between steps.

    def hold_row(self, req_slot: int, generation: int) -> bool:
        """Make ``req_slot``'s row the one of the request holding the slot at ``generation`` (the
        slot's count of requests it was given to): kept when it is, otherwise a row left by an
        earlier request of the slot is closed and a new one opened. True when a row opened.

        A row is the request's own only if it is open *and* was opened at the slot's current
        generation: the slot's owner frees it (returning the row) between requests, but a flush can
        zero the generations, so a later request may get the slot back at a generation an earlier
        one had; then the row is closed already and opens anew."""
        if self.is_open(req_slot):
            if self._generation[req_slot] == generation:
                return False
            self.close_request(req_slot)  # left by an earlier request of this slot
        self.open_request(req_slot, generation=generation)
        return True

    def open_request(self, req_slot: int, num_pages: int = 0, generation: int | None = None) -> None:
        """Give request slot ``req_slot`` its row and a page table of ``num_pages`` pages, for the
        request holding the slot at ``generation`` (:meth:`hold_row`).

        The row gets an equal share of the pool among the open requests (within the row width
        bounds); the widest open rows give back their least recently used slots when the free ones
        fall short.

        Raises
        ------
        GPUCacheFull
            When even the narrowest row cannot be made room for (nothing changes then).
        """
        if self.is_open(req_slot):
            raise ValueError(f"request slot {req_slot} already has a row (close it first)")
        lh = self.num_layers * self.num_kv_heads
        share = self.num_slots // (lh * (self.num_open + 1))
        width = max(self.min_row_width, min(self.row_width, share))
        reclaimable = sum(w - max(width, self.min_row_width) for w in self._width.values() if w > width)
        if self.num_free + lh * reclaimable < lh * width:
            width = self.min_row_width
            reclaimable = sum(w - width for w in self._width.values())
            if self.num_free + lh * reclaimable < lh * width:
                raise GPUCacheFull(
                    f"GPU page cache full: a request needs {lh * width} slots, {self.num_free} of "
                    f"{self.num_slots} are free; raise --sparse-gpu-cache-gb or lower --max-running-requests"
                )
        self.page_table.resize(req_slot, num_pages)  # may refuse (its segment pool): before any row shrinks
        if self.num_free < lh * width:
            self._shrink_widest(lh * width - self.num_free, floor=width)
        slots = self._free.pop(lh * width)
        self._filled[req_slot] = 0
        self._width[req_slot] = width
        self._generation[req_slot] = generation
        self.selected_at[req_slot].fill_(-1)  # fill_, not `= -1`: see mem_cache.utils
        self.rows[req_slot].fill_(-1)
        self.rows[req_slot, :, :, :width] = slots.view(self.num_layers, self.num_kv_heads, width).to(self.rows.device)

    def close_request(self, req_slot: int) -> None:
        """Return the row of ``req_slot`` (finish, abort, or the slot's reuse) and drop its table;
        the narrowest open rows grow into the freed slots."""
        del self._filled[req_slot], self._generation[req_slot]
        slots = self.rows[req_slot, :, :, : self._width.pop(req_slot)].reshape(-1)  # may be a view of rows
        self.page_table.release(req_slot)
        self.slot_page.index_fill_(0, slots, -1)  # the row's slots are on the device
        self.last_used.index_fill_(0, slots, -1)
        self._free.push(slots)  # copies them: before the row is cleared
        self.rows[req_slot].fill_(-1)
        self._grow_narrowest()

    def _shrink_widest(self, slots_needed: int, floor: int) -> None:
        """Free ``slots_needed`` slots from the widest open rows, none going below ``floor``. The
        widths are chosen on the host as cutting one row at a time would (the widest first, by as
        much as is still needed), then every row narrows in one pass (:meth:`_shrink_rows`)."""
        lh = self.num_layers * self.num_kv_heads
        widths, narrowed = dict(self._width), {}
        while slots_needed > 0:
            req = max(widths, key=lambda r: widths[r])
            cut = min(widths[req] - floor, -(-slots_needed // lh))
            assert cut > 0, "open_request checked that enough slots are reclaimable"
            widths[req] = narrowed[req] = widths[req] - cut
            slots_needed -= lh * cut
        self._shrink_rows(narrowed)

    def _shrink_rows(self, widths: dict[int, int]) -> None:
        """Narrow open rows to ``widths`` (request slot -> a width below its current one): each
        (layer, head) keeps its most recently used slots; the pages the others held go back to
        being on the host only. One batched sort for all the rows, then two slicing copies per row
        (its kept slots, its freed ones); no sync."""
        reqs = list(widths)
        old = [self._width[r] for r in reqs]
        new = [widths[r] for r in reqs]
        top, dev = max(old), self.rows.device
        index, old_width, new_width = host_to_device([reqs, old, new], dev)  # one copy
        column = torch.arange(top, device=dev)
        inside = column < old_width.view(-1, 1, 1, 1)  # [k, 1, 1, top]
        kept = column < new_width.view(-1, 1, 1, 1)
        rows = self.rows[index, :, :, :top]  # [k, L, H, top], -1 past each row's width
        # Most recent first; columns past a row's width sort after all of its slots (-2 < the
        # empty slot's -1), and a stable sort keeps ties in row order, as sorting each row would.
        key = torch.where(inside, self.recency(self.last_used[self.scratch(rows)]), -2)
        ordered = rows.gather(-1, key.argsort(dim=-1, descending=True, stable=True))
        dropped = self.scratch(torch.where(inside & ~kept, ordered, -1))  # the rest: the scratch slot
        self.page_table.invalidate(index.view(-1, 1, 1, 1), self._layers.view(1, -1, 1, 1),
                                   self._heads.view(1, 1, -1, 1), self.slot_page[dropped])  # fmt: skip
        scratch = self.slot_page[self.num_slots].clone(), self.last_used[self.num_slots].clone()
        dropped = dropped.reshape(-1)
        self.slot_page.index_fill_(0, dropped, -1)
        self.last_used.index_fill_(0, dropped, -1)
        self.slot_page[self.num_slots], self.last_used[self.num_slots] = scratch  # as they were
        self.rows[index, :, :, :top] = torch.where(kept, ordered, -1)
        for i, (req, width) in enumerate(zip(reqs, new)):
            self._free.push(ordered[i, :, :, width : old[i]].reshape(-1))
            self._width[req] = width
            # Its pages are no longer all cached in column order: no more write-allocation.
            self._filled[req] = width

    def _grow_narrowest(self) -> None:
        """Widen the narrowest open rows toward an equal share of the pool (at most ``row_width``)."""
        if not self._width:
            return
        lh = self.num_layers * self.num_kv_heads
        share = min(self.row_width, self.num_slots // (lh * self.num_open))
        for req in sorted(self._width, key=lambda r: self._width[r]):
            width = self._width[req]
            add = min(share - width, self.num_free // lh)
            if add <= 0:
                continue
            new = self._free.pop(lh * add)
            dev = self.rows.device
            self.rows[req, :, :, width : width + add] = new.view(self.num_layers, self.num_kv_heads, add).to(dev)
            if self._filled[req] == width:  # decode steps may load into the new (empty) columns first
                self._filled[req] = width + add
            self._width[req] = width + add

    def resize_request(self, req_slot: int, num_pages: int) -> None:
        """Let request ``req_slot`` hold ``num_pages`` logical pages (grow only: a request's pages
        are dropped all at once by :meth:`close_request`)."""
        if num_pages > self.page_table.num_pages[req_slot]:
            self.page_table.resize(req_slot, num_pages)

    def write_allocate(self, req_slot: int, first_page: int, num_pages: int) -> int:
        """Map new pages ``[first_page, first_page + n)`` of ``req_slot`` to the row's columns not
        yet write-allocated, in every layer and head, ``n = min(num_pages, such columns)``; returns
        ``n``. A page a decode step had loaded into such a column is unmapped first.

        Called when a request creates pages (prefill, or a decode step starting a page), before
        their tokens are stored, so :meth:`store` writes them into the cache as well."""
        filled = self._filled[req_slot]
        n = max(0, min(num_pages, self._width[req_slot] - filled))
        if n == 0:
            return 0
        dev = self.rows.device
        pages = torch.arange(first_page, first_page + n, device=dev)
        slots = self.rows[req_slot, :, :, filled : filled + n]  # [L, H, n]
        layers, heads = self._layers.view(-1, 1, 1), self._heads.view(1, -1, 1)
        # Decode steps may have loaded selected pages into these columns (a request whose prefix
        # came from the radix cache has pages its prefill did not write here): unmap those first.
        self.page_table.invalidate(req_slot, layers, heads, self.slot_page[slots])
        self.page_table.assign(req_slot, layers, heads, pages.view(1, 1, -1), slots)
        self.slot_page[slots] = pages.view(1, 1, -1).expand_as(slots)
        self.last_used[slots] = self.step
        self._filled[req_slot] = filled + n
        return n

    # Device side: token writes and the decode read path.

    def scratch(self, slots: torch.Tensor) -> torch.Tensor:
        """``slots`` as int64 with padding (-1) redirected to the scratch slot."""
        slots = slots.long()
        return torch.where(slots < 0, self.num_slots, slots)

    def store(
        self, layer: int, req_slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
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
        pages = torch.where(positions >= 0, positions // self.page_size, -1)
        slots = self.page_table.lookup(req_slots[:, None], layer, self._heads[None], pages[:, None])  # [T, H]
        slots = self.scratch(slots)
        offsets = (positions % self.page_size)[:, None].expand_as(slots)
        self.k_with_scratch[slots, offsets] = k
        self.v_with_scratch[slots, offsets] = v

    def due_for_selection(self, req_slots: torch.Tensor, seq_lens: torch.Tensor, interval: int) -> torch.Tensor:
        """``[B]`` bool: which requests select from all their pages this step (the others reuse
        their rows, ``--sparse-reselect-interval``): those whose last full selection is
        ``interval`` tokens back, or who have had none since their row opened. Their
        ``selected_at`` moves to now. Each request keeps its own phase, so the steps that load
        many pages are spread over the batch. No sync: ``seq_lens`` may be a CPU tensor."""
        slots = req_slots.long()
        seq = host_to_device(seq_lens, self.selected_at.device)
        at = self.selected_at[slots]
        due = (at < 0) | (seq - at >= interval)
        self.selected_at[slots] = torch.where(due, seq, at)
        return due

    def cached_rows(self, layer: int, req_slots: torch.Tensor, reselect: torch.Tensor | None = None) -> CachedRows:
        """The rows of ``layer`` of these requests (views, no copy: a CUDA graph reads them live)."""
        return CachedRows(reselect, self.rows[:, layer], req_slots, self.slot_page)

    def cached_pages(self, layer: int, req_slots: torch.Tensor, num_pages: int) -> torch.Tensor:
        """``[B, Hkv, num_pages]`` bool: which logical pages ``< num_pages`` of each request the
        rows of ``layer`` hold (no sync; a closed or padding row holds none)."""
        return self.cached_rows(layer, req_slots).held(num_pages)
