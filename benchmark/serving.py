"""Serving benchmark: vanilla SGLang vs sparse-sglang, same model, same KV budget, same Poisson traces.

For each system (vanilla first) one invocation starts the server once, drives it
with seeded Poisson traces at several request rates through a small streaming
client, and writes benchmark/results/serving-<date>.json plus a PNG of
throughput, mean TTFT and p99 TBT versus request rate. One GPU command may run at most
10 minutes, so a full run is several invocations joined with --merge-into.

The baselines are vanilla at its best settings for the same GPU memory: ``vanilla`` stores KV in
the sparse system's dtype (its ``--kv-cache-dtype`` and ``--quantization-param-path``) with the
token pool that fits ``--kv-hbm-gb`` at that dtype's bytes per token; ``vanilla-bf16`` (opt-in,
``--systems vanilla,vanilla-bf16,sparse``) stores bf16 KV in the same bytes. The summary's
``*_vs_best`` ratios are against the stronger of those run (long-generation output tokens/s in
the windows' second half), named in ``summary.baseline``. Each rate's window is 400 s by default
(--max-seconds-per-rate), with enough arrivals to fill it.

    python -m benchmark.serving --dry-run
    python -m benchmark.serving --traces long-prompt --systems vanilla --time-budget 480
    python -m benchmark.serving --combine OUT.json A.json [B.json ...]   # one file from several calls
        [--ablation NAME=SERVER_LOG_COMPARISON.json ...]                # kept whole under "ablations"
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import datetime
import json
import math
import re
import shlex
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import numpy as np
import orjson
import requests

from benchmark.server_log import decoded_tokens, host_fill, load_events, summarize_trace
from sparse_sglang.config import GIB
from sparse_sglang.testing.greedy import GreedyAgreement, nearer_than_selection, tp_steps_agree
from sparse_sglang.testing.models import (
    LLAMA3_8B_CONFIG,
    LLAMA3_8B_TOKEN_IDS,
    kv_bytes_per_token,
    write_llama3_8b_dummy,
)
from sparse_sglang.testing.provenance import module_command, run_header, save_result
from sparse_sglang.testing.server import (
    SPARSE_MODULE,
    VANILLA_MODULE,
    ServerProcess,
    flush_cache,
    generate_ids,
    sse_events,
)

REPO = Path(__file__).resolve().parents[1]
# Run in this order. "vanilla" keeps the sparse system's KV dtype; "vanilla-bf16" is bf16 KV.
SYSTEMS = {"vanilla": VANILLA_MODULE, "vanilla-bf16": VANILLA_MODULE, "sparse": SPARSE_MODULE}
BASELINES = ("vanilla", "vanilla-bf16")
DEFAULT_SYSTEMS = ["vanilla", "sparse"]
# The sparse launcher installs its own "sparse" attention backend and refuses --attention-backend.
SYSTEM_SERVER_ARGS = {"vanilla": ["--attention-backend", "flashinfer"],
                      "vanilla-bf16": ["--attention-backend", "flashinfer"], "sparse": []}  # fmt: skip
TOKEN_ID_RANGE = LLAMA3_8B_TOKEN_IDS
# --kv-cache-dtype values the benchmark sizes (SGLang's "auto" is the 8B dummy's bf16), and the
# bytes of one KV element in each.
KV_DTYPE_NAMES = {"auto": "bf16", "bf16": "bf16", "bfloat16": "bf16", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}
KV_ELEMENT_BYTES = {"bf16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}
# A window long enough for steady state; its second half is what the headline counts.
WINDOW_S = 400.0
QUARTERS = 4  # each run's throughput by quarter of its window (the second half is steady if its two agree)
STEADY_DRIFT = 0.10  # the most the last quarter may move from the third for the run to count as steady

# Rough H100 figures, used only by --dry-run's time estimate.
PREFILL_TOKENS_PER_S = 20_000
DECODE_S_PER_TOKEN = 0.013
SERVER_START_S = 150  # cold; about 40 s once the GPU host's JIT caches are warm


@dataclass(frozen=True)
class TraceSpec:
    name: str
    prompt_len: tuple[int, int]  # inclusive bounds, uniform
    output_len: tuple[int, int]
    default_rates: tuple[float, ...]
    vanilla_capacity_req_s: float  # measured saturation rate, for the estimate only


TRACES = {
    t.name: t
    for t in (
        TraceSpec("long-prompt", (16384, 49152), (256, 768), (0.2, 0.4, 0.8), 0.34),
        TraceSpec("long-generation", (8192, 24576), (2048, 8192), (0.1, 0.2, 0.4), 0.13),
    )
}


# ---------------------------------------------------------------- traces


@dataclass
class Request:
    arrival: float  # seconds after the rate's first send
    input_ids: list[int]
    max_new_tokens: int


def trace_seed(seed: int, trace: str, rate: float) -> list[int]:
    # Never the system: both servers must get the very same requests at a given trace and rate.
    return [seed, zlib.crc32(trace.encode()), round(rate * 1_000_000)]


def make_trace(spec: TraceSpec, rate: float, num_requests: int, seed: int) -> list[Request]:
    rng = np.random.default_rng(trace_seed(seed, spec.name, rate))
    gaps = rng.exponential(1.0 / rate, num_requests)
    arrivals = np.concatenate([[0.0], np.cumsum(gaps[:-1])])  # Poisson process, first request at once
    prompt_lens = rng.integers(*spec.prompt_len, size=num_requests, endpoint=True)
    output_lens = rng.integers(*spec.output_len, size=num_requests, endpoint=True)
    return [
        Request(float(a), rng.integers(*TOKEN_ID_RANGE, size=p).tolist(), int(o))
        for a, p, o in zip(arrivals, prompt_lens, output_lens)
    ]


# ---------------------------------------------------------------- client


class ServerError(Exception):
    """The server answered, but not with a finished generation."""


@dataclass
class RequestRecord:
    arrival: float
    prompt_len: int
    max_new_tokens: int
    status: str = "not_sent"  # not_sent | running | ok | failed | cancelled
    sent: float | None = None  # seconds after the rate's start
    output_len: int = 0
    ttft: float | None = None
    e2e: float | None = None
    error: str = ""
    streamed_tokens: int = 0  # tokens received, also by a request cancelled at the cutoff
    late_tokens: int = 0  # of those, received in the second half of the run (the steady state)


@dataclass
class RateRun:
    records: list[RequestRecord]
    tbt: list[float]  # all requests' samples, one per token after the first chunk
    duration: float  # first send to last completion (or to the cutoff)
    max_in_flight: int
    started_at: float | None = None  # time.time() at the first send: the server log's clock
    tokens_by_quarter: list[int] = field(default_factory=list)  # streamed in each quarter of the window
    at_cutoff: dict | None = None  # what drive's at_cutoff returned (a profile of the loaded server)


def generate_payload(request: Request) -> bytes:
    sampling = {"max_new_tokens": request.max_new_tokens, "temperature": 0, "ignore_eos": True}
    return orjson.dumps({"input_ids": request.input_ids, "sampling_params": sampling, "stream": True})


async def stream_generate(
    session: aiohttp.ClientSession, url: str, payload: bytes, chunks: list[tuple[float, int]]
) -> list[tuple[float, int]]:
    """POST /generate (stream); appends to ``chunks`` (kept if the request is cancelled) per chunk
    its arrival time and the request's tokens so far, and returns it."""
    async with session.post(url + "/generate", data=payload, headers={"Content-Type": "application/json"}) as resp:
        if resp.status != 200:
            raise ServerError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        async for event in sse_events(resp.content):
            received = time.perf_counter()
            if event == b"[DONE]":
                return chunks
            data = orjson.loads(event)
            if "error" in data:
                raise ServerError(str(data["error"])[:300])
            meta = data["meta_info"]
            finish = meta.get("finish_reason") or {}
            if finish.get("type") == "abort":
                raise ServerError(f"aborted: {finish.get('message')}")
            # completion_tokens counts all tokens so far, with or without
            # --incremental-streaming-output; output_ids is cumulative only without it.
            chunks.append((received, meta["completion_tokens"]))
    raise ServerError("stream ended without [DONE]")


def token_timing(sent: float, chunks: list[tuple[float, int]]) -> tuple[float | None, list[float]]:
    """SGLang's TTFT and TBT: TTFT is the first chunk with a token; each later chunk
    gives (gap since the previous token chunk) / (its new tokens), once per new token."""
    ttft, tbt, last_time, last_count = None, [], sent, 0
    for t, count in chunks:
        new = count - last_count
        if new <= 0:
            continue
        if ttft is None:
            ttft = t - sent
        else:
            tbt.extend([(t - last_time) / new] * new)
        last_time, last_count = t, count
    return ttft, tbt


def tokens_between(chunks: list[tuple[float, int]], since: float, until: float = math.inf) -> int:
    """Tokens of a request's stream that arrived in ``[since, until)`` (perf_counter seconds)."""
    before = max((count for t, count in chunks if t < since), default=0)
    return max((count for t, count in chunks if t < until), default=0) - before


def late_half_drift(quarters: list[float]) -> float | None:
    """How far the window's last quarter moved from its third, over their mean: the second half is
    the steady state only if this is small (a window of too few request lifetimes still shows the
    first admitted requests finishing together, and the prefill of those replacing them)."""
    if len(quarters) != QUARTERS or not (mean := (quarters[2] + quarters[3]) / 2):
        return None
    return (quarters[3] - quarters[2]) / mean


