"""The layer-segmented scheduler loop's order of work, on CPU, with a scripted scheduler; and its
segments paced to a time between tokens (``--sparse-tbt-target-ms``), with the scripted
scheduler's clock advanced by what each batch would cost on the GPU (a decode step 30 ms, a layer
of a 4,096-token prefill 6 ms).

SGLang's Scheduler needs a GPU to exist, so this drives :class:`SegmentedPrefillLoop` through a
stand-in that has the scheduler methods the loop calls and records each call. The real loop on the
real scheduler is ``test_segmented_prefill_gpu.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sparse_sglang.config import SparseConfig, SparseConfigError
from sparse_sglang.integration.segmented_prefill import SegmentedPrefillLoop
from sparse_sglang.prefill.pacing import SegmentPacer
from sparse_sglang.stats import SparseStats

LAYERS, INJECT = 8, 4096


class Batch:
    def __init__(self, name, mode, reqs=(), tokens=0):
        self.name, self.forward_mode, self.reqs, self.extend_num_tokens = name, mode, list(reqs), tokens
        self.split_index, self.split_forward_count, self.split_forward_batch = 0, 1, None
        self.is_prefill_only = False

    def is_empty(self):
        return not self.reqs


class Scheduler:
    """Scripted: ``plans`` are the batches get_next_batch_to_run returns, in order (None = idle)."""

    def __init__(self, plans, running_reqs):
        self.log, self.plans = [], list(plans)
        self.running_batch = Batch("running", ForwardMode.DECODE, running_reqs)
        self.last_batch = self.chunked_req = self._pending_chunked_abort_req = None
        self.gracefully_exit = self._engine_paused = False
        self.model_config = SimpleNamespace(num_hidden_layers=LAYERS)
        self.server_args = SimpleNamespace(
            sparse=SparseConfig(host_cache_gb=1.0, segmented_prefill=True, max_inject_tokens=INJECT)
        )
        backend = SimpleNamespace(resume_extend=lambda: self.log.append("resume"))
        runtime = SimpleNamespace(store=SimpleNamespace(wait_saves=lambda: self.log.append("wait_saves")),
                                  stats=SparseStats())  # fmt: skip
        pool = SimpleNamespace(runtime=runtime)  # the sparse KV pool SGLang's token allocator hands out
        self.token_to_kv_pool_allocator = SimpleNamespace(get_kvcache=lambda: pool)
        model = SimpleNamespace(forward_split_prefill=None)  # the models SGLang can run layer by layer have it
        self.tp_worker = SimpleNamespace(model_runner=SimpleNamespace(attn_backend=backend, model=model))
        self.tp_group = SimpleNamespace(world_size=1)
        self.request_receiver = SimpleNamespace(recv_requests=lambda: [])
        self.abort_at_segment = None

    def process_input_requests(self, reqs):
        pass

    def get_next_batch_to_run(self, running_batch, last_batch):
        self.log.append(f"next(last={last_batch.name if last_batch else None})")
        batch = self.plans.pop(0) if self.plans else None
        return SimpleNamespace(running_batch=running_batch, batch_to_run=batch)

    def update_running_batch(self, batch):
        self.log.append("update_running")
        return batch

    def run_batch(self, batch):
        if batch.forward_mode == ForwardMode.SPLIT_PREFILL:
            self.log.append(f"segment {batch.split_index}+{batch.split_forward_count}")
            if self.abort_at_segment == batch.split_index:
                for req in batch.reqs:
                    req.to_finish = "abort"
        else:
            self.log.append(f"run {batch.name}")
        return batch.name

    def process_batch_result(self, batch, result):
        self.log.append(f"result {batch.name}")

    def on_idle(self):
        self.log.append("idle")


def req(rid):
    return SimpleNamespace(rid=rid, to_finish=None, finished=lambda: False)


def run(scheduler):
    """Iterate until the script is done and nothing is in flight, then once more (idle)."""
    loop = SegmentedPrefillLoop(scheduler)
    while scheduler.plans or loop.prefill is not None:
        loop.iterate()
    loop.iterate()
    return loop


def test_each_iteration_runs_a_decode_step_then_the_next_segment_and_the_batch_is_merged_after():
    prefill = Batch("prefill", ForwardMode.EXTEND, [req("long")], tokens=1500)  # 4096 // 1500 = 2 layers per iteration
    s = Scheduler([prefill], running_reqs=[req("a"), req("b")])
    loop = run(s)
    assert s.log == ["next(last=None)",
                     "update_running", "run running", "result running", "segment 0+2",
                     "update_running", "run running", "result running", "resume", "segment 2+2",
                     "update_running", "run running", "result running", "resume", "segment 4+2",
                     "update_running", "run running", "result running", "resume", "segment 6+2", "result prefill",
                     "next(last=prefill)", "idle"]  # fmt: skip
    assert loop.stats.prefills == 1 and loop.stats.segments == 4 and loop.stats.decode_steps == 4
    assert s.enable_pdmux  # run_batch's SPLIT_PREFILL branch


def test_small_batches_and_batches_with_no_decodes_next_to_them_run_as_sglang_runs_them():
    small = Batch("small", ForwardMode.EXTEND, [req("s")], tokens=INJECT // LAYERS)  # all layers fit the budget
    s = Scheduler([small], running_reqs=[req("a")])
    run(s)
    assert s.log == ["next(last=None)", "run small", "result small", "next(last=small)", "idle"]
    alone = Batch("alone", ForwardMode.EXTEND, [req("l")], tokens=100_000)
    s = Scheduler([alone], running_reqs=[])
    run(s)
    assert s.log == ["next(last=None)", "run alone", "result alone", "next(last=alone)", "idle"]


def test_a_split_batch_whose_requests_were_all_aborted_stops_and_frees_at_once(monkeypatch):
    import sparse_sglang.integration.segmented_prefill as seg

    released = []
    monkeypatch.setattr(seg, "prepare_abort", lambda r: released.append(("abort", r.rid)))
    import sglang.srt.mem_cache.common as common

    monkeypatch.setattr(
        common, "release_kv_cache", lambda r, tree, is_insert: released.append(("release", r.rid, is_insert))
    )
    prefill = Batch("prefill", ForwardMode.EXTEND, [req("long")], tokens=3000)  # 1 layer per iteration
    s = Scheduler([prefill], running_reqs=[req("a")])
    s.tree_cache = object()
    s.ipc_channels = SimpleNamespace(
        send_to_tokenizer=SimpleNamespace(send_output=lambda out, r: released.append(("tell", out.rid)))
    )
    s.abort_at_segment = 2
    loop = run(s)
    segments = [e for e in s.log if e.startswith("segment")]
    assert segments == ["segment 0+1", "segment 1+1", "segment 2+1"]  # nothing after the abort
    assert released == [("abort", "long"), ("release", "long", False), ("tell", "long")]
    assert "result prefill" not in s.log and s.log[-2:] == ["next(last=None)", "idle"]
    assert loop.stats.cancelled == 1 and loop.prefill is None


def test_a_model_without_a_layer_split_forward_is_refused_by_name():
    s = Scheduler([], running_reqs=[])
    s.tp_worker.model_runner.model = object()
    with pytest.raises(RuntimeError, match="no layer-split forward .* for object; serve it without the flag"):
        SegmentedPrefillLoop(s)


DECODE_S, LAYER_S_PER_TOKEN, MODEL_LAYERS = 0.030, 0.006 / 4096, 32


def test_the_next_segment_fills_what_the_decode_step_leaves_of_the_target():
    pacer = SegmentPacer(target_s=0.080, fallback_inject_tokens=65536)
    assert pacer.layers(batch_tokens=4096) == 16  # nothing measured: the fixed budget's share
    pacer.note_period(0.030, layers=0, batch_tokens=0)
    pacer.note_period(0.030 + 16 * 0.006, layers=16, batch_tokens=4096)
    assert pacer.layers(batch_tokens=4096) == 8  # (80 - 30) / 6
    pacer.start_batch()  # a new batch, half the tokens: the last cost per token-layer, scaled
    assert pacer.layers(batch_tokens=2048) == 16
    pacer.note_period(0.030 + 4 * 0.050, layers=4, batch_tokens=2048)  # this batch's layers cost far more
    assert pacer.layers(batch_tokens=2048) == 1  # never zero: the prefill still advances
    pacer.note_period(float("nan"), layers=1, batch_tokens=2048)  # a broken clock teaches nothing
    assert pacer.layers(batch_tokens=2048) == 1


@pytest.mark.parametrize("target", [0.0, -5.0, float("inf")])
def test_a_target_that_is_not_a_positive_time_is_refused(target):
    with pytest.raises(ValueError, match="positive and finite"):
        SegmentPacer(target, 65536)


def test_the_flag_names_itself_and_needs_segmented_prefill():
    with pytest.raises(SparseConfigError, match="tbt_target_ms.*positive"):
        SparseConfig(host_cache_gb=1.0, segmented_prefill=True, tbt_target_ms=-1.0)
    with pytest.raises(SparseConfigError, match="tbt_target_ms.*segmented"):
        SparseConfig(host_cache_gb=1.0, tbt_target_ms=80.0)


class Clocked(Scheduler):
    """The scripted scheduler of the loop's tests, 32 layers, its clock advanced by each batch run."""

    def __init__(self, plans, running_reqs, target_ms):
        super().__init__(plans, running_reqs)
        self.now = 0.0
        self.model_config = SimpleNamespace(num_hidden_layers=MODEL_LAYERS)
        self.server_args = SimpleNamespace(sparse=SparseConfig(host_cache_gb=1.0, segmented_prefill=True,
                                                               tbt_target_ms=target_ms))  # fmt: skip
        self.decode_ends = []

    def run_batch(self, batch):
        if batch.forward_mode == ForwardMode.SPLIT_PREFILL:
            self.now += batch.split_forward_count * LAYER_S_PER_TOKEN * batch.extend_num_tokens
        elif batch.forward_mode == ForwardMode.DECODE:
            self.now += DECODE_S
        return super().run_batch(batch)

    def process_batch_result(self, batch, result):
        super().process_batch_result(batch, result)
        if batch.forward_mode == ForwardMode.DECODE:
            self.decode_ends.append(self.now)


