"""The serving benchmark's pure parts: traces, metrics, log parsing, summary, merge, plot (CPU only)."""

from __future__ import annotations

import asyncio
import datetime
import json
from dataclasses import asdict

import numpy as np
import orjson
import pytest

from benchmark.serving import (
    TOKEN_ID_RANGE,
    TRACES,
    RateRun,
    Request,
    RequestRecord,
    TraceSpec,
    drive,
    generate_payload,
    is_complete,
    late_half_drift,
    main,
    make_plan,
    make_trace,
    max_running_requests,
    merge_documents,
    parse_args,
    plot,
    profile_server,
    server_args,
    server_decode_by_quarter,
    sse_events,
    summarize,
    summarize_rate,
    token_timing,
    tokens_between,
)

LONG_PROMPT = TRACES["long-prompt"]


# ---------------------------------------------------------------- traces


def test_trace_is_deterministic_and_system_independent():
    first = make_trace(LONG_PROMPT, 0.4, 6, seed=0)
    again = make_trace(LONG_PROMPT, 0.4, 6, seed=0)
    # Each system's run regenerates the trace: the bytes sent must be identical.
    assert [generate_payload(r) for r in first] == [generate_payload(r) for r in again]
    assert first[0].input_ids != make_trace(LONG_PROMPT, 0.8, 6, seed=0)[0].input_ids
    assert first[0].input_ids != make_trace(LONG_PROMPT, 0.4, 6, seed=1)[0].input_ids
    assert first[0].input_ids != make_trace(TRACES["long-generation"], 0.4, 6, seed=0)[0].input_ids


@pytest.mark.parametrize("spec", TRACES.values(), ids=TRACES)
def test_trace_lengths_and_token_ids_within_bounds(spec):
    trace = make_trace(spec, 0.2, 40, seed=3)
    prompt_lens = [len(r.input_ids) for r in trace]
    output_lens = [r.max_new_tokens for r in trace]
    assert spec.prompt_len[0] <= min(prompt_lens) and max(prompt_lens) <= spec.prompt_len[1]
    assert spec.output_len[0] <= min(output_lens) and max(output_lens) <= spec.output_len[1]
    ids = np.concatenate([r.input_ids for r in trace])
    assert TOKEN_ID_RANGE[0] <= ids.min() and ids.max() < TOKEN_ID_RANGE[1]


def test_poisson_arrivals_have_the_right_mean_gap():
    rate = 0.25
    # Short prompts: only the arrival process matters here, not 16K-token prompts.
    small = TraceSpec("tiny", (1, 2), (1, 2), (rate,), 1.0)
    arrivals = np.array([r.arrival for r in make_trace(small, rate, 20000, seed=0)])
    gaps = np.diff(arrivals)
    assert arrivals[0] == 0.0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    assert gaps.std() == pytest.approx(1 / rate, rel=0.05)  # exponential: std == mean


def test_per_trace_request_count_overrides_the_default():
    args = parse_args(["--traces", "long-prompt,long-generation", "--num-requests", "5",
                       "--num-requests-long-generation", "3", "--rates-long-prompt", "0.3"])  # fmt: skip
    plan = [(p.spec.name, p.rate, p.num_requests) for p in make_plan(args)]
    assert plan == [("long-prompt", 0.3, 5), ("long-generation", 0.1, 3), ("long-generation", 0.2, 3),
                    ("long-generation", 0.4, 3)]  # fmt: skip


def test_dry_run_prints_the_plan_and_both_server_command_lines(capsys):
    main(["--dry-run", "--rates-long-prompt", "0.5", "--num-requests", "2"])
    out = capsys.readouterr().out
    assert "long-prompt" in out and "long-generation" in out and "rough estimate" in out
    assert "sglang.launch_server" in out and "--attention-backend flashinfer" in out
    vanilla_line = next(line for line in out.splitlines() if line.startswith("vanilla:"))
    sparse_line = next(line for line in out.splitlines() if line.startswith("sparse:"))
    assert "--max-total-tokens 163840" in vanilla_line  # 20 GiB of 8B-shaped KV
    assert "--attention-backend" not in sparse_line and "--max-total-tokens" not in sparse_line
    assert "--sparse-host-cache-gb 80" in sparse_line
    # both stream their new tokens only (the same for each system: what the client receives)
    assert all("--incremental-streaming-output" in line for line in (vanilla_line, sparse_line))


def test_sparse_gets_the_same_hbm_for_kv_as_vanilla():
    """The sparse page cache plus its summaries, staging and table add up to --kv-hbm-gb."""
    import torch

    from benchmark.serving import sparse_gpu_cache_gb
    from sparse_sglang.attention import kept_summaries
    from sparse_sglang.config import GIB, SparseConfig
    from sparse_sglang.mem_cache.plan import plan_memory

    cache = sparse_gpu_cache_gb(20.0, 16.0)  # a host store this machine can size (the plan checks RAM)
    plan = plan_memory(SparseConfig(host_cache_gb=16.0, gpu_cache_gb=cache), num_layers=32, num_kv_heads=8,
                       head_dim=128, dtype=torch.bfloat16, context_len=131072, gpu_kv_bytes=0,
                       **kept_summaries("quest"))  # fmt: skip
    total = plan.cache_bytes + plan.summary_bytes + plan.staging_bytes + plan.table_bytes
    assert 19.99 * GIB < total <= 20 * GIB
    assert plan.max_running_requests >= 50  # rows of 80 pages x 32 layers x 8 heads: 335 MB each
    assert sparse_gpu_cache_gb(20.0, 80.0) < cache  # more host KV, more summaries on the GPU
    with pytest.raises(SystemExit, match="lower --sparse-host-cache-gb"):
        sparse_gpu_cache_gb(1.0, 80.0)


def test_sparse_kv_budget_follows_the_kv_cache_dtype_of_the_extra_server_args():
    """fp8 KV: the same host GiB hold twice the pages; their corners are one byte per channel (the
    default mean/std corners: int8 levels and a scale byte, as bf16 KV's are), so the summaries
    take twice the GPU memory of bf16 KV's, and the page cache gets less of the same budget: that,
    the larger table and the staged prefix's bf16 copy (the 2026-11-23 fp8 run's budget counted none
    of this)."""
    import torch

    from benchmark.serving import kv_cache_dtype, sparse_gpu_cache_gb
    from sparse_sglang.attention import kept_summaries
    from sparse_sglang.config import GIB, SparseConfig
    from sparse_sglang.mem_cache.plan import plan_memory

    assert kv_cache_dtype("--cuda-graph-max-bs 64 --kv-cache-dtype fp8_e4m3") == torch.float8_e4m3fn
    assert kv_cache_dtype("--kv-cache-dtype auto") == kv_cache_dtype("") == torch.bfloat16
    fp8, bf16 = sparse_gpu_cache_gb(20.0, 16.0, kv_dtype=torch.float8_e4m3fn), sparse_gpu_cache_gb(20.0, 16.0)
    assert bf16 - 0.3 < fp8 < bf16
    plan, bf16_plan = (plan_memory(SparseConfig(host_cache_gb=16.0, gpu_cache_gb=cache), num_layers=32, num_kv_heads=8,
                                   head_dim=128, dtype=dtype, context_len=131072, gpu_kv_bytes=0, **kept_summaries("quest"))
                       for cache, dtype in ((fp8, torch.float8_e4m3fn), (bf16, torch.bfloat16)))  # fmt: skip
    assert 19.99 * GIB < plan.cache_bytes + plan.summary_bytes + plan.staging_bytes + plan.table_bytes <= 20 * GIB
    assert plan.shape.num_host_pages == 2 * bf16_plan.shape.num_host_pages
    assert plan.summary_bytes == pytest.approx(2 * bf16_plan.summary_bytes, rel=0.01)
    # Quest's min/max corners of fp8 keys are fp8 themselves, without the scale byte: a larger cache
    minmax = sparse_gpu_cache_gb(20.0, 16.0, kv_dtype=torch.float8_e4m3fn, page_bounds="minmax")
    assert fp8 < minmax < fp8 + 0.01


@pytest.mark.parametrize("extra", ["--sparse-host-cache-gb 92", "--cuda-graph-max-bs 64 --max-total-tokens=9999"])
def test_kv_budget_flags_in_the_extra_server_args_are_refused(extra):
    """The 2026-11-24 slip: a host budget given only to the server sized the page cache for 80 GiB."""
    import argparse

    from benchmark.serving import server_args

    args = argparse.Namespace(kv_hbm_gb=20.0, tp_size=1, sparse_host_cache_gb=16.0, extra_server_args=extra,
                              sparse_server_args="", vanilla_server_args="")  # fmt: skip
    with pytest.raises(SystemExit, match="sizes itself"):
        server_args("sparse", args)
    assert "--cuda-graph-max-bs" in server_args(
        "vanilla", argparse.Namespace(**{**vars(args), "extra_server_args": "--cuda-graph-max-bs 64"})
    )


