"""The sparse pools' periodic stats: interval arithmetic, the log line, the Prometheus gauges."""

import pytest
from prometheus_client import CollectorRegistry

from sparse_sglang.integration.metrics import GAUGES, SparseMetrics, interval_stats, log_line


def snapshot(selected, loaded, h2d, d2h, host_free=60000):
    return {"pages_selected": selected, "pages_loaded": loaded, "h2d_bytes": h2d, "d2h_bytes": d2h,
            "gpu_cache_rows_open": 3, "gpu_cache_slots_free": 100, "gpu_cache_slots": 400, "request_slots": 8,
            "working_set_pages": 250,
            "host_tokens": 65536, "host_tokens_free": host_free, "host_tokens_in_radix_cache": 4096, "host_tokens_evictable": 1024,
            "host_pages_shared": 96}  # fmt: skip


def test_interval_stats_are_differences_over_the_interval():
    stats = interval_stats(snapshot(1000, 100, 10, 0), snapshot(5000, 500, 2e9 + 10, 1e9), steps=40, seconds=2.0)
    assert stats["gpu_cache_hit_ratio"] == pytest.approx(1 - 400 / 4000)
    assert stats["h2d_pages_per_step"] == 10.0
    assert stats["h2d_bytes_per_s"] == pytest.approx(1e9) and stats["d2h_bytes_per_s"] == pytest.approx(5e8)
    assert stats["host_tokens_used"] == 65536 - 60000
    assert stats["host_tokens_in_radix_cache"] == 4096 and stats["host_pages_shared"] == 96
    # the running requests' own: in use, less the cached prefixes none of them holds
    assert stats["host_tokens_of_running"] == 65536 - 60000 - 1024
    idle = interval_stats(snapshot(5000, 500, 0, 0), snapshot(5000, 500, 0, 0), steps=40, seconds=2.0)
    assert idle["gpu_cache_hit_ratio"] is None and idle["h2d_pages_per_step"] == 0  # nothing selected: no ratio
    line = log_line(stats, snapshot(5000, 500, 0, 0))
    assert (
        line.startswith("Sparse KV, cache hit: 0.900, H2D pages/step: 10.0, H2D GB/s: 1.00")
        and "cache rows: 3/8, working set: 250/400 slots" in line
        and line.endswith("host KV tokens: 5536/65536, of running requests: 4512")
    )
    assert "cache hit: -," in log_line(idle, snapshot(5000, 500, 0, 0))


def test_reports_set_the_gauges_from_the_second_snapshot_on():
    registry = CollectorRegistry()
    metrics = SparseMetrics({"model_name": "m"})
    metrics.publish(interval_stats(snapshot(0, 0, 0, 0), snapshot(10, 5, 0, 0), 1, 1.0), registry=registry)
    assert registry.get_sample_value("sglang:sparse_gpu_cache_hit_ratio", {"model_name": "m"}) == 0.5
    assert metrics.report(snapshot(0, 0, 0, 0), step=40, enable_prometheus=True, log=False) is None  # remembers only
    stats = metrics.report(snapshot(200, 20, 0, 0), step=80, enable_prometheus=True, log=True)
    assert stats["h2d_pages_per_step"] == 0.5
    for name in GAUGES:
        value = registry.get_sample_value(f"sglang:sparse_{name}", {"model_name": "m"})
        assert value == pytest.approx(stats[name]), name


def test_working_set_admission_adds_demand_deferrals_and_retractions():
    admission = {"working_set_demand_pages": 380, "working_set_deferrals": 7, "working_set_retractions": 2}
    before, now = snapshot(0, 0, 0, 0) | admission, snapshot(100, 10, 0, 0) | admission
    stats = interval_stats(before, now, steps=10, seconds=1.0)
    assert (stats["working_set_demand_pages"], stats["working_set_deferrals"], stats["working_set_retractions"]) == (
        380,
        7,
        2,
    )
    assert "working set: 250/400 slots, demand: 380 pages, deferred: 7, retracted: 2, host KV" in log_line(stats, now)
    registry = CollectorRegistry()
    SparseMetrics({"model_name": "m"}).publish(stats, registry=registry)
    assert registry.get_sample_value("sglang:sparse_working_set_retractions", {"model_name": "m"}) == 2
    # Admission off: no demand, and the log line says nothing of it.
    off = interval_stats(snapshot(0, 0, 0, 0), snapshot(100, 10, 0, 0), steps=10, seconds=1.0)
    assert off["working_set_demand_pages"] is None and "demand" not in log_line(off, snapshot(100, 10, 0, 0))
