"""How fast this machine pins host memory: one ``cudaHostAlloc`` (``alloc_pinned``) against
threads faulting the memory in and one ``cudaHostRegister`` (``alloc_pinned_parallel``), by
thread count. Decided how the host store is pinned (docs/results.md, "Start-up").

    python -m benchmark.probes.pin_rate --gib 8 --out pin-rate.json
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from sparse_sglang.testing.provenance import run_header, save_result
from sparse_sglang.transfer.layout import plan_pin_chunks
from sparse_sglang.transfer.native import host_ext


def timed(make) -> float:
    started = time.perf_counter()
    buf = make()
    seconds = time.perf_counter() - started
    del buf
    return seconds


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=8.0)
    parser.add_argument("--threads", default="1,4,8,16")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.cuda.init()
    nbytes = int(args.gib * (1 << 30))
    ext = host_ext()
    rows = [{"path": "cudaHostAlloc", "seconds": timed(lambda: ext.alloc_pinned(nbytes))}]
    for threads in map(int, args.threads.split(",")):
        chunks = plan_pin_chunks(nbytes, threads)
        seconds = timed(lambda: ext.alloc_pinned_parallel(nbytes, chunks, threads))
        rows.append({"path": "faulted in by threads, one cudaHostRegister", "threads": threads, "seconds": seconds})
    for row in rows:
        row.update(seconds=round(row["seconds"], 3), gb_per_s=round(nbytes / row["seconds"] / 1e9, 2))
        print(row, flush=True)
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    threaded = max((r for r in rows if "threads" in r), key=lambda r: r["gb_per_s"])
    summary = {"cuda_host_alloc_gb_per_s": rows[0]["gb_per_s"], "threaded_best_gb_per_s": threaded["gb_per_s"],
               "threaded_best_threads": threaded["threads"]}  # fmt: skip
    result = {**run_header("benchmark.probes.pin_rate", argv), "gib": args.gib, "cpus": os.cpu_count(),
              "transparent_hugepage": thp.read_text().strip() if thp.exists() else None, "rows": rows,
              "summary": summary}  # fmt: skip
    if args.out:
        save_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
