"""Every SGLang symbol sparse-sglang hooks still exists where SGLang 0.5.17 defines it.

If one of these fails after an SGLang upgrade, re-read that symbol in the new
SGLang and fix the one hook in python/sparse_sglang/integration/ that names it.
"""

from __future__ import annotations

import importlib
import pickle
import pkgutil
import warnings

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import sparse_sglang.integration as integration

    for module in pkgutil.iter_modules(integration.__path__):
        importlib.import_module(f"{integration.__name__}.{module.name}")

from sparse_sglang.integration.registry import HOOKS, SGLANG_VERSION


def test_hooks_are_recorded():
    hooked = {h.module + ":" + h.name for h in HOOKS}
    for symbol in (
        "sglang.srt.server_args:ServerArgs",
        "sglang.srt.server_args:prepare_server_args",
        "sglang.srt.server_args:add_attention_backend_choices",
        "sglang.srt.layers.attention.attention_registry:register_attention_backend",
        "sglang.srt.layers.attention.flashinfer_backend:FlashInferAttnBackend",
        "sglang.srt.managers.scheduler:run_scheduler_process",
        "sglang.srt.entrypoints.http_server:launch_server",
    ):
        assert symbol in hooked, symbol


@pytest.mark.parametrize("hook", HOOKS, ids=[f"{h.module}:{h.name}" for h in HOOKS])
def test_hooked_symbol_has_not_moved(hook):
    file, line = hook.location()
    assert (file, line) == (hook.file, hook.line), (
        f"{hook.module}:{hook.name} moved to {file}:{line} (hook {hook.hook} says {hook.file}:{hook.line}); "
        "re-read it and update the hook"
    )


def test_sglang_version_is_the_pinned_one():
    import sglang

    assert sglang.__version__ == SGLANG_VERSION


def test_install_registers_the_sparse_backend():
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES

    integration.install()
    integration.install()  # idempotent: the scheduler child may call it again
    assert "sparse" in ATTENTION_BACKENDS
    assert ATTENTION_BACKEND_CHOICES.count("sparse") == 1


def test_sparse_backend_is_a_flashinfer_backend():
    from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend

    from sparse_sglang.integration.attention_backend import SparseAttnBackend

    assert issubclass(SparseAttnBackend, FlashInferAttnBackend)


def test_scheduler_entry_survives_spawn():
    # SGLang spawns the scheduler with this function as its target: it must pickle by reference.
    from sparse_sglang.integration.scheduler_process import run_scheduler_process

    assert pickle.loads(pickle.dumps(run_scheduler_process)) is run_scheduler_process


def test_scheduler_entry_wraps_sglangs_signature():
    import inspect

    from sglang.srt.managers.scheduler import run_scheduler_process

    # Our wrapper forwards *args/**kwargs; SGLang's engine passes these positionally.
    params = list(inspect.signature(run_scheduler_process).parameters)
    assert params[:4] == ["server_args", "port_args", "gpu_id", "tp_rank"]


def store_of(cache):
    """The part of a SparseKVStore that row release uses, around ``cache`` (on CPU: no streams)."""
    import contextlib
    import types

    return types.SimpleNamespace(cache=cache, on_forward_stream=contextlib.nullcontext)


def test_freeing_a_request_slot_returns_its_page_cache_row():
    """SGLang's own ReqToTokenPool and Req (on CPU): finishing, aborting or retracting a request
    frees its slot, and with it the request's GPU page-cache row, so an idle server holds none."""
    import torch
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.sampling.sampling_params import SamplingParams

    from sparse_sglang.integration.memory_pool import release_rows_on_free
    from sparse_sglang.mem_cache import GPUPageCache

    pool = ReqToTokenPool(3, 64, "cpu", False)
    cache = GPUPageCache(3 * 16, 2, 2, 4, 16, torch.bfloat16, max_requests=4, row_width=4, max_pages=16, total_pages=32)
    release_rows_on_free(pool, store_of(cache))
    reqs = [Req(f"r{i}", "", [1, 2, 3], SamplingParams()) for i in range(3)]
    for slot in pool.alloc(reqs):
        cache.open_request(slot, 1)  # what the attention backend does at the first forward
    assert cache.num_open == 3 and cache.num_free == 0
    pool.free(reqs[1])
    assert cache.num_open == 2 and cache.num_free == 16 and pool.available_size() == 1
    for req in (reqs[0], reqs[2]):
        pool.free(req)
    assert cache.num_open == 0 and cache.num_free == cache.num_slots and pool.available_size() == 3
    late = Req("late", "", [1], SamplingParams())
    pool.alloc([late])
    pool.free(late)  # a request freed before its first forward had no row: nothing to return
    assert pool.available_size() == 3


