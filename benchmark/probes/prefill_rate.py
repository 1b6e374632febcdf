"""Prefill throughput of vanilla SGLang and the sparse server, alone: no decoding next to it.

Under the long-prompt trace both servers spend most GPU time prefilling, so the output-throughput
ratio there is bounded by the ratio of their prefill rates. This measures those rates directly,
with the serving benchmark's exact server flags (same KV budget, same extra args):

- ``alone``: prompts of 16K, 32K and 48K tokens, one at a time, one output token each;
  prefill tok/s = prompt tokens / latency.
- ``queued``: ``--queued`` prompts of 32K tokens sent at once (what an overloaded server sees);
  prefill tok/s = all their tokens / time to the last answer.

Fresh random token ids per prompt, so the radix cache reuses nothing.

    python benchmark/probes/prefill_rate.py --sparse-server-args "--kv-cache-dtype fp8_e4m3 \
        --quantization-param-path benchmark/kv-scales-llama3-8b-dummy.json"   # about 6 minutes, H100

Writes ``benchmark/results/prefill-rate-<date>.json``; summary ``sparse_over_vanilla_alone`` and
``sparse_over_vanilla_queued`` (prefill tok/s ratios).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import shlex
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from sparse_sglang.testing.models import LLAMA3_8B_TOKEN_IDS, write_llama3_8b_dummy
from sparse_sglang.testing.provenance import add_server_run_args, finish_run
from sparse_sglang.testing.server import ServerProcess, flush_cache, generate_ids

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repo root holds `benchmark`
from benchmark.serving import SYSTEMS, server_args, warm_up  # noqa: E402

ALONE_TOKENS = (16384, 32768, 49152)
QUEUED_TOKENS = 32768


def fresh_prompt(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(*LLAMA3_8B_TOKEN_IDS, size=n).tolist()


def timed_prefills(url: str, prompts: list[list[int]]) -> float:
    """Seconds from sending every prompt at once to the last one's single output token."""
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        list(pool.map(lambda ids: generate_ids(url, ids, 1), prompts))
    return time.perf_counter() - start


def measure(url: str, rng: np.random.Generator, queued: int) -> dict:
    alone = []
    for n in ALONE_TOKENS:
        seconds = timed_prefills(url, [fresh_prompt(rng, n)])
        alone.append({"prompt_tokens": n, "seconds": round(seconds, 4), "tokens_per_s": round(n / seconds)})
    prompts = [fresh_prompt(rng, QUEUED_TOKENS) for _ in range(queued)]
    seconds = timed_prefills(url, prompts)
    total = QUEUED_TOKENS * queued
    return {
        "alone": alone,
        "alone_tokens_per_s": round(sum(ALONE_TOKENS) / sum(r["seconds"] for r in alone)),
        "queued": {"prompts": queued, "prompt_tokens": QUEUED_TOKENS, "seconds": round(seconds, 3)},
        "queued_tokens_per_s": round(total / seconds),
    }


def add_system_args(p: argparse.ArgumentParser) -> None:
    """The systems and their server flags (this benchmark's and ``prefill_profile.py``'s)."""
    p.add_argument("--systems", default="vanilla,sparse")
    p.add_argument("--kv-hbm-gb", type=float, default=20.0, help="as benchmark/serving.py")
    p.add_argument("--sparse-host-cache-gb", type=float, default=80.0, help="as benchmark/serving.py")
    p.add_argument("--extra-server-args", default="", help="appended to both servers' command lines")
    p.add_argument(
        "--sparse-server-args",
        default="",
        help="appended to the sparse server's only (e.g. FP8 KV, "
        "which the serving benchmark's sparse runs use and its vanilla runs do not)",
    )


def system_flags(system: str, args: argparse.Namespace) -> list[str]:
    """The serving benchmark's flags for ``system``. The sparse server's own args join the extra
    ones before the KV budget is sized: FP8 KV there means a larger page cache in the same GPU
    memory, as in the serving benchmark."""
    extra = f"{args.extra_server_args} {args.sparse_server_args}" if system == "sparse" else args.extra_server_args
    return server_args(system, argparse.Namespace(**{**vars(args), "extra_server_args": extra}))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_system_args(p)
    p.add_argument("--queued", type=int, default=8)
    add_server_run_args(p, "prefill-rate")
    args = p.parse_args(argv)

    model = write_llama3_8b_dummy(Path(tempfile.gettempdir()) / "sparse-sglang-llama3-8b-dummy")
    systems = {}
    for system in args.systems.split(","):
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        log = Path(args.log_dir) / f"{system}-{stamp}.log"
        flags = system_flags(system, args)
        with ServerProcess(SYSTEMS[system], model, flags, log_path=log, start_timeout=600) as server:
            warm_up(server.url)
            flush_cache(server.url)
            rng = np.random.default_rng(0)  # the same prompts for both systems
            systems[system] = {"command": shlex.join(server.command), **measure(server.url, rng, args.queued)}
        print(system, {k: v for k, v in systems[system].items() if k.endswith("per_s")})

    def ratio(key: str) -> float | None:
        if {"vanilla", "sparse"} <= systems.keys():
            return round(systems["sparse"][key] / systems["vanilla"][key], 3)
        return None

    summary = {
        "sparse_over_vanilla_alone": ratio("alone_tokens_per_s"),
        "sparse_over_vanilla_queued": ratio("queued_tokens_per_s"),
        **{f"{s}_{k}": v[k] for s, v in systems.items() for k in ("alone_tokens_per_s", "queued_tokens_per_s")},
    }
    return finish_run("benchmark/probes/prefill_rate.py", argv, {"systems": systems, "summary": summary}, args.out_dir,
                      "prefill-rate-{date}.json")  # fmt: skip


if __name__ == "__main__":
    main()