# ---------------------------------------------------------------- metrics


def test_token_timing_one_token_per_chunk():
    ttft, tbt = token_timing(10.0, [(10.5, 1), (10.6, 2), (10.8, 3)])
    assert ttft == pytest.approx(0.5)
    assert tbt == pytest.approx([0.1, 0.2])


def test_token_timing_splits_multi_token_chunks_and_skips_empty_ones():
    # First chunk carries 2 tokens (TTFT only), a repeat count adds nothing,
    # then 3 tokens arrive 0.3 s after the last token chunk: three 0.1 s samples.
    chunks = [(1.0, 0), (2.0, 2), (2.1, 2), (2.3, 5), (2.5, 6)]
    ttft, tbt = token_timing(0.0, chunks)
    assert ttft == pytest.approx(2.0)
    assert tbt == pytest.approx([0.1, 0.1, 0.1, 0.2])


def test_token_timing_without_tokens():
    assert token_timing(0.0, [(1.0, 0)]) == (None, [])


class _Pieces:
    """Stands in for aiohttp's StreamReader: yields the byte pieces given."""

    def __init__(self, pieces):
        self.pieces = pieces

    async def iter_any(self):
        for piece in self.pieces:
            yield piece


def test_sse_events_reassembles_events_split_across_reads():
    body = b'data: {"a": 1}\n\ndata: {"b": [' + b"7," * 50000 + b"7]}\n\ndata: [DONE]\n\n"
    pieces = [body[i : i + 4096] for i in range(0, len(body), 4096)]

    async def collect():
        return [e async for e in sse_events(_Pieces(pieces))]

    events = asyncio.run(collect())
    assert events[0] == b'{"a": 1}' and events[-1] == b"[DONE]"
    assert len(events) == 3 and events[1].count(b"7") == 50001


def test_a_run_cut_off_counts_what_every_request_streamed():
    """The client against a stand-in of SGLang's streaming /generate (one token per 10 ms): the
    request that finishes is complete; the one still streaming at the cutoff is cancelled but keeps
    its tokens, TTFT and TBT samples; the one never sent has none. Window throughput counts all
    streamed tokens, the late one only those of the second half. The cutoff leaves the short
    request seconds to finish inside the first half even on a loaded two-core machine."""
    from aiohttp import web

    from sparse_sglang.testing.server import standin_server

    async def generate(request):
        body = await request.json()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for n in range(1, body["sampling_params"]["max_new_tokens"] + 1):
            await asyncio.sleep(0.01)
            meta = {"completion_tokens": n, "finish_reason": None}
            await response.write(b"data: " + orjson.dumps({"meta_info": meta}) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    async def main():
        trace = [Request(0.0, [1000] * 8, 10), Request(0.0, [1001] * 8, 1000), Request(9.0, [1002] * 8, 10)]
        async with standin_server([web.post("/generate", generate)]) as url:
            return await drive(url, trace, cutoff=3.0, request_timeout=30)

    run = asyncio.run(main())
    done, cut, unsent = run.records
    assert (done.status, cut.status, unsent.status) == ("ok", "cancelled", "not_sent")
    assert done.output_len == done.streamed_tokens == 10 and done.late_tokens == 0
    assert 30 < cut.streamed_tokens < 300 and cut.output_len == 0 and cut.ttft is not None
    assert 0 < cut.late_tokens < cut.streamed_tokens
    assert unsent.streamed_tokens == 0 and unsent.ttft is None
    result = summarize_rate(1.0, [0], run, None, False)
    assert result.completed == 1 and result.output_throughput == pytest.approx(10 / run.duration)
    assert result.window_output_throughput == pytest.approx((10 + cut.streamed_tokens) / run.duration)
    assert result.late_output_throughput == pytest.approx(cut.late_tokens / (run.duration / 2))
    assert result.without_first_token == 1 and len(run.tbt) == 9 + cut.streamed_tokens - 1
    # every token streamed lands in one quarter of the window; the second half is the last two
    assert sum(run.tokens_by_quarter) == done.streamed_tokens + cut.streamed_tokens
    assert sum(run.tokens_by_quarter[2:]) == cut.late_tokens
    quarter = run.duration / 4
    assert result.throughput_by_quarter == pytest.approx([t / quarter for t in run.tokens_by_quarter])
    assert result.late_half_drift == pytest.approx(late_half_drift(result.throughput_by_quarter))


def _token_stream_route(seconds_per_token: float = 0.01):
    from aiohttp import web

    async def generate(request):
        body = await request.json()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for n in range(1, body["sampling_params"]["max_new_tokens"] + 1):
            await asyncio.sleep(seconds_per_token)
            meta = {"completion_tokens": n, "finish_reason": None}
            await response.write(b"data: " + orjson.dumps({"meta_info": meta}) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    return web.post("/generate", generate)


def test_work_at_the_cutoff_runs_while_requests_stream_and_nothing_after_the_cutoff_counts():
    """``at_cutoff`` (a profile of the loaded server) runs before the requests in flight are
    cancelled, so they still stream meanwhile; the run counts only what arrived before the
    cutoff: a request that finishes during it is cancelled as of the cutoff, without e2e."""
    import time

    from sparse_sglang.testing.server import standin_server

    calls = []

    def at_cutoff():
        calls.append(time.perf_counter())
        time.sleep(1.0)
        return {"profiled": True}

    async def main():
        # B arrives at 1.5 s and needs at least 0.8 s: it ends after the 2 s cutoff, while at_cutoff runs
        trace = [Request(0.0, [1000] * 8, 1000), Request(1.5, [1001] * 8, 80)]
        async with standin_server([_token_stream_route()]) as url:
            return await drive(url, trace, cutoff=2.0, request_timeout=30, at_cutoff=at_cutoff)

    run = asyncio.run(main())
    long, short = run.records
    assert run.at_cutoff == {"profiled": True} and len(calls) == 1
    assert (long.status, short.status) == ("cancelled", "cancelled")
    assert short.e2e is None and short.output_len == 0 and short.streamed_tokens < 80
    # the event loop may wake a hair before the 2 s cutoff
    assert 1.9 <= run.duration < 2.5 and long.streamed_tokens < 2.5 / 0.01
    assert sum(run.tokens_by_quarter) == long.streamed_tokens + short.streamed_tokens
    assert len(run.tbt) == long.streamed_tokens - 1 + max(short.streamed_tokens - 1, 0)
    assert summarize_rate(1.0, [0], run, None, False).profile == {"profiled": True}


def _synthetic_trace() -> list[dict]:
    """Two GPU spans with a 2 ms gap, during which the launching thread (the one with the
    launches) waits in the sparse backend's save wait; another thread's event is not counted."""
    cpu = {"pid": 1, "tid": 7}
    return [
        {"cat": "kernel", "name": "nvjet_gemm", "ts": 0.0, "dur": 1000.0},
        {"cat": "kernel", "name": "flash_h2d_kernel", "ts": 3000.0, "dur": 500.0},
        {"cat": "kernel", "name": "nvjet_gemm", "ts": 3520.0, "dur": 80.0},  # 20 us later: launch latency
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 100.0, "dur": 10.0, **cpu},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 2900.0, "dur": 10.0, **cpu},
        {"cat": "user_annotation", "name": "sparse.wait_saves", "ts": 1200.0, "dur": 1500.0, **cpu},
        {"cat": "cpu_op", "name": "other_thread_op", "ts": 1000.0, "dur": 2000.0, "pid": 1, "tid": 8},
    ]


def test_server_trace_finds_the_idle_gaps_and_what_the_launching_thread_did_in_them():
    from benchmark.server_log import summarize_trace

    out = summarize_trace(_synthetic_trace())
    assert out["gpu_ops"] == 3 and out["span_ms"] == 3.6 and out["gpu_busy_ms"] == 1.6  # 1.58, to 0.1 ms
    assert out["idle_gaps"] == 1 and out["idle_gap_ms"] == 2.0  # the 20 us one is launch latency
    assert out["idle_gap_cpu_ms"] == {"sparse.wait_saves": 1.5, "cudaLaunchKernel": 0.01}
    assert out["idle_gap_uncovered_ms"] == pytest.approx(0.5, abs=0.05)
    assert out["idle_gap_ms_by_neighbours"] == {"gemm -> flash_h2d": 2.0}
    assert out["gpu_ms_by_family"] == {"gemm": 1.1, "flash_h2d": 0.5}
    assert summarize_trace([]) == {"gpu_ops": 0}