def test_a_slot_reused_after_a_cache_flush_gets_a_new_row():
    """SGLang's ReqToTokenPool on CPU: a request finishes (its slot freed, its row returned),
    ``/flush_cache`` clears the pool (zeroing the generations), and the next request gets the same
    slot at the same generation: the runtime still opens it a row (on the GPU host this sequence
    crashed the server's first request after the benchmark's warm-up and flush). The generations
    are SGLang's, read by the backend; which row belongs to which generation only the cache keeps."""
    import types

    import torch
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.sampling.sampling_params import SamplingParams

    from sparse_sglang.integration.attention_backend import SparseAttnBackend
    from sparse_sglang.integration.memory_pool import release_rows_on_free
    from sparse_sglang.mem_cache import GPUPageCache
    from sparse_sglang.runtime import SparseRuntime
    from sparse_sglang.scheduler import WorkingSetTracker

    pool = ReqToTokenPool(3, 64, "cpu", False)
    cache = GPUPageCache(3 * 16, 2, 2, 4, 16, torch.bfloat16, max_requests=4, row_width=4, max_pages=16, total_pages=32)
    release_rows_on_free(pool, store_of(cache))
    tracker = WorkingSetTracker(4, 2, 2, 4, window=3)
    runtime = SparseRuntime(config=None, plan=None, store=store_of(cache), tracker=tracker)
    backend = types.SimpleNamespace(req_generation=pool.req_generation)

    def hold_row(slot):  # what a forward does first for each of its requests
        runtime._hold_rows([slot], SparseAttnBackend._generations(backend, [slot]))

    first = Req("first", "", [1, 2, 3], SamplingParams())
    (slot,) = pool.alloc([first])
    opened_at = int(pool.req_generation[slot])
    hold_row(slot)
    assert cache.is_open(slot)
    pool.free(first)
    assert not cache.is_open(slot)
    pool.clear()  # what /flush_cache does
    second = Req("second", "", [4, 5], SamplingParams())
    assert pool.alloc([second]) == [slot] and int(pool.req_generation[slot]) == opened_at
    tracker.record_step(torch.tensor([slot]), torch.ones(1, 2, 2, 4, dtype=torch.int32))  # the first one's selections
    hold_row(slot)
    assert cache.is_open(slot) and cache.num_open == 1
    assert tracker.sizes(torch.tensor([slot])).tolist() == [0]  # the new request inherits no working set
    cache.write_allocate(slot, 0, 1)  # what failed with KeyError on the server
    hold_row(slot)  # its own row: kept
    assert cache.num_open == 1


def test_a_prompt_over_the_host_store_is_refused_naming_the_flag():
    """The scheduler's own ``validate_input_length`` (SGLang's symbol, patched): a prompt at the
    limit the host store sets gets SGLang's refusal plus the host store's size and flag; when the
    model's context is the limit (a host store larger than it) the message is SGLang's alone."""
    from array import array

    import sglang.srt.managers.scheduler as scheduler
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    from sparse_sglang.integration import input_length

    req = Req("long", "", array("q", [7] * 98300), SamplingParams())
    input_length.patch_validate_input_length(
        input_length.HostStoreLimit(98272, "1.5 GiB (--sparse-host-cache-gb)", 131072)
    )
    message = scheduler.validate_input_length(req, 98266, False)
    assert message.startswith("Input length (98300 tokens) exceeds the maximum allowed length (98266 tokens).")
    assert "host KV store holds 98272 tokens (1.5 GiB (--sparse-host-cache-gb)); a server with a larger " in message
    assert (
        scheduler.validate_input_length(Req("short", "", array("q", [7] * 100), SamplingParams()), 98266, False) is None
    )
    # a pool built again rebinds the hook (not wrapped twice); here the context is the limit
    input_length.patch_validate_input_length(
        input_length.HostStoreLimit(1_000_000, "80 GiB (--sparse-host-cache-gb)", 131072)
    )
    assert not getattr(scheduler.validate_input_length.__wrapped__, "sparse_sglang", False)
    assert "sparse" not in scheduler.validate_input_length(
        Req("ctx", "", array("q", [7] * 131100), SamplingParams()), 131066, False
    )


