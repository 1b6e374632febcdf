"""Layer-segmented prefill (SparseServe §3.4): how far a prefill batch runs per scheduler iteration.

- :mod:`.segments`: how many layers a prefill batch runs per iteration, and where its next
  segment ends (the scheduler loop that runs it is :mod:`sparse_sglang.integration.segmented_prefill`).
- :mod:`.reference`: the plan of a whole prompt (chunks through layer segments) with the KV pages it
  holds on the GPU at each step, which the tests hold the loop against.
"""

from sparse_sglang.prefill.segments import layers_per_iteration, next_segment_end

__all__ = ["layers_per_iteration", "next_segment_end"]