def test_profile_server_summarizes_the_first_ranks_trace_and_reports_a_failure_instead_of_raising(tmp_path):
    import gzip

    from aiohttp import web

    from sparse_sglang.testing.server import standin_server

    async def start_profile(request):
        body = await request.json()
        out = tmp_path / "ok"
        out.mkdir()
        for rank in (0, 1):
            with gzip.open(out / f"123-TP-{rank}.trace.json.gz", "wt") as f:
                json.dump({"traceEvents": _synthetic_trace() if rank == 0 else []}, f)
        assert body["num_steps"] == 7 and body["output_dir"] == str(out)
        return web.json_response({"success": True})

    async def main():
        async with standin_server([web.post("/start_profile", start_profile)]) as url:
            loop = asyncio.get_running_loop()
            ok = await loop.run_in_executor(None, lambda: profile_server(url, tmp_path / "ok", 7, timeout=20, settle=0))
            missing = await loop.run_in_executor(None, lambda: profile_server(url + "/nowhere", tmp_path / "no", 7))
            return ok, missing

    ok, missing = asyncio.run(main())
    assert ok["steps"] == 7 and ok["trace"] == "123-TP-0.trace.json.gz" and ok["idle_gap_ms"] == 2.0
    assert missing["steps"] == 7 and "404" in missing["error"]


def test_tokens_between_counts_a_streams_tokens_that_arrived_in_the_span():
    chunks = [(1.0, 2), (2.0, 5), (3.5, 6), (5.0, 10)]  # (arrival, the request's tokens so far)
    assert tokens_between(chunks, 0.0) == 10 and tokens_between(chunks, 2.0) == 8
    assert tokens_between(chunks, 1.5, 3.5) == 3 and tokens_between(chunks, 6.0) == 0
    assert tokens_between([], 0.0, 1.0) == 0


def test_late_half_drift_is_the_last_quarter_against_the_third():
    assert late_half_drift([900.0, 1000.0, 1000.0, 1000.0]) == 0.0
    # the first admitted requests finishing together, their replacements prefilling: a falling end
    assert late_half_drift([0.0, 5600.0, 5400.0, 3900.0]) == pytest.approx(-1500 / 4650)
    assert late_half_drift([]) is None and late_half_drift([0.0, 0.0, 0.0, 0.0]) is None


def _run(statuses, output_len=100, duration=10.0):
    records = []
    for i, status in enumerate(statuses):
        ok = status == "ok"
        records.append(RequestRecord(arrival=float(i), prompt_len=1000, max_new_tokens=output_len, status=status,
                                     sent=float(i) if status != "not_sent" else None,
                                     output_len=output_len if ok else 0, streamed_tokens=output_len if ok else 0,
                                     ttft=0.5 if ok else None,
                                     e2e=2.0 if ok else None))  # fmt: skip
    return RateRun(records, tbt=[0.01] * 99 + [0.1], duration=duration, max_in_flight=len(statuses))


def test_summarize_rate_counts_only_completed_requests():
    result = summarize_rate(0.4, [0, 1, 2], _run(["ok", "ok", "failed", "cancelled", "not_sent"]), 3, True)
    assert (result.completed, result.failed, result.num_requests) == (2, 1, 5)
    assert result.output_throughput == pytest.approx(200 / 10.0)
    assert result.request_throughput == pytest.approx(0.2)
    assert result.total_input_tokens == 2000
    assert result.mean_ttft_ms == pytest.approx(500)
    assert result.median_tbt_ms == pytest.approx(10)
    assert result.p999_tbt_ms > result.p99_tbt_ms >= result.median_tbt_ms
    assert result.max_running_req == 3 and not is_complete(asdict(result))
    assert [r["status"] for r in result.records][2:] == ["failed", "cancelled", "not_sent"]


# ---------------------------------------------------------------- server log


def test_max_running_requests_from_scheduler_log_lines():
    log = "\n".join([
        "[2026-01-10 12:00:00] Load weight end. type=LlamaForCausalLM, dtype=torch.bfloat16",
        "[2026-01-10 12:00:01 TP0] Prefill batch, #new-seq: 1, #new-token: 8192, #cached-token: 0, "
        "token usage: 0.05, #running-req: 2, #queue-req: 3, #pending-token: 30000, cuda graph: False, "
        "input throughput (token/s): 25000.12",
        "[2026-01-10 12:00:02 TP0] Decode batch, #running-req: 7, #token: 120000, token usage: 0.73, "
        "cuda graph: True, gen throughput (token/s): 512.30, #queue-req: 1",
        "[2026-01-10 12:00:03 TP0] Decode batch, #running-req: 5, #token: 90000, token usage: 0.55, "
        "cuda graph: True, gen throughput (token/s): 480.00, #queue-req: 0",
    ])  # fmt: skip
    assert max_running_requests(log) == 7
    assert max_running_requests("[2026-01-10 12:00:00] The server is fired up and ready to roll!") is None


def test_server_late_decode_counts_the_logs_decode_lines_in_the_runs_second_half():
    import datetime

    start = datetime.datetime(2026, 1, 10, 12, 0, 0)
    lines = [f"[{(start + datetime.timedelta(seconds=t)).strftime('%Y-%m-%d %H:%M:%S')} TP0] Decode batch, "
             f"#running-req: {n}, #token: 1, token usage: 0.1, cuda graph: True, gen throughput (token/s): 1.0, "
             f"#queue-req: 0" for t, n in ((2, 10), (5, 20), (6, 30), (9, 40), (10, 50))]  # fmt: skip
    log = "\n".join(["[2026-01-10 11:59:00] server_args=ServerArgs(decode_log_interval=40, ...)", *lines])
    run = _run(["ok"], duration=10.0)
    run.started_at = start.timestamp()
    # quarters [0, 2.5), [2.5, 5), [5, 7.5), [7.5, 10): the lines at 2 s; none; 5 and 6 s; 9 s
    quarters = server_decode_by_quarter(log, run)
    assert quarters == pytest.approx([40 * n / 2.5 for n in (10, 0, 50, 40)])
    assert server_decode_by_quarter(log, _run(["ok"])) is None  # a run without its clock
    # the second half is [5 s, 10 s): the lines at 5, 6 and 9 s, 40 steps each
    result = summarize_rate(1.0, [0], run, None, True, quarters)
    assert result.server_late_decode_throughput == pytest.approx(40 * (20 + 30 + 40) / 5.0)
    assert summarize_rate(1.0, [0], run, None, True).server_late_decode_throughput is None


def test_the_sparse_launcher_takes_the_benchmarks_server_args():
    """Every flag the benchmark gives the sparse server parses as the launcher's (SGLang's and
    --sparse-*), the streaming flag among them."""
    from sparse_sglang.integration.server_args import build_parser

    args = parse_args(["--sparse-server-args", "--sparse-reselect-interval 8"])
    parsed = build_parser().parse_args(["--model-path", "m", *server_args("sparse", args)])
    assert parsed.incremental_streaming_output and parsed.skip_tokenizer_init


# ---------------------------------------------------------------- summary, merge, plot


def _result(rate, tok_s, complete=True):
    statuses = ["ok", "ok"] if complete else ["ok", "cancelled"]
    duration = 100 * statuses.count("ok") / tok_s
    return asdict(summarize_rate(rate, [0], _run(statuses, output_len=100, duration=duration), 4, True))


def _document(system, runs_by_trace):
    results = {trace: {system: runs} for trace, runs in runs_by_trace.items()}
    invocation = {"command": f"python -m benchmark.serving --systems {system}", "commit": "abc",
                  "device": "NVIDIA H100", "date": "2026-01-10"}  # fmt: skip
    return {**invocation, "servers": {system: {"command": f"python -m {system}"}},
            "traces": {t: {} for t in runs_by_trace}, "invocations": [invocation], "results": results,
            "summary": summarize(results)}  # fmt: skip


def test_summary_uses_highest_rate_both_completed():
    results = {
        "long-prompt": {
            "vanilla": [_result(0.2, 100), _result(0.4, 200), _result(0.8, 210, complete=False)],
            "sparse": [_result(0.2, 95), _result(0.4, 190), _result(0.8, 300)],
        },
        "long-generation": {
            "vanilla": [_result(0.1, 400), _result(0.2, 500)],
            "sparse": [_result(0.1, 440), _result(0.2, 300, complete=False)],
        },
    }
    summary = summarize(results)
    assert summary["at_highest_common_complete_rate"]["long-prompt"]["rate"] == 0.4
    assert summary["passthrough_throughput_ratio_by_trace"] == pytest.approx(
        {"long-prompt": 190 / 200, "long-generation": 440 / 400}
    )
    assert summary["passthrough_throughput_ratio"] == pytest.approx(0.95)
    assert summary["at_highest_common_complete_rate"]["long-generation"]["mean_ttft_ratio"] == pytest.approx(1.0)
    # Under overload (cut-off runs count too): the highest rate both ran, on what each streamed.
    overload = summary["at_highest_common_rate"]
    assert overload["long-prompt"]["rate"] == 0.8 and overload["long-generation"]["rate"] == 0.2
    assert overload["long-generation"]["window_output_throughput_ratio"] == pytest.approx(300 / 500)


