"""The counters a sparse scheduler process keeps since start: one :class:`SparseStats` per runtime.

Each counter has one writer (named per group below) and is read only to report: ``/get_server_info``'s
``"sparse"`` entry and the periodic metrics (``integration/scheduler_state.py``, ``metrics.py``).
The store's transfer and cache counters are not here: they are kept beside the store's device
state and read with it (:meth:`~sparse_sglang.mem_cache.kv_store.SparseKVStore.stats`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class WorkingSetCounts:
    """Written by :class:`~sparse_sglang.scheduler.WorkingSetGate` (``--sparse-working-set-admission``)."""

    admitted: int = 0  # admission answers "yes"
    deferred: int = 0  # admission answers "no" (a request deferred 3 rounds counts 3)
    retracted: int = 0  # running requests the working-set rule retracted
    aborted_while_holding: int = 0  # queued requests aborted while the rule held the queue


@dataclass
class SegmentedPrefillCounts:
    """Written by the layer-segmented scheduler loop (``--sparse-segmented-prefill``)."""

    prefills: int = 0  # prefill batches run in layer segments
    segments: int = 0  # layer segments run
    decode_steps: int = 0  # decode steps run between segments
    cancelled: int = 0  # split batches stopped because every request in them was aborted


@dataclass
class SparseStats:
    working_set: WorkingSetCounts = field(default_factory=WorkingSetCounts)
    segmented_prefill: SegmentedPrefillCounts = field(default_factory=SegmentedPrefillCounts)
    coarse_first_steps: int = 0  # decode steps planned coarse-first (the decoder; --sparse-coarse-pages)
    prefills_held: int = 0  # rounds a pending prefill waited for a decode step (--sparse-interleave-prefill)
