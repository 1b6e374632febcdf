"""The sparse pools' counters in SGLang's server info (``GET /get_server_info``).

SGLang answers ``/get_server_info`` with each scheduler's ``get_internal_state``; the hook adds a
``"sparse"`` entry: the GPU page cache (slots, open rows, pages selected and loaded since start, hit
ratio, the slots the running requests used in the last ``--sparse-working-set-window`` steps),
bytes moved each way, host KV tokens used and free, request slots free, the radix tree's share of
the host store, and the decode steps that selected coarse-first. An idle server shows every pool
back at its idle value, which is what the soak benchmark checks.
"""

from __future__ import annotations

from sparse_sglang.integration.memory_pool import runtime_of
from sparse_sglang.integration.registry import relies_on, wrap_once


def sparse_state(scheduler, reset_hbm_peak: bool = False) -> dict | None:
    """The ``"sparse"`` entry for one scheduler (``None`` when it serves without sparse decode):
    its runtime's report (:meth:`~sparse_sglang.runtime.SparseRuntime.report`) and what SGLang's
    own pools say."""
    runtime = runtime_of(scheduler.token_to_kv_pool_allocator)
    if runtime is None:
        return None
    allocator, tree = scheduler.token_to_kv_pool_allocator, scheduler.tree_cache
    return {
        **runtime.report(runtime.config.working_set_window),
        "host_tokens": scheduler.max_total_num_tokens,
        "host_tokens_free": allocator.available_size(),
        "host_tokens_in_radix_cache": tree.evictable_size() + tree.protected_size(),
        # cached prefixes no running request holds: freed as new requests need the room
        "host_tokens_evictable": tree.evictable_size(),
        # cached prefixes running requests hold now: pages the tree and a request share
        "host_pages_shared": tree.protected_size() // scheduler.server_args.page_size,
        "request_slots": scheduler.req_to_token_pool.size,
        "request_slots_free": scheduler.req_to_token_pool.available_size(),
        **hbm_state(reset_hbm_peak),
    }


def hbm_state(reset_peak: bool) -> dict:
    """This process's GPU memory (torch's allocator): allocated now, and the peak since the last
    reset. ``/get_server_info`` resets it after reading (a benchmark reads once before and once
    after what it measures); the periodic metrics read it without resetting."""
    import torch

    if not torch.cuda.is_available():
        return {}
    peak = torch.cuda.max_memory_allocated()
    if reset_peak:
        torch.cuda.reset_peak_memory_stats()
    return {"hbm_allocated_bytes": torch.cuda.memory_allocated(), "hbm_peak_bytes_since_last_report": peak}


@relies_on("sglang.srt.managers.scheduler:Scheduler.get_internal_state", at="sglang/srt/managers/scheduler.py:4165")
def patch_get_internal_state() -> None:
    """Make ``Scheduler.get_internal_state`` report :func:`sparse_state` under ``"sparse"``."""
    from sglang.srt.managers.scheduler import Scheduler

    def wrap(original):
        def get_internal_state(self, recv_req):
            out = original(self, recv_req)
            try:  # a failing report must not take the scheduler down
                state = sparse_state(self, reset_hbm_peak=True)
            except Exception as err:
                state = {"error": repr(err)}
            if state is not None and self.ps.tp_size > 1:  # every rank gathers, a failed report included
                state = with_tp_ranks(state, gather_over(self.tp_cpu_group))
            if state is not None:
                out.internal_state["sparse"] = state
            return out

        return get_internal_state

    wrap_once(Scheduler, "get_internal_state", wrap)


def gather_over(group):
    """Each rank's object, in rank order, from every rank of the (gloo, CPU) process ``group``.
    Every rank reaches the call: SGLang broadcasts each control request to the whole TP group,
    and every rank answers it in the same order."""
    import torch.distributed as dist

    def gather(obj) -> list:
        out = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, obj, group=group)
        return out

    return gather


def with_tp_ranks(state: dict, gather) -> dict:
    """Under tensor parallelism, rank 0's ``"sparse"`` entry (what answers the request) given
    ``"tp_ranks"``, every rank's entry in rank order, and ``"tp_total"``, their sum
    (:func:`summed`). Each rank holds its own kv heads of every token, so a token counts once per
    rank in the token fields of the sum; bytes and pages add up as they are."""
    ranks = gather(state)
    return {**state, "tp_ranks": ranks, "tp_total": summed(ranks)}


# Fields that do not add up over ranks or replicas (a ratio, a mean, a setting): left out of the total.
NOT_SUMMED = ("hit_ratio", "gpu_cache_row_width_mean", "working_set_window")


def replica_total(states: list[dict]) -> dict:
    """The server's sparse numbers over its data-parallel replicas: :func:`summed` over the
    replicas' ``"sparse"`` entries (each replica's ``"tp_total"`` where it has several ranks)."""
    entries = [s["sparse"] for s in states if isinstance(s.get("sparse"), dict)]
    return summed([e.get("tp_total", e) for e in entries])


def summed(entries: list[dict]) -> dict:
    """Each numeric field of ``entries`` summed (ratios and settings left out: :data:`NOT_SUMMED`)."""
    total = {}
    for key in entries[0] if entries else ():
        values = [e.get(key) for e in entries]
        if key not in NOT_SUMMED and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            total[key] = sum(values)
    return total


@relies_on("sglang.srt.managers.tokenizer_control_mixin:TokenizerControlMixin.get_internal_state",
           at="sglang/srt/managers/tokenizer_control_mixin.py:830")  # fmt: skip
def patch_tokenizer_get_internal_state() -> None:
    """With several data-parallel replicas, ``/get_server_info``'s ``internal_states`` (one per
    replica, each with its ``"sparse"`` entry) also carry ``"sparse_total"``, the same in each:
    :func:`replica_total`."""
    from sglang.srt.managers.tokenizer_control_mixin import TokenizerControlMixin

    def wrap(original):
        async def get_internal_state(self):
            return with_replica_total(await original(self))

        return get_internal_state

    wrap_once(TokenizerControlMixin, "get_internal_state", wrap)


def with_replica_total(states: list[dict]) -> list[dict]:
    """``states`` (one per replica), each given ``"sparse_total"`` (:func:`replica_total`) when
    there are several replicas serving sparse."""
    if len(states) > 1 and any("sparse" in s for s in states):
        total = replica_total(states)
        for state in states:
            state["sparse_total"] = total
    return states