async def drive(
    url: str,
    trace: list[Request],
    cutoff: float | None,
    request_timeout: float,
    at_cutoff: Callable[[], dict] | None = None,
) -> RateRun:
    """Send `trace` on its schedule; at `cutoff` seconds stop sending and cancel what is in flight.

    Requests cut off keep what they streamed (``streamed_tokens``, TTFT and TBT samples): under
    overload the run's output throughput is every token delivered within the window.
    ``at_cutoff`` runs (in a thread) at the cutoff before the cancellation, while the requests in
    flight still stream: e.g. a profile of the loaded server (:func:`profile_server`); the run
    keeps what it returns. Every number of the run counts only what arrived before the cutoff."""
    records = [RequestRecord(r.arrival, len(r.input_ids), r.max_new_tokens) for r in trace]
    payloads = [generate_payload(r) for r in trace]  # serialized before the clock starts
    streams: list[list[tuple[float, int]]] = [[] for _ in trace]
    ended = [math.inf] * len(trace)  # when each request's stream ended (done or failed)
    in_flight = max_in_flight = 0
    timeout = aiohttp.ClientTimeout(total=request_timeout)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        start, started_at = time.perf_counter(), time.time()

        async def one(i: int, record: RequestRecord, payload: bytes, chunks: list) -> None:
            nonlocal in_flight, max_in_flight
            await asyncio.sleep(record.arrival - (time.perf_counter() - start))
            record.sent, record.status = time.perf_counter() - start, "running"
            in_flight += 1
            max_in_flight = max(max_in_flight, in_flight)
            try:
                await stream_generate(session, url, payload, chunks)
                record.status = "ok"
            except asyncio.CancelledError:
                record.status = "cancelled"
                raise
            except Exception as err:  # one broken request is a failed record, not a failed benchmark
                record.status, record.error = "failed", f"{type(err).__name__}: {err}"[:300]
            finally:
                in_flight -= 1
                if record.status != "cancelled":
                    ended[i] = time.perf_counter()

        tasks = [asyncio.create_task(one(i, *args)) for i, args in enumerate(zip(records, payloads, streams))]
        _, pending = await asyncio.wait(tasks, timeout=cutoff)
        end = time.perf_counter()
        extra = None
        if at_cutoff is not None and pending:
            extra = await asyncio.get_running_loop().run_in_executor(None, at_cutoff)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    duration, tbt = end - start, []
    for record, chunks, stop in zip(records, streams, ended):
        window = [(t, n) for t, n in chunks if t < end]
        if record.status in ("ok", "failed") and stop > end:  # it ended while at_cutoff ran
            record.status, record.error = "cancelled", ""
        if record.status == "ok":
            record.e2e = stop - (start + record.sent)
            record.output_len = window[-1][1] if window else 0
        if record.sent is not None:
            record.ttft, samples = token_timing(start + record.sent, window)
            tbt.extend(samples)
        record.streamed_tokens = window[-1][1] if window else 0
        record.late_tokens = tokens_between(window, start + duration / 2)
    edges = [start + duration * q / QUARTERS for q in range(QUARTERS + 1)]
    by_quarter = [sum(tokens_between(c, a, b) for c in streams) for a, b in zip(edges, edges[1:])]
    return RateRun(records, tbt, duration, max_in_flight, started_at, by_quarter, extra)


# ---------------------------------------------------------------- metrics


@dataclass
class RateResult:
    rate: float
    num_requests: int
    seed: list[int]
    completed: int
    failed: int
    duration_s: float
    output_throughput: float  # output tokens of completed requests / s
    window_output_throughput: float  # every output token streamed within the run / s (cut-off requests too)
    late_output_throughput: float  # tokens streamed in the run's second half / its length (steady state)
    # what the server decoded in that half by its log (None without the log): a client that got
    # much less was held back by the stream, not the GPU
    server_late_decode_throughput: float | None
    throughput_by_quarter: list[float]  # tokens streamed in each quarter of the window / its length
    server_decode_by_quarter: list[float] | None  # the same by the server's log
    late_half_drift: float | None  # the last quarter against the third (:func:`late_half_drift`)
    request_throughput: float
    total_input_tokens: int
    total_output_tokens: int
    mean_ttft_ms: float | None
    median_ttft_ms: float | None
    p99_ttft_ms: float | None
    mean_tbt_ms: float | None
    median_tbt_ms: float | None
    p99_tbt_ms: float | None
    p999_tbt_ms: float | None
    mean_e2e_s: float | None
    without_first_token: int  # sent or waiting to be sent, no token yet when the run ended (TTFT censored)
    max_in_flight: int
    max_running_req: int | None  # from the server's log
    cache_flushed: bool
    records: list[dict]
    # a profile of the loaded server at the window's end (--profile-steps): benchmark/server_log.py's summary
    profile: dict | None = None
    # how full the running requests kept the host store in the window's second half (sparse only):
    # benchmark/server_log.py's host_fill
    host: dict | None = None


def _ms(seconds: list[float], percentile: float | None = None) -> float | None:
    """Mean (or a percentile) of `seconds` in ms; None without samples."""
    if not seconds:
        return None
    return 1000 * float(np.mean(seconds) if percentile is None else np.percentile(seconds, percentile))


def summarize_rate(
    rate: float,
    seed: list[int],
    run: RateRun,
    max_running_req: int | None,
    cache_flushed: bool,
    server_decode_by_quarter: list[float] | None = None,
    host: dict | None = None,
) -> RateResult:
    ok = [r for r in run.records if r.status == "ok"]
    by_quarter = [tokens / (run.duration / QUARTERS) for tokens in run.tokens_by_quarter]
    # the second half by the server's log: what late_output_throughput would be if every token
    # reached the client as it was made
    server_late = None if server_decode_by_quarter is None else sum(server_decode_by_quarter[2:]) / 2
    ttft = [r.ttft for r in run.records if r.ttft is not None]  # cut-off requests that got a token too
    output_tokens = sum(r.output_len for r in ok)
    return RateResult(
        rate=rate,
        num_requests=len(run.records),
        seed=seed,
        completed=len(ok),
        failed=sum(r.status == "failed" for r in run.records),
        duration_s=run.duration,
        output_throughput=output_tokens / run.duration,
        window_output_throughput=sum(r.streamed_tokens for r in run.records) / run.duration,
        late_output_throughput=sum(r.late_tokens for r in run.records) / (run.duration / 2),
        server_late_decode_throughput=server_late,
        throughput_by_quarter=by_quarter,
        server_decode_by_quarter=server_decode_by_quarter,
        late_half_drift=late_half_drift(by_quarter),
        request_throughput=len(ok) / run.duration,
        total_input_tokens=sum(r.prompt_len for r in ok),
        total_output_tokens=output_tokens,
        mean_ttft_ms=_ms(ttft),
        median_ttft_ms=_ms(ttft, 50),
        p99_ttft_ms=_ms(ttft, 99),
        mean_tbt_ms=_ms(run.tbt),
        median_tbt_ms=_ms(run.tbt, 50),
        p99_tbt_ms=_ms(run.tbt, 99),
        p999_tbt_ms=_ms(run.tbt, 99.9),
        mean_e2e_s=float(np.mean([r.e2e for r in ok])) if ok else None,
        without_first_token=sum(
            r.ttft is None and r.status in ("not_sent", "running", "cancelled") for r in run.records
        ),
        max_in_flight=run.max_in_flight,
        max_running_req=max_running_req,
        cache_flushed=cache_flushed,
        records=[asdict(r) for r in run.records],
        profile=run.at_cutoff,
        host=host,
    )


RUNNING_REQ = re.compile(r"#running-req: (\d+)")


def max_running_requests(log_text: str) -> int | None:
    """Peak `#running-req: N` of the scheduler's prefill/decode batch log lines."""
    return max(map(int, RUNNING_REQ.findall(log_text)), default=None)


def server_decode_by_quarter(log_text: str, run: RateRun) -> list[float] | None:
    """Tokens/s the server decoded in each quarter of the run's window, by its log's decode lines
    (to their one-second stamps); the last two make ``server_late_decode_throughput``."""
    if run.started_at is None:
        return None
    quarter = datetime.timedelta(seconds=run.duration / QUARTERS)
    start = datetime.datetime.fromtimestamp(run.started_at)
    return [decoded_tokens(log_text, start + q * quarter, start + (q + 1) * quarter) / quarter.total_seconds()
            for q in range(QUARTERS)]  # fmt: skip


def second_half_host_fill(log_text: str, run: RateRun) -> dict | None:
    """:func:`~benchmark.server_log.host_fill` over the second half of the run's window."""
    if run.started_at is None:
        return None
    return host_fill(log_text, datetime.datetime.fromtimestamp(run.started_at + run.duration / 2))


def is_complete(result: dict) -> bool:
    return result["completed"] == result["num_requests"]


def _ratio(sparse: dict, vanilla: dict, key: str) -> float | None:
    """sparse[key] / vanilla[key]; None where either is missing (an older file's row) or vanilla's is 0."""
    return sparse[key] / vanilla[key] if sparse.get(key) is not None and vanilla.get(key) else None


