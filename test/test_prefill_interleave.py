"""``--sparse-interleave-prefill``: the round after a prefill batch runs the decode step instead of
the next prefill batch, while requests decode; otherwise SGLang's rounds are unchanged."""

from types import SimpleNamespace

import pytest
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sparse_sglang.config import SparseConfig, SparseConfigError
from sparse_sglang.integration.prefill_interleave import (
    InterleavedChunkPacing,
    decode_goes_first,
    hold_prefill_for_decodes,
    time_each_batch,
)
from sparse_sglang.testing.simulated_gpu import SimulatedGpu


class Batch:
    def __init__(self, mode: ForwardMode, size: int = 1, prefill_only: bool = False):
        self.forward_mode, self.size, self.is_prefill_only = mode, size, prefill_only

    def is_empty(self) -> bool:
        return self.size == 0


def scheduler(interleave: bool, last_batch, chunked_req=None, waiting=()):
    sparse = SparseConfig(interleave_prefill=interleave, host_cache_gb=1)
    # an allocator that is not the sparse runtime's: no stats to count into
    return SimpleNamespace(server_args=SimpleNamespace(sparse=sparse), last_batch=last_batch, chunked_req=chunked_req,
                           waiting_queue=list(waiting), token_to_kv_pool_allocator=object())  # fmt: skip


def test_a_decode_step_goes_first_only_right_after_a_prefill_with_requests_decoding():
    decoding, extend = Batch(ForwardMode.DECODE, size=8), Batch(ForwardMode.EXTEND)
    assert decode_goes_first(extend, decoding, prefill_pending=True)
    assert not decode_goes_first(extend, decoding, prefill_pending=False)  # nothing to hold back
    assert not decode_goes_first(Batch(ForwardMode.DECODE), decoding, True)  # the decode just ran: prefill's turn
    assert not decode_goes_first(None, decoding, True)  # an idle round before
    assert not decode_goes_first(extend, Batch(ForwardMode.DECODE, size=0), True)  # nothing decodes
    assert not decode_goes_first(extend, Batch(ForwardMode.EXTEND, prefill_only=True), True)


def test_the_hook_forms_no_prefill_batch_in_that_round_and_defers_to_sglang_otherwise():
    calls = []
    sglang_prefill = lambda self, running: calls.append(running) or "sglang's plan"  # noqa: E731
    hooked = hold_prefill_for_decodes(sglang_prefill)
    running, chunk = Batch(ForwardMode.DECODE, size=8), object()

    plan = hooked(scheduler(True, last_batch=Batch(ForwardMode.EXTEND), chunked_req=chunk), running)
    assert plan.batch_to_run is None and plan.running_batch is running and calls == []
    plan = hooked(scheduler(True, last_batch=Batch(ForwardMode.EXTEND), waiting=["req"]), running)
    assert plan.batch_to_run is None and calls == []
    assert hooked(scheduler(True, last_batch=running, chunked_req=chunk), running) == "sglang's plan"  # after decode
    assert hooked(scheduler(True, last_batch=Batch(ForwardMode.EXTEND)), running) == "sglang's plan"  # none pending
    assert hooked(scheduler(False, last_batch=Batch(ForwardMode.EXTEND), chunked_req=chunk), running) == "sglang's plan"
    assert len(calls) == 3
    # alternating rounds while a chunked prompt is pending: prefill, decode, prefill, ... (the
    # prompt never starves the decodes and is never starved: the round after a decode is SGLang's)
    last, kinds = None, []
    for _ in range(6):
        plan = hooked(scheduler(True, last_batch=last, chunked_req=chunk), running)
        last = Batch(ForwardMode.EXTEND) if plan == "sglang's plan" else running
        kinds.append("prefill" if plan == "sglang's plan" else "decode")
    assert kinds == ["prefill", "decode"] * 3


def test_interleave_and_layer_segments_are_one_choice():
    with pytest.raises(SparseConfigError, match=r"^interleave_prefill: segmented_prefill already runs"):
        SparseConfig(interleave_prefill=True, segmented_prefill=True, host_cache_gb=1)


class Prefill:
    """A prefill batch as SGLang forms it: its requests' new and prefix tokens."""

    def __init__(self, new_tokens: int, prefix_tokens: int):
        self.forward_mode, self.extend_lens, self.prefix_lens = ForwardMode.EXTEND, [new_tokens], [prefix_tokens]


def chunk_seconds(new_tokens: int, prefix_tokens: int) -> float:
    """What the simulated GPU takes for a chunk: fixed, staging the prefix, the tokens, attention."""
    return 0.002 + 1e-7 * prefix_tokens + 8e-6 * new_tokens + 1e-9 * new_tokens * (prefix_tokens + new_tokens / 2)


