"""benchmark/probes/decode_profile.py's trace reading: steps between CUDA-graph launches, kernels by family."""

import pytest

from benchmark.probes.decode_profile import family, step_profile


def test_steps_run_from_one_graph_launch_to_the_next_and_sum_kernels_by_family():
    events = [
        {"name": "cudaGraphLaunch", "cat": "cuda_runtime", "ts": 0.0, "dur": 5.0},
        {"name": "_score_kernel_0d1d", "cat": "kernel", "ts": 10.0, "dur": 100.0},
        {"name": "nvjet_tst_128x64", "cat": "kernel", "ts": 200.0, "dur": 300.0},
        {"name": "cudaGraphLaunch", "cat": "cuda_runtime", "ts": 1000.0, "dur": 5.0},
        {"name": "_score_kernel_0d1d", "cat": "kernel", "ts": 1010.0, "dur": 300.0},
        {"name": "mystery", "cat": "kernel", "ts": 1400.0, "dur": 100.0},
        {"name": "cudaGraphLaunch", "cat": "cuda_runtime", "ts": 3000.0, "dur": 5.0},
        {"name": "nvjet_after_the_last_launch", "cat": "kernel", "ts": 3010.0, "dur": 999.0},
    ]
    p = step_profile(events)
    assert p["steps"] == 2
    assert p["wall_ms"] == pytest.approx(1.5)  # median of 1.0 and 2.0 ms
    assert p["gpu_busy_ms"] == pytest.approx(0.4)  # 0.4 and 0.4 ms
    assert (
        p["sparse_score_ms"] == pytest.approx(0.2)
        and p["gemm_ms"] == pytest.approx(0.15)
        and p["other_ms"] == pytest.approx(0.05)
    )
    assert p["mean"]["wall_ms"] == pytest.approx(1.5) and p["mean"]["other_ms"] == pytest.approx(0.05)
    assert [round(x["wall_ms"], 3) for x in p["per_step"]] == [1.0, 2.0]
    assert family("BatchDecodeWithPagedKVCacheKernel") == "flashinfer_decode" and family("x") == "other"
    assert family("_score_cached_kernel") == "sparse_score"  # the reuse pass (2bf2190's profile counted it as other)
    assert step_profile([]) == {"steps": 0}
