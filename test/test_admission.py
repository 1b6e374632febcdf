"""CPU tests of working-set admission: the tracker against a plain-Python (sets) reference on
random selection streams, and the admission policy's rules, progress and starvation freedom."""

from __future__ import annotations

import random

import pytest
import torch

from sparse_sglang.scheduler import AdmissionPolicy, Running, Waiting, WorkingSetTracker, prefill_pages

# Working-set tracker.


def test_prefill_pages_counts_partial_pages_per_layer_and_head():
    assert prefill_pages(32, 4, 8, 32) == 1 * 4 * 8
    assert prefill_pages(33, 4, 8, 32) == 2 * 4 * 8
    assert prefill_pages(0, 4, 8, 32) == 0


def test_tracker_matches_set_reference_on_random_streams():
    rng = random.Random(0)
    max_req, layers, heads, k, window, pages = 6, 3, 2, 4, 3, 12
    ws = WorkingSetTracker(max_req, layers, heads, k, window)
    history: dict[int, dict[tuple[int, int, int], set[int]]] = {r: {} for r in range(max_req)}  # (step, layer, head)

    def reference(slot: int, step: int) -> int:
        total = 0
        for layer in range(layers):
            for head in range(heads):
                union = set()
                for s in range(step - window + 1, step + 1):
                    union |= history[slot].get((s, layer, head), set())
                total += len(union)
        return total

    for step in range(1, 80):
        ws.next_step()
        batch = rng.sample(range(max_req), rng.randint(0, max_req))
        slots = torch.tensor(batch + [-1], dtype=torch.int64)  # a padded row too
        for layer in rng.sample(range(layers), rng.randint(1, layers)):
            width = rng.randint(1, k)
            gen = torch.Generator().manual_seed(step * 10 + layer)
            ids = torch.randint(-1, pages, (len(batch) + 1, heads, width), generator=gen)
            ws.record(slots, layer, ids)
            for i, r in enumerate(batch):
                for head in range(heads):
                    history[r][(step, layer, head)] = {p for p in ids[i, head].tolist() if p >= 0}
        if rng.random() < 0.1:
            gone = rng.randrange(max_req)
            ws.forget(gone)
            history[gone].clear()
        want = [reference(r, step) for r in range(max_req)]
        assert ws.sizes().tolist() == want, step
        assert ws.sizes(torch.arange(max_req), num_pages=pages).tolist() == want, step  # the bitmap count
        some = rng.sample(range(max_req), 3)
        assert ws.sizes(torch.tensor(some)).tolist() == [want[r] for r in some]


def test_tracker_counts_repeated_pages_once_and_forgets_after_the_window():
    ws = WorkingSetTracker(2, 1, 1, 2, window=2)
    page = torch.tensor([[[5, 7]]])
    ws.record(torch.tensor([0]), 0, page)
    ws.next_step()
    ws.record(torch.tensor([0]), 0, torch.tensor([[[7, 9]]]))
    assert ws.sizes().tolist() == [3, 0]  # {5, 7, 9}
    ws.next_step()
    assert ws.sizes().tolist() == [2, 0]  # {7, 9}: step 0 left the window
    ws.next_step()
    assert ws.sizes().tolist() == [0, 0]


# Admission policy.


def run(rid, arrival, ws):
    return Running(rid, arrival, ws)


def wait(rid, arrival, ws, host=0):
    return Waiting(rid, arrival, ws, host)


def test_running_over_budget_retracts_newest_first_and_admits_nothing():
    policy = AdmissionPolicy(gpu_budget_pages=100, host_total_pages=1000)
    d = policy.decide([run("c", 3, 30), run("a", 1, 40), run("b", 2, 40), run("d", 4, 5)], [wait("e", 5, 1)], 1000)
    assert d.keep == ["a", "b"] and d.retract == ["d", "c"]  # d would fit, but it is newer than c
    assert d.admit == [] and d.defer == ["e"] and d.working_set_pages == 80 and not d.forced


def test_oldest_running_request_is_kept_alone_over_budget():
    policy = AdmissionPolicy(100, 1000)
    d = policy.decide([run("a", 1, 150), run("b", 2, 10)], [], 1000)
    assert d.keep == ["a"] and d.retract == ["b"] and d.forced