def paced_prefill(overlap: bool, chunk_cost, prompts=(65536,), decode_s: float = 0.030):
    """Prompts of ``prompts`` tokens prefilled one after another beside 80 requests decoding
    (``decode_s`` a step) under a 100 ms target, on a simulated GPU whose chunks take
    ``chunk_cost(new, prefix)`` seconds, timed by events on it. The rounds start when SGLang's
    loop would start them: after the round's batch, or with overlap scheduling after the batch
    before it. Returns the batches run (the decode batch, or a prefill chunk) and their
    durations."""
    queue, done = list(prompts), [0]  # the prompts not finished; tokens of the first one prefilled
    gpu = SimulatedGpu()
    sparse = SparseConfig(interleave_prefill=True, tbt_target_ms=100, host_cache_gb=1)
    s = SimpleNamespace(server_args=SimpleNamespace(sparse=sparse), last_batch=None, chunked_req=None,
                        waiting_queue=list(queue), token_to_kv_pool_allocator=object(), chunked_prefill_size=8192,
                        page_size=32, enable_overlap=overlap, forward_stream=None,
                        tp_group=SimpleNamespace(world_size=1))  # fmt: skip
    s.sparse_chunk_pacing = InterleavedChunkPacing(100, 8192, 32, make_event=gpu.event)

    def sglang_prefill(self, running):  # SGLang's: the prompt's next chunk, at most chunked_prefill_size tokens
        if not queue:
            return SimpleNamespace(batch_to_run=None, running_batch=running)
        x = min(self.chunked_prefill_size, queue[0] - done[0])
        batch = Prefill(x, done[0])
        done[0] += x
        if done[0] < queue[0]:
            self.chunked_req = SimpleNamespace(prefix_indices=range(done[0]))
        else:
            queue.pop(0)
            self.chunked_req, done[0] = None, 0
        self.waiting_queue = queue[1:] if self.chunked_req is not None else list(queue)
        return SimpleNamespace(batch_to_run=batch, running_batch=running)

    def sglang_run_batch(self, batch):  # launches the batch on the simulated GPU
        durations.append(decode_s if batch is running else chunk_cost(batch.extend_lens[0], batch.prefix_lens[0]))
        gpu.run(durations[-1])

    hooked, run_batch = hold_prefill_for_decodes(sglang_prefill), time_each_batch(sglang_run_batch)
    running = Batch(ForwardMode.DECODE, size=80)
    durations, batches = [], []
    for k in range(4000):
        gpu.now = sum(durations[: max(k - 1, 0)] if overlap else durations)
        batch = hooked(s, running).batch_to_run or running  # no prefill: the decode step runs
        run_batch(s, batch)
        batches.append(batch)
        s.last_batch = batch
        if not queue and batch is running:
            break
    assert not queue and sum(b.extend_lens[0] for b in batches if b is not running) == sum(prompts)
    assert all(b is running for b in batches[1::2])  # a decode step after every chunk
    assert s.sparse_chunk_pacing.pacer.decode_s == pytest.approx(decode_s)  # each batch timed as itself
    return running, batches, durations


@pytest.mark.parametrize("overlap", [False, True])
def test_paced_chunks_keep_every_decode_step_and_the_chunk_before_it_within_the_target(overlap):
    """Decode steps of 30 ms, target 100 ms: once the pacer has seen a few chunks, every decode
    step waits for one chunk that fits in the 70 ms left, and the prompt still goes in large
    chunks, smaller as its prefix grows."""
    running, batches, durations = paced_prefill(overlap, chunk_seconds)
    chunks = [b for b in batches if b is not running]
    waits = [durations[i] + durations[i + 1] for i, b in enumerate(batches[:-1]) if b is not running]
    assert max(waits) > 0.1  # the first chunks, before the pacer knew their cost: SGLang's 8,192 tokens
    settled = waits[6:]
    assert settled and max(settled) <= 0.1 + 1e-9
    assert min(settled[:-1]) > 0.09  # and the chunks use the time they have (the last is the rest of the prompt)
    sizes = [b.extend_lens[0] for b in chunks[6:-1]]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > 2 * sizes[-1]  # deeper into the prompt: smaller


def test_a_prefix_too_costly_to_stage_within_the_target_does_not_make_the_prompt_crawl():
    """Staging the prefix from host memory at 2 ms per 1K tokens, beside 60 ms decode steps:
    past 18K tokens of a 24K prompt the staging alone fills the 100 ms target, and the chunks
    that fit it would be one aligned unit, each re-staging the whole prefix. The pacer instead
    takes the fewest tokens that prefill within twice SGLang's chunk's time per token: the
    prompts' prefill takes at most twice what SGLang's chunks take, in a few dozen rounds each."""
    staging = lambda x, p: 0.004 + 2e-6 * p + 3.7e-5 * x  # noqa: E731
    prompts = [24576] * 4  # the first one teaches the pacer
    running, batches, durations = paced_prefill(False, staging, prompts, decode_s=0.060)
    chunk_time = sum(d for b, d in zip(batches, durations) if b is not running)
    sglang_time = len(prompts) * sum(staging(8192, p) for p in range(0, 24576, 8192))
    assert chunk_time <= 2 * sglang_time
    assert len(batches) // 2 < 40 * len(prompts)
