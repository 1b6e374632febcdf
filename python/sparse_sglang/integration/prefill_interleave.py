"""A decode step between any two prefill batches (``--sparse-interleave-prefill``).

SGLang's scheduler runs a prefill batch whenever it can form one, and a decode step only when it
cannot (``Scheduler.get_next_batch_to_run``: "run prefill first if possible"). A long prompt is
chunked (``--chunked-prefill-size``), but its chunks still run back to back, so every running
request waits for all of them: with ~80 requests decoding and a new 16K prompt admitted each time
one finishes, those waits are the serving trace's p99 time between tokens.

With the knob on, the round after a prefill batch forms no prefill while requests are decoding
and a prefill is pending: the decode step runs, and the next chunk (or the next new request) in
the round after it. A running request then waits for at most one prefill batch between two of its
tokens, at most ``--chunked-prefill-size`` tokens of compute. Nothing is dropped or reordered: the chunked request
stays stashed as SGLang leaves it between rounds (its ``prefix_indices`` already cover the chunk,
so the next round does not stash it twice), and waiting requests keep their order. The decision
reads only the scheduler's own batches and queue, which every TP rank holds alike, so
the ranks agree without communication. Unlike layer-segmented prefill (which drives SGLang's
normal loop), this keeps SGLang's overlap scheduler.
"""

from __future__ import annotations

from sparse_sglang.integration.memory_pool import runtime_of
from sparse_sglang.integration.registry import relies_on, wrap_once


def decode_goes_first(last_batch, running_batch, prefill_pending: bool) -> bool:
    """Whether this round skips prefill for a decode step: a prefill is pending (a chunked request's
    next chunk, or a waiting request), the last batch was a prefill (extend), and requests are
    decoding."""
    return (
        prefill_pending
        and last_batch is not None
        and last_batch.forward_mode.is_extend()
        and not running_batch.is_empty()
        and not running_batch.is_prefill_only
    )


def hold_prefill_for_decodes(original):
    """``Scheduler.get_new_batch_prefill`` with the round after a prefill given to the decodes
    (under ``--sparse-interleave-prefill``; otherwise SGLang's)."""
    from sglang.srt.managers.schedule_batch import NextBatchPlan

    def get_new_batch_prefill(self, running_batch):
        sparse = getattr(self.server_args, "sparse", None)
        if sparse is None or not sparse.enabled or not sparse.interleave_prefill:
            return original(self, running_batch)
        pending = self.chunked_req is not None or len(self.waiting_queue) > 0
        if decode_goes_first(self.last_batch, running_batch, pending):
            runtime = runtime_of(self.token_to_kv_pool_allocator)
            if runtime is not None:
                runtime.stats.prefills_held += 1
            return NextBatchPlan(batch_to_run=None, running_batch=running_batch)
        return original(self, running_batch)

    return get_new_batch_prefill


@relies_on("sglang.srt.managers.scheduler:Scheduler.get_new_batch_prefill", at="sglang/srt/managers/scheduler.py:3067")
def patch_get_new_batch_prefill() -> None:
    """Make ``Scheduler.get_new_batch_prefill`` form no batch in the round after a prefill while
    requests decode, under ``--sparse-interleave-prefill`` (SGLang's loop then runs the decode step)."""
    from sglang.srt.managers.scheduler import Scheduler

    wrap_once(Scheduler, "get_new_batch_prefill", hold_prefill_for_decodes)