def run_clocked(monkeypatch, s):
    import sparse_sglang.integration.segmented_prefill as seg

    monkeypatch.setattr(seg, "time", SimpleNamespace(perf_counter=lambda: s.now))
    loop = seg.SegmentedPrefillLoop(s)
    while s.plans or loop.prefill is not None:
        loop.iterate()
    return loop


def test_the_loop_learns_the_layer_cost_and_keeps_each_token_within_the_target(monkeypatch):
    running = [req("a"), req("b")]
    decode = Batch("running", ForwardMode.DECODE, running)
    prefill = Batch("prefill", ForwardMode.EXTEND, [req("long")], tokens=4096)
    s = Clocked([decode, decode, decode, prefill], running, target_ms=80.0)
    run_clocked(monkeypatch, s)
    segments = [e for e in s.log if e.startswith("segment")]
    # The first segment has only the fixed budget to go by (65,536 token-layers: 16 layers); from
    # its period the loop learns 6 ms a layer, and 8 layers fill the 50 ms the decode step leaves.
    assert segments == ["segment 0+16", "segment 16+8", "segment 24+8"]
    periods = [b - a for a, b in zip(s.decode_ends, s.decode_ends[1:])]
    # decode steps alone, then next to 16 layers (126 ms: the one period the fixed budget sets), then 8
    assert periods == pytest.approx([DECODE_S] * 3 + [DECODE_S + 16 * 0.006, DECODE_S + 8 * 0.006])
    assert "result prefill" in s.log


