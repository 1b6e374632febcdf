"""How fast this machine pins host memory: one ``cudaHostAlloc`` against the chunked path
(``alloc_pinned_chunked``) at several thread counts, with and without each thread faulting its
chunks in first. Decides the host store's pinning (see docs/results.md, "Start-up").

    python benchmark/probes/pin_rate.py --gib 8 --out pin-rate.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

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
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    rows = [{"path": "cudaHostAlloc", "seconds": round(timed(lambda: ext.alloc_pinned(nbytes)), 3)}]
    for threads in map(int, args.threads.split(",")):
        for prefault in (True, False):
            chunks = plan_pin_chunks(nbytes, threads)
            seconds = timed(lambda: ext.alloc_pinned_chunked(nbytes, chunks, threads, prefault))
            rows.append({"path": "chunked", "threads": threads, "prefault": prefault, "seconds": round(seconds, 3)})
    for row in rows:
        row["gb_per_s"] = round(nbytes / row["seconds"] / 1e9, 2)
        print(row, flush=True)
    result = {"device": torch.cuda.get_device_name(), "gib": args.gib, "cpus": torch.get_num_threads(),
              "transparent_hugepage": thp.read_text().strip() if thp.exists() else None, "rows": rows}  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
