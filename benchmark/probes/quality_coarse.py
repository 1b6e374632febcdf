"""Q2 recall of coarse-first selection (``--sparse-coarse-pages``) against page-by-page quest.

Same capture as ``benchmark/quality.py`` (SmolLM2 on CPU, 7,168 tokens of license texts, the last
32 positions as decode queries, 32-token pages, 1 sink + 2 recent pages, GQA scores summed):
quest at budget 512 page by page, and coarse-first with super-pages of 4 and 8 pages keeping 2, 3,
4 or 6 budgets' worth of candidates, through the code the server runs (``PageSummaries.build_coarse``,
``score_coarse_reference``, ``candidate_pages``; the torch references of the GPU kernels). At 7K tokens a
request holds 224 pages; the budget keeps 16 and 4 budgets' worth of candidates is 64 of them, so
the coarse pass discards less here than at 128K (4,096 pages). About a minute on 2 CPU cores::

    python benchmark/probes/quality_coarse.py
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import benchmark.quality as quality  # noqa: E402
from sparse_sglang.attention import attention_mass_recall, get_selector, select_pages  # noqa: E402
from sparse_sglang.attention.reference import score_coarse_reference  # noqa: E402
from sparse_sglang.attention.scoring import candidate_pages  # noqa: E402
from sparse_sglang.mem_cache import PageSummaries  # noqa: E402
from sparse_sglang.mem_cache.summaries import coarse_built  # noqa: E402
from sparse_sglang.testing.provenance import finish_run  # noqa: E402

BUDGET, SINK, RECENT = 512, 1, 2
SETTINGS = [(0, 0.0)] + [(s, c) for s in (4, 8) for c in (2.0, 3.0, 4.0, 6.0)]


def main() -> dict:
    torch.manual_seed(0)
    start = time.monotonic()
    cap, scale = quality.license_capture()
    page, k_pages = quality.PAGE_SIZE, BUDGET // quality.PAGE_SIZE
    heads, tokens, dim = cap.k[0].shape
    seq_len = torch.arange(tokens - cap.num_queries, tokens) + 1
    num_pages = -(-seq_len // page)
    n = -(-tokens // page)
    host = torch.arange(n).expand(len(seq_len), n).contiguous()  # one request's pages, as host pages 0..n-1
    quest = get_selector("quest")
    recall = {setting: [] for setting in SETTINGS}
    for layer in range(len(cap.k)):
        q, k = cap.q[layer], cap.k[layer].expand(len(seq_len), -1, -1, -1).contiguous()
        qg = q.view(len(seq_len), heads, -1, dim)
        for s, cand in SETTINGS:
            summ = PageSummaries(1, heads, n, page, dim, cap.k[0].dtype, coarse_pages=s, with_mean=False)
            summ.update(0, cap.k[layer].transpose(0, 1), torch.arange(tokens))
            kmin, kmax = (t[0, :, :n].unsqueeze(0) for t in (summ.kmin, summ.kmax))
            scores = quest.score(qg, kmin.float(), kmax.float(), None, "sum")
            if s:
                built = coarse_built(num_pages, s, RECENT)
                summ.build_coarse(host, built)
                coarse = score_coarse_reference(qg, summ.coarse_layer(0), host, built, s, SINK)
                top = coarse.topk(min(math.ceil(cand * k_pages / s), coarse.shape[-1]), dim=-1)
                supers = torch.where(top.values > -math.inf, top.indices, -1)
                scores = scores.masked_fill(~candidate_pages(supers, built, num_pages, s, n), -math.inf)
            pages = select_pages(scores, num_pages, k_pages, SINK, RECENT).page_ids
            recall[s, cand].append(attention_mass_recall(q, k, pages, page, seq_len, scale).mean().item())
        print(layer, {f"{s}x{c}": round(r[-1], 3) for (s, c), r in recall.items()}, flush=True)
    rows = [{"coarse_pages": s, "coarse_candidates": c, "recall_mean": round(sum(r) / len(r), 4),
             "recall_per_layer": [round(x, 4) for x in r]} for (s, c), r in recall.items()]  # fmt: skip
    at = {(r["coarse_pages"], r["coarse_candidates"]): r["recall_mean"] for r in rows}
    summary = {
        "recall_512_page_by_page": at[0, 0.0],
        **{f"recall_512_coarse{s}_x{c:g}": at[s, c] for s, c in SETTINGS if s},
    }
    body = {"setup": {"tokens": tokens, "queries": cap.num_queries, "budget": BUDGET, "sink_pages": SINK,
                      "recent_pages": RECENT, "page_size": page, "group_reduce": "sum", "bound_format": "exact"},
            "rows": rows, "summary": summary, "run_time_s": round(time.monotonic() - start, 1)}  # fmt: skip
    for key, value in summary.items():
        print(f"{key}: {value}")
    return finish_run("benchmark/probes/quality_coarse.py", [], body, REPO / "benchmark" / "results",
                      "quality-coarse-{date}.json", device="cpu")  # fmt: skip


if __name__ == "__main__":
    main()
