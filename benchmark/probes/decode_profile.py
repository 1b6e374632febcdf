"""Where a sparse decode step's time goes on a loaded server (issue 5: the step profile).

The serving runs decode ~31 requests in ~31 ms a step although the decode benchmark times the
sparse attention of 32 layers at ~6 ms and the weights' GEMMs take ~6 ms. This starts the sparse
server on the 8B shape (dummy weights, the serving benchmark's 20 GiB of GPU memory for KV and 80
GiB of host KV), lets ``--requests`` requests of ``--prompt-tokens`` tokens prefill and decode, then
records ``--steps`` decode steps with SGLang's profiler (``/start_profile``: torch's profiler, CPU
and GPU) and reads the trace: per step (one CUDA-graph launch to the next) the wall time, the time
the GPU ran kernels, and that time by kernel family.

    python benchmark/probes/decode_profile.py      # about 4 minutes with the server start

Writes ``benchmark/results/decode-profile-<date>.json``.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import random
import statistics
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmark.serving import server_args  # noqa: E402
from sparse_sglang.testing.models import LLAMA3_8B_TOKEN_IDS, write_llama3_8b_dummy  # noqa: E402
from sparse_sglang.testing.provenance import add_server_run_args, finish_run  # noqa: E402
from sparse_sglang.testing.server import SPARSE_MODULE, ServerProcess, sparse_state  # noqa: E402

# Kernel families by name fragment (first match wins); the rest is "other".
FAMILIES = (
    ("sparse_score", ("_score_kernel", "_score_cached_kernel")),
    ("topk", ("topk", "TopK", "radix")),
    ("sparse_retrieve", ("retrieve",)),
    ("flash_h2d", ("flash_h2d", "gather_blocks")),
    ("sparse_index_save", ("_index", "store", "direct_d2h")),
    ("flashinfer_decode", ("BatchDecode", "BatchPrefillWithPagedKVCache", "PersistentVariableLength")),
    ("gemm", ("gemm", "Gemm", "nvjet", "cutlass", "sm90_xmma", "cublas")),
    ("norm_rope_act", ("rms", "Rms", "norm", "rope", "Rotary", "silu", "act_and_mul")),
    ("sampling", ("sampling", "Sampling", "argmax", "softmax")),
)


def family(name: str) -> str:
    return next((fam for fam, parts in FAMILIES if any(p in name for p in parts)), "other")


def step_profile(events: list[dict]) -> dict:
    """Per decode step (from one ``cudaGraphLaunch`` to the next): wall ms, GPU-busy ms, and ms by
    kernel family; medians over the steps, and under ``mean`` their means (steps differ: with
    ``--sparse-reselect-interval`` N only some steps select from every page), with every step's
    wall and busy ms under ``per_step``."""
    launches = sorted(e["ts"] for e in events if e.get("name") == "cudaGraphLaunch")
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    steps = []
    for start, end in zip(launches, launches[1:]):
        inside = [k for k in kernels if start <= k["ts"] < end]
        by_family = defaultdict(float)
        for k in inside:
            by_family[family(k["name"])] += k["dur"] / 1e3
        steps.append(
            {
                "wall_ms": (end - start) / 1e3,
                "gpu_busy_ms": sum(by_family.values()),
                **{f"{f}_ms": v for f, v in by_family.items()},
            }
        )
    if not steps:
        return {"steps": 0}
    keys = sorted({k for s in steps for k in s})
    return {"steps": len(steps), **{k: statistics.median(s.get(k, 0.0) for s in steps) for k in keys},
            "mean": {k: statistics.fmean(s.get(k, 0.0) for s in steps) for k in keys},
            "per_step": [{"wall_ms": s["wall_ms"], "gpu_busy_ms": s["gpu_busy_ms"]} for s in steps],
            "top_kernels": top_kernels(kernels, launches[0], launches[-1], len(steps))}  # fmt: skip


def top_kernels(kernels: list[dict], start: float, end: float, steps: int, n: int = 15) -> list[tuple[str, float]]:
    total = defaultdict(float)
    for k in kernels:
        if start <= k["ts"] < end:
            total[k["name"][:120]] += k["dur"] / 1e3 / steps
    return sorted(total.items(), key=lambda kv: -kv[1])[:n]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=16384)
    parser.add_argument(
        "--new-tokens", type=int, default=3000, help="each request's (they are stopped after the profile)"
    )
    parser.add_argument("--steps", type=int, default=8)
    # The serving benchmark's sparse server (benchmark/serving.py's flags and budgets).
    parser.add_argument("--sparse-host-cache-gb", type=float, default=80.0)
    parser.add_argument("--kv-hbm-gb", type=float, default=20.0)
    parser.add_argument("--extra-server-args", default="--cuda-graph-max-bs-decode 64")
    add_server_run_args(parser, "decode-profile")
    args = parser.parse_args(argv)
    log_dir = Path(args.log_dir)
    model = write_llama3_8b_dummy(log_dir / "llama3-8b-dummy")
    flags = server_args("sparse", args)
    rng = random.Random(0)
    prompts = [[rng.randrange(*LLAMA3_8B_TOKEN_IDS) for _ in range(args.prompt_tokens)] for _ in range(args.requests)]
    trace_dir = log_dir / "trace"
    with ServerProcess(SPARSE_MODULE, model, flags, log_path=log_dir / "server.log") as server:
        url = server.url

        def send(i: int) -> None:
            body = {"input_ids": prompts[i], "rid": f"profiled-{i}",
                    "sampling_params": {"max_new_tokens": args.new_tokens, "ignore_eos": True}}  # fmt: skip
            try:
                requests.post(url + "/generate", json=body, timeout=3600)
            except requests.RequestException:
                pass

        threads = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(args.requests)]
        for t in threads:
            t.start()
        deadline = time.time() + 600
        while sparse_state(url).get("gpu_cache_rows_open", 0) < args.requests and time.time() < deadline:
            time.sleep(2)
        time.sleep(5)  # past the last prefill: decode steps only
        state = sparse_state(url)
        requests.post(url + "/start_profile", json={"output_dir": str(trace_dir), "num_steps": args.steps, "activities": ["CPU", "GPU"],
                                                    "with_stack": False, "record_shapes": False}, timeout=600).raise_for_status()  # fmt: skip
        deadline = time.time() + 300
        while not glob.glob(str(trace_dir / "*.json*")) and time.time() < deadline:
            time.sleep(2)
        time.sleep(5)  # let the export finish
        for i in range(args.requests):
            requests.post(url + "/abort_request", json={"rid": f"profiled-{i}"}, timeout=60)
    files = sorted(glob.glob(str(trace_dir / "*.json*")))
    if not files:
        raise SystemExit(f"no trace written under {trace_dir}")
    opener = gzip.open if files[-1].endswith(".gz") else open
    with opener(files[-1], "rt") as f:
        events = json.load(f)["traceEvents"]
    summary = {"rows_open_when_profiled": state.get("gpu_cache_rows_open"), "hit_ratio_so_far": state.get("hit_ratio"),
               **step_profile(events)}  # fmt: skip
    body = {"flags": flags, "args": vars(args) | {"out_dir": str(args.out_dir)}, "trace_file": Path(files[-1]).name,
            "summary": summary}  # fmt: skip
    return finish_run("benchmark/probes/decode_profile.py", argv, body, args.out_dir, "decode-profile-{date}.json")


if __name__ == "__main__":
    main()
