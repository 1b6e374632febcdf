"""``--sparse-interleave-prefill``: the round after a prefill batch runs the decode step instead of
the next prefill batch, while requests decode; otherwise SGLang's rounds are unchanged."""

from types import SimpleNamespace

import pytest
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sparse_sglang.config import SparseConfig, SparseConfigError
from sparse_sglang.integration.prefill_interleave import decode_goes_first, hold_prefill_for_decodes


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
