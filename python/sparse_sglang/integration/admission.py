"""Working-set admission inside SGLang's prefill admission (``PrefillAdder.add_one_req``).

SGLang's scheduler forms each prefill batch by asking a ``PrefillAdder`` to take waiting requests
in policy order until one does not fit its token budgets. The hook asks
:class:`~sparse_sglang.scheduler.WorkingSetGate` first: when one more request would not fit next
to the running requests' working sets in the GPU page cache, it answers ``OTHER`` (the batch
stops here, as for SGLang's own per-batch request cap, and the request is asked about again in
the next round), so a request waits instead of shrinking the running requests' cache rows below
what they use.
"""

from __future__ import annotations

from sparse_sglang.integration.registry import relies_on, wrap_once
from sparse_sglang.scheduler import WorkingSetGate


@relies_on("sglang.srt.managers.schedule_policy:PrefillAdder.add_one_req", at="sglang/srt/managers/schedule_policy.py:1059")
def patch_prefill_adder() -> None:
    """Make ``PrefillAdder.add_one_req`` defer a request :data:`WorkingSetGate.current` does not admit."""
    from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder

    def wrap(original):
        def add_one_req(self, req, has_chunked_req, truncation_align_size):
            gate = WorkingSetGate.current
            if gate is not None:
                running = [r.req_pool_idx for r in self.running_batch.reqs if r.req_pool_idx is not None]
                if not gate.admits(running, starting=len(self.can_run_list)):
                    return AddReqResult.OTHER
            return original(self, req, has_chunked_req, truncation_align_size)

        return add_one_req

    wrap_once(PrefillAdder, "add_one_req", wrap)