def test_fp8_kv_scales_come_from_a_checkpoint_or_quantization_param_path():
    """SGLang keeps an fp8 checkpoint's KV scales in ``k_scale_float`` and sets a plain float
    ``k_scale`` from ``--quantization-param-path`` (``LlamaModel.load_kv_cache_scales``); a 16-bit
    store takes no scale."""
    import torch
    from sglang.srt.layers.radix_attention import RadixAttention

    from sparse_sglang.integration.attention_backend import fp8_kv_scales

    layer = RadixAttention(num_heads=4, head_dim=8, scaling=1.0, num_kv_heads=2, layer_id=0)
    fp8 = torch.float8_e4m3fn
    assert fp8_kv_scales(layer, fp8) == (None, None)  # no scales given: FlashInfer's 1.0
    layer.k_scale, layer.v_scale = 0.5, 0.25  # as load_kv_cache_scales sets them
    assert fp8_kv_scales(layer, fp8) == (0.5, 0.25)
    assert fp8_kv_scales(layer, torch.bfloat16) == (None, None)
    layer.k_scale, layer.v_scale = torch.tensor(9.0), torch.tensor(9.0)  # a checkpoint's: the floats win
    layer.k_scale_float, layer.v_scale_float = 2.0, 4.0
    assert fp8_kv_scales(layer, fp8) == (2.0, 4.0)


def test_the_backend_reads_request_slots_from_the_host_mirror():
    """Under overlap scheduling a read of the GPU slots waits for the forward before; the backend
    takes the mirror ``ForwardBatch.init_new`` handed it (once), padded with slot 0 for a CUDA-graph
    batch, and reads the GPU only when it has none that fits."""
    import types

    import torch

    from sparse_sglang.integration.attention_backend import SparseAttnBackend
    from sparse_sglang.mem_cache.gpu_cache import PADDING_SLOT

    backend = types.SimpleNamespace(next_req_slots=None)
    SparseAttnBackend.note_req_slots(backend, torch.tensor([7, 3]))
    gpu = torch.tensor([7, 3, PADDING_SLOT, PADDING_SLOT])  # a graph batch of 4: 2 real, 2 padding
    assert SparseAttnBackend._req_slots_cpu(backend, gpu) == [7, 3, 0, 0]
    assert backend.next_req_slots is None  # used once
    assert SparseAttnBackend._req_slots_cpu(backend, torch.tensor([5, 6])) == [5, 6]  # no mirror: the GPU's
    SparseAttnBackend.note_req_slots(backend, torch.tensor([1, 2, 3]))
    assert SparseAttnBackend._req_slots_cpu(backend, torch.tensor([1, 2])) == [1, 2]  # longer: not this batch's


