"""Scheduling on top of SGLang's: working-set-aware admission (SparseServe Algorithm 1).

- :class:`WorkingSetTracker`: running requests' working sets (pages selected over the last
  ``window`` decode steps), measured on the device.
- :class:`AdmissionPolicy`: keep / retract / admit / defer / refuse so the summed working sets fit
  the GPU page cache, strict FCFS on the waiting queue.
- :class:`WorkingSetGate`: the policy asked by SGLang's prefill admission and its decode memory
  check (``integration/admission.py``), with working sets the tracker counts; it owns one policy,
  built once, whose :class:`AdmissionStats` the runtime's ``SparseStats`` holds.
"""

from sparse_sglang.scheduler.admission import (
    AdmissionDecision,
    AdmissionPolicy,
    Running,
    Waiting,
    WorkingSetGate,
    WorkingSetTracker,
    max_over_ranks,
    prefill_pages,
)
from sparse_sglang.stats import AdmissionStats

__all__ = [
    "AdmissionDecision",
    "AdmissionPolicy",
    "AdmissionStats",
    "Running",
    "Waiting",
    "WorkingSetGate",
    "WorkingSetTracker",
    "max_over_ranks",
    "prefill_pages",
]