def paired_runs(
    systems: dict, complete_only: bool = False, baseline: str = "vanilla"
) -> dict[float, tuple[dict, dict]]:
    """rate -> (baseline run, sparse run) for each rate both systems ran (fully, with ``complete_only``)."""

    def by_rate(system: str) -> dict:
        return {r["rate"]: r for r in systems.get(system, []) if not complete_only or is_complete(r)}

    base, sparse = by_rate(baseline), by_rate("sparse")
    return {rate: (base[rate], sparse[rate]) for rate in sorted(base.keys() & sparse.keys())}


def summarize(results: dict, servers: dict | None = None) -> dict:
    """sparse / vanilla at each trace's highest rate that both systems completed fully, the
    issue's headline keys against ``vanilla`` (:func:`headline`), and the fair comparison against
    the stronger baseline run (:func:`against_best`; ``servers``, the file's server records, say
    which KV dtype each baseline ran with)."""
    at_rate = {}
    for trace, systems in results.items():
        if not (pairs := paired_runs(systems, complete_only=True)):
            continue
        rate = max(pairs)
        v, s = pairs[rate]
        at_rate[trace] = {
            "rate": rate,
            "throughput_ratio": _ratio(s, v, "output_throughput"),
            "mean_ttft_ratio": _ratio(s, v, "mean_ttft_ms"),
            "p99_tbt_ratio": _ratio(s, v, "p99_tbt_ms"),
        }
    by_trace = {t: d["throughput_ratio"] for t, d in at_rate.items() if d["throughput_ratio"] is not None}
    overload = overload_ratios(results)
    by_rate = ratios_by_rate(results)
    return {
        "passthrough_throughput_ratio": min(by_trace.values(), default=None),
        "passthrough_throughput_ratio_by_trace": by_trace,
        "at_highest_common_complete_rate": at_rate,
        "at_highest_common_rate": overload,
        "by_rate": by_rate,
        **headline(overload, by_rate),
        **against_best(results, servers or {}),
    }


def _largest_ttft_ratio(by_rate: dict) -> tuple[float | None, float | None]:
    """(the largest long-prompt mean-TTFT ratio over the rates of :func:`ratios_by_rate`, its rate)."""
    ttft = {r: d["ttft_ratio"] for r, d in by_rate.get("long-prompt", {}).items() if d["ttft_ratio"] is not None}
    rate = max(ttft, key=ttft.get, default=None)
    return ttft.get(rate), rate


def headline(overload: dict, by_rate: dict) -> dict:
    """The issue's headline keys (a trace not run gives None): P1 ``throughput_ratio``
    (long-generation) and ``throughput_ratio_long_prompt`` (output tokens in each run's window,
    sparse / vanilla), P3 ``p99_tbt_ratio`` (sparse / vanilla, long-generation; ``_long_prompt``
    beside it) and P6 ``concurrency_ratio`` (most running requests, long-generation), all at the
    highest rate both systems ran (:func:`overload_ratios`). P2 ``ttft_ratio`` (long-prompt mean
    TTFT, vanilla / sparse) is asked "at the rate where vanilla queues": the largest over the
    long-prompt rates both ran (:func:`ratios_by_rate`, which keeps every rate's), with the rate
    it is at as ``ttft_ratio_rate``."""
    gen, prompt = overload.get("long-generation", {}), overload.get("long-prompt", {})
    ttft, ttft_rate = _largest_ttft_ratio(by_rate)
    return {
        "throughput_ratio": gen.get("window_output_throughput_ratio"),
        "throughput_ratio_long_prompt": prompt.get("window_output_throughput_ratio"),
        "ttft_ratio": ttft,
        "ttft_ratio_rate": ttft_rate,
        "p99_tbt_ratio": gen.get("p99_tbt_ms_ratio"),
        "p99_tbt_ratio_long_prompt": prompt.get("p99_tbt_ms_ratio"),
        "concurrency_ratio": gen.get("max_running_req_ratio"),
    }


def ratios_by_rate(results: dict, baseline: str = "vanilla") -> dict:
    """Per trace and rate both systems ran: ``throughput_ratio`` (window output tokens, sparse /
    baseline), ``ttft_ratio`` (mean TTFT, baseline / sparse), ``tbt_mean_ratio``, ``tbt_p99_ratio``
    and ``tbt_p999_ratio`` (sparse / baseline), ``running_ratio`` (most running requests)."""
    names = {"throughput_ratio": "window_output_throughput", "tbt_mean_ratio": "mean_tbt_ms",
             "tbt_p99_ratio": "p99_tbt_ms", "tbt_p999_ratio": "p999_tbt_ms", "running_ratio": "max_running_req"}  # fmt: skip
    out = {}
    for trace, systems in results.items():
        for rate, (v, s) in paired_runs(systems, baseline=baseline).items():
            row = {name: _ratio(s, v, key) for name, key in names.items()}
            out.setdefault(trace, {})[rate] = {"ttft_ratio": _ratio(v, s, "mean_ttft_ms"), **row}
    return out


def overload_ratios(results: dict, baseline: str = "vanilla") -> dict:
    """sparse / baseline at each trace's highest rate both systems ran, complete or cut off: under
    overload a run ends at the cutoff, and what counts is what each system delivered in it."""
    keys = ("window_output_throughput", "late_output_throughput", "max_running_req", "mean_ttft_ms",
            "mean_tbt_ms", "p99_tbt_ms", "p999_tbt_ms")  # fmt: skip
    out = {}
    for trace, systems in results.items():
        if not (pairs := paired_runs(systems, baseline=baseline)):
            continue
        rate = max(pairs)
        v, s = pairs[rate]
        out[trace] = {"rate": rate, **{f"{k}_ratio": _ratio(s, v, k) for k in keys if k in s and k in v}}
    return out


# ---------------------------------------------------------------- the stronger baseline


def last_flag(words: list[str], flag: str) -> str | None:
    """The value of the last ``flag X`` or ``flag=X`` in ``words`` (argparse's: the last one wins)."""
    value = None
    for i, word in enumerate(words):
        if word == flag and i + 1 < len(words):
            value = words[i + 1]
        elif word.startswith(flag + "="):
            value = word[len(flag) + 1 :]
    return value


def server_kv_dtype(record: dict | None) -> str | None:
    """The KV dtype a server record ran with: its ``kv_cache_dtype``, or in a file from before
    that key its flags' last ``--kv-cache-dtype`` (none: SGLang's auto, the 8B dummy's bf16);
    None for a record without either."""
    if not record or not ("kv_cache_dtype" in record or "flags" in record):
        return None
    name = record.get("kv_cache_dtype") or last_flag(record["flags"], "--kv-cache-dtype") or "auto"
    return KV_DTYPE_NAMES.get(name, name)


def baseline_label(system: str, servers: dict) -> str:
    """ "vanilla-fp8" or "vanilla-bf16": the KV dtype the baseline ran with (its system name where
    the file does not say)."""
    dtype = "bf16" if system == "vanilla-bf16" else server_kv_dtype(servers.get(system))
    if dtype is None:
        return system
    return "vanilla-fp8" if dtype.startswith("fp8") else f"vanilla-{dtype}"


def stronger_baseline(results: dict) -> tuple[str | None, str | None, dict]:
    """(the baseline with the most output tokens/s in the second half of its window, the trace
    compared, each baseline's figure). Compared on long generation (long prompt where not every
    baseline ran long generation), at the highest rate the baseline shares with sparse (its own
    highest without one); a tie or no figure goes to ``vanilla``, the sparse system's KV dtype."""
    present = [b for b in BASELINES if any(systems.get(b) for systems in results.values())]
    trace = next(
        (t for t in ("long-generation", "long-prompt") if all(results.get(t, {}).get(b) for b in present)), None
    )
    strength = {}
    for b in present:
        if trace is None:
            strength[b] = None
            continue
        pairs = paired_runs(results[trace], baseline=b)
        run = pairs[max(pairs)][0] if pairs else max(results[trace][b], key=lambda r: r["rate"])
        strength[b] = run.get("late_output_throughput")
    best = max(present, key=lambda b: -math.inf if strength[b] is None else strength[b], default=None)
    return best, trace, strength


def against(results: dict, baseline: str | None) -> dict:
    """sparse against ``baseline`` at each trace's highest rate both ran (None where they share
    none): output tokens/s in the windows' second half (``throughput_ratio``, long generation;
    ``throughput_ratio_long_prompt``) and over the whole windows (``window_...``), most running
    requests (``concurrency_ratio``) and p99 TBT (``p99_tbt_ratio``) at long generation, and
    mean TTFT (baseline / sparse) the largest over the long-prompt rates (``ttft_ratio``, at
    ``ttft_ratio_rate``)."""
    overload = overload_ratios(results, baseline)
    gen, prompt = overload.get("long-generation", {}), overload.get("long-prompt", {})
    ttft, ttft_rate = _largest_ttft_ratio(ratios_by_rate(results, baseline))
    return {
        "throughput_ratio": gen.get("late_output_throughput_ratio"),
        "window_throughput_ratio": gen.get("window_output_throughput_ratio"),
        "throughput_ratio_long_prompt": prompt.get("late_output_throughput_ratio"),
        "window_throughput_ratio_long_prompt": prompt.get("window_output_throughput_ratio"),
        "concurrency_ratio": gen.get("max_running_req_ratio"),
        "ttft_ratio": ttft,
        "ttft_ratio_rate": ttft_rate,
        "p99_tbt_ratio": gen.get("p99_tbt_ms_ratio"),
    }


