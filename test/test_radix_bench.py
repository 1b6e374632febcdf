"""CPU tests of benchmark/radix.py: the shared-prefix workload, its arithmetic, and its client
against a stand-in of SGLang's /generate and /get_server_info that caches each group's prefix."""

from __future__ import annotations

import asyncio
import threading

import orjson
import pytest

from benchmark.radix import Workload, run_workload, slope, summarize
from sparse_sglang.config import GIB


def test_a_groups_requests_share_its_prefix_and_nothing_else():
    work = Workload(groups=2, per_group=3, prefix_tokens=40, question_tokens=8, output_tokens=4)
    a, b, other = work.prompt(0, 0), work.prompt(0, 1), work.prompt(1, 0)
    assert len(a) == 48 and a[:40] == b[:40] and a[40:] != b[40:] and a[:40] != other[:40]
    assert work.prompt(0, 1) == b  # the same ids on every run


def test_slope_is_the_least_squares_growth_per_group():
    assert slope([0, 10, 20, 30]) == pytest.approx(10) and slope([3, 5, 4]) == pytest.approx(0.5) and slope([7]) == 0


def test_client_measures_ttft_sharing_and_host_growth_against_a_caching_standin():
    from aiohttp import web

    from sparse_sglang.testing.server import standin_server

    work = Workload(groups=3, per_group=4, prefix_tokens=64, question_tokens=8, output_tokens=5)
    state = {"used": 0, "prefixes": set()}

    async def generate(request):
        body = await request.json()
        ids, new = body["input_ids"], body["sampling_params"]["max_new_tokens"]
        prefix = tuple(ids[: work.prefix_tokens])
        cached = work.prefix_tokens if prefix in state["prefixes"] else 0
        state["prefixes"].add(prefix)
        state["used"] += len(ids) - cached + new  # like the radix cache: the prefix once, the rest per request
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await asyncio.sleep(0.05 if cached else 0.2)  # a cached prefix starts sooner
        for n in range(1, new + 1):
            meta = {"completion_tokens": n, "cached_tokens": cached}
            await response.write(b"data: " + orjson.dumps({"meta_info": meta}) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    async def server_info(request):
        sparse = {"host_tokens": 10**6, "host_tokens_free": 10**6 - state["used"]}
        return web.json_response({"internal_states": [{"sparse": sparse}]})

    ready, stop, box = threading.Event(), None, {}

    def serve():  # its own loop: the client's host-memory reads block the loop they run on
        async def main():
            nonlocal stop
            stop = asyncio.Event()
            async with standin_server(
                [web.post("/generate", generate), web.get("/get_server_info", server_info)]
            ) as url:
                box["url"] = url
                ready.set()
                await stop.wait()

        box["loop"] = asyncio.new_event_loop()
        box["loop"].run_until_complete(main())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        run = asyncio.run(run_workload(box["url"], work))
    finally:
        box["loop"].call_soon_threadsafe(stop.set)
        thread.join(10)
    assert len(run["groups"]) == 3 and all(len(g["rest"]) == 2 for g in run["groups"])
    kv = 128 * 1024  # bytes per token of the 8B shape
    s = summarize(run, work, kv)
    assert s["cached_tokens_hit_median"] == 64 and s["ttft_ratio"] < 0.5
    assert s["host_gb_per_request"] * GIB / kv == pytest.approx(8 + 5)  # its question and output only
    assert s["host_gb_per_group"] * GIB / kv == pytest.approx(64 + 4 * (8 + 5))  # one prefix per group
    assert s["output_tokens_per_s"] == pytest.approx(3 * 4 * 5 / run["seconds"])
