"""The soak benchmark's pure parts: its request plan, its bad-request bodies, its leak accounting."""

import json

import pytest

from benchmark.soak import PAGE_SIZE, bad_requests, mixed_plan
from sparse_sglang.testing.server import leaks


def test_mixed_plan_is_seeded_poisson_with_log_uniform_prompts_and_a_share_aborted():
    plan = mixed_plan(2000, rate=4.0, abort_frac=0.3, seed=1)
    assert plan == mixed_plan(2000, rate=4.0, abort_frac=0.3, seed=1) != mixed_plan(2000, 4.0, 0.3, seed=2)
    assert len({r.rid for r in plan}) == 2000
    times = [r.send_at for r in plan]
    assert times == sorted(times) and times[-1] / 2000 == pytest.approx(1 / 4.0, rel=0.1)
    prompts = [r.prompt_tokens for r in plan]
    assert 1024 <= min(prompts) and max(prompts) <= 32768
    assert sum(p < 4096 for p in prompts) / 2000 == pytest.approx(0.4, abs=0.05)  # log-uniform: 2 of 5 doublings
    aborted = [r for r in plan if r.abort_after is not None]
    assert len(aborted) / 2000 == pytest.approx(0.3, abs=0.04)
    assert all(0 <= r.abort_after <= 1.5 * r.prompt_tokens / 15000 + 1 for r in aborted)
    assert all(16 <= r.new_tokens <= 128 for r in plan)


def test_bad_requests_cover_each_kind_of_bad_input():
    cases = bad_requests(context_len=131072, host_tokens=65536)
    assert set(cases) == {"longer_than_context", "negative_max_new_tokens", "malformed_json", "wrong_types",
                          "empty_prompt", "kv_exceeds_host_cache"}  # fmt: skip
    with pytest.raises(json.JSONDecodeError):
        json.loads(cases["malformed_json"])
    body = {name: json.loads(raw) for name, raw in cases.items() if name != "malformed_json"}
    assert len(body["longer_than_context"]["input_ids"]) > 131072
    assert 65536 < len(body["kv_exceeds_host_cache"]["input_ids"]) < 131072
    assert body["negative_max_new_tokens"]["sampling_params"]["max_new_tokens"] < 0
    assert not isinstance(body["wrong_types"]["input_ids"], list) and body["empty_prompt"]["input_ids"] == []
    # A host store larger than the context: no prompt the model takes can overflow it.
    assert "kv_exceeds_host_cache" not in bad_requests(context_len=8192, host_tokens=65536)


def test_leaks_compare_an_idle_server_with_the_fresh_one():
    fresh = {"gpu_cache_slots_free": 1000, "gpu_cache_rows_open": 0, "host_tokens_free": 65536, "request_slots_free": 8}
    assert leaks(fresh, dict(fresh)) == {"leaked_gpu_slots": 0, "leaked_gpu_rows": 0, "leaked_host_pages": 0,
                                         "leaked_request_slots": 0}  # fmt: skip
    held = {"gpu_cache_slots_free": 960, "gpu_cache_rows_open": 2, "host_tokens_free": 65536 - 3 * PAGE_SIZE,
            "request_slots_free": 6}  # fmt: skip
    assert leaks(fresh, held) == {"leaked_gpu_slots": 40, "leaked_gpu_rows": 2, "leaked_host_pages": 3,
                                  "leaked_request_slots": 2}  # fmt: skip


def test_the_client_sends_aborts_while_requests_run():
    """The soak client against a stand-in of SGLang's two routes it uses (the real server needs a
    GPU): a request aborted mid-flight ends as SGLang ends it (finish type "abort"), the rest run
    to their length, and the abort reaches the server while the request is still in flight."""
    import asyncio

    from aiohttp import web

    from benchmark.soak import SoakRequest, run_mixed
    from sparse_sglang.testing.server import standin_server

    aborted: dict[str, asyncio.Event] = {}

    async def generate(request):
        body = await request.json()
        event = aborted.setdefault(body["rid"], asyncio.Event())
        try:
            # room for the abort (sent 0.05 s in) to arrive, also on a loaded 2-core CI machine,
            # where 1 s was once not enough
            await asyncio.wait_for(event.wait(), timeout=3.0)
            finish = {"type": "abort", "message": "Abort in waiting queue"}
        except TimeoutError:
            finish = {"type": "length", "length": body["sampling_params"]["max_new_tokens"]}
        return web.json_response({"output_ids": [1], "meta_info": {"finish_reason": finish}})

    async def abort(request):
        aborted.setdefault((await request.json())["rid"], asyncio.Event()).set()
        return web.json_response({})

    async def main():
        plan = [SoakRequest(f"r{i}", 0.01 * i, 4000, 16, 0.05 if i % 2 else None) for i in range(150)]
        async with standin_server([web.post("/generate", generate), web.post("/abort_request", abort)]) as url:
            return await run_mixed(url, plan, timeout=30)

    results, crashers = asyncio.run(main())  # the stand-in and the client share one event loop
    assert len(results) == 150 and all(r["status"] == 200 for r in results) and crashers == []
    for r in results:
        assert r["abort_sent"] == (r["abort_after"] is not None)
        assert r["finish"]["type"] == ("abort" if r["abort_after"] is not None else "length"), r["rid"]