def test_nothing_running_admits_the_head_even_over_budget():
    policy = AdmissionPolicy(100, 1000)
    d = policy.decide([], [wait("big", 1, 500, 10), wait("small", 2, 5, 10)], 1000)
    assert d.admit == ["big"] and d.defer == ["small"] and d.forced and d.working_set_pages == 500


def test_refuses_what_never_fits_the_host_and_defers_what_fits_later():
    policy = AdmissionPolicy(100, host_total_pages=50)
    queue = [wait("huge", 2, 10, 51), wait("later", 3, 10, 40), wait("next", 4, 1, 1)]
    d = policy.decide([run("a", 1, 10)], queue, host_free_pages=30)
    assert (
        list(d.refuse) == ["huge"]
        and "51 host KV pages" in d.refuse["huge"]
        and "--sparse-host-cache-gb" in d.refuse["huge"]
    )
    assert d.defer == ["later", "next"] and d.admit == []  # "next" fits but must not overtake "later"
    d = policy.decide([run("a", 1, 10)], [wait("later", 3, 10, 40), wait("next", 4, 1, 1)], host_free_pages=45)
    assert d.admit == ["later", "next"] and d.defer == []
    assert (
        policy.stats.refused == 1
        and policy.stats.deferred == 2
        and policy.stats.admitted == 2
        and policy.stats.rounds == 2
    )


def test_decisions_obey_the_rules_on_random_inputs():
    rng = random.Random(1)
    for _ in range(500):
        budget, host_total = rng.randint(1, 200), rng.randint(1, 100)
        policy = AdmissionPolicy(budget, host_total)
        arrivals = rng.sample(range(1000), 12)
        running = [run(f"r{i}", arrivals[i], rng.randint(0, 80)) for i in range(rng.randint(0, 6))]
        waiting = [
            wait(f"w{i}", arrivals[6 + i], rng.randint(0, 80), rng.randint(0, 120)) for i in range(rng.randint(0, 6))
        ]
        host_free = rng.randint(0, host_total)
        d = policy.decide(running, waiting, host_free)
        ws = {x.rid: x.working_set_pages for x in running + waiting}

        by_age = [r.rid for r in sorted(running, key=lambda r: r.arrival)]
        assert d.keep + d.retract[::-1] == by_age  # kept: oldest prefix; retracted: the rest, newest first
        assert bool(running) == bool(d.keep)  # never retracts everything
        eligible = [w for w in sorted(waiting, key=lambda w: w.arrival) if w.host_pages <= host_total]
        assert set(d.refuse) == {w.rid for w in waiting} - {w.rid for w in eligible}
        assert d.admit + d.defer == [w.rid for w in eligible]  # strict FCFS: admitted is a prefix
        assert d.working_set_pages == sum(ws[r] for r in d.keep + d.admit)
        assert sum(w.host_pages for w in eligible if w.rid in d.admit) <= host_free
        alone = len(d.keep + d.admit) == 1
        assert d.working_set_pages <= budget or alone
        assert d.forced == (d.working_set_pages > budget)
        if d.retract:
            assert not d.admit and sum(ws[r] for r in d.keep) + ws[d.retract[-1]] > budget
        elif d.defer:  # the first deferred request really did not fit
            head = next(w for w in eligible if w.rid == d.defer[0])
            used_host = sum(w.host_pages for w in eligible if w.rid in d.admit)
            no_room = d.working_set_pages + head.working_set_pages > budget and (d.keep or d.admit)
            assert no_room or head.host_pages > host_free - used_host


def greedy_decide(budget, running, waiting):
    """A bypassing policy for contrast: admit any waiting request that fits, in arrival order."""
    used, admit = sum(r.working_set_pages for r in running), []
    for w in sorted(waiting, key=lambda w: w.arrival):
        if used + w.working_set_pages <= budget:
            admit.append(w.rid)
            used += w.working_set_pages
    return admit


