"""Where a prefill's GPU time goes, vanilla SGLang vs the sparse server (issue 5: it found why
sparse prefill ran at 0.87-0.89x vanilla's rate in ``prefill_rate.py``, fp8 prefixes on FA2).

Each system starts with the serving benchmark's flags (dummy 8B weights, 20 GiB of GPU memory for
KV, chunks of 8,192 tokens; ``--sparse-server-args`` for the sparse server alone, e.g. FP8 KV),
prefills one warm-up prompt of ``--prompt-tokens`` (the JIT of every chunk's kernels), then records
the ``--steps`` forward steps of a fresh prompt of the same length with SGLang's profiler
(``/start_profile``: torch's profiler) and reads the trace: the wall span from the first GPU
operation to the last, the time any GPU operation ran (overlapping streams counted once), and
the GPU time by kernel family (summed per stream, so families on a side stream can add up to
more than the busy time).

    python benchmark/probes/prefill_profile.py --sparse-server-args "--kv-cache-dtype fp8_e4m3 \\
        --quantization-param-path benchmark/kv-scales-llama3-8b-dummy.json"   # about 7 minutes, H100

Writes ``benchmark/results/prefill-profile-<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import gzip
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmark.probes.decode_profile import top_kernels  # noqa: E402
from benchmark.probes.prefill_rate import add_system_args, fresh_prompt, system_flags  # noqa: E402
from benchmark.server_log import GPU_CATEGORIES, family, intervals_union  # noqa: E402
from benchmark.serving import SYSTEMS  # noqa: E402
from sparse_sglang.testing.models import write_llama3_8b_dummy  # noqa: E402
from sparse_sglang.testing.provenance import add_server_run_args, finish_run  # noqa: E402
from sparse_sglang.testing.server import ServerProcess, flush_cache, generate_ids  # noqa: E402


def busy_ms(ops: list[dict]) -> float:
    """Milliseconds during which at least one of ``ops`` ran (their intervals' union)."""
    return sum(b - a for a, b in intervals_union([(op["ts"], op["ts"] + op["dur"]) for op in ops])) / 1e3


def prefill_profile(events: list[dict]) -> dict:
    """Wall span, GPU-busy time and time by family of every GPU operation in the trace."""
    ops = [e for e in events if e.get("cat") in GPU_CATEGORIES and "dur" in e]
    if not ops:
        return {"gpu_ops": 0}
    by_family = defaultdict(float)
    for op in ops:
        by_family[family(op["name"])] += op["dur"] / 1e3
    start, end = min(e["ts"] for e in ops), max(e["ts"] + e["dur"] for e in ops)
    return {"gpu_ops": len(ops), "span_ms": (end - start) / 1e3, "gpu_busy_ms": busy_ms(ops),
            **{f"{f}_ms": round(v, 3) for f, v in sorted(by_family.items())},
            "top_kernels": top_kernels(ops, start, end + 1, 1)}  # fmt: skip


def profile_system(system: str, args, model: Path, log_dir: Path) -> dict:
    flags = system_flags(system, args)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    trace_dir = log_dir / f"trace-{system}-{stamp}"
    rng = np.random.default_rng(0)  # the same prompts for both systems
    with ServerProcess(
        SYSTEMS[system], model, flags, log_path=log_dir / f"{system}-{stamp}.log", start_timeout=600
    ) as server:
        generate_ids(server.url, fresh_prompt(rng, args.prompt_tokens), 1)  # JIT of every chunk's kernels
        flush_cache(server.url)
        requests.post(server.url + "/start_profile", json={"output_dir": str(trace_dir), "num_steps": args.steps,
                                                           "activities": ["CPU", "GPU"], "with_stack": False,
                                                           "record_shapes": False}, timeout=600).raise_for_status()  # fmt: skip
        t0 = time.perf_counter()
        generate_ids(server.url, fresh_prompt(rng, args.prompt_tokens), 1)
        seconds = time.perf_counter() - t0
        deadline = time.time() + 300
        while not glob.glob(str(trace_dir / "*.json*")) and time.time() < deadline:
            time.sleep(2)
        time.sleep(5)  # let the export finish
    files = sorted(glob.glob(str(trace_dir / "*.json*")))
    if not files:
        raise SystemExit(f"{system}: no trace written under {trace_dir}")
    with (gzip.open if files[-1].endswith(".gz") else open)(files[-1], "rt") as f:
        events = json.load(f)["traceEvents"]
    return {"flags": flags, "prompt_seconds_profiled": round(seconds, 3), "trace_file": Path(files[-1]).name,
            **prefill_profile(events)}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_system_args(p)
    p.add_argument("--prompt-tokens", type=int, default=32768)
    p.add_argument("--steps", type=int, default=4, help="forward steps profiled: the prompt's chunks")
    add_server_run_args(p, "prefill-profile")
    args = p.parse_args(argv)
    log_dir = Path(args.log_dir)
    model = write_llama3_8b_dummy(log_dir / "llama3-8b-dummy")
    systems = {}
    for system in args.systems.split(","):
        systems[system] = profile_system(system, args, model, log_dir)
        print(
            system,
            json.dumps({k: v for k, v in systems[system].items() if k not in ("flags", "top_kernels")}),
            flush=True,
        )
    keys = sorted({k for s in systems.values() for k in s if k.endswith("_ms")})
    summary = {k: {s: round(v.get(k, 0.0), 2) for s, v in systems.items()} for k in keys}
    return finish_run("benchmark/probes/prefill_profile.py", argv, {"args": vars(args) | {"out_dir": str(args.out_dir)},
                                                             "systems": systems, "summary": summary},
                      args.out_dir, "prefill-profile-{date}.json")  # fmt: skip


if __name__ == "__main__":
    main()
