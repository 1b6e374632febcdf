"""SparseRuntime: one owner of a model runner's sparse state (store, decoder, prefix, tracker,
gate) and of the one stats object its parts write. The store half runs on CPU; the attention
half plans FlashInfer wrappers, so it runs on the GPU host."""

from __future__ import annotations

import pytest
import torch

from sparse_sglang.attention.selectors import kept_summaries
from sparse_sglang.config import SparseConfig
from sparse_sglang.mem_cache.plan import plan_memory
from sparse_sglang.runtime import build_runtime


def small_runtime(device: str, **config):
    config = SparseConfig(host_cache_gb=0.01, token_budget=512, **config)
    plan = plan_memory(config, num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, context_len=8192,
                       gpu_kv_bytes=64 << 20, **kept_summaries(config.selector))  # fmt: skip
    return build_runtime(config, plan, device)


def test_the_store_is_laid_out_by_the_plan_as_the_config_says():
    runtime = small_runtime("cpu", bound_format="exact", cache_lru_buckets=4, cache_lru_steps_per_bucket=2)
    store = runtime.store
    assert store.shape == runtime.plan.shape
    assert store.summaries.bound_format == "exact"
    assert (store.cache.lru_buckets, store.cache.lru_steps_per_bucket) == (4, 2)


def test_before_attention_starts_the_report_has_the_store_and_no_decoder_counts():
    runtime = small_runtime("cpu", segmented_prefill=True)
    report = runtime.report(window=12)
    assert runtime.decoder is None and runtime.gate is None
    assert report["decode_steps_coarse_first"] is None and report["working_set_admissions"] is None
    assert report["segmented_prefill"] == {"prefills": 0, "segments": 0, "decode_steps": 0, "cancelled": 0}
    runtime.stats.segmented_prefill.segments += 3  # the loop's counter is the runtime's
    assert runtime.report(window=12)["segmented_prefill"]["segments"] == 3
    assert small_runtime("cpu").report(window=12)["segmented_prefill"] is None


@pytest.mark.gpu
def test_attention_parts_write_the_runtimes_stats_and_start_once():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run on the GPU host: pytest -m gpu)")
    runtime = small_runtime("cuda", working_set_admission=True)
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    max_batch = runtime.plan.max_running_requests + 1
    runtime.start_attention(num_q_heads=8, workspace=workspace, max_batch=max_batch, staging_tokens=4096)
    assert runtime.decoder.stats is runtime.stats
    assert runtime.gate.counts is runtime.stats.working_set and runtime.gate.tracker is runtime.tracker
    assert runtime.gate.admits([], starting=0)  # an empty cache admits the first request
    assert runtime.report(window=12)["working_set_admissions"] == 1
    with pytest.raises(RuntimeError, match="once"):
        runtime.start_attention(num_q_heads=8, workspace=workspace, max_batch=max_batch, staging_tokens=4096)
    off = small_runtime("cuda")
    off.start_attention(num_q_heads=8, workspace=workspace, max_batch=max_batch, staging_tokens=4096)
    assert off.gate is None and off.tracker is None
