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
tokens), learned from the batches' times on the GPU
(:class:`~sparse_sglang.prefill.chunk_pacing.BatchTimer`, events around ``Scheduler.run_batch``).
Each rank times its own batches, so under tensor parallelism the ranks take the smallest of their
sizes.
"""

from __future__ import annotations

import logging

from sparse_sglang.integration.memory_pool import runtime_of
from sparse_sglang.integration.registry import relies_on, wrap_once
from sparse_sglang.integration.segmented_prefill import agreed_across_tp
from sparse_sglang.prefill.chunk_pacing import (
    CHUNK_WINDOW,
    MIN_CHUNKS,
    BatchTimer,
    ChunkPacer,
    ChunkShape,
    chunk_unit,
)

logger = logging.getLogger(__name__)

DECODE = "decode"  # BatchTimer's label of a decode step


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


def batch_label(batch):
    """What the pacer learns from ``batch``'s time: :data:`DECODE` for a decode step, the
    :class:`ChunkShape` of a prefill batch, None for anything else (not timed)."""
    mode = batch.forward_mode
    if mode.is_decode():
        return DECODE
    if mode.is_extend() and batch.extend_lens is not None:
        return ChunkShape.of(zip(batch.extend_lens, batch.prefix_lens))
    return None


def cuda_timing_event():
    import torch

    return torch.cuda.Event(enable_timing=True)


class InterleavedChunkPacing:
    """One scheduler's chunk pacing (``--sparse-tbt-target-ms`` with interleaved prefill): the
    timer over its batches and the pacer it teaches. The scheduler holds it as
    ``sparse_chunk_pacing``."""

    def __init__(self, target_ms: float, max_chunk_tokens: int, page_size: int, make_event=cuda_timing_event):
        self.pacer = ChunkPacer(target_ms / 1000, max_chunk_tokens, align=chunk_unit(page_size))
        self.timer = BatchTimer(make_event)
        self.chunks_timed = 0

    def learn(self) -> None:
        """Teach the pacer every batch the GPU has finished since the last call (no waiting)."""
        for label, seconds in self.timer.finished():
            if label is DECODE:
                self.pacer.note_decode(seconds)
                continue
            self.pacer.note_chunk(label, seconds)
            self.chunks_timed += 1
            if self.chunks_timed % CHUNK_WINDOW == MIN_CHUNKS:  # the first fit, then once a window
                logger.info(self.pacer.describe())


def interleaving(scheduler) -> bool:
    """Whether the scheduler runs ``--sparse-interleave-prefill`` (sparse decode on)."""
    sparse = getattr(scheduler.server_args, "sparse", None)
    return sparse is not None and sparse.enabled and sparse.interleave_prefill


@relies_on("sglang.srt.managers.scheduler:Scheduler.init_chunked_prefill", at="sglang/srt/managers/scheduler.py:1136")
def chunk_pacing_of(scheduler) -> InterleavedChunkPacing | None:
    """The scheduler's :class:`InterleavedChunkPacing` (made on first use, once its chunk size is
    final); None without interleaved prefill, ``--sparse-tbt-target-ms`` or chunked prefill
    (``server_args`` refuses the target without the other two)."""
    if not interleaving(scheduler):
        return None
    target = scheduler.server_args.sparse.tbt_target_ms
    if target is None or scheduler.chunked_prefill_size is None:
        return None
    pacing = getattr(scheduler, "sparse_chunk_pacing", None)
    if pacing is None:
        pacing = scheduler.sparse_chunk_pacing = InterleavedChunkPacing(
            target, scheduler.chunked_prefill_size, scheduler.page_size
        )
    return pacing


def hold_prefill_for_decodes(original):
    """``Scheduler.get_new_batch_prefill`` with the round after a prefill given to the decodes
    (under ``--sparse-interleave-prefill``; otherwise SGLang's)."""
    from sglang.srt.managers.schedule_batch import NextBatchPlan

    def get_new_batch_prefill(self, running_batch):
        if not interleaving(self):
            return original(self, running_batch)
        pacing = chunk_pacing_of(self)
        if pacing is not None:
            pacing.learn()
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
        return plan

    return get_new_batch_prefill


@relies_on("sglang.srt.managers.scheduler:Scheduler.get_new_batch_prefill", at="sglang/srt/managers/scheduler.py:3067")
def patch_get_new_batch_prefill() -> None:
    """Make ``Scheduler.get_new_batch_prefill`` form no batch in the round after a prefill while
    requests decode, under ``--sparse-interleave-prefill`` (SGLang's loop then runs the decode step)."""
    from sglang.srt.managers.scheduler import Scheduler

    wrap_once(Scheduler, "get_new_batch_prefill", hold_prefill_for_decodes)


def time_each_batch(original):
    """``Scheduler.run_batch`` between two events on the stream the batch runs on, for the chunk
    pacer (under ``--sparse-tbt-target-ms``; otherwise SGLang's, untouched)."""

    def run_batch(self, batch, *args, **kwargs):
        pacing = chunk_pacing_of(self)
        label = None if pacing is None else batch_label(batch)
        if label is None:
            return original(self, batch, *args, **kwargs)
        # the overlap loop launches forwards on its forward stream, the plain one on the current
        stream = self.forward_stream if self.enable_overlap else None
        start = pacing.timer.started(stream)
        result = original(self, batch, *args, **kwargs)
        pacing.timer.ended(label, start, stream)
        return result

    return run_batch


@relies_on("sglang.srt.managers.scheduler:Scheduler.run_batch", at="sglang/srt/managers/scheduler.py:3527")
def patch_run_batch() -> None:
    """Time ``Scheduler.run_batch``'s batches on the GPU for the chunk pacer."""
    from sglang.srt.managers.scheduler import Scheduler

    wrap_once(Scheduler, "run_batch", time_each_batch)
