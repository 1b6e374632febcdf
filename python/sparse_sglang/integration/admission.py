"""Working-set admission inside SGLang's prefill admission (``PrefillAdder.add_one_req``).

SGLang's scheduler forms each prefill batch by asking a ``PrefillAdder`` to take waiting requests
in policy order until one does not fit its token budgets. The hook asks
:class:`~sparse_sglang.scheduler.WorkingSetGate` first: when one more request would not fit next
to the running requests' working sets in the GPU page cache, it answers ``OTHER`` (the batch
stops here, as for SGLang's own per-batch request cap, and the request is asked about again in
the next round), so a request waits instead of shrinking the running requests' cache rows below
what they use. Retention: ``ScheduleBatch.check_decode_mem``, SGLang's check before each decode
step that makes it retract requests while it fails, also fails while the running working sets
exceed the cache (:meth:`WorkingSetGate.keeps`), so SGLang's own retraction path retracts them
and re-queues them, their host KV kept as a radix-cached prefix (``retraction.py``).
``Scheduler.abort_request`` is hooked to count the queued requests aborted while the gate held the
queue (the soak's "aborted while queued by the working-set rule").
"""

from __future__ import annotations

from sparse_sglang.integration.memory_pool import runtime_of
from sparse_sglang.integration.registry import relies_on, wrap_once
from sparse_sglang.scheduler import WorkingSetGate


def gate_of(token_to_kv_pool_allocator) -> WorkingSetGate | None:
    """The working-set gate of the sparse runtime behind SGLang's token allocator (``None`` for
    another pool, or with admission by working sets off)."""
    runtime = runtime_of(token_to_kv_pool_allocator)
    return None if runtime is None else runtime.gate


@relies_on(
    "sglang.srt.managers.schedule_policy:PrefillAdder.add_one_req", at="sglang/srt/managers/schedule_policy.py:1059"
)
def patch_prefill_adder() -> None:
    """Make ``PrefillAdder.add_one_req`` defer a request the KV pool's working-set gate does not admit."""
    from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder

    def wrap(original):
        def add_one_req(self, req, has_chunked_req, truncation_align_size):
            gate = gate_of(self.token_to_kv_pool_allocator)
            if gate is not None:
                running = [r.req_pool_idx for r in self.running_batch.reqs if r.req_pool_idx is not None]
                if not gate.admits(running, starting=len(self.can_run_list), rid=req.rid):
                    return AddReqResult.OTHER
            return original(self, req, has_chunked_req, truncation_align_size)

        return add_one_req

    wrap_once(PrefillAdder, "add_one_req", wrap)


@relies_on(
    "sglang.srt.managers.schedule_batch:ScheduleBatch.check_decode_mem", at="sglang/srt/managers/schedule_batch.py:2727"
)
def patch_check_decode_mem() -> None:
    """Make ``ScheduleBatch.check_decode_mem`` also ask :meth:`WorkingSetGate.keeps` whether the
    running requests (those ``selected_indices`` keeps, during a retraction) fit the GPU cache."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    def wrap(original):
        def check_decode_mem(self, selected_indices=None):
            fits = original(self, selected_indices=selected_indices)
            gate = gate_of(self.token_to_kv_pool_allocator)
            if not fits or gate is None:
                return fits
            reqs = self.reqs if selected_indices is None else [self.reqs[i] for i in selected_indices]
            return gate.keeps([r.req_pool_idx for r in reqs if r.req_pool_idx is not None])

        return check_decode_mem

    wrap_once(ScheduleBatch, "check_decode_mem", wrap)


def queued_aborts(waiting_queue, abort) -> list:
    """Rids of the waiting requests an ``AbortReq`` removes (SGLang's rule: every one for
    ``abort_all``, else those whose rid starts with the abort's rid)."""
    return [req.rid for req in waiting_queue if abort.abort_all or req.rid.startswith(abort.rid)]


@relies_on("sglang.srt.managers.scheduler:Scheduler.abort_request", at="sglang/srt/managers/scheduler.py:4326")
def patch_abort_request() -> None:
    """Make ``Scheduler.abort_request`` tell the KV pool's working-set gate which waiting requests
    it aborts (SGLang pops those whose rid starts with the abort's rid, or all of them)."""
    from sglang.srt.managers.scheduler import Scheduler

    def wrap(original):
        def abort_request(self, recv_req):
            gate = gate_of(self.token_to_kv_pool_allocator)
            if gate is not None:
                gate.note_queued_aborts(queued_aborts(self.waiting_queue, recv_req))
            return original(self, recv_req)

        return abort_request

    wrap_once(Scheduler, "abort_request", wrap)
