"""Soak: aborts, overload and bad input against the real sparse server; afterwards nothing leaked.

One server (Llama-3-8B shape, dummy weights, the default model's tokenizer so that every route takes
text, a small host cache), five phases:

1. **probe**: one greedy request on the fresh server; its tokens are the reference.
2. **mixed**: ``--requests`` requests, prompts log-uniform in 1K-32K tokens, 16-128 new tokens,
   Poisson arrivals at ``--rate``; ``--abort-frac`` of them get an abort (``POST /abort_request``)
   at a random moment: while queued, during prefill or during decode (with
   ``--extra-server-args "--sparse-segmented-prefill true"``, during layer-segmented prefill too:
   the summary's ``segmented_prefill`` counts the split batches those aborts stopped); an abort
   planned for after its request finished is not sent. Mixed in at random moments of the phase:
   ``--crashers`` bad requests of the fuzzer (``benchmark/fuzz.py``'s bad kinds, over its three
   routes: ids outside the vocabulary, NaN and huge numbers, specs that do not compile, bodies that
   are not JSON objects, ...), each of which must be refused with a 4xx or served, never a 5xx.
3. **bad input**: each malformed request must get an HTTP 4xx with a reason while the server keeps
   serving (a prompt longer than the context, one whose KV exceeds the host cache, negative
   ``max_new_tokens``, malformed JSON, wrong types, an empty prompt).
4. **host pressure**: a burst of ``--burst`` long requests whose KV together far exceeds the host
   cache: they queue and drain, none fails.
5. **idle**: the radix cache flushed, every pool is back at the value it had on the fresh server
   (GPU page-cache slots and rows, host KV tokens, request slots: ``GET /get_server_info``,
   ``internal_states[0]["sparse"]``), and the probe gives the same tokens again.

Writes ``benchmark/results/soak-<date>.json`` whose summary holds ``requests``, ``aborted``,
``errors_5xx`` (must be 0), ``leaked_host_pages``, ``leaked_gpu_slots`` (must be 0) and
``output_matches_fresh``::

    python -m benchmark.soak --requests 1000 --rate 8 --layers 4 --host-cache-gb 1.5 --request-timeout 300 \
        --extra-server-args "--cuda-graph-max-bs-decode 64 --sparse-segmented-prefill true \
        --sparse-working-set-admission true --sparse-gpu-cache-gb 0.25"
        # a soak of the small shape with the opt-in admission paths on (docs/results.md gives its run)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import requests

from benchmark import fuzz
from sparse_sglang.config import GIB, SparseConfig
from sparse_sglang.default_model import default_model_path
from sparse_sglang.testing.models import (
    LLAMA3_8B_CONFIG,
    LLAMA3_8B_KV_BYTES_PER_TOKEN,
    LLAMA3_8B_TOKEN_IDS,
    write_llama3_8b_dummy,
)
from sparse_sglang.testing.provenance import add_server_run_args, finish_run
from sparse_sglang.testing.server import (
    SPARSE_MODULE,
    ServerProcess,
    flush_cache,
    generate_ids,
    healthy,
    leaks,
    post_body,
    sparse_state,
    unpooled_session,
)

# Synthetic prompt ids: clear of the special tokens, inside the vocabulary of the tokenizer served
# (the default model's, which shrinks the 8B shape's vocabulary to its own)
TOKEN_IDS = (LLAMA3_8B_TOKEN_IDS[0], 40000)
PAGE_SIZE = SparseConfig().page_size  # the server's default --sparse-page-size


@dataclass(frozen=True)
class SoakRequest:
    rid: str
    send_at: float  # seconds after the phase starts
    prompt_tokens: int
    new_tokens: int
    abort_after: float | None  # seconds after sending; None = runs to the end


def mixed_plan(n: int, rate: float, abort_frac: float, seed: int, prompt_range=(1024, 32768),
               new_range=(16, 128), prefill_tokens_per_s: float = 15000.0) -> list[SoakRequest]:  # fmt: skip
    """The mixed phase: Poisson arrivals, log-uniform prompts; an aborted request's moment is drawn
    from zero (likely still queued) to past its expected prefill (likely decoding)."""
    rng = random.Random(seed)
    t, out = 0.0, []
    lo, hi = math.log(prompt_range[0]), math.log(prompt_range[1])
    for i in range(n):
        t += rng.expovariate(rate)
        prompt = int(math.exp(rng.uniform(lo, hi)))
        abort = None
        if rng.random() < abort_frac:
            abort = rng.uniform(0.0, 1.5 * prompt / prefill_tokens_per_s + 1.0)
        out.append(SoakRequest(f"soak-{seed}-{i}", t, prompt, rng.randint(*new_range), abort))
    return out


def bad_requests(context_len: int, host_tokens: int) -> dict[str, bytes]:
    """Request bodies the server must refuse with a 4xx (name -> raw JSON body)."""
    ids = list(range(TOKEN_IDS[0], TOKEN_IDS[0] + 8))
    greedy = {"max_new_tokens": 8, "temperature": 0}

    def body(**fields) -> bytes:
        return json.dumps(fields).encode()

    def prompt(n: int) -> list[int]:
        return [TOKEN_IDS[0] + i % (TOKEN_IDS[1] - TOKEN_IDS[0]) for i in range(n)]

    cases = {
        "longer_than_context": body(input_ids=prompt(context_len + 16), sampling_params=greedy),
        "negative_max_new_tokens": body(input_ids=ids, sampling_params={"max_new_tokens": -1}),
        "malformed_json": b'{"input_ids": [1000, 1001',
        "wrong_types": body(input_ids="not a list of ids", sampling_params={"temperature": "hot"}),
        "empty_prompt": body(input_ids=[], sampling_params=greedy),
    }
    if host_tokens + PAGE_SIZE < context_len:  # a prompt the model takes but the host store cannot hold
        cases["kv_exceeds_host_cache"] = body(input_ids=prompt(host_tokens + PAGE_SIZE), sampling_params=greedy)
    return cases


def prompt_ids(rid: str, n: int) -> list[int]:
    rng = random.Random(rid)
    return [rng.randrange(*TOKEN_IDS) for _ in range(n)]


def crasher_plan(n: int, span_s: float, seed: int, vocab_size: int, model: str) -> list[tuple[float, fuzz.FuzzCase]]:
    """``n`` of the fuzzer's bad requests (its seeded strategies, bad kinds only), each with a
    moment in ``[0, span_s)`` at which the mixed phase sends it."""
    cases: list[fuzz.FuzzCase] = []
    drawn = 0
    while len(cases) < n:
        more = fuzz.generate_cases(2 * (n - len(cases)) + 8, seed * 7919 + drawn, vocab_size, model)
        cases += [case for case in more if case.kind in fuzz.BAD_KINDS]
        drawn += 1
    rng = random.Random(seed)
    return sorted(((rng.uniform(0.0, span_s), case) for case in cases[:n]), key=lambda pair: pair[0])


async def run_mixed(url: str, plan: list[SoakRequest], timeout: float,
                    crashers: list[tuple[float, fuzz.FuzzCase]] = ()) -> tuple[list[dict], list[dict]]:  # fmt: skip
    """The mixed phase's requests (with their aborts) and, sent beside them, ``crashers``: one
    record per request of each."""
    async with unpooled_session() as session:
        start = time.monotonic()

        async def crasher(at: float, case: fuzz.FuzzCase) -> dict:
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            status, text = await post_body(session, url, case.body, timeout, case.route)
            return {"kind": case.kind, "route": case.route, "send_at": at, "status": status,
                    "error": None if status < 300 else text[:300]}  # fmt: skip

        async def one(r: SoakRequest) -> dict:
            await asyncio.sleep(max(0.0, start + r.send_at - time.monotonic()))
            params = {"max_new_tokens": r.new_tokens, "temperature": 0, "ignore_eos": True}
            body = json.dumps(
                {"rid": r.rid, "input_ids": prompt_ids(r.rid, r.prompt_tokens), "sampling_params": params}
            )
            task = asyncio.create_task(post_body(session, url, body.encode(), timeout))
            aborted = False
            if r.abort_after is not None:
                done, _ = await asyncio.wait({task}, timeout=r.abort_after)
                if not done:
                    async with session.post(url + "/abort_request", json={"rid": r.rid}) as resp:
                        aborted = resp.status == 200
            status, text = await task
            finish = None
            if status == 200:
                finish = (json.loads(text).get("meta_info") or {}).get("finish_reason") or {}
            return {**asdict(r), "status": status, "abort_sent": aborted, "finish": finish,
                    "error": None if status == 200 else text[:300]}  # fmt: skip

        records = await asyncio.gather(*(one(r) for r in plan), *(crasher(at, case) for at, case in crashers))
        return records[: len(plan)], records[len(plan) :]


async def run_burst(url: str, n: int, prompt_tokens: int, timeout: float) -> list[dict]:
    async with unpooled_session() as session:
        params = {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}

        async def one(i: int) -> dict:
            rid = f"burst-{i}"
            body = json.dumps({"rid": rid, "input_ids": prompt_ids(rid, prompt_tokens), "sampling_params": params})
            started = time.monotonic()
            status, text = await post_body(session, url, body.encode(), timeout)
            return {"rid": rid, "status": status, "latency_s": round(time.monotonic() - started, 2),
                    "error": None if status == 200 else text[:300]}  # fmt: skip

        return await asyncio.gather(*(one(i) for i in range(n)))


def settled(server: ServerProcess, idle: dict) -> dict:
    """A GPU test's end: the radix cache flushed, what the server holds beyond ``idle``
    (:func:`leaks`, all zero when nothing leaked) and the tracebacks in its log."""
    assert flush_cache(server.url, 60)
    return {
        **leaks(idle, sparse_state(server.url)),
        "tracebacks_in_log": server.log_path.read_text(errors="replace").count("Traceback"),
    }


def probe(url: str) -> list[int]:
    """The fixed greedy request whose tokens must not change over the run."""
    return generate_ids(url, prompt_ids("probe", 3000), 32)["output_ids"]


def summarize(result: dict) -> dict:
    """The soak's summary, from the raw phases in ``result``. ``aborted`` counts requests whose
    finish reason is an abort; an abort sent in the instant the request finished counts as completed."""
    mixed, bad, burst, now = result["mixed"], result["bad"], result["burst"], result["idle_after"]
    crashers = result.get("crashers", [])
    statuses = [r["status"] for r in mixed + crashers + burst] + [b["status"] for b in bad.values()]
    finishes = [(r["finish"] or {}) for r in mixed]
    aborted = [f for f in finishes if f.get("type") == "abort"]
    return {
        "requests": len(mixed),
        # an abort planned for after the request finished is never sent: --abort-frac 0.8 aborted 31%
        "aborts_planned": sum(1 for r in mixed if r["abort_after"] is not None),
        "aborted": len(aborted),
        # SGLang's reason for an abort of a request not yet scheduled (queued, by SGLang or the working-set rule)
        "aborted_while_queued": sum(1 for f in aborted if f.get("message") == "Abort in waiting queue"),
        "aborted_while_running": sum(1 for f in aborted if f.get("message") != "Abort in waiting queue"),
        "abort_sent_after_completion": sum(
            1 for r, f in zip(mixed, finishes) if r["abort_sent"] and f.get("type") != "abort"
        ),
        "completed": sum(1 for r, f in zip(mixed, finishes) if r["status"] == 200 and f.get("type") == "length"),
        "errors_5xx": sum(1 for s in statuses if s >= 500),
        "bad_requests_4xx": f"{sum(400 <= b['status'] < 500 for b in bad.values())}/{len(bad)}",
        # the fuzzer's bad requests sent during the mixed phase: refused (4xx) or served (2xx), never a 5xx
        "crashers": len(crashers),
        "crashers_4xx": sum(400 <= r["status"] < 500 for r in crashers),
        "crashers_2xx": sum(200 <= r["status"] < 300 for r in crashers),
        "crashers_5xx": sum(r["status"] >= 500 for r in crashers),
        "healthy_after_bad": all(b["healthy_after"] for b in bad.values()),
        "burst_completed": f"{sum(r['status'] == 200 for r in burst)}/{len(burst)}",
        **leaks(result["idle_before"], now),
        "output_matches_fresh": result["probe_after"] == result["probe_fresh"],
        # with --sparse-segmented-prefill: prefills segmented, and those stopped by aborts mid-prefill
        "segmented_prefill": now.get("segmented_prefill"),
        # with --sparse-working-set-admission: requests admitted / rounds a request waited for room
        "working_set_admissions": now.get("working_set_admissions"),
        "working_set_deferrals": now.get("working_set_deferrals"),
        "working_set_retractions": now.get("working_set_retractions"),
        "aborted_while_waiting_for_working_set": now.get("working_set_aborted_while_waiting"),
    }


def run(args) -> dict:
    model = write_llama3_8b_dummy(Path(args.log_dir) / f"llama3-8b-dummy-{args.layers}l",
                                  tokenizer_from=default_model_path(), num_layers=args.layers)  # fmt: skip
    kv_bytes_per_token = LLAMA3_8B_KV_BYTES_PER_TOKEN * args.layers // LLAMA3_8B_CONFIG["num_hidden_layers"]
    flags = ["--load-format", "dummy", "--mem-fraction-static", "0.8",
             "--sparse-host-cache-gb", str(args.host_cache_gb), *args.extra_server_args.split()]  # fmt: skip
    result: dict = {"flags": flags, "model": {"shape": "Llama-3-8B", "num_layers": args.layers, "weights": "dummy"}}
    with ServerProcess(SPARSE_MODULE, model, flags, log_path=Path(args.log_dir) / "soak-server.log") as server:
        url = server.url
        fresh = probe(url)
        flush_cache(url, 60)
        idle = sparse_state(url)
        plan = mixed_plan(args.requests, args.rate, args.abort_frac, args.seed)
        served_model, vocab_size = fuzz.model_facts(url)
        crashers = crasher_plan(args.crashers, plan[-1].send_at, args.seed, vocab_size, served_model)
        started = time.monotonic()
        mixed, crashed = asyncio.run(run_mixed(url, plan, args.request_timeout, crashers))
        result["mixed_s"] = round(time.monotonic() - started, 1)
        bad = {}
        for name, body in bad_requests(LLAMA3_8B_CONFIG["max_position_embeddings"], idle["host_tokens"]).items():
            response = requests.post(
                url + "/generate", data=body, headers={"Content-Type": "application/json"}, timeout=300
            )
            bad[name] = {"status": response.status_code, "reason": response.text[:300], "healthy_after": healthy(url)}
        burst_tokens = int(args.host_cache_gb * GIB // kv_bytes_per_token * 0.4)  # two or so fit at once
        burst = asyncio.run(run_burst(url, args.burst, burst_tokens, args.request_timeout))
        flushed = flush_cache(url, 60)
        now = sparse_state(url)
        again = probe(url)
        log = server.log_path.read_text(errors="replace")
    result.update(mixed=mixed, crashers=crashed, bad=bad, burst=burst, idle_before=idle, idle_after=now, flushed=flushed,
                  probe_fresh=fresh, probe_after=again, burst_prompt_tokens=burst_tokens,
                  server_tracebacks=log.count("Traceback"), stopped_cleanly=server.stopped_cleanly)  # fmt: skip
    result["summary"] = summarize(result)
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=4.0, help="mixed-phase arrivals per second")
    parser.add_argument(
        "--abort-frac",
        type=float,
        default=0.8,
        help="share of requests given an abort moment (some finish before theirs comes)",
    )
    parser.add_argument("--burst", type=int, default=50)
    parser.add_argument(
        "--crashers", type=int, default=500, help="the fuzzer's bad requests mixed into the mixed phase"
    )
    parser.add_argument("--host-cache-gb", type=float, default=8.0, help="small: the burst must queue")
    parser.add_argument(
        "--layers",
        type=int,
        default=LLAMA3_8B_CONFIG["num_hidden_layers"],
        help="layers of the 8B shape to keep: fewer make prefill faster, the machinery is the same",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout", type=float, default=1800.0)
    parser.add_argument("--extra-server-args", default="")
    add_server_run_args(parser, "soak")
    args = parser.parse_args(argv)
    return finish_run("benchmark.soak", argv, run(args), args.out_dir, "soak-{date}.json")


if __name__ == "__main__":
    main()
