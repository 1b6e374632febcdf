"""Q2 recall against the physical page size: is the 0.90 target at budget 512 reachable with
smaller pages? Same capture as ``benchmark/quality.py`` (SmolLM2 on CPU, 7,168 tokens of license
texts, the last 32 positions as decode queries); quest and the oracle (pages ranked by their true
attention mass) at budgets 512 and 1024, one sink and two recent pages, for pages of 32, 16 and 8
tokens. About 2 minutes on 2 CPU cores::

    python benchmark/probes/quality_page_size.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import benchmark.quality as quality  # noqa: E402
from sparse_sglang.testing.provenance import finish_run  # noqa: E402

PAGE_SIZES = (32, 16, 8)
BUDGETS = (512, 1024)


def main() -> dict:
    torch.manual_seed(0)
    start = time.monotonic()
    cap, scale = quality.license_capture()
    rows = []
    for page in PAGE_SIZES:
        quality.PAGE_SIZE = page  # the benchmark's physical page size (read at call time)
        policies = [quality.Policy(s, "sum", b, 1, 2, page) for s in ("quest", quality.ORACLE) for b in BUDGETS]
        for r in quality.recall_table(cap, policies, scale):
            rows.append({"page_size": page, "selector": r["selector"], "budget": r["budget"],
                         "recall_mean": round(r["recall_mean"], 4), "recall_per_layer": r["recall_per_layer"]})  # fmt: skip
            print(
                f"page {page:2d} {r['selector']:6} budget {r['budget']:4d}: recall {r['recall_mean']:.4f}", flush=True
            )
    at = {(r["page_size"], r["selector"], r["budget"]): r["recall_mean"] for r in rows}
    summary = {f"recall_512_page{p}_{s}": at[p, s, 512] for p in PAGE_SIZES for s in ("quest", quality.ORACLE)}
    summary["target"] = quality.TARGET_RECALL
    summary["largest_page_reaching_target_quest_512"] = next(
        (p for p in sorted(PAGE_SIZES, reverse=True) if at[p, "quest", 512] >= quality.TARGET_RECALL), None
    )
    body = {"setup": {"tokens": 7168, "queries": 32, "sink_pages": 1, "recent_pages": 2, "group_reduce": "sum"},
            "rows": rows, "summary": summary, "run_time_s": round(time.monotonic() - start, 1)}  # fmt: skip
    return finish_run("benchmark/probes/quality_page_size.py", [], body, REPO / "benchmark" / "results",
                      "quality-page-size-{date}.json", device="cpu")  # fmt: skip


if __name__ == "__main__":
    main()
