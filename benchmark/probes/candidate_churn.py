"""How fast a re-rank's candidates change from one decode step to the next: per (layer, kv head),
the pages the mean/std corners rank in their best ``factor x K`` (the candidates a re-rank scores)
and in their best ``K`` (the selection), over a greedy generation on real text. A candidate row
that keeps its pages' key codes on the GPU makes codes for the candidates new to it at a step; the
page cache loads the selection's pages new to it (their K and V). Rows are LRU, ``--row-factors``
times as wide as the pages a step takes: a wider row keeps a page that leaves and comes back. Decode is dense here, so the queries are
dense's: what the corners would rank, not what a sparse decode would have attended.

    python -m benchmark.probes.candidate_churn --items .accuracy/items-dev.json.gz --length 4096 \\
        --budget 1024 --new-tokens 64 --limit 4 --out churn.json

CPU reference, float32 (``benchmark/quality.py``'s model).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmark import accuracy, quality
from sparse_sglang.testing.provenance import run_header, save_result


class LRURow:
    """One (layer, kv head)'s row of ``capacity`` pages: a step's pages stay, the rest leave least
    recently used first."""

    def __init__(self, capacity: int):
        self.capacity, self.last = capacity, {}

    def admit(self, pages: list[int], step: int) -> int:
        """Make ``pages`` resident at ``step``; how many were not."""
        misses = sum(p not in self.last for p in pages)
        self.last.update(dict.fromkeys(pages, step))
        if len(self.last) > self.capacity:
            keep = sorted(self.last, key=self.last.get, reverse=True)[: self.capacity]
            self.last = {p: self.last[p] for p in keep}
        return misses


class ChurnHook:
    """Dense attention; at each decode step, per layer and kv head, the corners' best ``kc`` pages
    (the candidates) and best ``k`` (the selection), each admitted to rows of ``row_factors``
    times their count; the misses after the first step are counted."""

    def __init__(self, k: int, kc: int, row_factors: list[float]):
        self.counts = {"candidates": kc, "selected": k}
        self.row_factors = row_factors
        self.rows: dict[tuple, LRURow] = {}
        self.misses = {(name, f): 0 for name in self.counts for f in row_factors}
        self.steps = 0

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        out = quality.dense(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        if query.shape[2] != 1:
            return out
        heads, layer = key.shape[1], module.layer_idx
        q = query[0, :, 0].float().view(heads, -1, query.shape[-1])  # [Hkv, G, D]
        mean, var = quality.page_moments(key[0])  # [Hkv, N, D]
        std = var.sqrt()
        scores = q.sum(1, keepdim=True) @ mean.transpose(-1, -2) + q.abs().sum(1, keepdim=True) @ std.transpose(-1, -2)
        order = scores[:, 0].argsort(dim=-1, descending=True).tolist()  # [Hkv][N]
        first = (layer, 0, "candidates", self.row_factors[0]) not in self.rows
        if layer == 0 and not first:
            self.steps += 1
        for name, count in self.counts.items():
            for f in self.row_factors:
                for h in range(heads):
                    row = self.rows.setdefault((layer, h, name, f), LRURow(int(f * count)))
                    missed = row.admit(order[h][:count], self.steps)
                    if not first:
                        self.misses[name, f] += missed
        return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--items", required=True)
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--factor", type=float, default=2.0)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--row-factors", default="1,1.5,2", help="row widths, in multiples of the pages a step takes")
    p.add_argument("--limit", type=int, default=4)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    _, items = accuracy.load_items(Path(args.items))
    chosen = [i for i in items if i.length == args.length][: args.limit]
    tokenizer, model = quality.load_model()
    k = args.budget // quality.PAGE_SIZE
    factors = [float(f) for f in args.row_factors.split(",")]
    rows = []
    for item in chosen:
        hook = ChurnHook(k, int(args.factor * k), factors)
        ids = tokenizer(item.prompt, add_special_tokens=False).input_ids
        quality.greedy_answer(model, hook, ids, args.new_tokens)
        rows_heads = model.config.num_hidden_layers * model.config.num_key_value_heads * max(hook.steps, 1)
        misses = {f"{name}_x{f:g}": round(m / rows_heads, 3) for (name, f), m in hook.misses.items()}
        row = {"id": item.id, "tokens": len(ids), "steps": hook.steps, "misses_per_row_step": misses}
        rows.append(row)
        print(row, flush=True)
    means = {
        key: round(sum(r["misses_per_row_step"][key] for r in rows) / len(rows), 3)
        for key in rows[0]["misses_per_row_step"]
    }
    summary = {"new_candidates_per_row_step": means.get("candidates_x1"), "new_selected_per_row_step": means.get("selected_x1"),
               "misses_per_row_step": means, "candidates": int(args.factor * k), "selected": k}  # fmt: skip
    header = run_header("benchmark.probes.candidate_churn", None, device=str(model.device))
    save_result({**header, "length": args.length, "budget": args.budget, "factor": args.factor, "rows": rows,
                 "summary": summary}, args.out)  # fmt: skip
    print("summary", summary)


if __name__ == "__main__":
    main()
