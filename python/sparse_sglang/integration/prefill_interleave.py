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

With ``--sparse-tbt-target-ms`` a round's prefill, while requests decode, is at most as many
tokens as :class:`~sparse_sglang.prefill.chunk_pacing.ChunkPacer` predicts fit the target beside
one decode step (SGLang's ``chunked_prefill_size`` for that round; it bounds the batch's new
tokens), learned from the batches' times (:class:`~sparse_sglang.prefill.chunk_pacing.BatchClock`
over the rounds' starts). Each rank measures its own clock, so under tensor parallelism the ranks
take the smallest of their sizes.
"""

from __future__ import annotations

import logging
import time

from sparse_sglang.integration.memory_pool import runtime_of
from sparse_sglang.integration.registry import relies_on, wrap_once
from sparse_sglang.integration.segmented_prefill import agreed_across_tp
from sparse_sglang.prefill.chunk_pacing import (
    CHUNK_WINDOW,
    MIN_CHUNKS,
    BatchClock,
    ChunkPacer,
    ChunkShape,
    chunk_unit,
)

logger = logging.getLogger(__name__)

DECODE = "decode"  # BatchClock's label of a decode step


def decode_goes_first(last_batch, running_batch, prefill_pending: bool) -> bool:
    """Whether this round skips prefill for a decode step: a prefill is pending (a chunked request's
    next chunk, or a waiting request), the last batch was a prefill (extend), and requests are
    decoding."""
    return (
        prefill_pending and last_batch is not None and last_batch.forward_mode.is_extend() and decoding(running_batch)
    )


def decoding(running_batch) -> bool:
    """Whether requests are decoding (the running batch holds some, not only prefill-only ones)."""
    return not running_batch.is_empty() and not running_batch.is_prefill_only


class InterleavedChunkPacing:
    """One scheduler's chunk pacing (``--sparse-tbt-target-ms`` with interleaved prefill): the
    clock over its rounds, the pacer, and the prefill batch it formed last (to know it again as
    ``last_batch``). The scheduler holds it as ``sparse_chunk_pacing``."""

    def __init__(self, target_ms: float, max_chunk_tokens: int, page_size: int, overlap: bool):
        self.pacer = ChunkPacer(target_ms / 1000, max_chunk_tokens, align=chunk_unit(page_size))
        self.clock = BatchClock(overlap)
        self.prefill: tuple[object, ChunkShape] | None = None
        self.chunks_timed = 0

    def round_started(self, last_batch, now: float | None = None) -> None:
        """A round starts after ``last_batch`` (the batch the round before formed) was formed:
        time whatever batch the clock can now time, and teach the pacer."""
        label = None
        if last_batch is not None and self.prefill is not None and last_batch is self.prefill[0]:
            label = self.prefill[1]
        elif last_batch is not None and last_batch.forward_mode.is_decode():
            label = DECODE
        timed = self.clock.round_started(time.perf_counter() if now is None else now, label)
        if timed is None:
            return
        what, seconds = timed
        if what is DECODE:
            self.pacer.note_decode(seconds)
            return
        self.pacer.note_chunk(what, seconds)
        self.chunks_timed += 1
        if self.chunks_timed % CHUNK_WINDOW == MIN_CHUNKS:  # the first fit, then once a window
            logger.info(self.pacer.describe())

    def formed(self, batch) -> None:
        """The round formed ``batch`` (a prefill batch, or None)."""
        if batch is not None and batch.extend_lens is not None:
            self.prefill = (batch, ChunkShape.of(zip(batch.extend_lens, batch.prefix_lens)))


@relies_on("sglang.srt.managers.scheduler:Scheduler.init_chunked_prefill", at="sglang/srt/managers/scheduler.py:1136")
def chunk_pacing_of(scheduler) -> InterleavedChunkPacing | None:
    """The scheduler's :class:`InterleavedChunkPacing` (made on first use, once its chunk size
    and overlap setting are final); None without ``--sparse-tbt-target-ms`` or chunked prefill
    (``server_args`` refuses that pair)."""
    target = scheduler.server_args.sparse.tbt_target_ms
    if target is None or scheduler.chunked_prefill_size is None:
        return None
    pacing = getattr(scheduler, "sparse_chunk_pacing", None)
    if pacing is None:
        pacing = scheduler.sparse_chunk_pacing = InterleavedChunkPacing(
            target, scheduler.chunked_prefill_size, scheduler.page_size, scheduler.enable_overlap
        )
    return pacing


def hold_prefill_for_decodes(original):
    """``Scheduler.get_new_batch_prefill`` with the round after a prefill given to the decodes
    (under ``--sparse-interleave-prefill``; otherwise SGLang's)."""
    from sglang.srt.managers.schedule_batch import NextBatchPlan

    def get_new_batch_prefill(self, running_batch):
        sparse = getattr(self.server_args, "sparse", None)
        if sparse is None or not sparse.enabled or not sparse.interleave_prefill:
            return original(self, running_batch)
        pacing = chunk_pacing_of(self)
        if pacing is not None:
            pacing.round_started(self.last_batch)
        pending = self.chunked_req is not None or len(self.waiting_queue) > 0
        if decode_goes_first(self.last_batch, running_batch, pending):
            runtime = runtime_of(self.token_to_kv_pool_allocator)
            if runtime is not None:
                runtime.stats.prefills_held += 1
            return NextBatchPlan(batch_to_run=None, running_batch=running_batch)
        if pacing is None or not pending or not decoding(running_batch):
            plan = original(self, running_batch)
        else:  # this round's chunk: what fits the target beside a decode step
            prefix = len(self.chunked_req.prefix_indices) if self.chunked_req is not None else 0
            chunk = agreed_across_tp(self, pacing.pacer.chunk_tokens(prefix))
            sglang_chunk, self.chunked_prefill_size = self.chunked_prefill_size, chunk
            try:
                plan = original(self, running_batch)
            finally:
                self.chunked_prefill_size = sglang_chunk
        if pacing is not None:
            pacing.formed(plan.batch_to_run)
        return plan

    return get_new_batch_prefill


@relies_on("sglang.srt.managers.scheduler:Scheduler.get_new_batch_prefill", at="sglang/srt/managers/scheduler.py:3067")
def patch_get_new_batch_prefill() -> None:
    """Make ``Scheduler.get_new_batch_prefill`` form no batch in the round after a prefill while
    requests decode, under ``--sparse-interleave-prefill`` (SGLang's loop then runs the decode step)."""
    from sglang.srt.managers.scheduler import Scheduler

    wrap_once(Scheduler, "get_new_batch_prefill", hold_prefill_for_decodes)
