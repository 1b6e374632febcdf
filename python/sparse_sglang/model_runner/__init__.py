"""Model-runner side of sparse-sglang: layer-segmented prefill (SparseServe §3.4).

- :mod:`.segments`: the plan of a layer-segmented prefill (which layers and which prompt tokens
  each scheduler iteration runs) and the KV pages it holds on the GPU at each step.
"""

from sparse_sglang.model_runner.segments import Segment, default_max_inject_tokens, plan_segments, segment_hbm_pages

__all__ = ["Segment", "default_max_inject_tokens", "plan_segments", "segment_hbm_pages"]
