"""Steady-state numbers from SGLang server logs: decode throughput, running requests, sparse KV traffic.

SGLang logs a "Decode batch" line every ``--decode-log-interval`` decode steps (40 by default) with
the running requests and the interval's generation throughput (decoded tokens over the wall time
since the previous line, prefill batches in between included); the sparse server adds a "Sparse
KV" line after each (cache hit ratio, H2D pages per step and GB/s). This reads both from server
logs and reports, over the second half of each log's decode lines (the steady state), the
time-weighted output throughput (tokens / seconds, each line's tokens = interval x running) and
the means of the other values. It is the server's view, not the client's: a client cut off before
writing its result (the serving benchmark) leaves these.

    python -m benchmark.server_log NAME=LOG[@COMMIT] [...] [--baseline NAME] [--device NAME] [--out JSON]
                                   [--hit-by-batch PNG]   # hit ratio and H2D vs batch size, per log
                                   [--first-seconds S]    # also: tokens decoded in each log's first S s
                                   [--step-fit]           # also: the decode step against the batch, the prefill's share
    python -m benchmark.server_log --trace TRACE.json.gz [...]  # a profiler trace: idle GPU gaps and what the CPU did

``--step-fit`` fits every interval between two decode lines (40 decode steps at ``R`` running
requests, plus the prefill chunks logged in between) as ``40 x (a + b R) + c x prefill tokens``:
``a + b R`` is the decode step alone and ``c`` the prefill's seconds per token, so the fit says
what a decode step costs per request and what share of the log's time went to prefill.
"""

from __future__ import annotations

import argparse
import bisect
import datetime
import gzip
import json
import re
from collections import defaultdict
from pathlib import Path

DECODE = re.compile(r"Decode batch, #running-req: (\d+),.*gen throughput \(token/s\): ([\d.]+)")
PREFILL = re.compile(r"Prefill batch, #new-seq: \d+, #new-token: (\d+)")
BATCH_BANDS = ((0, 20), (20, 40), (40, 60), (60, 80), (80, 100), (100, 200))
SPARSE = re.compile(r"Sparse KV, cache hit: ([\d.]+), H2D pages/step: ([\d.]+), H2D GB/s: ([\d.]+)")
INTERVAL = re.compile(r"decode_log_interval=(\d+)")
# the "Sparse KV" line's end: host KV tokens in use / the store's, and the running requests' own
HOST = re.compile(r"cache rows: \d+/(\d+).*host KV tokens: (\d+)/(\d+), of running requests: (\d+)")
STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)(?: [A-Z]+\d+)*\]")  # "[... TP0]" under TP


def decode_log_interval(text: str) -> int:
    """Decode steps per "Decode batch" line: the server args' ``decode_log_interval``, SGLang's 40 if not logged."""
    return int(m.group(1)) if (m := INTERVAL.search(text)) else 40


