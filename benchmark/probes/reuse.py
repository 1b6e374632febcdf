"""Selection reuse on a real model (CPU): GPU-cache hit ratio and recall per ``--sparse-reselect-interval``.

The serving benchmark's sparse server is bound by the pages each decode step loads over PCIe
(the pages its selection misses in the request's GPU cache row). This measures, on SmolLM2's real
post-RoPE queries and keys (the ``benchmark/quality.py`` capture over ~7K tokens of license
texts), how often consecutive decode steps find their selected pages in the row, and what reusing
the row between full selections costs in recall. It runs the server's own pieces on CPU tensors:
``GPUPageCache`` (the row LRU, its page table and hit counters; prefill fills each row with the
prompt's first pages, as in the server), ``due_for_selection``/``cached_pages``/``keep_cached``
(the reuse rule) and the quest selection of ``benchmark/quality.py``. The last ``--queries``
positions act as consecutive decode steps, each over its own prefix.

    python benchmark/probes/reuse.py           # about 2 minutes on 2 CPU cores
    python benchmark/probes/reuse.py --row-ratios 1 1.25 2 3 4 --intervals 1 8 \
        --out benchmark/results/reuse-<date>-row-ratio.json   # rows wider than the selection

Writes ``benchmark/results/reuse-<date>.json``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from sparse_sglang.attention import attention_mass_recall
from sparse_sglang.attention.reference import retrieve_reference
from sparse_sglang.mem_cache import GPUPageCache
from sparse_sglang.mem_cache.plan import row_width_for
from sparse_sglang.testing.provenance import finish_run

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmark.quality import PAGE_SIZE, REPO, Policy, capture, choose_pages, license_tokens, load_model, summarize  # noqa: E402


def simulate(cap, policy: Policy, interval: int, scale: float, row_ratio: float = 1.25) -> dict:
    """Decode steps over the captured queries with one request's cache row per (layer, head)."""
    layers, (heads, tokens, dim) = len(cap.k), cap.k[0].shape
    num_pages, budget_pages = -(-tokens // PAGE_SIZE), policy.budget // PAGE_SIZE
    width = row_width_for(budget_pages, num_pages, row_ratio)
    cache = GPUPageCache(layers * heads * width, layers, heads, PAGE_SIZE, dim, torch.bfloat16, max_requests=2,
                         row_width=width, max_pages=num_pages, total_pages=num_pages)  # fmt: skip
    req, host_pages = torch.tensor([1]), torch.arange(num_pages).view(1, -1)
    first = tokens - cap.num_queries  # the prompt; decode steps at positions first .. tokens - 1
    cache.open_request(1, num_pages)
    cache.write_allocate(1, 0, -(-first // PAGE_SIZE))
    summaries = summarize(cap.k, PAGE_SIZE)
    recall, loads = [], []
    for i in range(cap.num_queries):
        seq_len = torch.tensor([first + i + 1])
        cache.next_step()
        due = cache.due_for_selection(req, seq_len, interval)
        step_loads = 0
        for layer in range(layers):
            q, k = cap.q[layer][i : i + 1], cap.k[layer].unsqueeze(0)
            cached = cache.cached_pages(layer, req, num_pages)
            pages = choose_pages(policy, q, summaries, layer, k, seq_len, cached, due)
            misses = []
            retrieve_reference(
                cache, layer, req, pages.long(), host_pages, lambda src, dst: misses.append(int((dst >= 0).sum())), 1
            )
            step_loads += misses[0]
            recall.append(attention_mass_recall(q, k, pages, PAGE_SIZE, seq_len, scale).mean().item())
        loads.append(step_loads)
    selected, loaded = cache.counters.tolist()
    return {"budget": policy.budget, "interval": interval, "row_ratio": row_ratio, "row_width_pages": width,
            "selected_pages": selected,
            "loaded_pages": loaded, "hit_ratio": round(1 - loaded / selected, 4),
            "hit_ratio_after_first_step": round(1 - sum(loads[1:]) / (selected - selected / len(loads)), 4),
            "loaded_per_step_per_head": round(sum(loads[1:]) / (len(loads) - 1) / (layers * heads), 3),
            "recall_mean": round(sum(recall) / len(recall), 4), "loads_per_step": loads}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=7168)
    parser.add_argument("--queries", type=int, default=96, help="consecutive decode steps (the last positions)")
    parser.add_argument("--budgets", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--intervals", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument(
        "--row-ratios",
        type=float,
        nargs="+",
        default=[1.25],
        help="cache row widths over the selection (--sparse-cache-row-ratio)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    start = time.monotonic()
    tokenizer, model = load_model()
    scale = model.model.layers[0].self_attn.scaling
    ids = license_tokens(tokenizer, args.tokens)
    cap = capture(model, torch.tensor([ids]), args.queries)
    rows = []
    for budget in args.budgets:
        for ratio in args.row_ratios:
            for interval in args.intervals:
                row = simulate(cap, Policy(budget=budget), interval, scale, ratio)
                rows.append(row)
                print({k: v for k, v in row.items() if k != "loads_per_step"}, flush=True)
    base = {(r["budget"], r["row_ratio"]): r for r in rows if r["interval"] == 1}
    body = {
        "model": "SmolLM2-135M-Instruct (bf16 weights, run in float32, transformers, CPU)",
        "setup": {"tokens": len(ids), "queries": args.queries, "page_size": PAGE_SIZE, "selector": Policy().selector,
                  "rows": "one request; each (layer, kv head) row holds row_width_pages pages, LRU; prefill fills "
                          "it with the prompt's first pages; interval N = a full selection every N steps, the "
                          "steps between choose among the row's pages plus the sink and recent pages"},
        "rows": rows,
        "summary": {f"budget_{b}_row_ratio_{x:g}": {
            f"interval_{r['interval']}": {"hit_ratio": r["hit_ratio_after_first_step"], "recall": r["recall_mean"],
                                          "recall_drop": round(base[b, x]["recall_mean"] - r["recall_mean"], 4) if (b, x) in base else None}
            for r in rows if (r["budget"], r["row_ratio"]) == (b, x)} for b in args.budgets for x in args.row_ratios},
        "run_time_s": round(time.monotonic() - start, 1),
    }  # fmt: skip
    out = args.out or REPO / "benchmark" / "results" / "reuse-{date}.json"
    return finish_run("benchmark/probes/reuse.py", argv, body, out.parent, out.name, device="cpu")


if __name__ == "__main__":
    main()