@pytest.mark.parametrize("policy_name", ["fcfs", "greedy"])
def test_a_long_request_behind_a_stream_of_short_ones(policy_name):
    """One request with a 60-page working set arrives behind a steady stream of 10-page requests
    that each run 8 steps (one arrives per step). Greedy bypass keeps ~80 of the 100 pages busy
    with short requests forever, so the long one starves; strict FCFS admits it within a few steps."""
    budget, short_ws, short_steps = 100, 10, 8
    policy = AdmissionPolicy(budget, host_total_pages=10**6)
    running: dict[str, tuple[Running, int]] = {}  # rid -> (request, finish step)
    waiting: list[Waiting] = []
    long_started = None
    for step in range(200):
        running = {rid: v for rid, v in running.items() if v[1] > step}
        waiting.append(wait(f"s{step}", step, short_ws))
        if step == 10:
            waiting.append(wait("long", 10.5, 60))
        reqs = [r for r, _ in running.values()]
        if policy_name == "fcfs":
            d = policy.decide(reqs, waiting, host_free_pages=10**6)
            assert not d.retract
            admitted = d.admit
        else:
            admitted = greedy_decide(budget, reqs, waiting)
        for w in [w for w in waiting if w.rid in admitted]:
            running[w.rid] = (
                run(w.rid, w.arrival, w.working_set_pages),
                step + (50 if w.rid == "long" else short_steps),
            )
            if w.rid == "long":
                long_started = step
        waiting = [w for w in waiting if w.rid not in admitted]
        assert sum(r.working_set_pages for r, _ in running.values()) <= budget
    if policy_name == "greedy":
        assert long_started is None  # the scenario does starve a bypassing policy
    else:
        assert long_started is not None and long_started - 10 <= short_steps
        assert len(waiting) < 60  # and the short stream drains again once it runs


# The gate SGLang's prefill admission asks (integration/admission.py), over a real page cache.


def _gate_with_tracker(num_slots=32):
    """A cache of ``num_slots`` slots on 2 layers x 2 heads (narrowest row 2 pages = 8 slots) and a
    tracker whose working sets the test sets by recording selections of ``n`` distinct pages."""
    from sparse_sglang.mem_cache import GPUPageCache
    from sparse_sglang.scheduler import WorkingSetGate

    cache = GPUPageCache(num_slots, 2, 2, 4, 16, torch.bfloat16, max_requests=6, row_width=4, max_pages=16,
                         total_pages=32, min_row_width=2)  # fmt: skip
    tracker = WorkingSetTracker(6, 2, 2, 4, window=3)
    return cache, tracker, WorkingSetGate(cache, tracker)


def _select(tracker, pages_per_slot: dict[int, int]) -> None:
    """One decode step: request slot s selects pages [0, n) in every layer and head (n <= 4)."""
    slots = list(pages_per_slot)
    sel = torch.full((len(slots), 2, 2, 4), -1, dtype=torch.int32)
    for i, s in enumerate(slots):
        sel[i, ..., : pages_per_slot[s]] = torch.arange(pages_per_slot[s], dtype=torch.int32)
    tracker.record_step(torch.tensor(slots), sel)
    tracker.publish(slots)


def test_gate_admits_while_working_sets_and_a_narrowest_row_per_new_request_fit_the_cache():
    cache, tracker, gate = _gate_with_tracker(num_slots=32)  # narrowest row 8 slots: room for 4
    assert gate.admits([], starting=0)
    for r in (1, 2):
        cache.open_request(r, 16)
    # Requests with no step yet count as narrowest rows (8 slots each): 16 + 8 per starting request fits 32 twice.
    assert gate.admits([1, 2], starting=0) and gate.admits([1, 2], starting=1)
    assert not gate.admits([1, 2], starting=2)
    _select(tracker, {1: 4, 2: 1})  # request 1 selects 16 slots' worth, request 2 less than a row
    assert gate.demand([1, 2]) == [16, 8]  # 16 + 8 + a new narrow row = 32 still fits
    assert gate.admits([1, 2], starting=0) and not gate.admits([1, 2], starting=1)
    _select(tracker, {1: 4, 2: 4})  # both use whole rows: nothing more fits
    assert not gate.admits([1, 2], starting=0)
    gate.note_queued_aborts(["a", "b"])  # the queue waits for room: aborts of queued requests count
    for _ in range(3):  # the window passes without selections: the working sets drain
        tracker.next_step()
    tracker.publish([1, 2])
    assert gate.demand([1, 2]) == [8, 8] and gate.admits([1, 2], starting=0)
    assert (gate.counts.admitted, gate.counts.deferred) == (5, 3)
    gate.note_queued_aborts(["c"])  # the last answer admitted: the queue is not held
    assert gate.counts.aborted_while_holding == 2


