"""Q3's pass-key check (CPU, SmolLM2, the default policy at budget 512) with the page bounds stored
both ways the server can keep them: ``exact`` (the keys' own dtype) and ``int8`` (levels times a
power-of-two scale per page and kv head, rounded outward: ``--sparse-bound-format``'s default for
16-bit KV). The same prompts as ``benchmark/quality.py``'s Q3, under its stricter protocol
(``--passkey-prefill question``: the question's tokens decode sparsely too), the one the committed
``passkey-bounds-2026-11-24.json`` ran::

    python benchmark/probes/passkey_bounds.py       # about 5 minutes on 2 CPU cores

Writes ``benchmark/results/passkey-bounds-<date>.json``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmark import quality  # noqa: E402
from sparse_sglang.testing.provenance import finish_run  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
FORMATS = ("exact", "int8")
PREFILL = "question"  # quality.PASSKEY_PROTOCOLS


def passkey_rows(tokenizer, model, bound_format: str, seed: int = 0) -> list[dict]:
    """Q3 rows of the default policy with the decode summaries' bounds in ``bound_format``."""
    torch.manual_seed(seed)
    return quality.passkey_table(tokenizer, model, [2048, 4096, 7168], [0.1, 0.5, 0.9], [quality.Policy()], 8, seed,
                                 PREFILL, bound_format)  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    start = time.monotonic()
    tokenizer, model = quality.load_model()
    rows = {fmt: passkey_rows(tokenizer, model, fmt) for fmt in FORMATS}
    cases = [{"tokens": r["target_tokens"], "depth": r["depth"], "key": r["key"], "dense": r["dense"]["answer"],
              **{fmt: {"answer": rows[fmt][i]["quest"]["answer"], "equal_dense": rows[fmt][i]["quest"]["equal_dense"],
                       "decode_recall_mean": rows[fmt][i]["quest"]["decode_recall_mean"]} for fmt in FORMATS}}
             for i, r in enumerate(rows["exact"])]  # fmt: skip
    summary = {f"passkey_equal_{fmt}": f"{sum(c[fmt]['equal_dense'] for c in cases)}/{len(cases)}" for fmt in FORMATS}
    summary["same_answers_both_formats"] = sum(c["exact"]["answer"] == c["int8"]["answer"] for c in cases)
    body = {"policy": quality.Policy().name, "budget": quality.Policy().budget, "passkey_prefill": PREFILL,
            "cases": cases, "summary": summary,
            "run_time_s": round(time.monotonic() - start, 1)}  # fmt: skip
    return finish_run(
        "benchmark/probes/passkey_bounds.py",
        argv,
        body,
        REPO / "benchmark" / "results",
        "passkey-bounds-{date}.json",
        device="cpu",
    )


if __name__ == "__main__":
    main()
