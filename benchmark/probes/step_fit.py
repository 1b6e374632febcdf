"""Where a serving window's time went, from an SGLang server's own log: the decode step against the
running batch, and the prefill's cost and share of the window.

SGLang logs a ``Decode batch`` line every ``--decode-log-interval`` (40) decode steps, with the
running requests ``R`` and the tokens/s since the line before, and a ``Prefill batch`` line for
every prefill chunk. The time between two decode lines is therefore ``40 x step(R)`` plus the
prefill chunks run in between; a least-squares fit over every interval gives

    interval_s = 40 x (a + b x R) + c x prefill_tokens

so ``a + b R`` is the decode step alone and ``c`` the prefill's seconds per token. Decode-only
intervals (no prefill in between) are summarized by batch size as a check on the fit::

    python benchmark/probes/step_fit.py serving-logs/sparse-*.log serving-logs/vanilla-*.log
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import numpy as np

PREFILL = re.compile(r"Prefill batch, #new-seq: \d+, #new-token: (\d+)")
DECODE = re.compile(r"Decode batch, #running-req: (\d+),.*gen throughput \(token/s\): ([\d.]+)")
BATCH_BANDS = ((0, 20), (20, 40), (40, 60), (60, 80), (80, 100), (100, 200))


def intervals(lines, steps_per_line: int) -> list[tuple[int, float, int]]:
    """(running requests, seconds, prefill tokens run in between) per pair of decode lines; the
    first decode line's interval (from the server's start) is dropped."""
    out, prefill = [], 0
    for line in lines:
        if m := PREFILL.search(line):
            prefill += int(m.group(1))
        elif m := DECODE.search(line):
            running, rate = int(m.group(1)), float(m.group(2))
            if rate > 0:
                out.append((running, steps_per_line * running / rate, prefill))
            prefill = 0
    return out[1:]


def fit(rows: list[tuple[int, float, int]], steps_per_line: int) -> dict:
    running = np.array([r for r, _, _ in rows], dtype=float)
    seconds = np.array([s for _, s, _ in rows])
    prefill = np.array([p for _, _, p in rows], dtype=float)
    design = np.stack([np.full_like(running, steps_per_line), steps_per_line * running, prefill], axis=1)
    (a, b, c), *_ = np.linalg.lstsq(design, seconds, rcond=None)
    decode_only = [(r, s / steps_per_line) for r, s, p in rows if p == 0]
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
        "window_s": round(float(seconds.sum()), 1),
        "prefill_share": round(float(c * prefill.sum() / seconds.sum()), 3),
        "max_running": int(running.max()),
        "decode_only_by_batch": bands,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("logs", nargs="+", type=Path, help="SGLang server logs (benchmark/serving.py's --log-dir)")
    p.add_argument("--decode-log-interval", type=int, default=40, help="the server's --decode-log-interval")
    args = p.parse_args()
    for log in args.logs:
        rows = intervals(log.read_text(errors="replace").splitlines(), args.decode_log_interval)
        print(json.dumps({"log": log.name, **fit(rows, args.decode_log_interval)}, indent=1))


if __name__ == "__main__":
    main()