def tbt_at_highest_common_rate(results: dict, baseline: str | None) -> dict:
    """Per trace, at the highest rate sparse and ``baseline`` both ran: each one's mean, p99 and
    p99.9 TBT (ms) and window (s)."""
    out = {}
    for trace, systems in results.items():
        if not (pairs := paired_runs(systems, baseline=baseline)):
            continue
        rate = max(pairs)
        out[trace] = {"rate": rate}
        for system, r in zip((baseline, "sparse"), pairs[rate]):
            out[trace][system] = {"mean": r.get("mean_tbt_ms"), "p99": r.get("p99_tbt_ms"),
                                  "p999": r.get("p999_tbt_ms"), "window_s": r.get("duration_s")}  # fmt: skip
    return out


def sparse_host_fill(results: dict) -> dict:
    """``host_fill_ratio``: how full sparse's running requests kept the host store in the second
    half of its long-generation run at the highest rate it ran (``host_fill``: the arithmetic,
    :func:`~benchmark.server_log.host_fill`); None for a run whose log does not say."""
    runs = results.get("long-generation", {}).get("sparse") or []
    fill = max(runs, key=lambda r: r["rate"]).get("host") if runs else None
    return {"host_fill_ratio": fill["host_fill_ratio"] if fill else None, "host_fill": fill}


def sparse_tbt_max(results: dict) -> dict:
    """The largest sparse p99 TBT over every trace and rate it ran (and where), and p99.9's."""
    rows = [(r[k], trace, r["rate"], k) for trace, systems in results.items() for r in systems.get("sparse", [])
            for k in ("p99_tbt_ms", "p999_tbt_ms") if r.get(k) is not None]  # fmt: skip
    p99 = max((row for row in rows if row[3] == "p99_tbt_ms"), default=None)
    return {
        "p99_tbt_ms_max": p99[0] if p99 else None,
        "p99_tbt_ms_max_at": {"trace": p99[1], "rate": p99[2]} if p99 else None,
        "p999_tbt_ms_max": max((row[0] for row in rows if row[3] == "p999_tbt_ms"), default=None),
    }


def against_best(results: dict, servers: dict) -> dict:
    """The fair comparison (issue 36): ``baseline`` names the stronger vanilla run
    (:func:`stronger_baseline`), every ``*_vs_best`` ratio is :func:`against` it; ``tbt_ms`` and
    ``window_s_min`` (the shortest window those ratios use; 400 s or more for steady state) at
    each trace's highest common rate; ``vs_baseline`` every baseline's ratios."""
    best, trace, strength = stronger_baseline(results)
    tbt = tbt_at_highest_common_rate(results, best)
    windows = [d[s]["window_s"] for d in tbt.values() for s in (best, "sparse") if d[s]["window_s"] is not None]
    return {
        "baseline": baseline_label(best, servers) if best else None,
        "baseline_system": best,
        "baseline_chosen_by": {"trace": trace, "late_output_throughput": strength},
        **{f"{key}_vs_best": value for key, value in against(results, best).items()},
        **sparse_tbt_max(results),
        **sparse_host_fill(results),
        "tbt_ms": tbt,
        "window_s_min": min(windows, default=None),
        "vs_baseline": {b: {"label": baseline_label(b, servers), **against(results, b)} for b in strength},
    }


# ---------------------------------------------------------------- result files


def merge_results(old: dict, new: dict) -> dict:
    """`old` with each (trace, system, rate) entry of `new` added, or replacing old's."""
    merged = copy.deepcopy(old)
    for trace, systems in new.items():
        for system, runs in systems.items():
            by_rate = {r["rate"]: r for r in merged.setdefault(trace, {}).get(system, [])}
            by_rate.update({r["rate"]: r for r in runs})
            merged[trace][system] = [by_rate[rate] for rate in sorted(by_rate)]
    return merged


def document_summary(results: dict, servers: dict, kv_hbm_gb: float | None) -> dict:
    return {**summarize(results, servers), "kv_hbm_budget_gb": kv_hbm_gb}


def merge_documents(old: dict, new: dict) -> dict:
    """One result file from two invocations: the newer's metadata on top, both runs kept. A
    system that ran with one KV dtype in one and another in the other is refused: its runs would
    share one name and one server record."""
    for system in old["servers"].keys() & new["servers"].keys():
        dtypes = server_kv_dtype(old["servers"][system]), server_kv_dtype(new["servers"][system])
        if None not in dtypes and dtypes[0] != dtypes[1]:
            raise SystemExit(f"{system} ran with {dtypes[0]} KV in one file and {dtypes[1]} in the other: "
                             "merge only runs of the same configuration")  # fmt: skip
    results = merge_results(old["results"], new["results"])
    servers = {**old["servers"], **new["servers"]}
    return {
        **new,
        "servers": servers,
        "traces": {**old["traces"], **new["traces"]},
        "invocations": old["invocations"] + new["invocations"],
        "results": results,
        "summary": document_summary(results, servers, new.get("kv_hbm_budget_gb", old.get("kv_hbm_budget_gb"))),
    }


