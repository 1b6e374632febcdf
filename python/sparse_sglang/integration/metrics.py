"""The sparse pools in SGLang's periodic decode log line and its Prometheus ``/metrics``.

Every ``--decode-log-interval`` decode steps SGLang logs a "Decode batch" line (and, with
``--enable-metrics``, updates its gauges); right after it the hook logs one "Sparse KV" line for
the same interval (GPU page-cache hit ratio, pages and bytes loaded per step host-to-GPU, tokens
saved GPU-to-host, page-cache rows in use, the running requests' working sets against the cache,
with working-set admission their selected pages and the rule's deferrals and retractions, host KV
in use) and sets ``sglang:sparse_*`` gauges.
Reading the GPU counters is a sync, once per interval, never per step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from sparse_sglang.integration.registry import relies_on, wrap_once
from sparse_sglang.integration.scheduler_state import sparse_state

logger = logging.getLogger(__name__)

GAUGES = {  # name suffix -> documentation; values from interval_stats()
    "gpu_cache_hit_ratio": "Share of selected KV pages found in the GPU page cache (last log interval).",
    "h2d_pages_per_step": "KV pages loaded from host memory per decode step (last log interval).",
    "h2d_bytes_per_s": "Bytes loaded host-to-GPU per second (last log interval).",
    "d2h_bytes_per_s": "Bytes saved GPU-to-host per second (last log interval).",
    "gpu_cache_rows_open": "Requests holding a GPU page-cache row.",
    "gpu_cache_slots_free": "Free GPU page-cache slots.",
    "working_set_pages": "GPU page-cache slots the running requests used in the last --sparse-working-set-window steps.",
    "working_set_demand_pages": "Distinct pages the running requests selected in the last --sparse-working-set-window steps "
    "(summed over layers and kv heads; with --sparse-working-set-admission).",
    "working_set_deferrals": "Admission answers 'wait' of the working-set rule since start.",
    "working_set_retractions": "Running requests the working-set rule retracted since start.",
    "host_tokens_used": "Host KV tokens in use (running requests and the radix cache).",
    "host_tokens_in_radix_cache": "Host KV tokens of prefixes the radix cache holds (radix hit tokens: SGLang's sglang:cached_tokens_total).",
    "host_tokens_of_running": "Host KV tokens the running requests hold (in use, less cached prefixes no running request holds).",
    "host_pages_shared": "Host KV pages of cached prefixes that running requests use now (shared by the radix cache and a request).",
}


def interval_stats(before: dict, now: dict, steps: int, seconds: float) -> dict:
    """What happened between two :func:`~sparse_sglang.integration.scheduler_state.sparse_state`
    snapshots ``steps`` decode steps and ``seconds`` apart."""
    selected = now["pages_selected"] - before["pages_selected"]
    loaded = now["pages_loaded"] - before["pages_loaded"]
    seconds = max(seconds, 1e-9)
    return {
        "gpu_cache_hit_ratio": None if selected == 0 else 1 - loaded / selected,
        "h2d_pages_per_step": loaded / max(steps, 1),
        "h2d_bytes_per_s": (now["h2d_bytes"] - before["h2d_bytes"]) / seconds,
        "d2h_bytes_per_s": (now["d2h_bytes"] - before["d2h_bytes"]) / seconds,
        "gpu_cache_rows_open": now["gpu_cache_rows_open"],
        "gpu_cache_slots_free": now["gpu_cache_slots_free"],
        "working_set_pages": now["working_set_pages"],
        "working_set_demand_pages": now.get("working_set_demand_pages"),
        "working_set_deferrals": now.get("working_set_deferrals"),
        "working_set_retractions": now.get("working_set_retractions"),
        "host_tokens_used": now["host_tokens"] - now["host_tokens_free"],
        "host_tokens_in_radix_cache": now["host_tokens_in_radix_cache"],
        "host_tokens_of_running": now["host_tokens"] - now["host_tokens_free"] - now["host_tokens_evictable"],
        "host_pages_shared": now["host_pages_shared"],
    }


def row_width(now: dict) -> str:
    width = now.get("gpu_cache_row_width_mean")
    return "" if width is None else f" ({width:.0f} pages wide)"


def admission(stats: dict) -> str:
    if stats["working_set_demand_pages"] is None:
        return ""
    return (
        f", demand: {stats['working_set_demand_pages']} pages, deferred: {stats['working_set_deferrals']}, "
        f"retracted: {stats['working_set_retractions']}"
    )


def log_line(stats: dict, now: dict) -> str:
    hit = stats["gpu_cache_hit_ratio"]
    return (
        f"Sparse KV, cache hit: {'-' if hit is None else f'{hit:.3f}'}, "
        f"H2D pages/step: {stats['h2d_pages_per_step']:.1f}, H2D GB/s: {stats['h2d_bytes_per_s'] / 1e9:.2f}, "
        f"D2H GB/s: {stats['d2h_bytes_per_s'] / 1e9:.2f}, "
        f"cache rows: {now['gpu_cache_rows_open']}/{now['request_slots']}{row_width(now)}, "
        f"working set: {now['working_set_pages']}/{now['gpu_cache_slots']} slots{admission(stats)}, "
        f"host KV tokens: {stats['host_tokens_used']}/{now['host_tokens']}, of running requests: "
        f"{stats['host_tokens_of_running']}"
    )


@dataclass
class SparseMetrics:
    """Per scheduler: the last snapshot, and the gauges once Prometheus is on."""

    labels: dict
    gauges: dict | None = None
    before: dict | None = None
    before_step: int = 0
    before_time: float = 0.0

    def report(self, now: dict, step: int, enable_prometheus: bool, log: bool) -> dict | None:
        """Log and publish the interval since the last report; the first call only remembers."""
        stats = None
        if self.before is not None:
            stats = interval_stats(self.before, now, step - self.before_step, time.perf_counter() - self.before_time)
            if log:
                logger.info(log_line(stats, now))
            if enable_prometheus:
                self.publish(stats)
        self.before, self.before_step, self.before_time = now, step, time.perf_counter()
        return stats

    def publish(self, stats: dict, registry=None) -> None:
        if self.gauges is None:
            from prometheus_client import REGISTRY, Gauge  # after SGLang set PROMETHEUS_MULTIPROC_DIR

            self.gauges = {
                name: Gauge(
                    f"sglang:sparse_{name}",
                    doc,
                    labelnames=list(self.labels),
                    multiprocess_mode="mostrecent",
                    registry=registry or REGISTRY,
                )  # fmt: skip
                for name, doc in GAUGES.items()
            }
        for name, gauge in self.gauges.items():
            if stats[name] is not None:
                gauge.labels(**self.labels).set(stats[name])


@relies_on(
    "sglang.srt.managers.scheduler_components.metrics_reporter:SchedulerMetricsReporter.report_decode_stats",
    at="sglang/srt/managers/scheduler_components/metrics_reporter.py:695",
)
def patch_report_decode_stats() -> None:
    """After SGLang's periodic decode stats, report the sparse pools' interval (see module doc)."""
    from sglang.srt.managers.scheduler_components.metrics_reporter import SchedulerMetricsReporter

    def wrap(original):
        def report_decode_stats(self, *args, **kwargs):
            out = original(self, *args, **kwargs)
            enable = self.current_scheduler_metrics_enabled
            if self.forward_ct_decode % self.decode_log_interval == 0 and (self.is_stats_logging_rank or enable):
                try:  # metrics never take the server down
                    now = sparse_state(self.scheduler)
                    if now is not None:
                        if not hasattr(self, "sparse_metrics"):
                            labels = getattr(getattr(self, "metrics_collector", None), "labels", None) or {}
                            self.sparse_metrics = SparseMetrics(labels)
                        self.sparse_metrics.report(now, self.forward_ct_decode, enable, self.is_stats_logging_rank)
                except Exception:
                    logger.exception("sparse KV metrics failed; the decode log goes on without them")
            return out

        return report_decode_stats

    wrap_once(SchedulerMetricsReporter, "report_decode_stats", wrap)