def test_the_prefill_graph_runners_made_up_batches_touch_no_sparse_state():
    """SGLang's prefill graph runner warms up and captures on a made-up batch in request slot 0
    (``--sparse-prefill-cuda-graph``): its attention runs, without a prefix, and nothing opens a
    cache row, binds save runs or saves KV; a real batch after it does all three."""
    import types

    import torch

    from sparse_sglang.integration.attention_backend import SparseAttnBackend
    from sparse_sglang.mem_cache import GPUPageCache
    from sparse_sglang.mem_cache.gpu_cache import PADDING_SLOT
    from sparse_sglang.runtime import PrefillPlan, SparseRuntime

    cache = GPUPageCache(3 * 16, 2, 2, 4, 16, torch.bfloat16, max_requests=4, row_width=4, max_pages=16, total_pages=32)
    saved, bound, planned = [], [], []
    store = types.SimpleNamespace(cache=cache, shape=types.SimpleNamespace(page_size=4, dtype=torch.bfloat16),
                                  bind_runs=bound.append, note_forward_stream=lambda: None,
                                  wait_saves=lambda: None)  # fmt: skip
    prefix = types.SimpleNamespace(active=False)

    def plan(req_to_token, req_slots, prefix_lens, extend_lens, keys=None):
        prefix.active = any(prefix_lens)
        planned.append((list(prefix_lens), keys))

    prefix.plan = plan
    runtime = SparseRuntime(config=None, plan=None, store=store, prefix=prefix)
    backend = types.SimpleNamespace(
        runtime=runtime, store=store, prefix=prefix, next_req_slots=None,
        req_generation=torch.zeros(4, dtype=torch.int64), prefill_plan=PrefillPlan(runs="runs of the batch before"),
        req_to_token_pool=types.SimpleNamespace(req_to_token=torch.zeros(4, 64, dtype=torch.int32)),
        constants=types.SimpleNamespace(check=lambda *a: None),
        prefill_wrapper_ragged=types.SimpleNamespace(run=lambda q, k, v: torch.zeros_like(q)),
        kv_pool=types.SimpleNamespace(save=lambda *a, **kw: saved.append(a)),
    )  # fmt: skip
    backend._req_slots_cpu = lambda slots: SparseAttnBackend._req_slots_cpu(backend, slots)
    backend._generations = lambda slots: SparseAttnBackend._generations(backend, slots)
    layer = types.SimpleNamespace(tp_q_head_num=4, tp_k_head_num=2, tp_v_head_num=2, head_dim=16, layer_id=0,
                                  scaling=0.25, logit_cap=0.0)  # fmt: skip
    q, k, v = torch.zeros(8, 64), torch.zeros(8, 32), torch.zeros(8, 32)

    def batch(slot, prefix_len):
        return types.SimpleNamespace(req_pool_indices=torch.tensor([slot]), extend_prefix_lens_cpu=[prefix_len],
                                     extend_seq_lens_cpu=[8], out_cache_loc=torch.arange(8))  # fmt: skip

    made_up = batch(PADDING_SLOT, 0)
    SparseAttnBackend._begin_extend(backend, made_up)
    SparseAttnBackend.forward_extend(backend, q, k, v, layer, made_up)
    assert (cache.num_open, bound, saved, backend.prefill_plan.runs) == (0, [], [], None)
    assert planned == [([0], None)] and not prefix.active  # no request: the resident prefix untouched
    real = batch(2, 0)
    SparseAttnBackend._begin_extend(backend, real)
    SparseAttnBackend.forward_extend(backend, q, k, v, layer, real)
    assert cache.is_open(2) and len(bound) == 1 and len(saved) == 1
    assert planned[-1] == ([0], [(2, 0)])  # the request's slot and generation


def test_a_request_the_scheduler_fails_on_fails_alone(monkeypatch):
    """SGLang's ``Scheduler.handle_generate_request`` (patched) on a stand-in scheduler that lacks
    what the method reads: instead of raising into the event loop, the request is queued finished
    with an abort naming the error, and what the failed call had queued is taken back."""
    import types

    import sglang.srt.managers.schedule_batch as schedule_batch
    from sglang.srt.managers.schedule_batch import FINISH_ABORT
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.sampling.sampling_params import SamplingParams

    from sparse_sglang.integration.request_intake import patch_handle_generate_request

    patch_handle_generate_request()
    monkeypatch.setattr(schedule_batch, "get_parallel", lambda: types.SimpleNamespace(tp_rank=0))  # no TP group on CPU
    queued = []
    scheduler = types.SimpleNamespace(
        waiting_queue=["already waiting"], tokenizer=None, model_config=types.SimpleNamespace(vocab_size=100),
        init_req_max_new_tokens=lambda req: None, _add_request_to_queue=queued.append,
    )  # fmt: skip
    # the fields of a TokenizedGenerateReqInput that a refusal reads; SGLang's method reads more, and fails
    recv = types.SimpleNamespace(rid="bad-one", input_text="", input_ids=[1, 2, 3], sampling_params=SamplingParams(),
                                 http_worker_ipc=None)  # fmt: skip
    Scheduler.handle_generate_request(scheduler, recv)  # the stand-in lacks what SGLang reads: it fails inside
    (req,) = queued
    assert req.rid == "bad-one" and isinstance(req.to_finish, FINISH_ABORT)  # answered with the next batch
    assert "the scheduler could not take this request: AttributeError" in req.to_finish.message
    assert scheduler.waiting_queue == ["already waiting"]