def steady_state(text: str) -> dict:
    """The second half of a log's decode lines, summarized (see the module doc)."""
    interval = decode_log_interval(text)
    decode = [(int(r), float(t)) for r, t in DECODE.findall(text)]
    sparse = [tuple(map(float, x)) for x in SPARSE.findall(text)]
    if not decode:
        raise ValueError("no 'Decode batch' lines")
    half = decode[len(decode) // 2 :]
    tokens = sum(interval * running for running, _ in half)
    seconds = sum(interval * running / tput for running, tput in half if tput > 0)
    out = {"decode_lines": len(decode), "lines_used": len(half), "decode_log_interval": interval,
           "output_throughput": round(tokens / seconds, 1), "running_mean": round(sum(r for r, _ in half) / len(half), 1),
           "running_max": max(r for r, _ in decode), "step_ms": round(1000 * seconds / (interval * len(half)), 1)}  # fmt: skip
    if sparse:
        tail = sparse[len(sparse) // 2 :]
        out.update({"cache_hit_ratio": round(sum(x[0] for x in tail) / len(tail), 3),
                    "h2d_pages_per_step": round(sum(x[1] for x in tail) / len(tail)),
                    "h2d_gb_per_s": round(sum(x[2] for x in tail) / len(tail), 2)})  # fmt: skip
    return out


def decode_intervals(text: str, interval: int) -> list[tuple[int, float, int]]:
    """(running requests, seconds, prefill tokens logged in between) per pair of decode lines; the
    first decode line's interval (from the server's start) is dropped."""
    out, prefill = [], 0
    for line in text.splitlines():
        if m := PREFILL.search(line):
            prefill += int(m.group(1))
        elif m := DECODE.search(line):
            running, rate = int(m.group(1)), float(m.group(2))
            if rate > 0:
                out.append((running, interval * running / rate, prefill))
            prefill = 0
    return out[1:]


def step_fit(text: str) -> dict:
    """The decode step and the prefill's cost fitted over a log's intervals (``--step-fit``, the
    module doc), with decode-only intervals' median step by batch size as a check on the fit."""
    import numpy as np

    interval = decode_log_interval(text)
    rows = decode_intervals(text, interval)
    running = np.array([r for r, _, _ in rows], dtype=float)
    seconds = np.array([s for _, s, _ in rows])
    prefill = np.array([p for _, _, p in rows], dtype=float)
    design = np.stack([np.full_like(running, interval), interval * running, prefill], axis=1)
    (a, b, c), *_ = np.linalg.lstsq(design, seconds, rcond=None)
    decode_only = [(r, s / interval) for r, s, p in rows if p == 0]
    bands = {}
    for lo, hi in BATCH_BANDS:
        steps = [s for r, s in decode_only if lo <= r < hi]
        if steps:
            bands[f"{lo}-{hi - 1}"] = {
                "median_step_ms": round(1e3 * float(np.median(steps)), 2),
                "intervals": len(steps),
            }
    return {
        "intervals": len(rows),
        "step_ms_fixed": round(1e3 * a, 2),
        "step_ms_per_request": round(1e3 * b, 4),
        "prefill_s_per_10k_tokens": round(1e4 * c, 4),
        "prefill_tokens": int(prefill.sum()),
        "seconds": round(float(seconds.sum()), 1),
        "prefill_share": round(float(c * prefill.sum() / seconds.sum()), 3),
        "decode_only_by_batch": bands,
    }


def first_seconds(text: str, seconds: float) -> dict:
    """Decoded tokens per second over the ``seconds`` after a log's first "Decode batch" line (by
    the lines' timestamps; each line counts interval x running tokens), with the mean hit ratio and
    H2D pages per step of the "Sparse KV" lines in that span: the same wall-clock span for every
    log, where :func:`steady_state`'s second half spans however long each log's half took."""
    interval = decode_log_interval(text)
    start, tokens, sparse = None, 0, []
    for line in text.splitlines():
        if not (stamp := STAMP.match(line)):
            continue
        when = datetime.datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S")
        decode = DECODE.search(line)
        if start is None and decode:
            start = when
        if start is None:
            continue
        if (when - start).total_seconds() >= seconds:  # [start, start + seconds)
            break
        if decode:
            tokens += interval * int(decode.group(1))
        elif kv := SPARSE.search(line):
            sparse.append((float(kv.group(1)), float(kv.group(2))))
    if start is None:
        raise ValueError("no 'Decode batch' lines")
    out = {"seconds": seconds, "output_throughput": round(tokens / seconds, 1)}
    if sparse:
        out.update({"cache_hit_ratio": round(sum(h for h, _ in sparse) / len(sparse), 3),
                    "h2d_pages_per_step": round(sum(p for _, p in sparse) / len(sparse))})  # fmt: skip
    return out


def decoded_tokens(text: str, since: datetime.datetime, until: datetime.datetime) -> int:
    """Tokens the server decoded by its "Decode batch" lines stamped in ``[since, until)`` (each
    line counts interval x running): the server's side of a client's token count over the same
    span, to the logs' one-second stamps."""
    interval = decode_log_interval(text)
    tokens = 0
    for line in text.splitlines():
        if (stamp := STAMP.match(line)) and (decode := DECODE.search(line)):
            when = datetime.datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S")
            if since <= when < until:
                tokens += interval * int(decode.group(1))
    return tokens


def sparse_lines(text: str):
    """Each "Sparse KV" line (one log interval) with the running requests of the "Decode batch"
    line before it: ``(running, line)``; a line with no decode line since the one before it is
    skipped."""
    running = None
    for line in text.splitlines():
        if m := DECODE.search(line):
            running = int(m.group(1))
        elif "Sparse KV, " in line and running is not None:
            yield running, line
            running = None


def host_fill(text: str, since: datetime.datetime | None = None) -> dict | None:
    """How full the running requests keep the host store, from the "Sparse KV" lines stamped at
    or after ``since`` (each paired with the running requests of the "Decode batch" line before
    it); None without such lines (a log from before they said the running requests' tokens).

    ``host_fill_ratio`` is the running requests' host tokens over the store's, averaged over the
    lines: the share of the store they fill, cached prefixes no running request holds left out
    (SGLang frees those as new requests need the room). The arithmetic beside it: a running
    request holds ``tokens_per_running_request`` (the mean of their tokens over the mean of
    their count), so the store holds ``requests_host_holds`` such requests, and a host with
    twice the RAM ``2 x`` that, unless the server's request slots (SGLang's request pool, a GPU
    page-cache row each) stop it first: ``requests_twice_the_host_holds``."""
    rows = []
    for running, line in sparse_lines(text):
        if not ((m := HOST.search(line)) and running):
            continue
        stamp = STAMP.match(line)
        if since is not None and (
            stamp is None or datetime.datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S") < since
        ):
            continue
        slots, total, of_running = int(m.group(1)), int(m.group(3)), int(m.group(4))
        rows.append((running, of_running, total, slots))
    if not rows or not any(r[1] for r in rows):
        return None
    n = len(rows)
    running_mean, tokens_mean = sum(r[0] for r in rows) / n, sum(r[1] for r in rows) / n
    host_tokens, slots = rows[-1][2], rows[-1][3]
    per_request = tokens_mean / running_mean
    holds = host_tokens / per_request
    return {
        "lines": n,
        "host_fill_ratio": round(sum(r[1] / r[2] for r in rows) / n, 4),
        "host_tokens": host_tokens,
        "running_mean": round(running_mean, 1),
        "tokens_per_running_request": round(per_request),
        "requests_host_holds": round(holds, 1),
        "request_slots": slots,
        "requests_twice_the_host_holds": round(min(2 * holds, slots), 1),
        "twice_the_host_limited_by": "request slots" if slots < 2 * holds else "host memory",
    }


def hit_ratio_by_batch(text: str, bin_width: int = 8) -> list[dict]:
    """Page-cache hit ratio and H2D pages per step against the batch size: each "Sparse KV" line
    (one log interval) paired with the running requests of the "Decode batch" line before it, the
    intervals binned by running requests (``[lo, lo + bin_width)``), their means per bin."""
    bins: dict[int, list[tuple[float, float]]] = {}
    for running, line in sparse_lines(text):
        if not (m := SPARSE.search(line)):  # an interval with no selection ("cache hit: -")
            continue
        bins.setdefault(running // bin_width * bin_width, []).append((float(m.group(1)), float(m.group(2))))
    return [{"batch_lo": lo, "batch_hi": lo + bin_width - 1, "intervals": len(v),
             "cache_hit_ratio": round(sum(h for h, _ in v) / len(v), 4),
             "h2d_pages_per_step": round(sum(p for _, p in v) / len(v))} for lo, v in sorted(bins.items())]  # fmt: skip


def plot_hit_ratio_by_batch(by_run: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (hit_ax, h2d_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for name, rows in by_run.items():
        x = [(r["batch_lo"] + r["batch_hi"]) / 2 for r in rows]
        hit_ax.plot(x, [r["cache_hit_ratio"] for r in rows], marker="o", label=name)
        h2d_ax.plot(x, [r["h2d_pages_per_step"] for r in rows], marker="o", label=name)
    hit_ax.set(
        xlabel="running requests (decode batch)", ylabel="GPU page-cache hit ratio", title="hit ratio vs batch size"
    )
    h2d_ax.set(
        xlabel="running requests (decode batch)", ylabel="pages loaded per step (H2D)", title="H2D vs batch size"
    )
    h2d_ax.set_yscale("log")
    hit_ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- profiler traces
# Where a loaded server's time goes, from one TP rank's torch-profiler trace (SGLang's
# /start_profile; `benchmark/serving.py --profile-steps N` records one at each window's end, while
# the requests in flight still stream): how long the GPU sat idle between operations, what the
# thread that launches the kernels was doing on the CPU meanwhile, and GPU time by kernel family.
# A serving server keeps its GPU fed only while its CPU launches the next forward before the one
# running ends (SGLang's overlap scheduler), so an idle gap is a forward launched late. Each gap's
# time goes to every event of that thread overlapping it (torch ops, CUDA runtime calls,
# record_function ranges such as the sparse backend's "sparse.*"; nested events each get their
# share, so the shares add up to more than the gaps); what no event covers is Python.

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
# CUDA runtime calls that put work on a stream: their thread is the one that feeds the GPU.
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch", "cuLaunchKernelEx", "cudaLaunchKernelExC")
CPU_CATEGORIES = ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver", "python_function")
# Kernel families by name fragment (first match wins); the rest is "other".
FAMILIES = (
    ("flash_h2d", ("flash_h2d",)),
    ("kv_save", ("direct_d2h", "store_kv", "set_kv", "_index", "Memcpy DtoH", "Memcpy DtoD")),
    # FA2 kernels name the KV layout in the kernel, FA3 (Hopper) ones in its parameters
    ("prefix_attention", ("BatchPrefillWithPagedKVCache", "PagedParams")),
    ("ragged_attention", ("BatchPrefillWithRaggedKVCache", "RaggedParams")),
    ("decode_attention", ("BatchDecode", "Decode")),
    ("merge_state", ("MergeState", "merge_state")),
    ("all_reduce", ("allreduce", "AllReduce", "all_reduce", "nccl")),
    ("gemm", ("gemm", "Gemm", "nvjet", "cutlass", "sm90_xmma", "cublas")),
    ("norm_rope_act", ("rms", "Rms", "norm", "rope", "Rotary", "silu", "act_and_mul")),
)
MIN_GAP_US = 100.0  # idle spans shorter than this are launch latency, not a late forward
TOP = 15
LONG_US = 10_000.0  # CPU events longer than this are few: attribute_gaps checks them against every gap


def family(name: str) -> str:
    return next((fam for fam, parts in FAMILIES if any(p in name for p in parts)), "other")


def intervals_union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``(start, end)`` spans as sorted disjoint spans."""
    out: list[list[float]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def busy_spans(ops: list[dict]) -> tuple[list[tuple[float, float]], list[str], list[str]]:
    """The union of GPU operations' spans (sorted, disjoint) with, per span, the name of the
    operation that ends it and of the one that starts it."""
    spans: list[list[float]] = []
    last: list[str] = []
    first: list[str] = []
    for op in sorted(ops, key=lambda e: e["ts"]):
        start, end = op["ts"], op["ts"] + op["dur"]
        if spans and start <= spans[-1][1]:
            if end > spans[-1][1]:
                spans[-1][1], last[-1] = end, op["name"]
        else:
            spans.append([start, end])
            last.append(op["name"])
            first.append(op["name"])
    return [(a, b) for a, b in spans], last, first


def launch_thread(events: list[dict]) -> tuple | None:
    """``(pid, tid)`` of the thread with the most launch calls."""
    counts: dict[tuple, int] = defaultdict(int)
    for e in events:
        if e.get("name") in LAUNCHES:
            counts[(e.get("pid"), e.get("tid"))] += 1
    return max(counts, key=counts.get) if counts else None


def attribute_gaps(gaps: list[tuple[float, float]], cpu: list[dict]) -> tuple[dict[str, float], float]:
    """Microseconds of ``gaps`` overlapped by each CPU event name, and those overlapped by none."""
    # Short events are found by their start (none starts more than LONG_US before a gap it
    # overlaps); the few long ones (a whole forward's range) are checked against every gap.
    short = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in cpu if e["dur"] <= LONG_US)
    long = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in cpu if e["dur"] > LONG_US]
    starts = [s for s, _, _ in short]
    shares: dict[str, float] = defaultdict(float)
    uncovered = 0.0
    for g0, g1 in gaps:
        near = short[bisect.bisect_left(starts, g0 - LONG_US) : bisect.bisect_left(starts, g1)]
        covered = []
        for start, end, name in near + long:
            overlap = min(end, g1) - max(start, g0)
            if overlap > 0:
                shares[name] += overlap
                covered.append((max(start, g0), min(end, g1)))
        uncovered += (g1 - g0) - sum(b - a for a, b in intervals_union(covered))
    return shares, uncovered


def summarize_trace(events: list[dict]) -> dict:
    """The trace's GPU span, busy and idle time, its idle gaps and what the launching thread did
    during them, and GPU time by kernel family (milliseconds)."""
    ops = [e for e in events if e.get("cat") in GPU_CATEGORIES and "dur" in e]
    if not ops:
        return {"gpu_ops": 0}
    busy, before, after = busy_spans(ops)
    span = busy[-1][1] - busy[0][0]
    busy_us = sum(b - a for a, b in busy)
    # idle spans long enough to be a forward launched late (shorter ones are launch latency), and
    # each by the family of the GPU operation that ended just before it (a prefill forward's last
    # kernel, a decode step's, a save's copy) and of the one that ended it
    gaps: list[tuple[float, float]] = []
    by_neighbour: dict[str, float] = defaultdict(float)
    for i, (a, b) in enumerate(zip(busy, busy[1:])):
        if b[0] - a[1] >= MIN_GAP_US:
            gaps.append((a[1], b[0]))
            by_neighbour[f"{family(before[i])} -> {family(after[i + 1])}"] += b[0] - a[1]
    by_family: dict[str, float] = defaultdict(float)
    for op in ops:
        by_family[family(op["name"])] += op["dur"]
    thread = launch_thread(events)
    cpu = [e for e in events if (e.get("pid"), e.get("tid")) == thread and e.get("cat") in CPU_CATEGORIES
           and "dur" in e]  # fmt: skip
    shares, uncovered = attribute_gaps(gaps, cpu)
    gap_ms = [round((b - a) / 1e3, 3) for a, b in gaps]
    return {
        "gpu_ops": len(ops),
        "span_ms": round(span / 1e3, 1),
        "gpu_busy_ms": round(busy_us / 1e3, 1),
        "gpu_idle_share": round(1 - busy_us / span, 4) if span else None,
        "graph_launches": sum(e.get("name") == "cudaGraphLaunch" for e in cpu),
        "idle_gaps": len(gaps),
        "idle_gap_ms": round(sum(gap_ms), 1),
        "largest_idle_gaps_ms": sorted(gap_ms, reverse=True)[:TOP],
        "idle_gap_cpu_ms": {n: round(v / 1e3, 2) for n, v in sorted(shares.items(), key=lambda kv: -kv[1])[:TOP]},
        "idle_gap_uncovered_ms": round(uncovered / 1e3, 1),
        "idle_gap_ms_by_neighbours": {
            k: round(v / 1e3, 1) for k, v in sorted(by_neighbour.items(), key=lambda kv: -kv[1])[:TOP]
        },
        "gpu_ms_by_family": {f: round(v / 1e3, 1) for f, v in sorted(by_family.items(), key=lambda kv: -kv[1])},
    }


def load_events(path: str) -> list[dict]:
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        return json.load(f)["traceEvents"]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="*", metavar="NAME=LOG[@COMMIT]", help="the commit the server ran")
    parser.add_argument("--trace", nargs="+", default=[], metavar="TRACE", help="summarize these profiler traces "
                        "instead: the GPU's idle gaps and what the CPU did in them")  # fmt: skip
    parser.add_argument("--device", default=None, help="the GPU the logs come from")
    parser.add_argument("--baseline", help="NAME whose throughput and running requests the others are divided by")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--hit-by-batch", type=Path, metavar="PNG", help="also bin each log's intervals by batch size "
                        "(hit ratio and H2D pages per step) into the JSON and plot them here")  # fmt: skip
    parser.add_argument("--first-seconds", type=float, metavar="S", help="also each log's decode throughput over "
                        "the S seconds after its first decode line (the same span for every log)")  # fmt: skip
    parser.add_argument("--step-fit", action="store_true", help="also fit each log's decode step against its batch "
                        "and its prefill's cost and share of the time (the module doc)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.trace:
        traces = {path: summarize_trace(load_events(path)) for path in args.trace}
        print(json.dumps(traces, indent=1))  # a reading of traces, not a result file
        return traces
    if not args.logs:
        parser.error("give server logs (NAME=LOG) or --trace")
    runs, texts = {}, {}
    for item in args.logs:
        name, _, path = item.partition("=")
        path, _, commit = path.partition("@")
        texts[name] = Path(path).read_text(errors="replace")
        runs[name] = {"log": path, "commit": commit or None, **steady_state(texts[name])}
        if args.first_seconds:
            runs[name]["first_seconds"] = first_seconds(texts[name], args.first_seconds)
        if args.step_fit:
            runs[name]["step_fit"] = step_fit(texts[name])
    from sparse_sglang.testing.provenance import run_header

    # The code and machine that wrote the logs, not this checkout's: as the command line names them.
    commits = sorted({run["commit"] for run in runs.values()} - {None})
    result = {**run_header("benchmark.server_log", argv, device=args.device or "unknown (no --device given)",
                           commit=", ".join(commits) or "unknown (no NAME=LOG@COMMIT given)"),
              "runs": runs}  # fmt: skip
    # Without a baseline the summary is each log's steady state; with one, each other log's ratios to it.
    result["summary"] = {name: {k: r[k] for k in ("output_throughput", "running_mean")} for name, r in runs.items()}
    if args.hit_by_batch:
        result["hit_ratio_by_batch"] = {name: hit_ratio_by_batch(text) for name, text in texts.items()}
        plot_hit_ratio_by_batch(result["hit_ratio_by_batch"], args.hit_by_batch)
    if args.baseline:
        base = runs[args.baseline]
        result["summary"] = {name: {"throughput_ratio": round(r["output_throughput"] / base["output_throughput"], 3),
                                    "running_ratio": round(r["running_mean"] / base["running_mean"], 2)}
                             for name, r in runs.items() if name != args.baseline}  # fmt: skip
        if args.first_seconds:
            for name, ratios in result["summary"].items():
                ratios["first_seconds_throughput_ratio"] = round(
                    runs[name]["first_seconds"]["output_throughput"] / base["first_seconds"]["output_throughput"], 3
                )
    print(json.dumps({k: result[k] for k in ("runs", "summary") if k in result}, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
