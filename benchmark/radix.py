"""Prefix sharing through SGLang's radix cache on the sparse server (issue 7's measurement).

A shared-prefix workload like ``sglang.bench_serving``'s ``generated-shared-prefix``: ``--groups``
groups of ``--per-group`` requests; a group's requests share a ``--prefix-tokens`` system prompt
and each adds its own ``--question-tokens``, then decodes ``--output-tokens`` (greedy, ignore_eos,
``input_ids`` in: the 8B shape with dummy weights). The same workload runs on two sparse servers,
radix cache on and ``--disable-radix-cache``. Group by group:

1. the group's first request alone: its prefix is not cached anywhere (cold TTFT);
2. its second request alone: with the radix cache, a prefix hit (hit TTFT);
3. the rest of the group at once, polling ``/get_server_info`` for the host KV tokens in use
   (their peak over the use before them: what those requests hold together, beyond a prefix the
   radix cache already holds);
4. the host KV tokens in use once the group is done (with the radix cache: its prefix and the
   requests' own tokens stay cached until evicted).

Summary (radix on unless named): ``prefix_hit_ttft_ratio`` (median hit TTFT / median cold TTFT,
each request alone), ``host_gb_per_group`` (host KV kept per group: the slope over the groups),
``host_gb_per_request`` (a group's peak extra host KV / its concurrent requests, radix on and
off), ``throughput_ratio_vs_no_radix`` (output tokens per second over the whole workload),
``ttft_rest_ratio_vs_no_radix`` (median TTFT of the concurrent requests, radix on / off).

    python -m benchmark.radix                           # 8 groups x 16 requests, 16K-token prefixes
                                                        # (estimate: two server starts + ~2.5 minutes)
    python -m benchmark.radix --groups 16 --per-group 32   # the issue's example size (not yet run)

Writes ``benchmark/results/radix-<date>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from sparse_sglang.config import GIB
from sparse_sglang.testing.models import LLAMA3_8B_KV_BYTES_PER_TOKEN, LLAMA3_8B_TOKEN_IDS, write_llama3_8b_dummy
from sparse_sglang.testing.provenance import add_server_run_args, finish_run
from sparse_sglang.testing.server import SPARSE_MODULE, ServerProcess, flush_cache, sparse_state, streamed_meta


@dataclass(frozen=True)
class Workload:
    groups: int
    per_group: int
    prefix_tokens: int
    question_tokens: int
    output_tokens: int
    seed: int = 0

    def prompt(self, group: int, request: int) -> list[int]:
        """The group's shared prefix, then this request's own question (deterministic ids)."""
        shared = random.Random(f"{self.seed}-prefix-{group}")
        own = random.Random(f"{self.seed}-question-{group}-{request}")
        lo, hi = LLAMA3_8B_TOKEN_IDS
        return [shared.randrange(lo, hi) for _ in range(self.prefix_tokens)] + [
            own.randrange(lo, hi) for _ in range(self.question_tokens)
        ]


def host_tokens_used(url: str) -> int:
    sparse = sparse_state(url)
    return sparse["host_tokens"] - sparse["host_tokens_free"]


async def generate(session: aiohttp.ClientSession, url: str, ids: list[int], max_new_tokens: int) -> dict:
    """One streamed greedy request: its TTFT, end-to-end time, output tokens and cached tokens."""
    sent, ttft, meta = time.perf_counter(), None, {}
    async for arrived, meta in streamed_meta(session, url, ids, max_new_tokens):
        if ttft is None and meta.get("completion_tokens", 0) > 0:
            ttft = arrived - sent
    return {"ttft_s": ttft, "e2e_s": time.perf_counter() - sent, "output_tokens": meta.get("completion_tokens", 0),
            "cached_tokens": meta.get("cached_tokens", 0)}  # fmt: skip


class PeakPoller:
    """Polls the host KV tokens in use every ``interval`` s on a thread; ``peak`` is the largest seen."""

    def __init__(self, url: str, interval: float = 0.2):
        self.url, self.interval, self.peak = url, interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, host_tokens_used(self.url))
            self._stop.wait(self.interval)

    def __enter__(self) -> PeakPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, host_tokens_used(self.url))


async def run_workload(url: str, work: Workload) -> dict:
    groups = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=3600)) as session:  # fmt: skip
        start = time.perf_counter()
        for g in range(work.groups):
            before = host_tokens_used(url)
            cold = await generate(session, url, work.prompt(g, 0), work.output_tokens)
            hit = await generate(session, url, work.prompt(g, 1), work.output_tokens)  # alone, like the cold one
            before_rest = host_tokens_used(url)  # with the radix cache: the group's prefix now cached
            with PeakPoller(url) as poller:
                rest = await asyncio.gather(*(generate(session, url, work.prompt(g, r), work.output_tokens)
                                              for r in range(2, work.per_group)))  # fmt: skip
            groups.append({"host_tokens_before": before, "host_tokens_before_rest": before_rest, "cold": cold, "hit": hit,
                           "rest": list(rest), "host_tokens_peak": poller.peak, "host_tokens_after": host_tokens_used(url)})  # fmt: skip
        seconds = time.perf_counter() - start
    return {"groups": groups, "seconds": seconds}


def slope(ys: list[float]) -> float:
    """Least-squares slope of ``ys`` over 0, 1, 2, ... (0 for fewer than two points)."""
    n = len(ys)
    if n < 2:
        return 0.0
    mean_x, mean_y = (n - 1) / 2, sum(ys) / n
    return sum((x - mean_x) * (y - mean_y) for x, y in enumerate(ys)) / sum((x - mean_x) ** 2 for x in range(n))


def summarize(run: dict, work: Workload, kv_bytes_per_token: int) -> dict:
    """One mode's numbers (see module doc)."""
    groups = run["groups"]
    cold = [g["cold"]["ttft_s"] for g in groups]
    hit = [g["hit"]["ttft_s"] for g in groups]
    rest = [r["ttft_s"] for g in groups for r in g["rest"]]
    out_tokens = sum(g["cold"]["output_tokens"] + g["hit"]["output_tokens"] + sum(r["output_tokens"] for r in g["rest"])
                     for g in groups)  # fmt: skip
    gb = kv_bytes_per_token / GIB
    extra = [(g["host_tokens_peak"] - g["host_tokens_before_rest"]) / max(work.per_group - 2, 1) for g in groups]
    return {
        "ttft_cold_median_s": statistics.median(cold), "ttft_hit_median_s": statistics.median(hit),
        "ttft_rest_median_s": statistics.median(rest), "ttft_ratio": statistics.median(hit) / statistics.median(cold),
        "cached_tokens_hit_median": statistics.median(g["hit"]["cached_tokens"] for g in groups),
        "host_gb_per_group": slope([g["host_tokens_after"] for g in groups]) * gb,
        "host_gb_per_request": statistics.median(extra) * gb,
        "output_tokens_per_s": out_tokens / run["seconds"],
    }  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--per-group", type=int, default=16)
    parser.add_argument("--prefix-tokens", type=int, default=16384)
    parser.add_argument("--question-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument(
        "--host-cache-gb",
        type=float,
        default=48.0,
        help="without sharing, a group's prefixes all need room (15 x 16.6K tokens: 31 GiB)",
    )
    parser.add_argument("--extra-server-args", default="")
    add_server_run_args(parser, "radix")
    args = parser.parse_args(argv)
    work = Workload(args.groups, args.per_group, args.prefix_tokens, args.question_tokens, args.output_tokens)
    model = write_llama3_8b_dummy(Path(args.log_dir) / "llama3-8b-dummy")
    flags = ["--load-format", "dummy", "--skip-tokenizer-init", "--mem-fraction-static", "0.8",
             "--sparse-host-cache-gb", str(args.host_cache_gb), *args.extra_server_args.split()]  # fmt: skip
    runs, summaries = {}, {}
    for mode, extra in (("radix", []), ("no_radix", ["--disable-radix-cache"])):
        with ServerProcess(
            SPARSE_MODULE, model, [*flags, *extra], log_path=Path(args.log_dir) / f"{mode}.log"
        ) as server:
            flush_cache(server.url, 60)
            runs[mode] = asyncio.run(run_workload(server.url, work))
        summaries[mode] = summarize(runs[mode], work, LLAMA3_8B_KV_BYTES_PER_TOKEN)
    r, n = summaries["radix"], summaries["no_radix"]
    summary = {
        "prefix_hit_ttft_ratio": r["ttft_ratio"], "host_gb_per_group": r["host_gb_per_group"],
        "host_gb_per_request": r["host_gb_per_request"], "host_gb_per_request_no_radix": n["host_gb_per_request"],
        "throughput_ratio_vs_no_radix": r["output_tokens_per_s"] / n["output_tokens_per_s"],
        "ttft_rest_ratio_vs_no_radix": r["ttft_rest_median_s"] / n["ttft_rest_median_s"],
    }  # fmt: skip
    body = {"workload": asdict(work), "flags": flags, "modes": summaries, "runs": runs, "summary": summary}
    return finish_run("benchmark.radix", argv, body, args.out_dir, "radix-{date}.json")


if __name__ == "__main__":
    main()
