"""The counters a sparse scheduler process keeps since start: one :class:`SparseStats` per runtime.

Each counter has one writer (named per group below) and is read only to report: ``/get_server_info``'s
``"sparse"`` entry and the periodic metrics (``integration/scheduler_state.py``, ``metrics.py``).
The store's transfer and cache counters are not here: they are kept beside the store's device
state and read with it (:meth:`~sparse_sglang.mem_cache.kv_store.SparseKVStore.stats`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class AdmissionStats:
    """Written by :class:`~sparse_sglang.scheduler.AdmissionPolicy`: its totals over every round it
    decided (Prometheus-style counters)."""

    rounds: int = 0
    admitted: int = 0
    deferred: int = 0  # request-rounds spent waiting (a request deferred 3 rounds counts 3)
    retracted: int = 0  # running requests a round did not keep (the newest past the budget)
    refused: int = 0
    forced: int = 0  # rounds where one request ran alone over the budget


@dataclass
class WorkingSetCounts:
    """Written by :class:`~sparse_sglang.scheduler.WorkingSetGate` (``--sparse-working-set-admission``),
    ``admission`` by the gate's policy: one round per admission question, whose one waiting request
    is the candidate (so ``admission.admitted`` / ``deferred`` are the "yes" / "no" answers, and
    ``admission.forced`` the candidates let in alone over the cache by the progress rule)."""

    admission: AdmissionStats = field(default_factory=AdmissionStats)
    retracted: int = 0  # running requests the working-set rule retracted (its decode-check "no"s)
    aborted_while_holding: int = 0  # queued requests aborted while the rule held the queue

    @property
    def admitted(self) -> int:
        """Admission answers "yes"."""
        return self.admission.admitted

    @property
    def deferred(self) -> int:
        """Admission answers "no" (a request deferred 3 rounds counts 3)."""
        return self.admission.deferred


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
    resident_prefix_pages: int = 0  # prefix pages a prefill attended from the resident buffer (the prefix attention)
