"""benchmark/probes/prefill_profile.py's trace reading (CPU, synthetic trace)."""

import pytest

from benchmark.probes.prefill_profile import busy_ms, family, prefill_profile


def op(name, ts, dur, cat="kernel"):
    return {"name": name, "ts": ts, "dur": dur, "cat": cat}


def test_busy_time_counts_overlapping_streams_once():
    # 0-1000 and 500-2000 overlap (a side stream), 3000-3500 alone: 2.5 ms busy
    assert busy_ms([op("a", 0, 1000), op("b", 500, 1500), op("c", 3000, 500)]) == pytest.approx(2.5)
    assert busy_ms([op("a", 0, 1000), op("b", 100, 200)]) == pytest.approx(1.0)  # nested


def test_profile_sums_families_and_spans_the_gpu_operations():
    events = [
        op("nvjet_sm90_tst_128x256", 0, 4000),
        op("void sparse_transfer::flash_h2d_kernel<long>", 1000, 2000),  # on the load stream, under the GEMM
        op("flashinfer::BatchPrefillWithRaggedKVCacheKernel", 4000, 1000),
        op("Memcpy DtoH (Device -> Pinned)", 5000, 500, cat="gpu_memcpy"),
        op("cudaLaunchKernel", 0, 10, cat="cuda_runtime"),  # CPU side: not a GPU operation
        op("some_elementwise", 6000, 1000),
    ]
    p = prefill_profile(events)
    assert p["gpu_ops"] == 5 and p["span_ms"] == pytest.approx(7.0) and p["gpu_busy_ms"] == pytest.approx(6.5)
    assert p["gemm_ms"] == 4.0 and p["flash_h2d_ms"] == 2.0 and p["ragged_attention_ms"] == 1.0
    assert p["kv_save_ms"] == 0.5 and p["other_ms"] == 1.0
    assert family("BatchPrefillWithPagedKVCacheKernel<...>") == "prefix_attention"
    fa3 = "void cutlass::device_kernel<flashinfer::FlashAttnFwdSm90<flashinfer::CollectiveMainloop<{}::AdditionalParams"
    assert (
        family(fa3.format("PagedParams")) == "prefix_attention"
        and family(fa3.format("RaggedParams")) == "ragged_attention"
    )
    assert prefill_profile([op("cudaLaunchKernel", 0, 10, cat="cuda_runtime")]) == {"gpu_ops": 0}