def _answer_of_a_fresh_policy(capacity, demand, row, starting, candidate_pages):
    """What the gate answered before it kept one policy: a fresh ``AdmissionPolicy`` per question,
    this round's earlier admissions waiting (a narrowest row each) ahead of the candidate."""
    running = [Running(i, i, pages) for i, pages in enumerate(demand)]
    waiting = [Waiting(("new", j), len(running) + j, row, 0) for j in range(starting)]
    waiting.append(Waiting(("new", starting), len(running) + starting, candidate_pages, 0))
    return waiting[-1].rid in AdmissionPolicy(capacity, host_total_pages=1).decide(running, waiting, 0).admit


def test_gate_keeps_one_policy_and_answers_as_a_fresh_policy_per_question_did():
    from types import SimpleNamespace

    from sparse_sglang.scheduler import WorkingSetGate

    rng, yes = random.Random(7), 0
    for _ in range(50):
        cache = SimpleNamespace(num_slots=rng.randint(1, 120), row_slots=rng.randint(1, 16))
        published: dict[int, int] = {}
        gate = WorkingSetGate(cache, SimpleNamespace(published=lambda published=published: published))
        policy, answers = gate.policy, []
        for question in range(40):
            slots = rng.sample(range(12), rng.randint(0, 6))
            published.clear()
            published.update({s: rng.randint(0, 40) for s in rng.sample(slots, len(slots) // 2)})
            rid, starting = f"r{question % 5}", rng.randint(0, 4)
            if rng.random() < 0.3:
                gate.resume_pages[rid] = rng.randint(0, 60)
            candidate_pages = gate.resume_pages.get(rid, cache.row_slots)
            demand = [max(published.get(s, 0), cache.row_slots) for s in slots]
            want = _answer_of_a_fresh_policy(cache.num_slots, demand, cache.row_slots, starting, candidate_pages)
            answers.append(gate.admits(slots, starting, rid=rid))
            assert answers[-1] == want
            assert gate.holding == (not want) and not (want and rid in gate.resume_pages)  # admitted: forgotten
        assert gate.policy is policy  # built once
        stats = gate.counts.admission
        assert stats is policy.stats and stats.rounds == len(answers) and stats.refused == 0
        assert (gate.counts.admitted, gate.counts.deferred) == (sum(answers), len(answers) - sum(answers))
        yes += sum(answers)
    assert 0.2 < yes / (50 * 40) < 0.8  # both answers are exercised


def test_queued_aborts_follow_sglangs_rid_prefix_rule():
    from types import SimpleNamespace

    from sglang.srt.managers.io_struct import AbortReq

    from sparse_sglang.integration.admission import queued_aborts

    queue = [SimpleNamespace(rid=rid) for rid in ("a-1", "a-2", "b-1")]
    assert queued_aborts(queue, AbortReq(rid="a-")) == ["a-1", "a-2"] and queued_aborts(queue, AbortReq(rid="b-1")) == [
        "b-1"
    ]
    assert queued_aborts(queue, AbortReq(rid="c")) == [] and len(queued_aborts(queue, AbortReq(abort_all=True))) == 3


def test_prefill_adder_defers_a_request_the_gate_does_not_admit():
    from types import SimpleNamespace

    from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder

    from sparse_sglang.integration.admission import patch_prefill_adder

    class Refusing:
        def admits(self, running_slots, starting, rid=None):
            self.asked = (running_slots, starting, rid)
            return False

    patch_prefill_adder()
    gate = Refusing()
    adder = SimpleNamespace(
        running_batch=SimpleNamespace(reqs=[SimpleNamespace(req_pool_idx=3)]), can_run_list=[object()],
        token_to_kv_pool_allocator=allocator_of_pool_with(gate),
    )  # fmt: skip
    assert PrefillAdder.add_one_req(adder, SimpleNamespace(rid="r7"), False, None) == AddReqResult.OTHER
    assert gate.asked == ([3], 1, "r7")


def allocator_of_pool_with(gate):
    """A stand-in of SGLang's token allocator handing out a sparse KV pool whose runtime owns ``gate``."""
    from types import SimpleNamespace

    pool = SimpleNamespace(runtime=SimpleNamespace(gate=gate))
    return SimpleNamespace(get_kvcache=lambda: pool)


def test_the_gate_is_the_one_the_kv_pools_runtime_owns():
    from types import SimpleNamespace

    from sparse_sglang.integration.admission import gate_of

    gate = object()
    assert gate_of(allocator_of_pool_with(gate)) is gate
    assert gate_of(allocator_of_pool_with(None)) is None  # admission by working sets off
    assert gate_of(SimpleNamespace(get_kvcache=lambda: SimpleNamespace())) is None  # SGLang's own pool
    assert gate_of(None) is None


def test_record_step_is_the_per_layer_record_of_a_whole_step():
    by_layer, by_step = WorkingSetTracker(4, 3, 2, 5, window=2), WorkingSetTracker(4, 3, 2, 5, window=2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        slots = torch.tensor([2, -1, 0])
        step = torch.randint(-1, 9, (3, 3, 2, 4), generator=gen)
        by_layer.next_step()
        for layer in range(3):
            by_layer.record(slots, layer, step[:, layer])
        by_step.record_step(slots, step)
        by_step.publish([0, 2])
        assert by_step.published() == dict(zip([0, 2], by_step.sizes(torch.tensor([0, 2])).tolist()))
    assert by_layer.sizes().tolist() == by_step.sizes().tolist()
    assert by_step.sizes(num_pages=4).tolist() == [
        sum(
            len({p for p in by_step.ring[r, :, layer, head].flatten().tolist() if 0 <= p < 4})
            for layer in range(3)
            for head in range(2)
        )
        for r in range(4)
    ]  # ids past num_pages count as none


def test_gate_with_tracker_retracts_while_true_working_sets_overflow_and_readmits_by_the_remembered_set():
    cache, tracker, gate = _gate_with_tracker(num_slots=32)
    _select(tracker, {1: 2, 2: 2, 3: 2})  # 8 slots each (a narrowest row): 24 of 32
    assert gate.demand([1, 2, 3]) == [8, 8, 8] and gate.keeps([1, 2, 3]) and gate.keeps([1])
    _select(tracker, {1: 4, 2: 4, 3: 4})  # each now selects 4 pages per (layer, head): 16 slots
    assert gate.demand([1, 2, 3]) == [16, 16, 16]
    assert not gate.keeps([1, 2, 3]) and gate.keeps([1, 2]) and gate.keeps([3])  # one alone always stays
    assert gate.counts.retracted == 1
    gate.note_retracted("r3", 3)  # SGLang retracts request slot 3 (rid "r3")
    assert gate.resume_pages == {"r3": 16}
    # Back in the queue it asks for its 16 slots, not a narrowest row: no room next to 32 used.
    assert not gate.admits([1, 2], starting=0, rid="r3") and gate.admits([1], starting=0, rid="r3")
    assert gate.resume_pages == {}  # admitted: forgotten
    gate.note_retracted("r4", 4)
    gate.note_queued_aborts(["r4"])  # aborted while waiting: forgotten too
    assert gate.resume_pages == {}


def test_sglangs_retraction_loop_retracts_until_the_working_sets_fit():
    """SGLang's own ``ScheduleBatch.retract_decode`` (its order: fewest output tokens kept last),
    with the patched ``check_decode_mem`` and a KV pool that has room: it retracts the requests the
    working-set rule cannot keep, one at a time, and keeps the rest."""
    from types import SimpleNamespace

    from sglang.srt.managers.schedule_batch import ScheduleBatch

    from sparse_sglang.integration.admission import patch_check_decode_mem

    patch_check_decode_mem()
    cache, tracker, gate = _gate_with_tracker(num_slots=40)
    _select(tracker, {1: 4, 2: 4, 3: 4, 4: 2})  # 16 + 16 + 16 + 8 = 56 > 40
    reqs = [SimpleNamespace(rid=f"r{slot}", req_pool_idx=slot, output_ids=[0] * out, origin_input_ids=[0] * 100,
                            kv_committed_len=100 + out, sampling_params=SimpleNamespace(max_new_tokens=64))
            for slot, out in ((1, 9), (2, 5), (3, 3), (4, 1))]  # fmt: skip
    released = []
    batch = SimpleNamespace(
        reqs=reqs, tree_cache=None, spec_algorithm=SimpleNamespace(is_none=lambda: True),
        token_to_kv_pool_allocator=SimpleNamespace(page_size=32, available_size=lambda: 10_000,
                                                   get_kvcache=lambda: SimpleNamespace(runtime=SimpleNamespace(gate=gate))),
        _get_decode_retraction_order=ScheduleBatch._get_decode_retraction_order,
        release_req=lambda idx, remaining, args: released.append(reqs[idx].rid),
        filter_batch=lambda keep_indices: batch.__setattr__("reqs", [reqs[i] for i in keep_indices]),
    )  # fmt: skip
    batch.new_tokens_required_next_decode = lambda selected_indices=None: ScheduleBatch.new_tokens_required_next_decode(
        batch, selected_indices
    )
    batch.check_decode_mem = lambda selected_indices=None: ScheduleBatch.check_decode_mem(batch, selected_indices)
    assert not batch.check_decode_mem()  # what makes update_running_batch retract
    retracted, _, aborted = ScheduleBatch.retract_decode(batch, SimpleNamespace(retraction_policy="length"))
    # SGLang retracts the request with the fewest output tokens first: r4 (8 slots), then r3 (16).
    assert [r.rid for r in retracted] == released == ["r4", "r3"] and aborted == []
    assert [r.rid for r in batch.reqs] == ["r1", "r2"] and gate.counts.retracted == 2


# Tensor parallelism: each rank's gate sees its own kv heads' working sets and its own cache; the
# ranks must still answer every question alike (test_tp_ranks_agree...).


def _rank_decisions(rank: int, world: int, init_file: str, out) -> None:
    """One TP rank: a gate whose working sets (and cache size) differ from the other rank's, asked
    the same sequence of admission and retraction questions; its answers go to ``out``."""
    import torch.distributed as dist

    from sparse_sglang.mem_cache import GPUPageCache
    from sparse_sglang.scheduler import WorkingSetGate, max_over_ranks

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        num_slots = 48 if rank == 0 else 40  # ranks may size their caches differently
        cache = GPUPageCache(num_slots, 2, 2, 4, 16, torch.bfloat16, max_requests=6, row_width=4, max_pages=16,
                             total_pages=32, min_row_width=2)  # fmt: skip
        tracker = WorkingSetTracker(6, 2, 2, 4, window=3)
        gate = WorkingSetGate(cache, tracker, agree=max_over_ranks(dist.group.WORLD))
        for r in (1, 2):
            cache.open_request(r, 16)
        answers = [gate.admits([1, 2], starting=0), gate.admits([1, 2], starting=1), gate.admits([1, 2], starting=2)]
        # rank 0's request 1 selects whole rows, rank 1's request 2 does: different local demand
        _select(tracker, {1: 4, 2: 1} if rank == 0 else {1: 1, 2: 4})
        answers += [gate.demand([1, 2]), gate.admits([1, 2], starting=0), gate.admits([1, 2], starting=1)]
        answers += [gate.keeps([1, 2]), gate.keeps([1])]
        out.put((rank, answers))
    finally:
        dist.destroy_process_group()


def test_tp_ranks_with_different_local_working_sets_decide_alike(tmp_path):
    """Two ranks (processes, a gloo group) whose gates see different working sets and cache sizes
    give the same answers: each decides on the largest demand and the smallest cache over ranks,
    as one gate holding those numbers would."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank_decisions, args=(r, 2, str(tmp_path / "rendezvous"), out)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert results[0] == results[1], results
    # the agreed numbers: demand max(16, 8) and max(8, 16) pages, cache min(48, 40) = 40 slots
    admits, demand, after = results[0][:3], results[0][3], results[0][4:]
    assert admits == [True, True, True]  # 2 rows of 8 + 3 new rows = 40 slots: fits the smaller cache
    assert after[:2] == [True, False]  # 32 + a row = 40 fits, 32 + two rows does not (alone, rank 0 admits both)
    assert demand == [16, 16]
    assert after[2:] == [True, True]  # 32 <= 40: both stay


def test_each_tp_rank_keys_its_own_kv_heads_as_sglangs_qkv_projection_splits_them():
    from sparse_sglang.integration.memory_pool import rank_kv_heads

    assert [rank_kv_heads(8, 2, r) for r in range(2)] == [slice(0, 4), slice(4, 8)]
    assert [rank_kv_heads(8, 8, r) for r in range(8)] == [slice(r, r + 1) for r in range(8)]
    # more ranks than kv heads: each head is replicated on tp / heads consecutive ranks
    assert [rank_kv_heads(2, 8, r) for r in range(8)] == [slice(r // 4, r // 4 + 1) for r in range(8)]
    for bad in ((6, 4, 0), (3, 8, 0), (8, 2, 2)):
        with pytest.raises(ValueError):
            rank_kv_heads(*bad)
