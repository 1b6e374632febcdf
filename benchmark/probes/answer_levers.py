"""Which selection levers keep dense's correct answers: the torch reference decoder (``quality.py``,
float32, exact bounds) on items of the accuracy suite that dense answers right, under several
policies, one of them an oracle (pages ranked by their true attention mass, summed over the kv
head's query heads) that no selector reaches but that bounds what page selection can keep.

    python benchmark/probes/answer_levers.py --items items.json.gz --runs dense.json --budget 512 --length 2048 --limit 15
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmark"))
import accuracy  # noqa: E402
import quality  # noqa: E402

from sparse_sglang.attention import select_pages, sparse_attention_reference  # noqa: E402


class OracleDecoder(quality.SparseDecoder):
    """Pages by their true softmax mass (the kv head's query heads summed)."""

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        tokens, new = key.shape[2], query.shape[2]
        if new > 1:
            return quality.dense(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        q, seq_len = query[:, :, 0], torch.tensor([tokens])
        mass = quality.oracle_page_mass(q, key, seq_len, scaling)
        pages = select_pages(mass, -(-seq_len // quality.PAGE_SIZE), self.policy.budget // quality.PAGE_SIZE,
                             self.policy.sink_pages, self.policy.recent_pages).page_ids  # fmt: skip
        return sparse_attention_reference(q, key, value, pages, quality.PAGE_SIZE, seq_len, scaling).unsqueeze(1)


class QuestStepDecoder(quality.SparseDecoder):
    """A decode step that scores pages with Quest's bounds, lets :meth:`rank` turn those scores into
    the ranking selection takes (as they are, here), and attends over the pages selected."""

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        layer, tokens, new = module.layer_idx, key.shape[2], query.shape[2]
        if new > 1:
            return super().__call__(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        self.summaries.update(layer, key[0, :, tokens - new :].transpose(0, 1), torch.arange(tokens - new, tokens))
        q, seq_len = query[:, :, 0], torch.tensor([tokens])
        n = -(-tokens // quality.PAGE_SIZE)
        kmin, kmax = (getattr(self.summaries, name)[layer, :, :n].unsqueeze(0) for name in ("kmin", "kmax"))
        qg = q.view(1, kmin.shape[1], -1, q.shape[-1])
        scores = quality.get_selector("quest").score(qg, kmin, kmax, None, self.policy.group_reduce)
        ranked = self.rank(layer, scores, q, key, seq_len, scaling)
        pages = select_pages(ranked, -(-seq_len // quality.PAGE_SIZE), self.policy.budget // quality.PAGE_SIZE,
                             self.policy.sink_pages, self.policy.recent_pages).page_ids  # fmt: skip
        return sparse_attention_reference(q, key, value, pages, quality.PAGE_SIZE, seq_len, scaling).unsqueeze(1)

    def rank(self, layer, scores, q, key, seq_len, scaling):
        return scores


class RerankDecoder(QuestStepDecoder):
    """Quest's bounds pick ``factor`` x the budget's pages as candidates; the candidates' exact
    attention mass (their keys against the query, the group summed) picks the budget's pages. A
    server would read the candidates' keys (not their values) to score them; the softmax's
    denominator is the same for every page, so ranking by the full mass equals ranking by the
    candidates' own exp(q.k) sums."""

    factor: int = 2

    def rank(self, layer, scores, q, key, seq_len, scaling):
        n = scores.shape[-1]
        candidates = scores.topk(min(n, self.factor * (self.policy.budget // quality.PAGE_SIZE)), dim=-1).indices
        mass = quality.oracle_page_mass(q, key, seq_len, scaling)
        return torch.full_like(mass, -math.inf).scatter_(-1, candidates, mass.gather(-1, candidates))


WINDOW = 32  # the prompt's last queries whose attention picks the pages a request keeps (SnapKV's window)


class WindowDecoder(QuestStepDecoder):
    """Quest, plus pages the prompt's last ``WINDOW`` queries attend to most (per layer and kv head,
    their softmax mass summed over the window and the group): a quarter of the budget, kept every
    step (SnapKV's observation window, used to pin pages rather than to drop tokens)."""

    pinned: dict

    def rank(self, layer, scores, q, key, seq_len, scaling):
        scores[0].scatter_(-1, self.pinned[layer].clamp(max=scores.shape[-1] - 1), math.inf)
        return scores


def window_pins(model, tokenizer, ids, budget) -> dict:
    """Per layer, ``[Hkv, M]`` pages with the most attention mass from the prompt's last WINDOW queries."""
    pins = {}

    def hook(module, query, key, value, attention_mask, scaling=None, **kwargs):
        out = quality.dense(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        heads, tokens = key.shape[1], key.shape[2]
        qw = query[0, :, -WINDOW:]  # [Hq, W, D]
        group = qw.shape[0] // heads
        logits = (qw.view(heads, group, WINDOW, -1) @ key[0].transpose(-1, -2).unsqueeze(1)) * scaling
        causal = torch.arange(tokens).view(1, -1) > torch.arange(tokens - WINDOW, tokens).view(-1, 1)
        probs = logits.masked_fill(causal, -math.inf).softmax(-1).sum(dim=(1, 2))  # [Hkv, T]
        page = quality.PAGE_SIZE
        mass = torch.nn.functional.pad(probs, (0, -tokens % page)).view(heads, -1, page).sum(-1)
        pins[module.layer_idx] = mass.topk(max(1, budget // page // 4), dim=-1).indices
        return out

    quality.run_with(hook, model, input_ids=torch.tensor([ids]), use_cache=False, logits_to_keep=1)
    return pins


def window_bound_pins(summaries, queries: dict, budget: int, group_reduce: str = "sum") -> dict:
    """Per layer, ``[Hkv, M]`` pages the prompt's last WINDOW queries score highest by Quest's bounds
    (what a server holding only page summaries can compute at the end of a prefill)."""
    selector = quality.get_selector("quest")
    pins = {}
    for layer, qw in queries.items():  # qw [Hq, W, D]
        heads = summaries.kmin.shape[1]
        tokens = qw.shape[1]
        kmin, kmax = (getattr(summaries, name)[layer].unsqueeze(0) for name in ("kmin", "kmax"))
        qg = qw.transpose(0, 1).reshape(qw.shape[1], heads, -1, qw.shape[-1])  # [W, Hkv, G, D]
        scores = torch.stack([selector.score(qg[w : w + 1], kmin, kmax, None, group_reduce)[0] for w in range(tokens)])
        finite = scores.nan_to_num(nan=-3e38, posinf=3e38, neginf=-3e38)
        ranks = finite.argsort(-1, descending=True).argsort(-1).float()  # per query: 0 = its best page
        pins[layer] = (-ranks).mean(0).topk(max(1, budget // quality.PAGE_SIZE // 4), dim=-1).indices
    return pins


def window_queries(model, ids) -> dict:
    qs = {}

    def hook(module, query, key, value, attention_mask, scaling=None, **kwargs):
        qs[module.layer_idx] = query[0, :, -WINDOW:].clone()
        return quality.dense(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    quality.run_with(hook, model, input_ids=torch.tensor([ids]), use_cache=False, logits_to_keep=1)
    return qs


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--items", required=True)
    p.add_argument("--runs", required=True, help="a dense serve output: its right answers pick the items")
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--limit", type=int, default=15)
    p.add_argument("--family", default="niah", help="items whose family starts with this")
    p.add_argument("--out", required=True)
    p.add_argument("--policies", default="", help="comma-separated subset of the policies")
    p.add_argument("--ids", default="", help="comma-separated item ids instead of dense's right answers")
    args = p.parse_args()
    _, items = accuracy.load_items(Path(args.items))
    by_id = {i.id: i for i in items}
    dense_run = {o["id"]: o for o in json.loads(Path(args.runs).read_text())["outputs"]}
    chosen = [by_id[i] for i, o in dense_run.items() if o.get("score") == 1 and i in by_id and by_id[i].length == args.length
              and by_id[i].family.startswith(args.family)][: args.limit]  # fmt: skip
    if args.ids:
        chosen = [by_id[i] for i in args.ids.split(",")]
    tokenizer, model = quality.load_model()
    policies = {
        "quest": quality.Policy(budget=args.budget),
        "quest-gmax": quality.Policy(budget=args.budget, group_reduce="max"),
        "oracle": quality.Policy(budget=args.budget),
        "quest-window": quality.Policy(budget=args.budget),
        "quest-window-bounds": quality.Policy(budget=args.budget),
        "arkvale": quality.Policy(selector="arkvale", budget=args.budget),
        "mean": quality.Policy(selector="mean", budget=args.budget),
        "quest-dense2": quality.Policy(budget=args.budget, dense_layers=2),  # Quest keeps its first two layers dense
        "quest-rerank2": quality.Policy(budget=args.budget),
        "quest-rerank4": quality.Policy(budget=args.budget),
    }
    if args.policies:
        policies = {k: v for k, v in policies.items() if k in args.policies.split(",")}
    rows = []
    for item in chosen:
        ids = tokenizer(item.prompt, add_special_tokens=False).input_ids
        from transformers import DynamicCache

        cache = DynamicCache(config=model.config)
        prefill = quality.SparseDecoder(model, quality.Policy(selector=None), len(ids) + item.max_new_tokens)
        logits = quality.run_with(prefill, model, input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True,
                                  logits_to_keep=1).logits  # fmt: skip
        first = int(logits[0, -1].argmax())
        pins = window_pins(model, tokenizer, ids, args.budget) if "quest-window" in policies else None
        bound_pins = (window_bound_pins(prefill.summaries, window_queries(model, ids), args.budget)
                      if "quest-window-bounds" in policies else None)  # fmt: skip
        row = {"id": item.id}
        for name, policy in [("dense", quality.Policy(selector=None))] + list(policies.items()):
            hook = prefill.fork(policy)
            if name == "oracle":
                hook.__class__ = OracleDecoder
            if name.startswith("quest-rerank"):
                hook.__class__ = RerankDecoder
                hook.factor = int(name.removeprefix("quest-rerank"))
            if name in ("quest-window", "quest-window-bounds"):
                hook.__class__ = WindowDecoder
                hook.pinned = pins if name == "quest-window" else bound_pins
            out = quality.decode(
                model, hook, copy.deepcopy(cache), [], min(item.max_new_tokens, 24), first, stop=tokenizer.eos_token_id
            )
            text = tokenizer.decode(out, skip_special_tokens=True)
            row[name] = accuracy.score(item, text)
        rows.append(row)
        print(row, flush=True)
    means = {k: round(sum(r[k] for r in rows) / len(rows), 3) for k in rows[0] if k != "id"}
    print("means", means)
    Path(args.out).write_text(json.dumps({"budget": args.budget, "length": args.length, "rows": rows, "means": means}))


if __name__ == "__main__":
    main()