def plot(results: dict, path: Path) -> None:
    """Per trace, against the request rate: output throughput (tokens in the run's window where
    it has one), mean TTFT, and p99 TBT (log scale: it spans milliseconds to seconds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def seconds(ms: float | None) -> float:
        return np.nan if ms is None else ms / 1000

    panels = (
        ("output throughput", "tokens/s", lambda r: r.get("window_output_throughput") or r["output_throughput"]),
        ("mean TTFT", "s", lambda r: seconds(r["mean_ttft_ms"])),
        ("p99 TBT", "ms", lambda r: np.nan if r["p99_tbt_ms"] is None else r["p99_tbt_ms"]),
    )
    fig, axes = plt.subplots(len(results), len(panels), figsize=(15, 3.8 * len(results)), squeeze=False)
    for row, (trace, systems) in zip(axes, results.items()):
        for system, runs in systems.items():
            rates = [r["rate"] for r in runs]
            for ax, (_, _, value) in zip(row, panels):
                values = [value(r) for r in runs]
                (line,) = ax.plot(rates, values, marker="o", label=system)
                partial = [(x, y) for x, y, r in zip(rates, values, runs) if not is_complete(r)]
                if partial:
                    ax.scatter(*zip(*partial), s=90, facecolors="none", edgecolors=line.get_color(), zorder=3)
        for ax, (title, unit, _) in zip(row, panels):
            ax.set(title=f"{trace}: {title}", xlabel="request rate (req/s)", ylabel=unit)
            ax.legend()
        row[0].set_ylim(bottom=0)
        row[1].set_ylim(bottom=0)
        row[2].set_yscale("log")
    fig.suptitle("open circle: the run was cut at its window with requests still in flight", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _fmt(value: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def print_table(results: dict) -> None:
    print(
        f"\n{'trace':<16}{'rate':>6} {'system':<13}{'done':>7}{'tok/s':>9}{'window':>8}{'2nd half':>9}{'TTFT s':>8}"
        f"{'TBT mean/p99/p99.9 ms':>24}{'max run':>8}{'Q4/Q3':>7}"
    )
    for trace, systems in results.items():
        order = {system: i for i, system in enumerate(SYSTEMS)}
        rows = [(r["rate"], order.get(system, len(order)), system, r) for system, runs in systems.items() for r in runs]
        for rate, _, system, r in sorted(rows, key=lambda row: row[:2]):
            tbt = "/".join(_fmt(r.get(k)) for k in ("mean_tbt_ms", "p99_tbt_ms", "p999_tbt_ms"))
            print(
                f"{trace:<16}{rate:>6g} {system:<13}{r['completed']:>3}/{r['num_requests']:<3}"
                f"{r['output_throughput']:>9.0f}{_fmt(r.get('window_output_throughput'), digits=0):>8}"
                f"{_fmt(r.get('late_output_throughput'), digits=0):>9}"
                f"{_fmt(r['mean_ttft_ms'], 1e-3, 2):>8}{tbt:>24}"
                f"{_fmt(r['max_running_req'], digits=0):>8}"
                f"{'' if r.get('late_half_drift') is None else format(r['late_half_drift'], '+.0%'):>7}"
            )


# ---------------------------------------------------------------- running servers


@dataclass
class RatePlan:
    spec: TraceSpec
    rate: float
    num_requests: int


def requests_for_window(rate: float, window_s: float | None) -> int:
    """Enough Poisson arrivals at ``rate`` to last ``window_s``: the mean count m plus 4 sqrt(m) + 4
    (the last arrival is then ~4 standard deviations past the window); 12 without a window."""
    if not window_s:
        return 12
    mean = rate * window_s
    return math.ceil(mean + 4 * math.sqrt(mean)) + 4


def make_plan(args: argparse.Namespace) -> list[RatePlan]:
    plan = []
    for name in args.traces:
        key = name.replace("-", "_")
        for rate in getattr(args, f"rates_{key}"):
            num_requests = (getattr(args, f"num_requests_{key}") or args.num_requests
                            or requests_for_window(rate, args.max_seconds_per_rate))  # fmt: skip
            plan.append(RatePlan(TRACES[name], rate, num_requests))
    return plan


def estimate_seconds(trace: list[Request], spec: TraceSpec) -> float:
    """Arrivals or vanilla's capacity, whichever is slower, then one mean request's own latency."""
    queue = max(trace[-1].arrival, len(trace) / spec.vanilla_capacity_req_s)
    mean_prompt = np.mean([len(r.input_ids) for r in trace])
    mean_output = np.mean([r.max_new_tokens for r in trace])
    return queue + mean_prompt / PREFILL_TOKENS_PER_S + mean_output * DECODE_S_PER_TOKEN


def print_dry_run(plan: list[RatePlan], args: argparse.Namespace) -> None:
    print(f"{'trace':<16}{'rate':>6}{'requests':>9}{'prompt tok':>12}{'output tok':>12}{'est. s':>8}")
    per_system = 0.0
    for step in plan:
        trace = make_trace(step.spec, step.rate, step.num_requests, args.seed)
        seconds = estimate_seconds(trace, step.spec)
        if args.max_seconds_per_rate:
            seconds = min(seconds, args.max_seconds_per_rate)
        per_system += seconds
        prompt = sum(len(r.input_ids) for r in trace)
        output = sum(r.max_new_tokens for r in trace)
        print(f"{step.spec.name:<16}{step.rate:>6g}{step.num_requests:>9}{prompt:>12}{output:>12}{seconds:>8.0f}")
    total = len(args.systems) * (SERVER_START_S + per_system)
    print(
        f"\nrough estimate (vanilla on an H100): {per_system:.0f} s of traffic per system; "
        f"{total:.0f} s for {len(args.systems)} system(s) with cold server starts "
        f"({SERVER_START_S} s each, ~40 s warm)"
    )
    if args.time_budget and total > args.time_budget:
        print(f"over --time-budget {args.time_budget:g} s: the last rates would be cut short or skipped")
    if not args.max_seconds_per_rate or args.max_seconds_per_rate < WINDOW_S:
        print(f"windows shorter than {WINDOW_S:g} s: the second half may not be steady state")
    per_gpu = f" on each of its {args.tp_size} GPUs" if args.tp_size > 1 else ""
    print(f"\nKV: {args.kv_hbm_gb:g} GiB of GPU memory for each system{per_gpu}")
    for system in args.systems:
        dtype = system_kv_dtype(system, args)
        if system in BASELINES:
            per_token = kv_bytes_per_token(KV_ELEMENT_BYTES[dtype])
            print(
                f"  {system}: {dtype} KV, {per_token} bytes per token: a pool of "
                f"{vanilla_max_total_tokens(args.kv_hbm_gb, dtype, args.tp_size)} tokens"
            )
        else:
            print(f"  {system}: {dtype} KV in {args.sparse_host_cache_gb:g} GiB of host memory")
    if {"vanilla", "vanilla-bf16"} <= set(args.systems) and system_kv_dtype("vanilla", args) == "bf16":
        print("  vanilla already runs bf16 KV (the sparse system's): vanilla-bf16 repeats it")
    for system in args.systems:
        command = ["python", "-m", SYSTEMS[system], "--model-path", "MODEL", *server_args(system, args)]
        print(f"{system}: {shlex.join(command)}")


def kv_budget_args(system: str, args: argparse.Namespace) -> list[str]:
    """The same GPU memory for KV (``--kv-hbm-gb``) in each system's terms: a vanilla baseline's
    token pool in its KV dtype (``vanilla``: the sparse system's, with its calibrated scales;
    ``vanilla-bf16``: bf16), or the sparse page cache plus everything else sparse keeps on the
    GPU for KV (page summaries of the whole host store, prefix staging, page table), with all KV
    in ``--sparse-host-cache-gb`` of host memory."""
    dtype = system_kv_dtype(system, args)
    if system in BASELINES:
        scales = last_flag(sparse_words(args), "--quantization-param-path") if dtype != "bf16" else None
        tokens = vanilla_max_total_tokens(args.kv_hbm_gb, dtype, args.tp_size)
        return ["--max-total-tokens", str(tokens), "--kv-cache-dtype", dtype,
                *(["--quantization-param-path", scales] if scales else [])]  # fmt: skip
    words = sparse_words(args)
    cache_gb = sparse_gpu_cache_gb(args.kv_hbm_gb, args.sparse_host_cache_gb, kv_dtype=torch_kv_dtype(dtype),
                                   tp_size=args.tp_size, page_bounds=last_flag(words, "--sparse-page-bounds"),
                                   bound_format=last_flag(words, "--sparse-bound-format"))  # fmt: skip
    return ["--sparse-gpu-cache-gb", f"{cache_gb:.3f}", "--sparse-host-cache-gb", f"{args.sparse_host_cache_gb:g}"]


def vanilla_max_total_tokens(kv_hbm_gb: float, dtype: str, tp_size: int = 1) -> int:
    """Vanilla's ``--max-total-tokens``: the tokens whose KV (the 8B shape, ``dtype``) fit ``kv_hbm_gb``
    GiB on each of ``tp_size`` GPUs (each holds its share of the kv heads of every token)."""
    return int(kv_hbm_gb * tp_size * GIB // kv_bytes_per_token(KV_ELEMENT_BYTES[dtype]))


def sparse_words(args: argparse.Namespace) -> list[str]:
    """The sparse server's own words of its command line: the extra server args, then its own."""
    return shlex.split(args.extra_server_args) + shlex.split(args.sparse_server_args)


def kv_dtype_name(server_args: str) -> str:
    """The KV dtype (bf16, fp8_e4m3 or fp8_e5m2) the last ``--kv-cache-dtype`` in ``server_args`` asks for."""
    name = last_flag(shlex.split(server_args), "--kv-cache-dtype") or "auto"
    if name not in KV_DTYPE_NAMES:
        raise SystemExit(f"--kv-cache-dtype {name}: the benchmark sizes {', '.join(KV_DTYPE_NAMES)} only")
    return KV_DTYPE_NAMES[name]


def system_kv_dtype(system: str, args: argparse.Namespace) -> str:
    """bf16 for ``vanilla-bf16``; the sparse system's KV dtype for sparse and ``vanilla``."""
    return "bf16" if system == "vanilla-bf16" else kv_dtype_name(shlex.join(sparse_words(args)))


def torch_kv_dtype(name: str):
    import torch

    return {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "bf16": torch.bfloat16}[name]


def kv_cache_dtype(server_args: str):
    """The torch KV dtype ``--kv-cache-dtype`` in the server args asks for (bf16 without it)."""
    return torch_kv_dtype(kv_dtype_name(server_args))


