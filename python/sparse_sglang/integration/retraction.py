"""A retracted request keeps its host KV: SGLang's ``release_req``, inserting into the radix tree.

When the host KV store runs short during decode, SGLang retracts running requests
(``ScheduleBatch.retract_decode`` → ``release_req``) and frees their KV, so a retracted request
prefills its whole prompt and output again when it comes back (SGLang's note at the call: "for
preempted requests, we may want to insert into the tree"). With the sparse hierarchy that KV is
already in host pages, with their summaries, so :func:`patch_release_req` inserts the request's
full pages into the radix tree instead, unlocked: coming back is a prefix hit that prefills only
its last partial page, and under pressure the tree evicts those pages like any cached prefix
(least recently used first), so the retraction still frees what the running requests need.
The working-set rule retracts through the same path (``admission.py``); the gate remembers the
retracted request's working set, which it asks for again when it comes back.
"""

from __future__ import annotations

from sparse_sglang.integration.admission import gate_of
from sparse_sglang.integration.registry import relies_on, wrap_once


@relies_on("sglang.srt.managers.schedule_batch:release_req", at="sglang/srt/managers/schedule_batch.py:1834")
def patch_release_req() -> None:
    """Make ``release_req`` insert a retracted request's KV into the radix tree (sparse on; SGLang's
    own path for HiSparse, PD decode servers and finished requests)."""
    from sglang.srt.environ import envs
    from sglang.srt.managers import schedule_batch
    from sglang.srt.mem_cache.common import evict_from_tree_cache, release_kv_cache

    def wrap(original):
        def release_req(*, req, remaing_req_count, server_args, req_to_token_pool, token_to_kv_pool_allocator,
                        tree_cache, hisparse_coordinator, offload_kv=True):  # fmt: skip
            sparse = getattr(server_args, "sparse", None)
            if (sparse is None or not sparse.enabled or hisparse_coordinator is not None or req.finished()
                    or server_args.disaggregation_mode == "decode"):  # fmt: skip
                return original(req=req, remaing_req_count=remaing_req_count, server_args=server_args,
                                req_to_token_pool=req_to_token_pool, token_to_kv_pool_allocator=token_to_kv_pool_allocator,
                                tree_cache=tree_cache, hisparse_coordinator=hisparse_coordinator, offload_kv=offload_kv)  # fmt: skip
            gate = gate_of(token_to_kv_pool_allocator)
            if gate is not None and req.req_pool_idx is not None:
                gate.note_retracted(req.rid, req.req_pool_idx)
            release_kv_cache(req, tree_cache, is_insert=True)
            # As SGLang does after a retraction: make room for the remaining requests' next steps
            # (the pages just inserted are the most recently used, so older prefixes go first).
            evict_from_tree_cache(tree_cache, remaing_req_count * envs.SGLANG_RETRACT_DECODE_STEPS.get())
            req.reset_for_retract()

        return release_req

    wrap_once(schedule_batch, "release_req", wrap)