def test_a_decode_step_slower_than_the_target_still_lets_the_prefill_advance(monkeypatch):
    running = [req("a")]
    decode = Batch("running", ForwardMode.DECODE, running)
    prefill = Batch("prefill", ForwardMode.EXTEND, [req("long")], tokens=4096)
    s = Clocked([decode, decode, prefill], running, target_ms=20.0)  # below the 30 ms decode step
    run_clocked(monkeypatch, s)
    segments = [e for e in s.log if e.startswith("segment")]
    assert segments[0] == "segment 0+16" and set(segments[1:]) == {f"segment {i}+1" for i in range(16, 32)}


def test_segments_run_while_no_request_decodes_teach_the_pacer_nothing(monkeypatch):
    import sparse_sglang.integration.segmented_prefill as seg

    decode = Batch("running", ForwardMode.DECODE, [req("a")])
    prefill = Batch("prefill", ForwardMode.EXTEND, [req("long")], tokens=8192)  # 12 ms a layer; 8 a segment
    s = Clocked([decode, decode, prefill], [req("a")], target_ms=80.0)
    monkeypatch.setattr(seg, "time", SimpleNamespace(perf_counter=lambda: s.now))
    loop = seg.SegmentedPrefillLoop(s)
    for _ in range(3):  # two decode steps alone, then a decode step and the segment 0+8
        loop.iterate()
    waiting = s.running_batch.reqs[:]
    s.running_batch.reqs.clear()  # the decodes finish: the segment 8+8 runs alone
    loop.iterate()
    s.running_batch.reqs.extend(waiting)  # decodes again: the period since the last one spans two segments
    loop.iterate()
    assert loop.pacer.layer_s is None  # not one segment's cost: nothing learned
    loop.iterate()  # the period of one decode step and the segment 16+8
    assert loop.pacer.layer_s == pytest.approx(0.012)
    assert [e for e in s.log if e.startswith("segment")] == [
        "segment 0+8",
        "segment 8+8",
        "segment 16+8",
        "segment 24+4",
    ]


def _agree_on_rank(rank: int, port: int, values: list[int], out) -> None:
    import torch.distributed as dist

    from sparse_sglang.integration.segmented_prefill import agreed_across_tp

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=len(values))
    try:
        scheduler = SimpleNamespace(tp_group=SimpleNamespace(world_size=len(values)), tp_cpu_group=dist.group.WORLD)
        out.put((rank, agreed_across_tp(scheduler, values[rank])))
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_ranks_run_the_fewest_layers_any_of_them_paced():
    """Each rank paces from its own clock; two real gloo ranks (the CPU group SGLang's schedulers
    share) leave agreed_across_tp with the same count, the smaller one."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_agree_on_rank, args=(rank, port, [5, 3], out)) for rank in range(2)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert got == {0: 3, 1: 3} and all(p.exitcode == 0 for p in procs)
    from sparse_sglang.integration.segmented_prefill import agreed_across_tp

    assert agreed_across_tp(SimpleNamespace(tp_group=SimpleNamespace(world_size=1)), 7) == 7  # no TP: its own