def sparse_gpu_cache_gb(kv_hbm_gb: float, host_cache_gb: float, context_len: int | None = None, kv_dtype=None,
                       tp_size: int = 1, page_bounds: str | None = None, bound_format: str | None = None) -> float:  # fmt: skip
    """Page-cache GiB that, with the summaries, staging and table of ``host_cache_gb`` of host KV
    of ``kv_dtype`` (bf16 by default; :func:`~sparse_sglang.mem_cache.plan.plan_memory`'s sizes;
    the default staging buffer, no longer than ``context_len``, the 8B shape's by default), fills
    ``kv_hbm_gb``. With ``tp_size`` ranks, each GPU's: its 1/``tp_size`` of the kv heads and of
    the host store (what the server's ``--sparse-gpu-cache-gb`` means on each rank). The page
    corners and their storage (``--sparse-page-bounds``, ``--sparse-bound-format``; None: the
    defaults) set the summaries' bytes: int8 corners keep a scale byte per page that fp8 ones do not."""
    import torch

    from sparse_sglang.attention.selectors import kept_summaries
    from sparse_sglang.config import SparseConfig
    from sparse_sglang.mem_cache.host_pool import pages_for_budget
    from sparse_sglang.mem_cache.plan import fixed_gpu_bytes, prefix_staging_tokens

    c, dtype = LLAMA3_8B_CONFIG, kv_dtype or torch.bfloat16
    shape = (c["num_hidden_layers"], c["num_key_value_heads"] // tp_size)
    page = SparseConfig(host_cache_gb=1.0).page_size  # the default page
    host_pages = pages_for_budget(host_cache_gb / tp_size, *shape, page, c["head_dim"], dtype)
    defaults = SparseConfig(host_cache_gb=1.0)
    config = SparseConfig(host_cache_gb=1.0, page_bounds=page_bounds or defaults.page_bounds,
                          bound_format=bound_format or defaults.bound_format)  # fmt: skip
    kept = kept_summaries(config.selector)  # the default selector's summaries
    staging = prefix_staging_tokens(config, context_len or c["max_position_embeddings"])
    other = sum(fixed_gpu_bytes(host_pages, *shape, c["head_dim"], dtype, staging, **kept,
                                bound_format=config.bound_format, page_bounds=config.page_bounds))  # fmt: skip
    cache_gb = kv_hbm_gb - other / GIB
    if cache_gb <= 0:
        raise SystemExit(f"--kv-hbm-gb {kv_hbm_gb:g}: the summaries and staging of {host_cache_gb:g} GiB of host KV "
                         f"take {other / GIB:.2f} GiB; lower --sparse-host-cache-gb")  # fmt: skip
    return cache_gb


# Flags the benchmark derives from --kv-hbm-gb and --sparse-host-cache-gb: the same flag again in
# --extra-server-args would win on the server's command line and silently unbalance the systems.
KV_BUDGET_FLAGS = ("--max-total-tokens", "--sparse-gpu-cache-gb", "--sparse-host-cache-gb")
# The KV dtype flags: the sparse system's are given (extra or sparse server args); the baselines'
# are the benchmark's, so theirs are dropped from the extra server args and refused in the
# vanilla server args.
KV_DTYPE_FLAGS = ("--kv-cache-dtype", "--quantization-param-path")


def _flags_in(words: list[str], flags: tuple[str, ...]) -> list[str]:
    return [flag for flag in flags if any(w == flag or w.startswith(flag + "=") for w in words)]


def without_flags(words: list[str], flags: tuple[str, ...]) -> list[str]:
    """``words`` less each ``flag X`` and ``flag=X`` of ``flags``."""
    out, skip = [], False
    for word in words:
        if skip:
            skip = False
        elif word in flags:
            skip = True
        elif not any(word.startswith(flag + "=") for flag in flags):
            out.append(word)
    return out


def check_kv_scales(words: list[str], tp_size: int) -> None:
    """Refuse a ``--quantization-param-path`` the servers could not use at ``tp_size`` (the
    launcher's rule, :func:`~sparse_sglang.integration.server_args.kv_scales_problem`, applied to
    vanilla too): SGLang would run at scale 1.0, the dummy weights' tiny keys would become fp8
    zeros (every page scores alike), and the run would time another workload than the one named."""
    from sparse_sglang.integration.server_args import kv_scales_problem

    path = last_flag(words, "--quantization-param-path")
    if problem := kv_scales_problem(path, tp_size):
        raise SystemExit(f"--quantization-param-path {path}: {problem} "
                         "(benchmark/kv-scales-llama3-8b-dummy-tp2.json holds two ranks)")  # fmt: skip


def server_args(system: str, args: argparse.Namespace) -> list[str]:
    extra, sparse, vanilla = (shlex.split(a) for a in (args.extra_server_args, args.sparse_server_args,
                                                       args.vanilla_server_args))  # fmt: skip
    if clash := _flags_in(extra + sparse + vanilla, KV_BUDGET_FLAGS):
        raise SystemExit(f"the server args set {', '.join(clash)}, which the benchmark sizes itself: "
                         "give --kv-hbm-gb / --sparse-host-cache-gb instead")  # fmt: skip
    if clash := _flags_in(extra + sparse + vanilla, ("--tp-size", "--tensor-parallel-size")):
        raise SystemExit(f"the server args set {', '.join(clash)}: give the benchmark's --tp-size, which sizes "
                         "each system's KV per GPU")  # fmt: skip
    if clash := _flags_in(vanilla, KV_DTYPE_FLAGS):
        raise SystemExit(f"--vanilla-server-args sets {', '.join(clash)}: vanilla takes the sparse system's KV "
                         "dtype and scales, vanilla-bf16 bf16 (--systems)")  # fmt: skip
    own = [*extra, *sparse] if system == "sparse" else [*without_flags(extra, KV_DTYPE_FLAGS), *vanilla]
    check_kv_scales(sparse_words(args), args.tp_size)  # vanilla takes the sparse system's scales
    return [
        "--load-format", "dummy",
        "--skip-tokenizer-init",
        # each stream chunk carries its new tokens only: cumulative output_ids cost the server and
        # the client O(length) per token, which caps what a fast server streams (docs/results.md)
        "--incremental-streaming-output",
        *kv_budget_args(system, args),
        *(["--tp-size", str(args.tp_size)] if args.tp_size > 1 else []),
        "--chunked-prefill-size", "8192",
        *SYSTEM_SERVER_ARGS[system],
        *own,
    ]  # fmt: skip


def warm_up(url: str) -> None:
    # The first request can pay for kernel JIT; keep that out of the first rate's TTFT.
    generate_ids(url, list(range(TOKEN_ID_RANGE[0], TOKEN_ID_RANGE[0] + 4096)), 16)


def profile_server(url: str, trace_dir: Path, steps: int, timeout: float = 300.0, settle: float = 5.0) -> dict:
    """Record ``steps`` forward steps of the server with SGLang's profiler (torch's, CPU and GPU
    activities) and summarize the first TP rank's trace (``benchmark/server_log.py``) once it has
    not grown for ``settle`` seconds (the export takes a while). A failure is the summary's
    ``error``: it must not lose the run it ends."""
    try:
        body = {"output_dir": str(trace_dir), "num_steps": steps, "activities": ["CPU", "GPU"],
                "with_stack": False, "record_shapes": False}  # fmt: skip
        requests.post(url + "/start_profile", json=body, timeout=60).raise_for_status()
        deadline, files = time.monotonic() + timeout, []
        while time.monotonic() < deadline:
            files = sorted(trace_dir.glob("*TP-0*.trace.json*")) or sorted(trace_dir.glob("*.trace.json*"))
            if files and files[0].stat().st_size and time.time() - files[0].stat().st_mtime >= settle:
                break  # written and no longer growing
            time.sleep(2)
        else:
            return {"steps": steps, "error": f"no trace under {trace_dir} after {timeout:.0f} s"}
        return {"steps": steps, "trace": files[0].name, **summarize_trace(load_events(str(files[0])))}
    except Exception as err:  # noqa: BLE001 - reported in the result instead
        return {"steps": steps, "error": f"{type(err).__name__}: {err}"[:500]}


def run_system(system: str, plan: list[RatePlan], args, model: str, deadline: float | None) -> tuple[dict, dict]:
    """Start one server, run every planned rate on it, stop it; (server record, trace -> rate results)."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    log_path = Path(args.log_dir) / f"{system}-{stamp}.log"
    flags = server_args(system, args)
    start_timeout = 900.0 if deadline is None else deadline - time.monotonic()
    server = ServerProcess(
        SYSTEMS[system], model, flags, log_path=log_path, start_timeout=start_timeout, stop_timeout=30
    )
    record = {"command": shlex.join(server.command), "flags": flags, "log": str(log_path),
              "kv_cache_dtype": system_kv_dtype(system, args)}  # fmt: skip
    results: dict[str, list] = {}
    try:
        with server:
            warm_up(server.url)
            flush_cache(server.url)
            for step in plan:
                limits = [args.max_seconds_per_rate] if args.max_seconds_per_rate else []
                if deadline is not None:
                    limits.append(deadline - time.monotonic())
                if limits and min(limits) <= 0:
                    print(f"[{system}] time budget spent: skipping {step.spec.name} @ {step.rate:g} req/s")
                    continue
                trace = make_trace(step.spec, step.rate, step.num_requests, args.seed)
                log_offset = log_path.stat().st_size
                trace_dir = Path(args.log_dir) / f"profile-{system}-{stamp}-{step.spec.name}-{step.rate:g}"
                at_cutoff = (
                    (lambda: profile_server(server.url, trace_dir, args.profile_steps)) if args.profile_steps else None
                )
                run = asyncio.run(drive(server.url, trace, min(limits, default=None), args.request_timeout, at_cutoff))
                flushed = flush_cache(server.url)
                with open(log_path, "rb") as log:
                    log.seek(log_offset)
                    log_text = log.read().decode(errors="replace")
                seed = trace_seed(args.seed, step.spec.name, step.rate)
                result = summarize_rate(step.rate, seed, run, max_running_requests(log_text), flushed,
                                        server_decode_by_quarter(log_text, run),
                                        second_half_host_fill(log_text, run))  # fmt: skip
                results.setdefault(step.spec.name, []).append(asdict(result))
                print(
                    f"[{system}] {step.spec.name} @ {step.rate:g} req/s: {result.completed}/{result.num_requests} "
                    f"done, {result.output_throughput:.0f} tok/s, {result.duration_s:.0f} s; second half "
                    f"{result.late_output_throughput:.0f} tok/s streamed, {result.server_late_decode_throughput or 0:.0f} decoded; "
                    f"last quarter {100 * (result.late_half_drift or 0):+.0f}% on the third"
                )
    except (RuntimeError, TimeoutError, requests.RequestException) as err:
        # Keep the other system's results: one server failing to start must not lose them.
        record["error"] = f"{type(err).__name__}: {err}"[-2000:]
        print(f"[{system}] failed: {record['error']}", file=sys.stderr)
    record.update(exit_code=server.exit_code, stopped_cleanly=server.stopped_cleanly)
    return record, results


def gpu_name() -> str:
    # In a child process: a CUDA context here would hold GPU memory during the whole run.
    probe = [sys.executable, "-c", "import torch; print(torch.cuda.get_device_name(0))"]
    return subprocess.run(probe, capture_output=True, text=True).stdout.strip() or "unknown"


def run_benchmark(plan: list[RatePlan], args: argparse.Namespace, argv: list[str] | None = None) -> dict:
    deadline = time.monotonic() + args.time_budget if args.time_budget else None
    model = write_llama3_8b_dummy(Path(tempfile.gettempdir()) / "sparse-sglang-llama3-8b-dummy")
    invocation = run_header("benchmark.serving", argv, device=gpu_name())
    servers, results = {}, {}
    for system in args.systems:
        if deadline is not None and time.monotonic() >= deadline:
            print(f"[{system}] time budget spent: not started")
            continue
        servers[system], by_trace = run_system(system, plan, args, model, deadline)
        for trace, runs in by_trace.items():
            results.setdefault(trace, {})[system] = runs
    traces = {
        step.spec.name: {"prompt_len": step.spec.prompt_len, "output_len": step.spec.output_len,
                         "arrivals": "poisson", "token_ids": TOKEN_ID_RANGE, "seed": args.seed}
        for step in plan
    }  # fmt: skip
    return {
        **invocation,
        "servers": servers,
        "traces": traces,
        "invocations": [invocation],
        "results": results,
        "kv_hbm_budget_gb": args.kv_hbm_gb,
        "tp_size": args.tp_size,
        "summary": document_summary(results, servers, args.kv_hbm_gb),
    }


# ---------------------------------------------------------------- command line


def _choices(known):
    def parse(text: str) -> list[str]:
        names = [n for n in text.split(",") if n]
        unknown = [n for n in names if n not in known]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {', '.join(known)}")
        return names

    return parse


def _rates(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--traces", type=_choices(TRACES), default=list(TRACES), help="comma-separated")
    p.add_argument(
        "--systems",
        type=_choices(SYSTEMS),
        default=DEFAULT_SYSTEMS,
        help="comma-separated, run in "
        "order; vanilla has the sparse system's KV dtype, vanilla-bf16 (a second baseline) bf16",
    )
    for spec in TRACES.values():
        p.add_argument(
            f"--rates-{spec.name}",
            type=_rates,
            default=list(spec.default_rates),
            metavar="R,R,...",
            help=f"request rates (req/s); default {','.join(map(str, spec.default_rates))}",
        )
        p.add_argument(f"--num-requests-{spec.name}", type=int, metavar="N", help="overrides --num-requests")
    p.add_argument(
        "--num-requests",
        type=int,
        help="per trace and rate; default: enough arrivals to last --max-seconds-per-rate (12 without it)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--kv-hbm-gb",
        "--kv-hbm-budget-gb",
        type=float,
        default=20.0,
        help="GPU memory (GiB) for KV "
        "on each GPU in every system: a vanilla token pool of this many bytes over its KV dtype's bytes per "
        "token (and GPU); sparse's page cache, summaries and staging",
    )
    p.add_argument("--tp-size", type=int, default=1, help="SGLang's --tp-size for every server (GPUs per server)")
    p.add_argument(
        "--sparse-host-cache-gb",
        type=float,
        default=80.0,
        help="pinned host memory (GiB) holding the sparse system's KV",
    )
    p.add_argument(
        "--extra-server-args",
        default="",
        help="appended to every server's command line (the "
        "baselines' without --kv-cache-dtype / --quantization-param-path: the benchmark sets theirs)",
    )
    p.add_argument(
        "--sparse-server-args",
        default="",
        help="appended to the sparse server's command line; with "
        "--extra-server-args its --kv-cache-dtype and --quantization-param-path are vanilla's too "
        "(give them to every invocation, also one that runs vanilla alone)",
    )
    p.add_argument("--vanilla-server-args", default="", help="appended to the vanilla servers' command lines")
    p.add_argument("--out-dir", default=str(REPO / "benchmark" / "results"))
    p.add_argument("--merge-into", metavar="JSON", help="add to (or start) this result file instead of a new one")
    p.add_argument("--request-timeout", type=float, default=900.0, help="seconds per request")
    p.add_argument(
        "--max-seconds-per-rate",
        type=float,
        default=WINDOW_S,
        help="each rate's window: then stop "
        f"sending and cancel what is in flight (default {WINDOW_S:g}; 0: until every request is done)",
    )
    p.add_argument(
        "--time-budget",
        type=float,
        help="seconds for the whole invocation; past it, rates are cut "
        "short or skipped, so results get written before an outer time limit",
    )
    p.add_argument("--log-dir", default="/tmp/sparse-sglang-serving", help="for the server logs")
    p.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="at each window's end, before cancelling the "
        "requests in flight, profile this many forward steps of the loaded server (traces in --log-dir; "
        "the first rank's summary in the result's 'profile'); 0: none",
    )
    p.add_argument("--dry-run", action="store_true", help="print the plan and a time estimate; start nothing")
    return p.parse_args(argv)  # fmt: skip


def combine(out: Path, inputs: list[Path], ablations: dict[str, Path] | None = None) -> dict:
    """One result file from several (each a whole invocation's file, e.g. one per GPU call): their
    runs merged in order, a later file's (trace, system, rate) replacing an earlier one's; the
    summary recomputed (one input: the same runs, summarized by this version). ``ablations`` (name
    -> a ``benchmark/server_log.py`` comparison file) go in whole under ``ablations``: a variant of
    one system at one rate has no (trace, system, rate) slot of its own."""
    documents = [json.loads(Path(f).read_text()) for f in inputs]
    document = documents[0]
    for newer in documents[1:]:
        document = merge_documents(document, newer)
    document["summary"] = document_summary(
        document["results"], document.get("servers", {}), document.get("kv_hbm_budget_gb")
    )
    if ablations:
        document["ablations"] = {name: json.loads(Path(f).read_text()) for name, f in ablations.items()}
    if len(inputs) > 1:
        document["combined_from"] = [Path(f).name for f in inputs]
    save_result(document, out)
    plot(document["results"], out.with_suffix(".png"))
    return document


# Sparse server flags that differ between a TP=2 run and its TP=1 counterpart by design: the TP
# size, each GPU's page cache and host share, the decode graphs' batch, the per-rank KV scales file
TP_SIZED_FLAGS = frozenset({"--tp-size", "--sparse-gpu-cache-gb", "--sparse-host-cache-gb",
                            "--cuda-graph-max-bs-decode", "--quantization-param-path", "--host", "--port"})  # fmt: skip


def scaling_differences(tp2: dict, tp1: dict) -> list[str]:
    """What else differs between the sparse TP=2 and TP=1 runs that ``tp2_over_tp1`` compares:
    card, date, commit, window (the runs' durations, within 5%), and the sparse server's flags
    apart from :data:`TP_SIZED_FLAGS`. Empty: the same configuration on the same kind of card the
    same day; anything listed is a caveat on the ratio, which is still reported."""

    def flags(doc: dict) -> dict[str, str]:  # each flag's last value ("" for a switch)
        words = without_flags(doc.get("servers", {}).get("sparse", {}).get("flags", []), TP_SIZED_FLAGS)
        values = {w.split("=", 1)[0]: last_flag(words, w.split("=", 1)[0]) for w in words if w.startswith("--")}
        return {k: "" if v is None or v.startswith("--") else v for k, v in values.items()}

    def duration(doc: dict) -> float | None:
        runs = doc.get("results", {}).get("long-generation", {}).get("sparse") or []
        return max(runs, key=lambda r: r["rate"])["duration_s"] if runs and "duration_s" in runs[0] else None

    out = [
        f"{key}: {tp2.get(key)} vs {tp1.get(key)}"
        for key in ("device", "date", "commit")
        if tp2.get(key) != tp1.get(key)
    ]
    d2, d1 = duration(tp2), duration(tp1)
    if d2 and d1 and abs(d2 - d1) > 0.05 * max(d2, d1):
        out.append(f"window: {d2:.0f} s vs {d1:.0f} s")
    f2, f1 = flags(tp2), flags(tp1)
    out += [f"{k}: {f2.get(k, '(unset)')} vs {f1.get(k, '(unset)')}" for k in sorted(f2.keys() | f1.keys())
            if f2.get(k) != f1.get(k)]  # fmt: skip
    return out


def parallel_summary(
    tp2: dict,
    tp1: dict,
    tp_exact: dict | None,
    dp: dict | None,
    tp_vs_tp1: dict | None = None,
    tp_vs_tp1_depth: dict | None = None,
    tp2_beside_tp1: dict | None = None,
) -> dict:
    """The two-GPU summary: sparse TP=2 against vanilla TP=2 (``tp2``, one invocation with
    ``--tp-size 2``, long generation), sparse TP=2 over sparse TP=1 (``tp1``'s sparse run against
    ``tp2_beside_tp1``'s, a sparse TP=2 run made beside it, else ``tp2``'s; with
    :func:`scaling_differences`, what else differs between the two), each at
    its highest long-generation rate (against vanilla: at the same rate), output tokens/s in the
    window's second half (the steady state, as ``throughput_ratio``), as the client received them
    and (``_decoded``) as the servers' logs counted them, with each run's ``late_half_drift`` and
    whether all of them are within :data:`STEADY_DRIFT` (``serving_steady``: False if one is not,
    else None where a run did not record it); and the GPU tests' records
    (``tp_exact``: test_tp_gpu's exact-path agreement; ``dp``: test_dp_gpu's summary;
    ``tp_vs_tp1``: TP=2 against TP=1 with real selection on one layer, step by step, held to that
    test's bar; ``tp_vs_tp1_depth``: the same on four layers, held to staying far nearer TP=1 than
    selection moves). A part not given, or not run, is None (so is a record of an earlier form of
    those tests)."""

    def top(doc: dict, system: str) -> dict | None:
        runs = doc.get("results", {}).get("long-generation", {}).get(system) or []
        return max(runs, key=lambda r: r["rate"], default=None)

    sparse2, sparse1, vanilla2 = top(tp2, "sparse"), top(tp1, "sparse"), top(tp2, "vanilla")
    scaling_doc = tp2_beside_tp1 or tp2
    scaled = top(scaling_doc, "sparse")  # the sparse TP=2 run the scaling ratio takes
    scaling = _ratio(scaled, sparse1, "late_output_throughput") if scaled and sparse1 else None
    same_rate = sparse2 and vanilla2 and sparse2["rate"] == vanilla2["rate"]
    vs_vanilla = _ratio(sparse2, vanilla2, "late_output_throughput") if same_rate else None
    # the same by the servers' logs (what they decoded, whether or not the client kept up)
    decoded_scaling = _ratio(scaled, sparse1, "server_late_decode_throughput") if scaled and sparse1 else None
    decoded_vs_vanilla = _ratio(sparse2, vanilla2, "server_late_decode_throughput") if same_rate else None
    # steady state is checked, not assumed: each run's last quarter against its third
    drifts = {"tp2_vanilla": vanilla2, "tp2_sparse": sparse2, "tp1_sparse": sparse1}
    if tp2_beside_tp1:
        drifts["tp2_sparse_beside_tp1"] = scaled
    drifts = {name: run.get("late_half_drift") for name, run in drifts.items() if run}
    known = [abs(d) <= STEADY_DRIFT for d in drifts.values() if d is not None]
    steady = False if not all(known) else None if len(known) < len(drifts) or not known else True
    selects_as_tp1 = nearer_at_depth = None
    if tp_vs_tp1 is not None:  # the test's measured bar and, if the run counted them, its switch limit
        steps = [a and GreedyAgreement(**a) for a in tp_vs_tp1["forced_steps"]]
        selects_as_tp1 = tp_steps_agree(steps, tp_vs_tp1["logprob_tol"], tp_vs_tp1.get("max_switched"))
    if tp_vs_tp1_depth is not None and "steps" in tp_vs_tp1_depth.get("sparse_vs_dense_tp1", {}):
        steps, selection = (
            [a and GreedyAgreement(**a) for a in rows]
            for rows in (tp_vs_tp1_depth["forced_steps"], tp_vs_tp1_depth["sparse_vs_dense_tp1"]["steps"])
        )
        nearer_at_depth = nearer_than_selection(steps, selection)
    ok_dp = None
    if dp is not None:
        d = dp["summary"]
        ok_dp = (
            d["replicas"] == 2
            and d["statuses"] == [200]
            and d["tracebacks_in_log"] == 0
            and not any(v for leak in d["leaks_per_replica"] for v in leak.values())
        )
    return {
        "tp2_greedy_equal": None if tp_exact is None else all(a["equal"] for a in tp_exact["agreement"]),
        "tp2_throughput_ratio_vs_vanilla": vs_vanilla,
        "tp2_over_tp1_throughput": scaling,
        "tp2_over_tp1_differences": scaling_differences(scaling_doc, tp1) if scaled and sparse1 else None,
        "tp2_decoded_ratio_vs_vanilla": decoded_vs_vanilla,
        "tp2_over_tp1_decoded": decoded_scaling,
        "tp2_selects_as_tp1": selects_as_tp1,
        "tp2_at_depth_nearer_than_selection": nearer_at_depth,
        # the selection tests' prompts: their rules were set on seed 1 (records before the seed was
        # recorded all used it), so only another seed holds them to prompts they were not fitted on
        "tp_test_prompt_seed": None if tp_vs_tp1 is None else tp_vs_tp1.get("prompt_seed", 1),
        "tp2_rate": None if (sparse2 or scaled) is None else (sparse2 or scaled)["rate"],
        "tp1_rate": None if sparse1 is None else sparse1["rate"],
        "late_half_drift": drifts,
        "serving_steady": steady,
        "dp2_ok": ok_dp,
    }


def write_parallel(out: Path, tp2: Path, tp1: Path, tests: list[Path], tp2_beside_tp1: Path | None = None,
                   command: str | None = None) -> dict:  # fmt: skip
    """``serving.py --parallel OUT TP2.json TP1.json [TEST.json ...] [--tp2-beside-tp1 TP2.json]``:
    :func:`parallel_summary` in one file with its inputs (the GPU tests' records by name:
    tp2-exact-gpu-test.json, dp-gpu-test.json, tp2-vs-tp1-one-layer-gpu-test.json,
    tp2-vs-tp1-gpu-test.json; ``-`` for a serving run not made; ``--tp2-beside-tp1``: the sparse TP=2
    run made beside TP=1, which the scaling ratio then takes, TP2.json's pair keeping the vanilla one)."""
    docs = {p.name: json.loads(p.read_text()) for p in tests if p.exists()}  # a test not run: None
    tp2_doc, tp1_doc = ({} if str(p) == "-" else json.loads(p.read_text()) for p in (tp2, tp1))  # "-": not run
    beside = json.loads(tp2_beside_tp1.read_text()) if tp2_beside_tp1 else None
    first = tp2_doc or next(iter(docs.values()), {})
    document = {
        "device": first.get("device"),
        "date": first.get("date"),
        "commit": first.get("commit"),
        "command": command,
        "summary": parallel_summary(
            tp2_doc,
            tp1_doc,
            docs.get("tp2-exact-gpu-test.json"),
            docs.get("dp-gpu-test.json"),
            docs.get("tp2-vs-tp1-one-layer-gpu-test.json"),
            docs.get("tp2-vs-tp1-gpu-test.json"),
            beside,
        ),
        "tp2": tp2_doc,
        "tp1": tp1_doc,
        **({"tp2_beside_tp1": beside} if beside else {}),
        "tests": docs,
    }
    save_result(document, out)
    return document


def versus_quest(out: Path, default_path: Path, quest_path: Path) -> dict:
    """The default's serving pair and quest's, made against one vanilla run in the same windows
    (``--combine`` files): the default's document, its summary with ``ratio_vs_quest_default``
    (the default's throughput ratio over vanilla at its best, the windows' second halves, divided
    by quest's) and quest's summary beside."""
    default, quest = (json.loads(Path(f).read_text()) for f in (default_path, quest_path))

    def ratio(summary: dict) -> float | None:  # the steady state's: the windows' second halves
        return summary.get("throughput_ratio_vs_best", summary.get("throughput_ratio"))

    ours, theirs = ratio(default["summary"]), ratio(quest["summary"])
    document = {**default, "quest": {"summary": quest["summary"], "servers": quest.get("servers", {})}}
    document["summary"] = {**default["summary"], "quest_throughput_ratio": theirs,
                           "ratio_vs_quest_default": round(ours / theirs, 4) if ours and theirs else None}  # fmt: skip
    document["combined_from"] = [Path(default_path).name, Path(quest_path).name]
    save_result(document, out)
    return document


def main(argv: list[str] | None = None) -> None:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--versus-quest"]:
        if len(argv) != 4:
            raise SystemExit("usage: serving.py --versus-quest OUT.json DEFAULT.json QUEST.json (--combine files)")
        document = versus_quest(Path(argv[1]), Path(argv[2]), Path(argv[3]))
        print(f"summary: {json.dumps(document['summary'], indent=1)}\nwrote {argv[1]}")
        return
    if argv[:1] == ["--combine"]:
        inputs, ablations, words = [], {}, iter(argv[2:])
        for word in words:
            if word == "--ablation":
                name, _, path = next(words, "").partition("=")
                if not (name and path):
                    raise SystemExit("--ablation takes NAME=FILE (a benchmark/server_log.py result)")
                ablations[name] = Path(path)
            else:
                inputs.append(Path(word))
        if len(argv) < 2 or not inputs:
            raise SystemExit("usage: serving.py --combine OUT.json IN.json [IN.json ...] [--ablation NAME=FILE ...]")
        document = combine(Path(argv[1]), inputs, ablations)
        print_table(document["results"])
        print(f"\nsummary: {json.dumps(document['summary'], indent=1)}\nwrote {argv[1]}")
        return
    if argv[:1] == ["--parallel"]:
        words, beside = list(argv), None
        if "--tp2-beside-tp1" in words:
            at = words.index("--tp2-beside-tp1")
            if at + 1 >= len(words):
                raise SystemExit("--tp2-beside-tp1 takes a file: the sparse TP=2 run made beside sparse TP=1")
            beside = Path(words.pop(at + 1))
            words.pop(at)
        if len(words) < 4:
            raise SystemExit(
                "usage: serving.py --parallel OUT.json TP2.json TP1.json [GPU-TEST.json ...] [--tp2-beside-tp1 TP2.json]"
            )
        document = write_parallel(Path(words[1]), Path(words[2]), Path(words[3]), [Path(a) for a in words[4:]], beside,
                                  module_command("benchmark.serving", argv))  # fmt: skip
        print(f"summary: {json.dumps(document['summary'], indent=1)}\nwrote {argv[1]}")
        return
    args = parse_args(argv)
    plan = make_plan(args)
    if args.dry_run:
        print_dry_run(plan, args)
        return
    document = run_benchmark(plan, args, argv)
    out = Path(args.merge_into or Path(args.out_dir) / f"serving-{document['date']}.json")
    if args.merge_into and out.exists():
        document = merge_documents(json.loads(out.read_text()), document)
    save_result(document, out)
    plot(document["results"], out.with_suffix(".png"))
    print_table(document["results"])
    print(f"\nsummary: {json.dumps(document['summary'], indent=1)}\nwrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