def test_server_info_sums_the_sparse_numbers_of_data_parallel_replicas():
    """``/get_server_info``: each replica's ``"sparse"`` entry, and with several replicas their
    total (counters and sizes summed, ratios and settings left out) in each state."""
    from sparse_sglang.integration.scheduler_state import with_replica_total

    states = [
        {"sparse": {"gpu_cache_slots": 100, "pages_loaded": 7, "hit_ratio": 0.5, "working_set_window": 12,
                    "working_set_admissions": None, "segmented_prefill": {"steps": 1}}, "other": 1},
        {"sparse": {"gpu_cache_slots": 100, "pages_loaded": 3, "hit_ratio": 0.9, "working_set_window": 12,
                    "working_set_admissions": None, "segmented_prefill": None}},
    ]  # fmt: skip
    got = with_replica_total(states)
    assert got[0]["sparse_total"] == got[1]["sparse_total"] == {"gpu_cache_slots": 200, "pages_loaded": 10}
    assert got[0]["sparse"]["pages_loaded"] == 7  # each replica's own entry is kept
    one = [{"sparse": {"pages_loaded": 7}}]
    assert "sparse_total" not in with_replica_total(one)[0]  # one replica: its entry is the total


def test_server_info_gathers_every_tensor_parallel_ranks_entry_over_a_gloo_group(tmp_path):
    """Under ``--tp-size``, each rank's ``"sparse"`` entry reaches the answer (rank 0's), with their
    sum: a real two-process gloo group, each rank with its own numbers."""
    import torch.multiprocessing as mp

    init_file = str(tmp_path / "gloo-init")
    with mp.get_context("spawn").Pool(2) as pool:
        got = pool.starmap(_gathered_entry, [(rank, init_file) for rank in range(2)])
    assert got[0]["pages_loaded"] == 7  # rank 0's own entry answers
    assert [r["pages_loaded"] for r in got[0]["tp_ranks"]] == [7, 8]
    assert got[0]["tp_total"] == {"gpu_cache_slots": 200, "pages_loaded": 15}  # the ratio left out
    assert got[1]["tp_ranks"] == got[0]["tp_ranks"]


def _gathered_entry(rank: int, init_file: str) -> dict:
    import torch.distributed as dist

    from sparse_sglang.integration.scheduler_state import gather_over, with_tp_ranks

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        entry = {"gpu_cache_slots": 100, "pages_loaded": 7 + rank, "hit_ratio": 0.5 + rank / 10}
        return with_tp_ranks(entry, gather_over(dist.group.WORLD))
    finally:
        dist.destroy_process_group()


def _self_attributes(cls) -> tuple[set[str], set[str]]:
    """The ``self.<name>`` a class's own source reads and the names it sets (assignments, its
    methods and properties)."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    reads, sets = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            (sets if isinstance(node.ctx, ast.Store) else reads).add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            sets.add(node.name)
    return reads, sets


def test_the_backend_reads_only_attributes_it_or_sglangs_backends_set():
    """Every ``self.<name>`` the sparse backend reads is set by it or by a class it inherits from
    (a read of an attribute SGLang's FlashInfer backend never sets fails only at a server's first
    prefill, on a GPU)."""
    from sparse_sglang.integration.attention_backend import SparseAttnBackend

    reads, _ = _self_attributes(SparseAttnBackend)
    provided = set()
    for cls in SparseAttnBackend.__mro__:
        if cls is object:
            continue
        provided |= _self_attributes(cls)[1]
    assert reads - provided == set()


def test_flashinfer_decode_max_gives_the_builtins_value_with_one_reduction():
    """The decode plan's ``max(kv_lens_arr_host).item()`` reads the same through the patch, and
    every other use of ``max`` in FlashInfer's decode module is Python's own."""
    import builtins
    import inspect

    import flashinfer.decode
    import torch

    from sparse_sglang.integration.flashinfer_decode_plan import tensor_aware_max

    lens = torch.randint(1, 1 << 20, (600,), dtype=torch.int32)
    assert tensor_aware_max(lens).item() == builtins.max(lens).item() == int(lens.max())
    assert tensor_aware_max(lens[:1]).item() == int(lens[0])
    assert tensor_aware_max([3, 9, 4]) == 9 and tensor_aware_max(3, 9) == 9
    assert tensor_aware_max([(1, "b"), (2, "a")], key=lambda x: x[1]) == (1, "b")
    assert tensor_aware_max([], default=7) == 7
    with pytest.raises(ValueError):
        tensor_aware_max(torch.empty(0, dtype=torch.int32))  # as the builtin: an empty sequence
    integration.install()
    assert flashinfer.decode.max is tensor_aware_max
    # why the patch exists: if FlashInfer stops taking the longest row this way, drop it
    assert "max(kv_lens_arr_host).item()" in inspect.getsource(
        flashinfer.decode.BatchDecodeWithPagedKVCacheWrapper._plan_impl
    )
