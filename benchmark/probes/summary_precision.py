"""Page summaries in one byte (CPU, SmolLM2): does Quest keep its recall with bounds rounded outward?

At 128K tokens a decode step's selection reads every page's key bounds (min and max: 1/32 of the
KV at 32-token pages, twice what the 64 selected pages hold), so selection is most of the step
(``select_frac_128k`` 0.69 on the H100, bar 0.30). One byte per bound instead of two halves that
read. This measures what it costs in recall before any kernel reads one-byte bounds, two ways:
e4m3 with a power-of-two scale per (layer, kv head) that fits its largest bound into 448, and int8
levels with a power-of-two scale per (page, kv head) (a page can be quantized when it fills: the
partial newest page is always selected, so its bounds are never scored). The min rounds down and
the max up, so every key stays inside its page's box and Quest's score stays an upper bound of
``q . k`` over the page. Recall is ``benchmark/quality.py``'s (its capture: 7,168 tokens
of license texts, the last 32 positions as queries), with bf16 and with fp8 bounds.

    python benchmark/probes/summary_precision.py       # about 1.5 minutes on 2 CPU cores

Writes ``benchmark/results/summary-precision-<date>.json``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmark import quality  # noqa: E402
from sparse_sglang.mem_cache.bounds import dequantize_bounds, quantize_bounds  # noqa: E402
from sparse_sglang.testing.provenance import finish_run  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
BUDGETS = (256, 512, 1024, 2048)
E4M3_MAX = 448.0


def e4m3_values() -> torch.Tensor:
    """Every finite e4m3 value, ascending (float32)."""
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return torch.unique(values[values.isfinite()])


def fp8_outward(
    kmin: torch.Tensor, kmax: torch.Tensor, values: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``kmin``/``kmax`` ``[..., pages, D]`` (float32) as e4m3 values times one power-of-two scale
    per ``[pages, D]`` slab (per kv head), rounded outward: ``lo <= kmin`` and ``hi >= kmax``
    elementwise, each exactly an e4m3 value times its scale (non-finite bounds stay as they are)."""
    values = e4m3_values() if values is None else values
    finite = lambda x: torch.where(x.isfinite(), x.abs(), 0).amax(dim=(-2, -1), keepdim=True)  # noqa: E731
    amax = torch.maximum(finite(kmin), finite(kmax))
    scale = torch.exp2(torch.ceil(torch.log2(amax.clamp_min(1e-30) / E4M3_MAX)))
    lo_idx = torch.searchsorted(values, (kmin / scale).contiguous(), right=True) - 1
    hi_idx = torch.searchsorted(values, (kmax / scale).contiguous(), right=False)
    lo, hi = values[lo_idx.clamp(0, len(values) - 1)] * scale, values[hi_idx.clamp(0, len(values) - 1)] * scale
    return torch.where(kmin.isfinite(), lo, kmin), torch.where(kmax.isfinite(), hi, kmax)


def int8_outward(kmin: torch.Tensor, kmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``kmin``/``kmax`` ``[..., D]`` (float32) as int8 levels times one power-of-two scale per
    ``[D]`` vector (per page and kv head), the min rounded down and the max up: ``lo <= kmin`` and
    ``hi >= kmax``, each exactly ``level * scale`` with ``|level| <= 127`` (non-finite bounds stay).
    The server's own rounding (``bounds.quantize_bounds``), read back as values."""
    lo, hi, e = quantize_bounds(*(torch.where(x.isfinite(), x, 0.0) for x in (kmin, kmax)))
    lo, hi = dequantize_bounds(lo, e), dequantize_bounds(hi, e)
    return torch.where(kmin.isfinite(), lo, kmin), torch.where(kmax.isfinite(), hi, kmax)


def quantized(outward):
    """:func:`benchmark.quality.summarize` with its bounds replaced by ``outward``'s roundings."""

    def summarize(keys, page_size: int):
        s = SUMMARIZE(keys, page_size)
        for layer in range(s.kmin.shape[0]):
            lo, hi = outward(s.kmin[layer].float(), s.kmax[layer].float())
            s.kmin[layer], s.kmax[layer] = lo.to(s.kmin.dtype), hi.to(s.kmax.dtype)  # exact: a few bits x 2^k fit bf16
        return s

    return summarize


SUMMARIZE = quality.summarize
PRECISIONS = {"bf16": SUMMARIZE, "fp8": quantized(fp8_outward), "int8": quantized(int8_outward)}


def main() -> dict:
    start = time.monotonic()
    cap, scale = quality.license_capture()
    policies = [quality.Policy(budget=b) for b in BUDGETS]
    rows = []
    for precision, summarize in PRECISIONS.items():
        quality.summarize = summarize  # recall_table builds its summaries through this name
        for r in quality.recall_table(cap, policies, scale):
            rows.append({"precision": precision, "budget": r["budget"], "recall_mean": round(r["recall_mean"], 4),
                         "recall_per_layer": r["recall_per_layer"]})  # fmt: skip
            print(f"{precision} budget {r['budget']:4d}: recall {r['recall_mean']:.4f}", flush=True)
    quality.summarize = SUMMARIZE
    at = {(r["precision"], r["budget"]): r["recall_mean"] for r in rows}
    summary = {f"recall_{b}_{p}": at[p, b] for b in BUDGETS for p in PRECISIONS}
    for p in ("fp8", "int8"):
        summary[f"max_recall_drop_{p}"] = round(max(at["bf16", b] - at[p, b] for b in BUDGETS), 4)
    body = {"setup": {"tokens": 7168, "queries": 32, "selector": quality.DEFAULT_SELECTOR, "page_size": quality.PAGE_SIZE,
                      "fp8": "e4m3, a power-of-two scale per (layer, kv head), min rounded down and max up",
                      "int8": "int8 levels, a power-of-two scale per (page, kv head), min rounded down and max up"},
            "rows": rows, "summary": summary, "run_time_s": round(time.monotonic() - start, 1)}  # fmt: skip
    return finish_run("benchmark/probes/summary_precision.py", [], body, REPO / "benchmark" / "results",
                      "summary-precision-{date}.json", device="cpu")  # fmt: skip


if __name__ == "__main__":
    main()