def test_summary_counts_aborts_by_finish_reason_and_where_they_landed():
    from benchmark.soak import summarize

    def request(abort_after, abort_sent, finish, status=200):
        return {"abort_after": abort_after, "abort_sent": abort_sent, "finish": finish, "status": status}

    idle = {"gpu_cache_slots_free": 10, "gpu_cache_rows_open": 0, "host_tokens_free": 640, "request_slots_free": 4,
            "segmented_prefill": {"cancelled": 1}, "working_set_aborted_while_waiting": 2}  # fmt: skip
    result = {
        "mixed": [
            request(None, False, {"type": "length", "length": 16}),
            request(0.5, False, {"type": "length", "length": 16}),  # finished before its abort moment
            request(0.1, True, {"type": "abort", "message": "Abort in waiting queue"}),
            request(0.9, True, {"type": "abort", "message": "Aborted"}),
            request(1.2, True, {"type": "length", "length": 16}),  # the abort crossed the finish
            request(None, False, None, status=503),
        ],
        "bad": {"empty_prompt": {"status": 400, "healthy_after": True}},
        "burst": [{"status": 200}],
        "idle_before": idle, "idle_after": dict(idle), "probe_fresh": [1, 2], "probe_after": [1, 2],
    }  # fmt: skip
    summary = summarize(result)
    assert summary["requests"] == 6 and summary["aborts_planned"] == 4
    assert (summary["aborted"], summary["aborted_while_queued"], summary["aborted_while_running"]) == (2, 1, 1)
    assert summary["abort_sent_after_completion"] == 1 and summary["completed"] == 3
    assert summary["errors_5xx"] == 1 and summary["bad_requests_4xx"] == "1/1" and summary["burst_completed"] == "1/1"
    assert summary["leaked_host_pages"] == 0 and summary["output_matches_fresh"] is True
    assert summary["aborted_while_waiting_for_working_set"] == 2 and summary["segmented_prefill"] == {"cancelled": 1}


def test_crashers_are_the_fuzzers_bad_requests_at_seeded_moments_of_the_phase():
    from benchmark import fuzz
    from benchmark.soak import crasher_plan

    plan = crasher_plan(40, 12.5, seed=3, vocab_size=49152, model="m")
    assert len(plan) == 40 and plan == crasher_plan(40, 12.5, seed=3, vocab_size=49152, model="m")
    assert all(case.kind in fuzz.BAD_KINDS and case.route in fuzz.ROUTES for _, case in plan)
    moments = [at for at, _ in plan]
    assert moments == sorted(moments) and 0.0 <= moments[0] and moments[-1] < 12.5
    assert len({case.kind for _, case in plan}) > 5  # many classes, not one


def test_crashers_go_out_beside_the_mixed_requests_and_their_5xx_count():
    """Through a stand-in whose routes refuse every crasher with a 400 except one it fails with a
    500: each crasher is sent to its own route, and the summary counts the 500 as an error."""
    import asyncio

    from aiohttp import web

    from benchmark import fuzz
    from benchmark.soak import SoakRequest, run_mixed, summarize
    from sparse_sglang.testing.server import standin_server

    seen: list[str] = []

    def route(path):
        async def handler(request):
            body = await request.read()
            seen.append(path)
            if b"input_ids" in body and b"rid" in body:  # a mixed-phase request
                return web.json_response({"output_ids": [1], "meta_info": {"finish_reason": {"type": "length"}}})
            return web.json_response({"error": "bad"}, status=500 if body == b"boom" else 400)

        return web.post(path, handler)

    crashers = [(0.01 * i, fuzz.FuzzCase("malformed_json", r, b"[]")) for i, r in enumerate(fuzz.ROUTES)]
    crashers.append((0.05, fuzz.FuzzCase("malformed_json", "/generate", b"boom")))

    async def main():
        plan = [SoakRequest(f"r{i}", 0.01 * i, 64, 4, None) for i in range(5)]
        async with standin_server([route(path) for path in fuzz.ROUTES]) as url:
            return await run_mixed(url, plan, timeout=30, crashers=crashers)

    mixed, crashed = asyncio.run(main())
    assert [r["status"] for r in mixed] == [200] * 5
    assert [(r["route"], r["status"]) for r in crashed] == [(r, 400) for r in fuzz.ROUTES] + [("/generate", 500)]
    assert sorted(set(seen)) == sorted(fuzz.ROUTES)
    idle = {"gpu_cache_slots_free": 1, "gpu_cache_rows_open": 0, "host_tokens_free": 64, "request_slots_free": 1}
    summary = summarize({"mixed": mixed, "crashers": crashed, "bad": {}, "burst": [], "idle_before": idle,
                         "idle_after": dict(idle), "probe_fresh": [1], "probe_after": [1]})  # fmt: skip
    assert (summary["crashers"], summary["crashers_4xx"], summary["crashers_5xx"], summary["errors_5xx"]) == (
        4,
        3,
        1,
        1,
    )