def test_headline_keys_are_the_issues_ratios_at_the_highest_common_rate():
    results = {
        "long-prompt": {"vanilla": [_result(0.8, 150, complete=False)], "sparse": [_result(0.8, 300, complete=False)]},
        "long-generation": {"vanilla": [_result(1.0, 500, complete=False)], "sparse": [_result(1.0, 2000, complete=False)]},
    }  # fmt: skip
    results["long-prompt"]["vanilla"][0].update(mean_ttft_ms=80_000.0, p99_tbt_ms=20.0)
    results["long-prompt"]["sparse"][0].update(mean_ttft_ms=8_000.0, p99_tbt_ms=30.0)
    results["long-generation"]["vanilla"][0].update(max_running_req=8, p99_tbt_ms=20.0)
    results["long-generation"]["sparse"][0].update(max_running_req=72, p99_tbt_ms=22.0)
    summary = summarize(results)
    assert summary["throughput_ratio"] == pytest.approx(4.0)
    assert summary["throughput_ratio_long_prompt"] == pytest.approx(2.0)
    assert summary["ttft_ratio"] == pytest.approx(10.0)  # vanilla / sparse: higher is better
    assert summary["p99_tbt_ratio"] == pytest.approx(1.1) and summary["p99_tbt_ratio_long_prompt"] == pytest.approx(1.5)
    assert summary["concurrency_ratio"] == pytest.approx(9.0)
    # A trace one system did not run leaves its keys None, not a ratio against nothing.
    only_gen = summarize({"long-generation": results["long-generation"],
                          "long-prompt": {"vanilla": results["long-prompt"]["vanilla"]}})  # fmt: skip
    assert only_gen["throughput_ratio_long_prompt"] is None and only_gen["ttft_ratio"] is None
    assert only_gen["throughput_ratio"] == pytest.approx(4.0)


