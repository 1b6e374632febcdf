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


def test_the_save_staging_buffers_reach_the_store(monkeypatch):
    """``--sparse-save-staging-buffers`` is the store's FlashD2H ring (its engine exists on a GPU
    only: ``test_attention_parts_write_the_runtimes_stats_and_start_once`` checks the ring there)."""
    from sparse_sglang.mem_cache import kv_store

    built = {}
    monkeypatch.setattr(kv_store, "SparseKVStore", lambda shape, device, **kwargs: built.update(kwargs))
    small_runtime("cpu", save_staging_buffers=32)
    assert built["d2h_buffers"] == 32


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
    runtime = small_runtime("cuda", working_set_admission=True, save_staging_buffers=6)
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    max_batch = runtime.plan.max_running_requests + 1
    assert runtime.store.flash_d2h.num_buffers == 6
    assert runtime.store.flash_d2h.staging_bytes == runtime.plan.save_staging_bytes  # what the plan reports
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
    assert off.store.flash_d2h.num_buffers == SparseConfig().save_staging_buffers


class NoWrapper:
    """FlashInfer's wrappers on CPU: the step plans them, and the decode output is zeros."""

    def __init__(self, *args, **kwargs):
        pass

    def plan(self, *args, **kwargs):
        pass

    def run(self, q, kv, **kwargs):
        return torch.zeros_like(q)


def cpu_attention_runtime(monkeypatch, **config):
    import flashinfer

    import sparse_sglang.attention.prefix as prefix

    monkeypatch.setattr(flashinfer, "BatchDecodeWithPagedKVCacheWrapper", NoWrapper)
    monkeypatch.setattr(prefix, "PrefixAttention", NoWrapper)  # stages prefixes through FlashH2D: CUDA only
    runtime = small_runtime("cpu", **config)
    runtime.start_attention(num_q_heads=4, workspace=torch.empty(1), max_batch=4, staging_tokens=64)
    return runtime


def token_locations(shape, slots: int = 4) -> torch.Tensor:
    """SGLang's ``req_to_token``: request slot ``s`` holds host pages ``1 + s * P ...`` (its own)."""
    per_slot = (shape.num_host_pages - 1) // slots
    t = torch.arange(per_slot * shape.page_size)
    pages = 1 + torch.arange(slots).view(-1, 1) * per_slot + t // shape.page_size
    return (pages * shape.page_size + t % shape.page_size).to(torch.int32)


def test_a_decode_step_is_one_runtime_call_with_a_frozen_plan_that_leaves_the_decoder_as_it_was(monkeypatch):
    """``begin_decode`` is the whole host side of a step: rows held (a slot given to a new request
    gets a new row, its working-set history dropped), the saved-token count, the tracker's batch,
    the plan. The layers read the plan, which cannot change; no attribute of the decoder is
    rebound by a step (the CUDA-graph form, whose plans are views of static buffers, is
    ``test_sparse_decode_gpu.py``'s)."""
    import dataclasses

    runtime = cpu_attention_runtime(monkeypatch, working_set_admission=True, reselect_interval=3)
    store, decoder, cache = runtime.store, runtime.decoder, runtime.store.cache
    page = store.shape.page_size
    req_to_token = token_locations(store.shape)
    attributes = {name: id(value) for name, value in vars(decoder).items()}
    slots, q = torch.tensor([1, 2]), torch.randn(2, 4, store.shape.head_dim)
    plans = []
    for step, generations in enumerate(([5, 7], [5, 7], [6, 7])):  # the third: slot 1 holds a new request
        lengths = torch.tensor([3 * page + 1 + step, 40 * page + step])
        plan = runtime.begin_decode(slots, [1, 2], generations, lengths, lengths, req_to_token)
        plans.append(plan)
        assert plan.batch == 2 and plan.num_pages.tolist() == [4, 40 + (step > 0)]
        assert plan.host_pages.tolist() == (req_to_token[:3, ::page][1:, : plan.max_pages] // page).tolist()
        assert plan.reselect is not None and not plan.exact  # 40 pages are over the 16-page budget
        assert store.saved_tokens == 2 * (step + 1) and runtime.tracked_slots.tolist() == [1, 2]
        for layer in range(store.shape.num_layers):
            assert decoder.run(layer, q, plan).shape == q.shape
        assert (decoder.selection_log[:2] >= 0).any()
        with pytest.raises(dataclasses.FrozenInstanceError):
            plan.batch = 3
    assert {name: id(value) for name, value in vars(decoder).items()} == attributes
    assert not cache.hold_row(1, 6) and not cache.hold_row(2, 7)  # each row is its request's
    assert plans[0].reselect.tolist() == [True, True] and plans[1].reselect.tolist() == [False, False]
    assert plans[2].reselect.tolist() == [True, False]  # the new request selects from all its pages
    assert runtime.tracker.sizes(slots).tolist()[0] <= 4 * store.shape.num_layers * store.shape.num_kv_heads


def test_each_counter_has_one_writer():
    """Every counter the server reports is written (``=``, ``+=``) in one module of the package:
    the stats' fields by the part their group names, the store's saved tokens by the store (a
    decode step's through ``count_decode_saves``, which the runtime calls once per step). A write
    is ``holder.counter`` for any holder but ``self``, and ``self.counter`` inside the counter's
    own class (another class's attribute of the same name is another thing)."""
    import ast
    import dataclasses
    from pathlib import Path

    from sparse_sglang import stats

    package = Path(__file__).resolve().parents[1] / "python" / "sparse_sglang"
    # counter -> (the class holding it, the one module that writes it)
    counters = {"saved_tokens": ("SparseKVStore", "mem_cache/kv_store.py"),
                "coarse_first_steps": ("SparseStats", "attention/sparse_decode.py"),
                "prefills_held": ("SparseStats", "integration/prefill_interleave.py"),
                "resident_prefix_pages": ("SparseStats", "attention/prefix.py")}  # fmt: skip
    groups = {"working_set", "segmented_prefill", "admission"}  # fields that hold counters, not counters
    # The gate's counts and its policy's (WorkingSetCounts.admission): both written in the scheduler.
    for group, module in ((stats.WorkingSetCounts, "scheduler/admission.py"),
                          (stats.AdmissionStats, "scheduler/admission.py"),
                          (stats.SegmentedPrefillCounts, "integration/segmented_prefill.py")):  # fmt: skip
        counters.update({f.name: (group.__name__, module) for f in dataclasses.fields(group) if f.name not in groups})
    assert {f.name for f in dataclasses.fields(stats.SparseStats)} - groups <= set(counters)  # none left out
    writers: dict[str, set[str]] = {name: set() for name in counters}

    def visit(node: ast.AST, module: str, cls: str | None) -> None:
        if isinstance(node, ast.ClassDef):
            cls = node.name
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Attribute) and target.attr in counters:
                    own = isinstance(target.value, ast.Name) and target.value.id == "self"
                    if not own or cls == counters[target.attr][0]:
                        writers[target.attr].add(module)
        for child in ast.iter_child_nodes(node):
            visit(child, module, cls)

    for path in package.rglob("*.py"):
        visit(ast.parse(path.read_text()), path.relative_to(package).as_posix(), None)
    assert writers == {name: {module} for name, (_, module) in counters.items()}
