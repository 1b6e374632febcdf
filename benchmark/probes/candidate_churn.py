"""How fast a re-rank's candidates change from one decode step to the next: per (layer, kv head),
the pages the mean/std corners rank in their best ``factor x K`` (the candidates a re-rank scores)
and in their best ``K`` (the selection), over a greedy generation on real text. A candidate row
that keeps its pages' key codes on the GPU makes codes for the candidates new at a step; the page
cache loads the selection's new pages (their K and V). Decode is dense here, so the queries are
dense's: what the corners would rank, not what a sparse decode would have attended.

    python -m benchmark.probes.candidate_churn --items .accuracy/items-dev.json.gz --length 4096 \\
        --budget 1024 --new-tokens 64 --limit 4 --out churn.json

CPU reference, float32 (``benchmark/quality.py``'s model).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchmark import accuracy, quality
from benchmark.probes.block_sparse_prefill import page_corners
from sparse_sglang.testing.provenance import run_header, save_result


class ChurnHook:
    """Dense attention; at each decode step, per layer, the corners' best ``kc`` and ``k`` pages
    of every kv head, and how many of each were not in the step before's."""

    def __init__(self, k: int, kc: int):
        self.k, self.kc = k, kc
        self.previous: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.new_candidates, self.new_selected, self.steps = 0, 0, 0

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        out = quality.dense(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        if query.shape[2] != 1:
            return out
        heads = key.shape[1]
        q = query[0, :, 0].float().view(heads, -1, query.shape[-1])  # [Hkv, G, D]
        mean, std = page_corners(key[0], quality.PAGE_SIZE)  # [Hkv, N, D]
        scores = q.sum(1, keepdim=True) @ mean.transpose(-1, -2) + q.abs().sum(1, keepdim=True) @ std.transpose(-1, -2)
        order = scores[:, 0].argsort(dim=-1, descending=True)  # [Hkv, N]
        pages = order.shape[-1]
        chosen = [torch.zeros(heads, pages + 1, dtype=torch.bool) for _ in range(2)]
        for mask, count in zip(chosen, (self.kc, self.k)):
            mask.scatter_(-1, order[:, :count], True)
        layer = module.layer_idx
        if layer in self.previous:
            for i, mask in enumerate(chosen):
                before = self.previous[layer][i]
                before = torch.nn.functional.pad(before, (0, mask.shape[-1] - before.shape[-1]))
                new = int((mask & ~before).sum())
                if i == 0:
                    self.new_candidates += new
                else:
                    self.new_selected += new
            if layer == 0:
                self.steps += 1
        self.previous[layer] = chosen
        return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--items", required=True)
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--factor", type=float, default=2.0)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--limit", type=int, default=4)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    _, items = accuracy.load_items(Path(args.items))
    chosen = [i for i in items if i.length == args.length][: args.limit]
    tokenizer, model = quality.load_model()
    k = args.budget // quality.PAGE_SIZE
    rows = []
    for item in chosen:
        hook = ChurnHook(k, int(args.factor * k))
        ids = tokenizer(item.prompt, add_special_tokens=False).input_ids
        quality.greedy_answer(model, hook, ids, args.new_tokens)
        rows_heads = model.config.num_hidden_layers * model.config.num_key_value_heads * max(hook.steps, 1)
        row = {"id": item.id, "tokens": len(ids), "steps": hook.steps,
               "new_candidates_per_row_step": round(hook.new_candidates / rows_heads, 3),
               "new_selected_per_row_step": round(hook.new_selected / rows_heads, 3)}  # fmt: skip
        rows.append(row)
        print(row, flush=True)
    mean = {key: round(sum(r[key] for r in rows) / len(rows), 3)
            for key in ("new_candidates_per_row_step", "new_selected_per_row_step")}  # fmt: skip
    summary = {**mean, "candidates": int(args.factor * k), "selected": k}
    header = run_header("benchmark.probes.candidate_churn", None, device=str(model.device))
    save_result({**header, "length": args.length, "budget": args.budget, "factor": args.factor, "rows": rows,
                 "summary": summary}, args.out)  # fmt: skip
    print("summary", summary)


if __name__ == "__main__":
    main()