def test_combine_merges_files_from_several_calls_and_resummarizes(tmp_path):
    from benchmark.serving import main

    vanilla = _document("vanilla", {"long-generation": [_result(1.0, 500, complete=False)]})
    sparse = _document("sparse", {"long-generation": [_result(1.0, 1500, complete=False)]})
    (tmp_path / "v.json").write_text(json.dumps(vanilla))
    (tmp_path / "s.json").write_text(json.dumps(sparse))
    main(["--combine", str(tmp_path / "both.json"), str(tmp_path / "v.json"), str(tmp_path / "s.json")])
    both = json.loads((tmp_path / "both.json").read_text())
    assert set(both["results"]["long-generation"]) == {"vanilla", "sparse"}
    assert both["combined_from"] == ["v.json", "s.json"]
    assert both["summary"]["throughput_ratio"] == pytest.approx(3.0)
    assert (tmp_path / "both.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(SystemExit, match="usage"):
        main(["--combine", str(tmp_path / "x.json")])

    # A variant run compared through the server logs goes in whole, under its name.
    (tmp_path / "abl.json").write_text(json.dumps({"summary": {"lru_bucketed": {"throughput_ratio": 0.96}}}))
    main(["--combine", str(tmp_path / "abl-both.json"), str(tmp_path / "both.json"),
          "--ablation", f"lru={tmp_path / 'abl.json'}"])  # fmt: skip
    with_ablation = json.loads((tmp_path / "abl-both.json").read_text())
    assert with_ablation["ablations"]["lru"]["summary"]["lru_bucketed"]["throughput_ratio"] == 0.96
    assert with_ablation["results"] == both["results"]
    with pytest.raises(SystemExit, match="NAME=FILE"):
        main(["--combine", str(tmp_path / "x.json"), str(tmp_path / "v.json"), "--ablation", "lru"])


def test_ttft_ratio_is_the_largest_over_the_long_prompt_rates_and_every_rate_is_kept():
    def run(rate, ttft_s, p99_ms, tok_s=100):
        result = _result(rate, tok_s, complete=False)
        result.update(mean_ttft_ms=ttft_s * 1000, p99_tbt_ms=p99_ms)
        return result

    # Below vanilla's capacity both answer fast; above it vanilla queues; far above, both queue.
    results = {"long-prompt": {
        "vanilla": [run(0.3, 5.0, 14.0), run(0.4, 20.0, 20.0), run(0.8, 80.0, 19.0)],
        "sparse": [run(0.3, 2.5, 23.0), run(0.4, 4.0, 26.0), run(0.8, 50.0, 3000.0, tok_s=200)],
    }}  # fmt: skip
    summary = summarize(results)
    assert summary["ttft_ratio"] == pytest.approx(5.0) and summary["ttft_ratio_rate"] == 0.4
    by_rate = summary["by_rate"]["long-prompt"]
    assert sorted(by_rate) == [0.3, 0.4, 0.8]
    assert by_rate[0.3]["ttft_ratio"] == pytest.approx(2.0) and by_rate[0.8]["ttft_ratio"] == pytest.approx(1.6)
    assert by_rate[0.4]["tbt_p99_ratio"] == pytest.approx(1.3)
    # The other headline keys stay at the highest rate both ran.
    assert summary["throughput_ratio_long_prompt"] == pytest.approx(2.0)
    assert summary["p99_tbt_ratio_long_prompt"] == pytest.approx(3000 / 19)


def test_summary_without_a_common_complete_rate():
    summary = summarize({"long-prompt": {"vanilla": [_result(0.2, 100)]}})
    assert summary["passthrough_throughput_ratio"] is None
    assert summary["passthrough_throughput_ratio_by_trace"] == {}


def test_merge_of_two_partial_runs():
    vanilla = _document("vanilla", {"long-prompt": [_result(0.2, 100), _result(0.4, 200)]})
    sparse = _document("sparse", {"long-prompt": [_result(0.2, 90), _result(0.4, 180)]})
    merged = merge_documents(vanilla, sparse)
    assert set(merged["results"]["long-prompt"]) == {"vanilla", "sparse"}
    assert set(merged["servers"]) == {"vanilla", "sparse"}
    assert len(merged["invocations"]) == 2 and merged["command"] == sparse["command"]
    assert merged["summary"]["passthrough_throughput_ratio"] == pytest.approx(0.9)

    # A rerun of one rate replaces that rate only; a new trace is added.
    rerun = _document("sparse", {"long-prompt": [_result(0.4, 220)], "long-generation": [_result(0.1, 50)]})
    merged = merge_documents(merged, rerun)
    sparse_runs = merged["results"]["long-prompt"]["sparse"]
    assert [r["rate"] for r in sparse_runs] == [0.2, 0.4]
    assert sparse_runs[1]["output_throughput"] == pytest.approx(220)
    assert merged["summary"]["passthrough_throughput_ratio_by_trace"] == pytest.approx({"long-prompt": 1.1})
    assert "long-generation" in merged["results"]


def test_plot_writes_a_png(tmp_path):
    results = {
        "long-prompt": {"vanilla": [_result(0.2, 100), _result(0.4, 200, complete=False)],
                        "sparse": [_result(0.2, 95), _result(0.4, 190)]},
        "long-generation": {"vanilla": [_result(0.1, 400)]},
    }  # fmt: skip
    path = tmp_path / "serving.png"
    plot(results, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_server_log_steady_state_is_time_weighted_over_the_second_half():
    from benchmark.server_log import steady_state

    lines = ["server_args=ServerArgs(decode_log_interval=10, ...)"]
    for running, tput in [(2, 100.0), (4, 50.0), (4, 200.0), (8, 400.0)]:
        lines.append(
            f"[t] Decode batch, #running-req: {running}, #token: 1, cuda graph: True, gen throughput (token/s): {tput}, #queue-req: 0"
        )
        lines.append(f"[t] Sparse KV, cache hit: 0.5, H2D pages/step: {running}.0, H2D GB/s: 1.0, D2H GB/s: 0.1")
    got = steady_state("\n".join(lines))
    # Second half: 40 tokens at 200 tok/s (0.2 s) and 80 at 400 (0.2 s): 300 tok/s, 20 steps in 0.4 s.
    assert (got["output_throughput"], got["running_mean"], got["running_max"], got["step_ms"]) == (300.0, 6.0, 8, 20.0)
    assert (got["cache_hit_ratio"], got["h2d_pages_per_step"]) == (0.5, 6)


def test_server_log_step_fit_recovers_the_decode_step_and_the_prefill_cost():
    from benchmark.server_log import decode_intervals, step_fit

    # SGLang-formatted lines of a server whose decode step (6 ms + 0.16 ms a request) and prefill
    # (3.6e-5 s a token) are exactly these
    decode = "[t] Decode batch, #running-req: {}, #token: 1, token usage: 0.5, cuda graph: True, gen throughput (token/s): {:.6f}, #queue-req: 3"  # noqa: E501
    lines = [decode.format(10, 100.0)]  # from the start: dropped
    for running, prefill in [(10, 0), (20, 8192), (40, 0), (80, 4096), (60, 12288), (30, 0)]:
        if prefill:
            lines.append(f"[t] Prefill batch, #new-seq: 1, #new-token: {prefill}, #cached-token: 0, token usage: 0.5")
        seconds = 40 * (0.006 + 0.00016 * running) + 3.6e-5 * prefill
        lines.append(decode.format(running, 40 * running / seconds))
    text = "\n".join(lines)
    assert len(decode_intervals(text, 40)) == 6
    fit = step_fit(text)
    assert fit["step_ms_fixed"] == pytest.approx(6.0, abs=0.01)
    assert fit["step_ms_per_request"] == pytest.approx(0.16, abs=1e-4)
    assert fit["prefill_s_per_10k_tokens"] == pytest.approx(0.36, abs=1e-3)
    assert fit["prefill_tokens"] == 8192 + 4096 + 12288 and 0 < fit["prefill_share"] < 1
    assert fit["decode_only_by_batch"]["40-59"] == {"median_step_ms": pytest.approx(12.4, abs=0.01), "intervals": 1}


def test_server_log_hit_ratio_by_batch_pairs_each_interval_with_its_batch(tmp_path):
    from benchmark.server_log import hit_ratio_by_batch, main

    lines = []
    for running, hit, pages in [(3, 0.99, 100), (5, 0.97, 300), (9, 0.90, 1000), (12, 0.80, 2000), (7, 0.95, 500)]:
        lines.append(
            f"[t] Decode batch, #running-req: {running}, #token: 1, cuda graph: True, gen throughput (token/s): 10.0, #queue-req: 0"
        )
        lines.append("[t] Prefill batch, #new-seq: 1, #new-token: 8192")  # between the two: ignored
        lines.append(f"[t] Sparse KV, cache hit: {hit}, H2D pages/step: {pages}.0, H2D GB/s: 1.0, D2H GB/s: 0.1")
    lines.append("[t] Sparse KV, cache hit: 0.1, H2D pages/step: 9.0, H2D GB/s: 1.0")  # no decode line before it
    bins = hit_ratio_by_batch("\n".join(lines), bin_width=8)
    assert [(b["batch_lo"], b["batch_hi"], b["intervals"]) for b in bins] == [(0, 7, 3), (8, 15, 2)]
    assert bins[0]["cache_hit_ratio"] == pytest.approx((0.99 + 0.97 + 0.95) / 3, abs=1e-4)
    assert (bins[1]["cache_hit_ratio"], bins[1]["h2d_pages_per_step"]) == (pytest.approx(0.85), 1500)
    log = tmp_path / "sparse.log"
    log.write_text("\n".join(lines))
    result = main([f"run={log}@abc", "--hit-by-batch", str(tmp_path / "hit.png"), "--out", str(tmp_path / "hit.json")])
    assert result["hit_ratio_by_batch"]["run"] == bins
    assert (tmp_path / "hit.png").read_bytes()[:4] == b"\x89PNG"


def test_server_log_first_seconds_counts_the_same_wall_clock_span_from_the_first_decode_line(tmp_path):
    from benchmark.server_log import first_seconds, main

    def decode(stamp, running):
        return f"[2026-11-24 10:{stamp}] Decode batch, #running-req: {running}, #token: 1, cuda graph: True, gen throughput (token/s): 1.0, #queue-req: 0"

    def kv(stamp, hit, pages):
        return f"[2026-11-24 10:{stamp}] Sparse KV, cache hit: {hit}, H2D pages/step: {pages}, H2D GB/s: 1.0, D2H GB/s: 0.1"

    lines = ["server_args=ServerArgs(decode_log_interval=10, ...)", "[2026-11-24 10:00:00] Prefill batch, #new-seq: 1",
             decode("00:05", 2), kv("00:05", 0.9, 100), decode("00:10", 4), kv("00:10", 0.7, 300),
             decode("00:15", 8), kv("00:15", 0.1, 900)]  # fmt: skip
    # 10 s from the first decode line (10:00:05) take the lines at :05 and :10 (and not :15).
    got = first_seconds("\n".join(lines), 10)
    assert got == {
        "seconds": 10,
        "output_throughput": (20 + 40) / 10,
        "cache_hit_ratio": 0.8,
        "h2d_pages_per_step": 200,
    }
    (tmp_path / "a.log").write_text("\n".join(lines))
    (tmp_path / "b.log").write_text("\n".join(lines).replace("#running-req: 4", "#running-req: 10"))
    result = main([f"a={tmp_path / 'a.log'}", f"b={tmp_path / 'b.log'}", "--baseline", "a", "--first-seconds", "10"])
    assert result["summary"]["b"]["first_seconds_throughput_ratio"] == pytest.approx(120 / 60, abs=1e-3)
    with pytest.raises(ValueError, match="no 'Decode batch'"):
        first_seconds(lines[1], 10)


def test_host_fill_reads_the_running_requests_share_of_the_host_store_from_the_servers_own_lines():
    from benchmark.server_log import host_fill
    from benchmark.serving import sparse_host_fill
    from sparse_sglang.integration.metrics import interval_stats, log_line

    def kv(stamp, used, evictable, slots=128):
        # the line the server logs (metrics.log_line), so that the parser follows its format
        now = {"pages_selected": 10, "pages_loaded": 1, "h2d_bytes": 0, "d2h_bytes": 0, "gpu_cache_rows_open": 1,
               "gpu_cache_slots_free": 1, "gpu_cache_slots": 2, "request_slots": slots, "working_set_pages": 1,
               "host_tokens": 1_000_000, "host_tokens_free": 1_000_000 - used, "host_tokens_in_radix_cache": evictable,
               "host_tokens_evictable": evictable, "host_pages_shared": 0}  # fmt: skip
        return f"[2026-11-24 10:{stamp}] " + log_line(interval_stats(now, now, steps=40, seconds=1.0), now)

    def decode(stamp, running):
        return (
            f"[2026-11-24 10:{stamp}] Decode batch, #running-req: {running}, #token: 1, gen throughput (token/s): 1.0"
        )

    lines = [decode("00:05", 10), kv("00:05", 500_000, 0),  # before `since`: left out
             decode("00:10", 40), kv("00:10", 900_000, 100_000),  # 800K of running requests, 20K each
             decode("00:15", 60), kv("00:15", 1_000_000, 40_000),  # 960K, 16K each
             kv("00:16", 1_000_000, 0)]  # no decode line before it: left out  # fmt: skip
    since = datetime.datetime(2026, 11, 24, 10, 0, 10)
    fill = host_fill("\n".join(lines), since=since)
    assert fill["lines"] == 2 and fill["host_fill_ratio"] == pytest.approx((0.8 + 0.96) / 2)
    assert fill["running_mean"] == 50 and fill["tokens_per_running_request"] == 17600  # 880K over 50
    assert fill["requests_host_holds"] == pytest.approx(1_000_000 / 17600, abs=0.05)
    # twice the host holds 113.6 such requests; 128 request slots do not stop them, 100 do
    assert fill["requests_twice_the_host_holds"] == pytest.approx(113.6, abs=0.05)
    assert fill["twice_the_host_limited_by"] == "host memory"
    capped = host_fill("\n".join(lines).replace("cache rows: 1/128", "cache rows: 1/100"), since=since)
    assert capped["requests_twice_the_host_holds"] == 100 and capped["twice_the_host_limited_by"] == "request slots"
    assert host_fill("\n".join(line for line in lines if "Sparse KV" not in line)) is None
    # the summary takes sparse's long-generation run at its highest rate
    runs = {
        "long-generation": {"sparse": [{"rate": 1.0, "host": {"host_fill_ratio": 0.5}}, {"rate": 2.0, "host": fill}]}
    }
    assert sparse_host_fill(runs) == {"host_fill_ratio": fill["host_fill_ratio"], "host_fill": fill}
    assert sparse_host_fill({"long-prompt": {}}) == {"host_fill_ratio": None, "host_fill": None}


# ---------------------------------------------------------------- the fair baseline (issue 36)


def test_vanilla_token_pool_is_the_kv_budget_over_its_dtypes_bytes_per_token():
    from benchmark.serving import vanilla_max_total_tokens
    from sparse_sglang.testing.models import LLAMA3_8B_KV_BYTES_PER_TOKEN, kv_bytes_per_token

    assert kv_bytes_per_token() == LLAMA3_8B_KV_BYTES_PER_TOKEN == 2 * kv_bytes_per_token(1) == 128 * 1024
    assert vanilla_max_total_tokens(20.0, "bf16") == 163840
    assert vanilla_max_total_tokens(20.0, "fp8_e4m3") == vanilla_max_total_tokens(20.0, "fp8_e5m2") == 327680
    assert vanilla_max_total_tokens(1.5, "fp8_e4m3") == 24576


def _line(out, system):
    return next(line for line in out.splitlines() if line.startswith(f"{system}: "))


def test_dry_run_gives_vanilla_the_sparse_kv_dtype_and_vanilla_bf16_the_same_bytes(capsys):
    main(["--dry-run", "--systems", "vanilla,vanilla-bf16,sparse", "--traces", "long-generation",
          "--rates-long-generation", "2.0", "--num-requests", "2", "--sparse-host-cache-gb", "16",
          "--extra-server-args", "--cuda-graph-max-bs-decode 64 --kv-cache-dtype fp8_e4m3",
          "--sparse-server-args", "--quantization-param-path benchmark/kv-scales-llama3-8b-dummy.json --sparse-reselect-interval 8"])  # fmt: skip
    out = capsys.readouterr().out
    assert "vanilla: fp8_e4m3 KV, 65536 bytes per token: a pool of 327680 tokens" in out
    assert "vanilla-bf16: bf16 KV, 131072 bytes per token: a pool of 163840 tokens" in out
    vanilla, bf16, sparse = (_line(out, s) for s in ("vanilla", "vanilla-bf16", "sparse"))
    assert (
        "--max-total-tokens 327680 --kv-cache-dtype fp8_e4m3 --quantization-param-path benchmark/kv-scales-llama3-8b-dummy.json"
        in vanilla
    )
    assert "--max-total-tokens 163840 --kv-cache-dtype bf16" in bf16
    for line in (vanilla, bf16):
        # The extra args reach every server, less the KV dtype the benchmark sets; sparse's own stay its own.
        assert "--cuda-graph-max-bs-decode 64" in line and "--sparse-reselect-interval" not in line
        assert line.count("--kv-cache-dtype") == 1 and "--attention-backend flashinfer" in line
    assert "kv-scales" not in bf16
    assert "--kv-cache-dtype fp8_e4m3" in sparse and "--sparse-reselect-interval 8" in sparse
    assert "--max-total-tokens" not in sparse


def test_the_kv_dtype_flags_are_read_as_sglang_reads_them_and_refused_for_vanilla():
    import argparse

    from benchmark.serving import kv_dtype_name, server_args

    assert kv_dtype_name("--kv-cache-dtype fp8_e5m2 --kv-cache-dtype=fp8_e4m3") == "fp8_e4m3"  # the last wins
    assert kv_dtype_name("--kv-cache-dtype bfloat16") == kv_dtype_name("") == "bf16"
    with pytest.raises(SystemExit, match="sizes"):
        kv_dtype_name("--kv-cache-dtype nvfp4")
    args = argparse.Namespace(kv_hbm_gb=20.0, tp_size=1, sparse_host_cache_gb=16.0, extra_server_args="",
                              sparse_server_args="--kv-cache-dtype fp8_e4m3", vanilla_server_args="--kv-cache-dtype bf16")  # fmt: skip
    with pytest.raises(SystemExit, match="vanilla takes the sparse system's KV dtype"):
        server_args("vanilla", args)
    args.vanilla_server_args = "--max-total-tokens 5"
    with pytest.raises(SystemExit, match="sizes itself"):
        server_args("sparse", args)


def test_the_default_window_is_400_s_with_enough_arrivals_to_fill_it():
    from benchmark.serving import WINDOW_S, requests_for_window

    args = parse_args(["--traces", "long-generation", "--rates-long-generation", "0.1,2"])
    assert args.max_seconds_per_rate == WINDOW_S >= 400 and args.systems == ["vanilla", "sparse"]
    plan = make_plan(args)
    assert [p.num_requests for p in plan] == [requests_for_window(0.1, 400), requests_for_window(2.0, 400)]
    for step in plan:  # the last arrival falls past the window
        assert make_trace(step.spec, step.rate, step.num_requests, seed=0)[-1].arrival > WINDOW_S
    assert make_plan(parse_args(["--max-seconds-per-rate", "0", "--traces", "long-prompt"]))[0].num_requests == 12
    assert parse_args(["--kv-hbm-budget-gb", "10"]).kv_hbm_gb == 10.0  # the issue's name for --kv-hbm-gb


def _row(rate, late, window=None, running=8, ttft_s=10.0, p99=20.0, p999=40.0, mean_tbt=15.0, duration=400.0):
    row = _result(rate, 100, complete=False)
    row.update(late_output_throughput=late, window_output_throughput=window or late, max_running_req=running,
               mean_ttft_ms=ttft_s * 1000, p99_tbt_ms=p99, p999_tbt_ms=p999, mean_tbt_ms=mean_tbt, duration_s=duration)  # fmt: skip
    return row


def _fair_results(fp8_late=749.0, bf16_late=514.0):
    """The issue's shape: vanilla with fp8 KV (17 running) against vanilla bf16 (8) and sparse (83)."""
    return {
        "long-generation": {
            "vanilla": [_row(2.0, fp8_late, 721.0, running=17, p99=35.0)],
            "vanilla-bf16": [_row(2.0, bf16_late, 543.0, running=8, p99=16.0)],
            "sparse": [_row(1.0, 2252.0, running=85, p99=241.0, p999=900.0),
                       _row(2.0, 2707.0, 2485.0, running=83, p99=251.0, p999=700.0)],
        },
        "long-prompt": {
            "vanilla": [_row(0.4, 200.0, ttft_s=20.0), _row(0.8, 180.0, ttft_s=60.0)],
            "vanilla-bf16": [_row(0.4, 170.0, ttft_s=28.5), _row(0.8, 168.0, ttft_s=80.0)],
            "sparse": [_row(0.4, 209.0, ttft_s=2.0, p99=20.0), _row(0.8, 307.0, ttft_s=30.0, p99=2410.0, duration=270.0)],
        },
    }  # fmt: skip


FP8_SERVERS = {"vanilla": {"kv_cache_dtype": "fp8_e4m3"}, "vanilla-bf16": {"kv_cache_dtype": "bf16"},
               "sparse": {"kv_cache_dtype": "fp8_e4m3"}}  # fmt: skip


def test_every_headline_ratio_is_against_the_stronger_baseline():
    summary = summarize(_fair_results(), FP8_SERVERS)
    assert (summary["baseline"], summary["baseline_system"]) == ("vanilla-fp8", "vanilla")
    assert summary["baseline_chosen_by"] == {"trace": "long-generation",
                                             "late_output_throughput": {"vanilla": 749.0, "vanilla-bf16": 514.0}}  # fmt: skip
    assert summary["throughput_ratio_vs_best"] == pytest.approx(2707 / 749)  # second half
    assert summary["window_throughput_ratio_vs_best"] == pytest.approx(2485 / 721)
    assert summary["throughput_ratio_long_prompt_vs_best"] == pytest.approx(307 / 180)
    assert summary["concurrency_ratio_vs_best"] == pytest.approx(83 / 17)
    assert summary["ttft_ratio_vs_best"] == pytest.approx(10.0) and summary["ttft_ratio_rate_vs_best"] == 0.4
    assert summary["p99_tbt_ratio_vs_best"] == pytest.approx(251 / 35)
    # The largest sparse p99 over every rate it ran, not only the headline's.
    assert summary["p99_tbt_ms_max"] == 2410.0 and summary["p99_tbt_ms_max_at"] == {"trace": "long-prompt", "rate": 0.8}
    assert summary["p999_tbt_ms_max"] == 900.0
    assert summary["tbt_ms"]["long-generation"] == {
        "rate": 2.0, "vanilla": {"mean": 15.0, "p99": 35.0, "p999": 40.0, "window_s": 400.0},
        "sparse": {"mean": 15.0, "p99": 251.0, "p999": 700.0, "window_s": 400.0}}  # fmt: skip
    assert summary["window_s_min"] == 270.0
    # Each baseline's own ratios stay beside; the old keys remain against "vanilla".
    assert summary["vs_baseline"]["vanilla-bf16"]["label"] == "vanilla-bf16"
    assert summary["vs_baseline"]["vanilla-bf16"]["throughput_ratio"] == pytest.approx(2707 / 514)
    assert summary["vs_baseline"]["vanilla-bf16"]["concurrency_ratio"] == pytest.approx(83 / 8)
    assert summary["throughput_ratio"] == pytest.approx(2485 / 721)

    # bf16 stronger (more tokens in the second half): every ratio follows it.
    flipped = summarize(_fair_results(fp8_late=500.0, bf16_late=514.0), FP8_SERVERS)
    assert (flipped["baseline"], flipped["baseline_system"]) == ("vanilla-bf16", "vanilla-bf16")
    assert flipped["throughput_ratio_vs_best"] == pytest.approx(2707 / 514)
    assert flipped["concurrency_ratio_vs_best"] == pytest.approx(83 / 8)
    assert flipped["ttft_ratio_vs_best"] == pytest.approx(14.25)
    # A tie goes to vanilla, the sparse system's dtype.
    assert summarize(_fair_results(fp8_late=514.0), FP8_SERVERS)["baseline_system"] == "vanilla"


def test_baseline_labels_and_summary_without_every_system():
    results = _fair_results()
    # vanilla alone, its dtype from the server's flags (an older file has no kv_cache_dtype key).
    only = {t: {s: runs for s, runs in systems.items() if s != "vanilla-bf16"} for t, systems in results.items()}
    old_servers = {"vanilla": {"flags": ["--max-total-tokens", "163840", "--cuda-graph-max-bs", "64"]}}
    summary = summarize(only, old_servers)
    assert summary["baseline"] == "vanilla-bf16" and summary["baseline_system"] == "vanilla"
    fp8_flags = {"vanilla": {"flags": ["--kv-cache-dtype", "fp8_e4m3"]}}
    assert summarize(only, fp8_flags)["baseline"] == "vanilla-fp8"
    assert summarize(only)["baseline"] == "vanilla"  # no server record: the name, not a guess
    # No baseline at all: the keys are there, None.
    none = summarize({"long-generation": {"sparse": results["long-generation"]["sparse"]}})
    assert none["baseline"] is None and none["throughput_ratio_vs_best"] is None and none["tbt_ms"] == {}
    assert none["p99_tbt_ms_max"] == 251.0


def test_combine_of_an_older_file_without_the_new_keys(tmp_path):
    """A file from before issue 36: no kv_cache_dtype in its server records, rows without the
    second-half throughput: the fair keys it cannot give are None, the rest still computed."""
    old = _document("vanilla", {"long-generation": [_result(2.0, 500, complete=False)]})
    sparse = _document("sparse", {"long-generation": [_result(2.0, 2000, complete=False)]})
    old["servers"]["vanilla"]["flags"] = ["--max-total-tokens", "163840"]
    for document in (old, sparse):
        for runs in document["results"]["long-generation"].values():
            for row in runs:
                del row["late_output_throughput"], row["p999_tbt_ms"]
    (tmp_path / "v.json").write_text(json.dumps(old))
    (tmp_path / "s.json").write_text(json.dumps(sparse))
    main(["--combine", str(tmp_path / "both.json"), str(tmp_path / "v.json"), str(tmp_path / "s.json")])
    summary = json.loads((tmp_path / "both.json").read_text())["summary"]
    assert summary["baseline"] == "vanilla-bf16"
    assert summary["throughput_ratio_vs_best"] is None
    assert summary["window_throughput_ratio_vs_best"] == pytest.approx(4.0) == summary["throughput_ratio"]
    assert summary["p999_tbt_ms_max"] is None and summary["p99_tbt_ms_max"] is not None


def test_merge_refuses_one_system_name_with_two_kv_dtypes():
    first = _document("vanilla", {"long-generation": [_result(2.0, 500, complete=False)]})
    second = _document("vanilla", {"long-generation": [_result(1.0, 700, complete=False)]})
    first["servers"]["vanilla"]["flags"] = ["--max-total-tokens", "163840"]  # bf16, before issue 36
    second["servers"]["vanilla"]["kv_cache_dtype"] = "fp8_e4m3"
    with pytest.raises(SystemExit, match="bf16 KV in one file and fp8_e4m3"):
        merge_documents(first, second)
    second["servers"]["vanilla"]["kv_cache_dtype"] = "bf16"
    assert merge_documents(first, second)["summary"]["baseline"] == "vanilla-bf16"


def test_tensor_parallel_servers_get_the_same_kv_bytes_on_each_gpu():
    """``--tp-size 2``: each server is told it, vanilla's pool holds twice the tokens (each GPU has
    half the kv heads of every token in the same bytes), sparse's page cache is each GPU's (the
    summaries of half the heads beside it); a --tp-size in the server args is refused."""
    from benchmark.serving import server_args, sparse_gpu_cache_gb

    one = parse_args(["--kv-hbm-gb", "20", "--sparse-host-cache-gb", "64"])
    two = parse_args(["--kv-hbm-gb", "20", "--sparse-host-cache-gb", "64", "--tp-size", "2"])
    flag = lambda words, name: words[words.index(name) + 1]  # noqa: E731
    vanilla1, vanilla2 = server_args("vanilla", one), server_args("vanilla", two)
    assert "--tp-size" not in vanilla1 and flag(vanilla2, "--tp-size") == "2"
    assert int(flag(vanilla2, "--max-total-tokens")) == 2 * int(flag(vanilla1, "--max-total-tokens"))
    sparse2 = server_args("sparse", two)
    assert flag(sparse2, "--tp-size") == "2" and flag(sparse2, "--sparse-host-cache-gb") == "64"
    # per GPU: half the heads of the same pages, so half the summaries and a larger page cache
    other1 = 20 - sparse_gpu_cache_gb(20, 64)
    assert float(flag(sparse2, "--sparse-gpu-cache-gb")) == pytest.approx(20 - other1 / 2, abs=2e-3)
    with pytest.raises(SystemExit, match="--tp-size"):
        server_args("sparse", parse_args(["--extra-server-args", "--tp-size 2"]))


def test_kv_scales_for_another_tp_size_are_refused_before_a_server_starts():
    """SGLang runs a rank whose scales a file lacks at 1.0 (the dummy keys become fp8 zeros), so
    the benchmark refuses a scales file whose ranks are not the servers' --tp-size."""
    from benchmark.serving import server_args

    def args(path: str, tp: int):
        kv = f"--kv-cache-dtype fp8_e4m3 --quantization-param-path {path}"
        return parse_args(["--sparse-server-args", kv, "--tp-size", str(tp)])

    one, two = "benchmark/kv-scales-llama3-8b-dummy.json", "benchmark/kv-scales-llama3-8b-dummy-tp2.json"
    for system in ("vanilla", "sparse"):
        assert "--quantization-param-path" in server_args(system, args(one, 1))
        assert two in server_args(system, args(two, 2))
        with pytest.raises(
            SystemExit, match=r"--quantization-param-path .*rank\(s\) 0; --tp-size 2 needs exactly 0, 1"
        ):
            server_args(system, args(one, 2))
    with pytest.raises(SystemExit, match="not a KV scales file"):
        server_args("sparse", args("pyproject.toml", 1))


def test_parallel_summary_reads_the_tp_runs_and_the_two_gpu_tests(tmp_path):
    from benchmark.serving import main

    def same(gap: float) -> dict:
        return {"equal": True, "first_difference": None, "max_logprob_gap": gap, "reference_margin": None}

    def switched(margin: float) -> dict:
        return {"equal": False, "first_difference": 0, "max_logprob_gap": 0.0, "reference_margin": margin}

    def doc(systems: dict, ratio=None) -> dict:
        runs = {s: [{"rate": r, "late_output_throughput": t, "late_half_drift": 0.05} for r, t in v]
                for s, v in systems.items()}  # fmt: skip
        return {"device": "H100", "date": "d", "commit": "c", "results": {"long-generation": runs},
                "summary": {"throughput_ratio": ratio}}  # fmt: skip

    files = {
        # the file's own window ratio (3.2) is not the steady state's (3.5)
        "tp2.json": doc({"vanilla": [(4.0, 1000.0)], "sparse": [(2.0, 2000.0), (4.0, 3500.0)]}, ratio=3.2),
        "tp1.json": doc({"sparse": [(2.0, 2000.0)]}),
        "tp2-exact-gpu-test.json": {"agreement": [{"equal": True}, {"equal": True}]},
        "dp-gpu-test.json": {"summary": {"replicas": 2, "statuses": [200], "tracebacks_in_log": 0,
                                         "leaks_per_replica": [{"slots": 0}, {"slots": 0}]}},
        "tp2-vs-tp1-one-layer-gpu-test.json": {"logprob_tol": 0.4, "max_switched": None,
                                               "forced_steps": [same(0.3), switched(0.01), same(0.1), None]},
        # four layers: 1 switch and a 0.4 gap against selection's 8 switches and 1.0
        "tp2-vs-tp1-gpu-test.json": {"forced_steps": [same(0.4), switched(0.5), None, same(0.1)],
                                     "sparse_vs_dense_tp1": {"steps": [same(1.0)] + [switched(2.0)] * 8}},
    }  # fmt: skip
    # what the servers' logs counted as decoded (tp1's run without the count: an older file)
    tp2_runs = files["tp2.json"]["results"]["long-generation"]
    tp2_runs["vanilla"][0]["server_late_decode_throughput"] = 1100.0
    tp2_runs["sparse"][1]["server_late_decode_throughput"] = 4400.0
    for name, body in files.items():
        (tmp_path / name).write_text(json.dumps(body))
    out = tmp_path / "parallel.json"
    main(["--parallel", str(out), *(str(tmp_path / n) for n in files)])
    summary = json.loads(out.read_text())["summary"]
    assert summary == {"tp2_greedy_equal": True, "tp2_throughput_ratio_vs_vanilla": 3.5,
                       "tp2_over_tp1_throughput": 1.75, "tp2_over_tp1_differences": [],
                       "tp2_decoded_ratio_vs_vanilla": 4.0,
                       "tp2_over_tp1_decoded": None, "tp2_selects_as_tp1": True,
                       "tp2_at_depth_nearer_than_selection": True, "tp_test_prompt_seed": 1,
                       "tp2_rate": 4.0, "tp1_rate": 2.0, "late_half_drift": {"tp2_vanilla": 0.05, "tp2_sparse": 0.05, "tp1_sparse": 0.05},
                       "serving_steady": True, "dp2_ok": True}  # fmt: skip
    # a run whose last quarter fell from its third: not steady; a run that did not record it: unknown
    tp2_runs["sparse"][1]["late_half_drift"] = -0.2
    (tmp_path / "tp2.json").write_text(json.dumps(files["tp2.json"]))
    main(["--parallel", str(out), *(str(tmp_path / n) for n in files)])
    assert json.loads(out.read_text())["summary"]["serving_steady"] is False
    del tp2_runs["vanilla"][0]["late_half_drift"]  # not steady whatever vanilla's was
    (tmp_path / "tp2.json").write_text(json.dumps(files["tp2.json"]))
    main(["--parallel", str(out), *(str(tmp_path / n) for n in files)])
    assert json.loads(out.read_text())["summary"]["serving_steady"] is False
    tp2_runs["sparse"][1]["late_half_drift"] = 0.02
    (tmp_path / "tp2.json").write_text(json.dumps(files["tp2.json"]))
    main(["--parallel", str(out), *(str(tmp_path / n) for n in files)])
    assert json.loads(out.read_text())["summary"]["serving_steady"] is None
    # a step TP=1 was sure of switched: not rounding (on held-out prompts, which the summary names)
    one_layer = files["tp2-vs-tp1-one-layer-gpu-test.json"]
    one_layer["forced_steps"][1]["reference_margin"] = 1.5
    one_layer["prompt_seed"] = 7
    (tmp_path / "tp2-vs-tp1-one-layer-gpu-test.json").write_text(json.dumps(one_layer))
    main(["--parallel", str(out), *(str(tmp_path / n) for n in files)])
    summary = json.loads(out.read_text())["summary"]
    assert summary["tp2_selects_as_tp1"] is False and summary["tp_test_prompt_seed"] == 7
    # a near-tie switch, but more switches than a run that counted them allowed
    one_layer["forced_steps"][1]["reference_margin"] = 0.01
    one_layer["max_switched"] = 0
    (tmp_path / "tp2-vs-tp1-one-layer-gpu-test.json").write_text(json.dumps(one_layer))
    main(["--parallel", str(out), *(str(tmp_path / n) for n in files)])
    assert json.loads(out.read_text())["summary"]["tp2_selects_as_tp1"] is False
    # at depth, three switches against selection's eight: more than a quarter
    depth = files["tp2-vs-tp1-gpu-test.json"]
    depth["forced_steps"] = [switched(0.5)] * 3 + [same(0.1)]
    (tmp_path / "tp2-vs-tp1-gpu-test.json").write_text(json.dumps(depth))
    main(["--parallel", str(out), *(str(tmp_path / n) for n in files)])
    assert json.loads(out.read_text())["summary"]["tp2_at_depth_nearer_than_selection"] is False
    # records of the tests' earlier forms (a depth record without selection's steps), or none run
    (tmp_path / "tp2-vs-tp1-gpu-test.json").write_text(json.dumps({"logprob_tol": 0.26, "forced_steps": []}))
    (tmp_path / "tp2-vs-tp1-one-layer-gpu-test.json").unlink()
    main(["--parallel", str(out), *(str(tmp_path / n) for n in files)])
    summary = json.loads(out.read_text())["summary"]
    assert summary["tp2_at_depth_nearer_than_selection"] is None and summary["tp2_selects_as_tp1"] is None


def test_tp_scaling_names_what_else_differs_between_the_two_runs():
    """``tp2_over_tp1`` is reported whatever the two runs were, with what differs besides the TP
    size: the flags sized by TP do not count; another card, window or sparse flag does."""
    from benchmark.serving import scaling_differences

    def doc(device: str, duration: float, flags: list[str]) -> dict:
        run = {"rate": 2.0, "duration_s": duration}
        return {"device": device, "date": "d", "commit": "c", "servers": {"sparse": {"flags": flags}},
                "results": {"long-generation": {"sparse": [run]}}}  # fmt: skip

    base = ["--load-format", "dummy", "--skip-tokenizer-init", "--kv-cache-dtype", "fp8_e4m3"]
    tp2 = doc(
        "H200", 330.2, [*base, "--tp-size", "2", "--sparse-host-cache-gb", "184", "--cuda-graph-max-bs-decode", "192"]
    )
    tp1 = doc("H200", 329.9, [*base, "--sparse-host-cache-gb", "92", "--cuda-graph-max-bs-decode", "96"])
    assert scaling_differences(tp2, tp1) == []
    tp2["servers"]["sparse"]["flags"] += ["--sparse-prefill-cuda-graph", "true"]
    assert scaling_differences(tp2, doc("H100", 540.0, tp1["servers"]["sparse"]["flags"])) == [
        "device: H200 vs H100",
        "window: 330 s vs 540 s",
        "--sparse-prefill-cuda-graph: true vs (unset)",
    ]


def test_parallel_scaling_takes_the_tp2_run_made_beside_tp1(tmp_path):
    """``--tp2-beside-tp1``: on four GPUs the scaling pair (sparse TP=2 beside sparse TP=1) and the
    vanilla pair run in different stages; the scaling ratio takes the run beside TP=1, the vanilla
    ratio stays within its own pair, and the extra run's drift counts toward ``serving_steady``."""
    from benchmark.serving import main

    def doc(systems: dict, duration: float = 330.0) -> dict:
        runs = {s: [{"rate": r, "late_output_throughput": t, "late_half_drift": 0.05, "duration_s": duration}]
                for s, (r, t) in systems.items()}  # fmt: skip
        return {"device": "H200", "date": "d", "commit": "c", "results": {"long-generation": runs}}

    files = {
        "pair.json": doc({"vanilla": (4.0, 1000.0), "sparse": (4.0, 3100.0)}),
        "tp1.json": doc({"sparse": (2.0, 1600.0)}),
        "alone.json": doc({"sparse": (4.0, 3000.0)}, duration=500.0),
    }
    for name, body in files.items():
        (tmp_path / name).write_text(json.dumps(body))
    out, paths = tmp_path / "parallel.json", [str(tmp_path / n) for n in ("pair.json", "tp1.json")]
    main(["--parallel", str(out), *paths])
    assert json.loads(out.read_text())["summary"]["tp2_over_tp1_throughput"] == pytest.approx(3100 / 1600)
    main(["--parallel", str(out), *paths, "--tp2-beside-tp1", str(tmp_path / "alone.json")])
    document = json.loads(out.read_text())
    summary = document["summary"]
    assert summary["tp2_throughput_ratio_vs_vanilla"] == pytest.approx(3.1)
    assert summary["tp2_over_tp1_throughput"] == pytest.approx(3000 / 1600)
    assert summary["tp2_over_tp1_differences"] == ["window: 500 s vs 330 s"]  # the beside run's, not the pair's
    assert summary["late_half_drift"]["tp2_sparse_beside_tp1"] == 0.05 and summary["serving_steady"] is True
    assert document["tp2_beside_tp1"]["results"] == files["alone.json"]["results"]
    files["alone.json"]["results"]["long-generation"]["sparse"][0]["late_half_drift"] = 0.4
    (tmp_path / "alone.json").write_text(json.dumps(files["alone.json"]))
    main(["--parallel", str(out), "--tp2-beside-tp1", str(tmp_path / "alone.json"), *paths])  # anywhere
    assert json.loads(out.read_text())["summary"]["serving_steady"] is False
    with pytest.raises(SystemExit, match="--tp2-beside-tp1 takes a file"):
        main(["--parallel", str(out), *paths, "--tp2-beside-tp1"])


def test_versus_quest_divides_the_default_ratio_by_quest_s(tmp_path):
    default = {"summary": {"throughput_ratio_vs_best": 3.0, "throughput_ratio": 2.0, "p99_tbt_ms": 200},
               "servers": {"sparse": {"flags": []}}}  # fmt: skip
    quest = {
        "summary": {"throughput_ratio_vs_best": 2.5},
        "servers": {"sparse": {"flags": ["--sparse-page-bounds", "minmax"]}},
    }
    paths = [tmp_path / "d.json", tmp_path / "q.json"]
    for path, doc in zip(paths, (default, quest)):
        path.write_text(json.dumps(doc))
    out = tmp_path / "vs.json"
    main(["--versus-quest", str(out), *map(str, paths)])
    summary = json.loads(out.read_text())["summary"]
    assert summary["ratio_vs_quest_default"] == 1.2 and summary["quest_throughput_ratio"] == 2.5
    assert summary["p99_tbt_ms"] == 200
