"""Model-runner side of sparse-sglang: layer-segmented prefill (SparseServe §3.4).

- :mod:`.segments`: how many layers a prefill batch runs per scheduler iteration, and the plan of
  a whole prompt (chunks through layer segments) with the KV pages it holds on the GPU at each step.
  The scheduler loop that runs it is :mod:`sparse_sglang.integration.segmented_prefill`.
"""

from sparse_sglang.model_runner.segments import (
    Segment,
    layers_per_iteration,
    next_segment_end,
    plan_segments,
    segment_hbm_pages,
)

__all__ = ["Segment", "layers_per_iteration", "next_segment_end", "plan_segments", "segment_hbm_pages"]
