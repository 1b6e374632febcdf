"""Which of dense's right answers survive block-sparse prefill: each block of ``--query-block``
prompt positions attends, per kv head, the sink, a local window, and only the pages whose
mean/std corners (the summaries decode reads) score highest for the block's queries, up to a
budget of tokens; decode stays dense, so what is lost is the prefill's alone.

A page's score for one query is the decode selector's (``q . mean + |q| . std``, the kv head's
query heads summed); a block's is its queries' best (``max``) or its summed query's (``mean``).

    python -m benchmark.probes.block_sparse_prefill --items .accuracy/items-dev.json.gz \\
        --runs .accuracy/dev-runs/dense-alone-4096.json --length 4096 --budgets 1024 --out bsp.json

CPU reference, float32 (``benchmark/quality.py``'s model); items the dense run answers right. It
also reports each policy's density: the share of the causal (query, key) pairs a prompt attends.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmark import accuracy, quality
from sparse_sglang.testing.provenance import run_header, save_result


def allowed_keys(query: torch.Tensor, key: torch.Tensor, page: int, block: int, budget: int, sink: int, window: int,
                 reduce: str, dense_tail: int = 0) -> torch.Tensor:  # fmt: skip
    """``[Hkv, T, T]`` bool: which keys each prompt position attends, per kv head. Causal; every
    position attends the first ``sink`` tokens and the ``window`` tokens before its block; of the
    pages before that, the ``budget // page`` best for its block by the corners' score. The last
    ``dense_tail`` positions (where a prompt's question usually is) attend every earlier key."""
    heads, tokens = key.shape[1], key.shape[2]
    group = query.shape[1] // heads
    q = query[0].float().view(heads, group, tokens, -1)
    mean, var = quality.page_moments(key[0], page)  # [Hkv, N, D]
    std = var.sqrt()
    scores = q.sum(1) @ mean.transpose(-1, -2) + q.abs().sum(1) @ std.transpose(-1, -2)  # [Hkv, T, N]
    blocks = -(-tokens // block)
    padded = F.pad(scores, (0, 0, 0, blocks * block - tokens), value=float("-inf")).view(heads, blocks, block, -1)
    if reduce == "max":
        block_scores = padded.amax(2)
    else:  # the block's summed query against the corners
        qs = F.pad(q.sum(1), (0, 0, 0, blocks * block - tokens)).view(heads, blocks, block, -1).sum(2)
        qa = F.pad(q.abs().sum(1), (0, 0, 0, blocks * block - tokens)).view(heads, blocks, block, -1).sum(2)
        block_scores = qs @ mean.transpose(-1, -2) + qa @ std.transpose(-1, -2)  # [Hkv, blocks, N]
    pages = mean.shape[1]
    start = torch.arange(blocks) * block  # each block's first position
    page_end = (torch.arange(pages) + 1) * page  # one past each page's last token
    far = page_end.view(1, -1) <= (start - window).view(-1, 1)  # [blocks, N]: pages wholly before the window
    block_scores = block_scores.masked_fill(~far, float("-inf"))
    k = min(pages, max(1, budget // page))
    top = block_scores.topk(k, dim=-1)
    chosen = torch.zeros(heads, blocks, pages, dtype=torch.bool)
    chosen.scatter_(-1, top.indices, top.values > float("-inf"))
    pos = torch.arange(tokens)
    token_page = pos // page
    chosen_tokens = chosen[:, pos // block][:, :, token_page]  # [Hkv, T, T]
    q_start = (pos // block * block).view(-1, 1)
    near = (pos.view(1, -1) < sink) | (pos.view(1, -1) >= q_start - window)
    causal = pos.view(1, -1) <= pos.view(-1, 1)
    tail = (pos >= tokens - dense_tail).view(-1, 1)
    return causal & (near | chosen_tokens | tail)


class BlockSparsePrefill:
    """The attention of every layer: prefill block-sparse (:func:`allowed_keys`), decode dense.
    Counts the (query, key) pairs it attends against the causal ones."""

    def __init__(self, page: int, block: int, budget: int, sink: int, window: int, reduce: str, dense_tail: int):
        self.args = (page, block, budget, sink, window, reduce, dense_tail)
        self.attended = self.causal = 0

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        if query.shape[2] == 1:
            return quality.dense(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        mask = allowed_keys(query, key, *self.args)
        tokens = key.shape[2]
        self.attended += int(mask.sum())
        self.causal += mask.shape[0] * tokens * (tokens + 1) // 2
        group = query.shape[1] // key.shape[1]
        k, v = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(query, k, v, attn_mask=mask.repeat_interleave(group, 0).unsqueeze(0),
                                             scale=scaling)  # fmt: skip
        return out.transpose(1, 2)


def main() -> None:
    p = argparse.ArgumentParser()
    accuracy.add_answered_args(p, length=4096, limit=40)
    p.add_argument("--budgets", default="1024", help="tokens of pages each query block attends beyond sink and window")
    p.add_argument("--reduces", default="max", help="max, mean: a block's score of a page")
    p.add_argument("--dense-tails", default="0", help="prompt positions at the end that attend densely")
    p.add_argument("--query-block", type=int, default=64)
    p.add_argument("--sink", type=int, default=64)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    _, items = accuracy.load_items(Path(args.items))
    chosen = accuracy.items_answered(items, Path(args.runs), args.length, args.family, args.limit)
    tokenizer, model = quality.load_model()
    policies = {f"bsp{b}-{r}-tail{t}": (int(b), r, int(t)) for b in args.budgets.split(",")
                for r in args.reduces.split(",") for t in args.dense_tails.split(",")}  # fmt: skip
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    rows, density = [], {name: [0, 0] for name in policies}
    for item in chosen:
        ids = tokenizer(item.prompt, add_special_tokens=False).input_ids
        row = {"id": item.id}
        for name, spec in [("dense", None)] + list(policies.items()):
            if spec is None:
                hook = quality.dense
            else:
                hook = BlockSparsePrefill(
                    quality.PAGE_SIZE, args.query_block, spec[0], args.sink, args.window, *spec[1:]
                )
            out = quality.greedy_answer(model, hook, ids, min(item.max_new_tokens, 24), stop)
            row[name] = accuracy.score(item, tokenizer.decode(out, skip_special_tokens=True))
            if spec is not None:
                density[name][0] += hook.attended
                density[name][1] += hook.causal
        rows.append(row)
        print(row, flush=True)
    kept = {k: sum(r[k] == 1 for r in rows) for k in rows[0] if k != "id"}
    summary = {"items": len(rows), "kept": kept,
               "density": {k: round(a / max(c, 1), 3) for k, (a, c) in density.items()}}  # fmt: skip
    header = run_header("benchmark.probes.block_sparse_prefill", None, device=str(model.device))
    save_result({**header, "length": args.length, "query_block": args.query_block, "sink": args.sink,
                 "window": args.window, "rows": rows, "summary": summary}, args.out)  # fmt: skip
    print("summary", summary)


if __name__ == "__main__":
    main()
