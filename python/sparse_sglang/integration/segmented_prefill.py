"""Layer-segmented prefill in SGLang's scheduler loop (``--sparse-segmented-prefill``).

SGLang's normal loop runs one batch per iteration: a prefill batch if one can be formed, else a
decode step, so running decodes wait for every layer of every prefill chunk. With segmented
prefill the loop below replaces ``Scheduler.event_loop_normal``. While requests decode, a prefill
batch becomes a ``SPLIT_PREFILL`` batch, SGLang's layer-split forward (built for PD
multiplexing, ``forward_split_prefill``), and each iteration runs

1. one decode step of the running batch, then
2. the prefill's next layers, as many as ``--sparse-max-inject-tokens`` allows
   (:func:`~sparse_sglang.prefill.segments.next_segment_end`), or with ``--sparse-tbt-target-ms``
   as many as fit that time beside the decode step, from the periods the loop measures
   (:class:`~sparse_sglang.prefill.pacing.SegmentPacer`; under tensor parallelism every rank
   takes the smallest of the ranks' counts, :func:`agreed_across_tp`, since each measures its own
   clock and all must run the same layers).

The hidden states wait in the split batch's ``ForwardBatch`` between iterations; every layer's KV
has gone to the host by then (the ``sparse`` backend saves it as the layer runs), so the GPU holds
one layer's KV of the prompt. SGLang's chunked prefill still cuts prompts longer than
``--chunked-prefill-size`` into chunks, and each chunk is segmented: the paper's in-layer hybrid.
Without running decodes, or for a batch small enough to run all layers within the budget, an
iteration is SGLang's own.

When the last segment has run, the batch's result is processed as any prefill's and the batch
becomes ``last_batch``, so SGLang's next ``get_next_batch_to_run`` merges it into the running
batch (and continues a chunked request) as it does after a normal prefill. Keeping it as
``last_batch`` while it runs also lets ``abort_request`` find its requests; a split batch whose
every request was aborted stops at once and frees their host pages and request slots.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from sparse_sglang.integration.memory_pool import runtime_of
from sparse_sglang.integration.registry import relies_on, wrap_once
from sparse_sglang.prefill.pacing import SegmentPacer
from sparse_sglang.prefill.segments import layers_per_iteration, next_segment_end
from sparse_sglang.scheduler import max_over_ranks

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.scheduler import Scheduler

logger = logging.getLogger(__name__)


@relies_on("sglang.srt.managers.scheduler:Scheduler.init_model_worker", at="sglang/srt/managers/scheduler.py:974")
def agreed_across_tp(scheduler: Scheduler, value: int) -> int:
    """The smallest of ``value`` over the scheduler's tensor-parallel ranks (``value`` itself
    without TP). A choice a rank makes from its own clock (the pacer's layers) must be every
    rank's, or their forwards' collectives part ways: one all-reduce of one integer over SGLang's
    CPU group (``tp_cpu_group``, gloo), which ``init_model_worker`` sets up."""
    if scheduler.tp_group.world_size == 1:
        return value
    return -max_over_ranks(scheduler.tp_cpu_group)([-value])[0]


class SegmentedPrefillLoop:
    """SGLang's normal scheduler loop, with prefill batches run a layer segment per iteration."""

    def __init__(self, scheduler: Scheduler):
        model = scheduler.tp_worker.model_runner.model
        if not hasattr(model, "forward_split_prefill"):
            raise RuntimeError(f"--sparse-segmented-prefill: SGLang has no layer-split forward (forward_split_prefill) "
                               f"for {type(model).__name__}; serve it without the flag")  # fmt: skip
        self.scheduler = scheduler
        self.num_layers = scheduler.model_config.num_hidden_layers
        self.max_inject_tokens = scheduler.server_args.sparse.inject_tokens(self.num_layers)
        self.backend = scheduler.tp_worker.model_runner.attn_backend  # resumes the split batch's metadata
        self.runtime = runtime_of(scheduler.token_to_kv_pool_allocator)
        self.prefill: ScheduleBatch | None = None  # the split batch in flight
        self.stats = self.runtime.stats.segmented_prefill  # the runtime's; server info reports them
        target_ms = scheduler.server_args.sparse.tbt_target_ms
        self.pacer = None if target_ms is None else SegmentPacer(target_ms / 1000, self.max_inject_tokens)
        # The pacer's inputs: when the last decode step's result was read back, and the segment
        # launched since (its layers and its batch's new tokens).
        self.last_decode_end: float | None = None
        self.segment_since = (0, 0)
        # Scheduler.run_batch runs a SPLIT_PREFILL batch only under this flag (scheduler.py:3653).
        # dispatch_event_loop has chosen this loop already, and nothing else reads the
        # scheduler's copy after its __init__ (the model runner reads server_args' own).
        scheduler.enable_pdmux = True
        logger.info("layer-segmented prefill: at most %d token-layers per iteration next to decodes",
                    self.max_inject_tokens)  # fmt: skip

    def run_forever(self) -> None:
        while not self.scheduler.gracefully_exit:
            self.iterate()

    def iterate(self) -> None:
        s = self.scheduler
        s.process_input_requests(s.request_receiver.recv_requests())
        if s._engine_paused:
            return
        if self.prefill is None and not self._run_sglang_iteration():
            return
        self._run_segmented_iteration()

    def _run_sglang_iteration(self) -> bool:
        """One iteration of SGLang's normal loop, unless it forms a prefill batch to segment (then
        that batch is in flight and True is returned)."""
        s = self.scheduler
        plan = s.get_next_batch_to_run(running_batch=s.running_batch, last_batch=s.last_batch)
        s.running_batch = plan.running_batch
        batch = s.cur_batch_for_debug = plan.batch_to_run
        if batch is not None and self._should_segment(batch):
            batch.forward_mode = split_prefill_mode()
            batch.split_index, batch.split_prefill_finished = 0, False
            s.last_batch = batch  # where abort_request looks for requests in flight
            self.prefill = batch
            self.stats.prefills += 1
            return True
        if batch is not None:
            s.process_batch_result(batch, s.run_batch(batch))
            self._note_decode_end(batch.forward_mode.is_decode())
        else:
            s.on_idle()
            self._note_decode_end(False)
        s.last_batch = batch
        return False

    def _note_decode_end(self, decoded: bool) -> None:
        """A batch's result was read back: a decode step's (``decoded``) ends a period the pacer
        learns from; anything else (a whole prefill, an idle round) breaks the chain of periods."""
        if self.pacer is None:
            return
        now = time.perf_counter()
        if decoded and self.last_decode_end is not None:
            layers, tokens = self.segment_since
            self.pacer.note_period(now - self.last_decode_end, layers, tokens)
        self.last_decode_end = now if decoded else None
        self.segment_since = (0, 0)

    def _should_segment(self, batch: ScheduleBatch) -> bool:
        running = self.scheduler.running_batch
        if self.pacer is not None:
            self.pacer.start_batch()  # a new batch's first segment: from the cost measured so far
            layers = agreed_across_tp(self.scheduler, self.pacer.layers(batch.extend_num_tokens))
        else:
            layers = layers_per_iteration(batch.extend_num_tokens, self.max_inject_tokens)
        return (
            batch.forward_mode.is_extend()
            and not batch.forward_mode.is_decode()
            and running is not None
            and not running.is_empty()
            and not running.is_prefill_only
            and layers < self.num_layers
        )

    def _run_segmented_iteration(self) -> None:
        s, batch = self.scheduler, self.prefill
        running = s.running_batch
        decoded = False
        if not running.is_empty() and not running.is_prefill_only:
            running = s.running_batch = s.update_running_batch(running)
            if not running.is_empty():
                s.process_batch_result(running, s.run_batch(running))
                self.stats.decode_steps += 1
                decoded = True
        self._note_decode_end(decoded)  # a segment with no decode step before it: no period to learn from
        if all(req.finished() or req.to_finish is not None for req in batch.reqs):
            self._cancel(batch)
            return
        if self.pacer is None:
            end = next_segment_end(batch.split_index, batch.extend_num_tokens, self.num_layers, self.max_inject_tokens)
        else:
            layers = agreed_across_tp(s, self.pacer.layers(batch.extend_num_tokens))
            end = min(self.num_layers, batch.split_index + layers)
        if batch.split_index > 0:
            self.backend.resume_extend()
        batch.split_forward_count = end - batch.split_index
        result = s.run_batch(batch)
        self.segment_since = (end - batch.split_index, batch.extend_num_tokens)
        batch.split_index = end
        self.stats.segments += 1
        if end == self.num_layers:
            batch.split_prefill_finished = True
            s.process_batch_result(batch, result)
            batch.split_forward_batch = None  # its hidden states; the batch may live on as the running batch
            self.prefill = None  # stays last_batch: the next get_next_batch_to_run merges it

    def _cancel(self, batch: ScheduleBatch) -> None:
        """Stop a split batch whose requests were all aborted: free their host pages and request
        slots now, and tell the tokenizer, as SGLang does for an aborted chunked request."""
        from sglang.srt.managers.io_struct import AbortReq
        from sglang.srt.mem_cache.common import release_kv_cache

        s = self.scheduler
        for req in batch.reqs:
            if req is s.chunked_req:
                s.chunked_req = None
                s._pending_chunked_abort_req = None
            prepare_abort(req)
            release_kv_cache(req, s.tree_cache, is_insert=False)
            s.ipc_channels.send_to_tokenizer.send_output(AbortReq(rid=req.rid), req)
        self.runtime.store.wait_saves()  # the layers run so far may still be landing in the freed pages
        self.prefill = s.last_batch = None
        self.stats.cancelled += 1
        logger.info("layer-segmented prefill of %d request(s) aborted after %d of %d layers",
                    len(batch.reqs), batch.split_index, self.num_layers)  # fmt: skip


@relies_on(
    "sglang.srt.model_executor.forward_batch_info:ForwardMode", at="sglang/srt/model_executor/forward_batch_info.py:98"
)
def split_prefill_mode():
    """SGLang's forward mode of a batch run a few layers at a time."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return ForwardMode.SPLIT_PREFILL


@relies_on("sglang.srt.disaggregation.utils:prepare_abort", at="sglang/srt/disaggregation/utils.py:1237")
def prepare_abort(req) -> None:
    """Mark ``req`` finished by an abort (what SGLang does to an aborted chunked request)."""
    from sglang.srt.disaggregation.utils import prepare_abort as sglang_prepare_abort

    sglang_prepare_abort(req, "Aborted")
    req.to_finish = None


@relies_on("sglang.srt.managers.scheduler:Scheduler.event_loop_normal", at="sglang/srt/managers/scheduler.py:1681")
def patch_event_loop_normal() -> None:
    """Make ``Scheduler.event_loop_normal`` run :class:`SegmentedPrefillLoop` when
    ``--sparse-segmented-prefill`` is on (SGLang runs this loop with overlap scheduling off, which
    sparse decode always sets)."""
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.utils import DynamicGradMode

    def wrap(original):
        def event_loop_normal(self):
            sparse = getattr(self.server_args, "sparse", None)
            if sparse is None or not sparse.enabled or not sparse.segmented_prefill:
                return original(self)
            with DynamicGradMode():
                SegmentedPrefillLoop(self).run_forever()

        return event_loop_normal

    wrap_once(Scheduler, "event_loop_normal", wrap)
