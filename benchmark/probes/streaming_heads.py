"""Which of dense's right answers survive streaming heads (LServe, DuoAttention): a share of the kv
heads attend only the first ``sink`` and the last ``window`` tokens, in prefill and in decode; the
other heads attend everything (dense), so what is lost is the streaming heads' alone.

Heads are ranked once per model, on the shipped calibration text (``sparse_sglang.calibrate``'s
``torch.nn`` docstrings), by the share of their queries' attention mass that falls outside the
sink and the window (``distant mass``, over the text's last ``--probe-queries`` positions, averaged
over the kv head's query heads): the heads with the least become streaming heads.

    python -m benchmark.probes.streaming_heads --items .accuracy/items-dev.json.gz \\
        --runs .accuracy/dev-runs/dense-alone-2048.json --length 2048 --fractions 0.25,0.5 \\
        --out streaming.json

CPU reference, float32 (``benchmark/quality.py``'s model); items the dense run answers right.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmark import accuracy, quality
from sparse_sglang.testing.provenance import run_header, save_result


def allowed(queries: int, tokens: int, sink: int, window: int, streaming: torch.Tensor) -> torch.Tensor:
    """``[H, queries, tokens]`` bool: causal attention of the last ``queries`` positions over
    ``tokens`` keys, and for the heads ``streaming`` ``[H]`` only the first ``sink`` keys and the
    ``window`` keys up to each query."""
    pos_q = torch.arange(tokens - queries, tokens).view(-1, 1)
    pos_k = torch.arange(tokens).view(1, -1)
    causal = pos_k <= pos_q
    near = (pos_k < sink) | (pos_q - pos_k < window)
    return causal & (near | ~streaming.view(-1, 1, 1))


def attend(query, key, value, streaming, sink, window, scaling):
    """Attention of ``query`` ``[1, Hq, n, D]`` over ``key``/``value`` ``[1, Hkv, T, D]`` with the
    streaming kv heads ``[Hkv]`` restricted; ``[1, n, Hq, D]`` as the model's attention returns."""
    group = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    mask = allowed(query.shape[2], key.shape[2], sink, window, streaming.repeat_interleave(group))
    out = F.scaled_dot_product_attention(query, k, v, attn_mask=mask.unsqueeze(0), scale=scaling)
    return out.transpose(1, 2)


class StreamingHook:
    """The attention of every layer, the streaming kv heads of ``streaming`` (layer -> ``[Hkv]``
    bool) restricted to the sink and the window."""

    def __init__(self, streaming: dict[int, torch.Tensor], sink: int, window: int):
        self.streaming, self.sink, self.window = streaming, sink, window

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        return attend(query, key, value, self.streaming[module.layer_idx], self.sink, self.window, scaling)


def distant_mass(model, tokenizer, text: str, tokens: int, probe: int, sink: int, window: int) -> torch.Tensor:
    """``[layers, Hkv]``: each kv head's share of attention mass outside the sink and the window,
    over the last ``probe`` positions of the text's first ``tokens`` tokens."""
    ids = tokenizer(text, add_special_tokens=False).input_ids[:tokens]
    shares = {}

    def hook(module, query, key, value, attention_mask, scaling=None, **kwargs):
        heads, group = key.shape[1], query.shape[1] // key.shape[1]
        q = query[0, :, -probe:].float()
        k = key[0].float().repeat_interleave(group, dim=0)
        logits = q @ k.transpose(-1, -2) * scaling
        total = len(ids)
        mask = allowed(probe, total, 0, total, torch.zeros(q.shape[0], dtype=torch.bool))
        probs = logits.masked_fill(~mask, -math.inf).softmax(-1)
        near = allowed(probe, total, sink, window, torch.ones(q.shape[0], dtype=torch.bool))
        far = (probs * ~near).sum(-1).mean(-1)  # [Hq]
        shares[module.layer_idx] = far.view(heads, group).mean(-1)
        return quality.dense(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    quality.run_with(hook, model, input_ids=torch.tensor([ids]), use_cache=False, logits_to_keep=1)
    return torch.stack([shares[layer] for layer in range(len(shares))])


def streaming_heads(far: torch.Tensor, fraction: float) -> dict[int, torch.Tensor]:
    """The ``fraction`` of all kv heads with the least distant mass, as layer -> ``[Hkv]`` bool."""
    count = round(fraction * far.numel())
    chosen = torch.zeros(far.numel(), dtype=torch.bool)
    chosen[far.flatten().argsort()[:count]] = True
    return dict(enumerate(chosen.view_as(far)))


def main() -> None:
    from sparse_sglang.calibrate import calibration_texts

    p = argparse.ArgumentParser()
    accuracy.add_answered_args(p, length=2048, limit=40)
    p.add_argument("--fractions", default="0.25,0.5", help="shares of kv heads made streaming")
    p.add_argument("--sink", type=int, default=64)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--calibration-tokens", type=int, default=2048)
    p.add_argument("--probe-queries", type=int, default=256)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    _, items = accuracy.load_items(Path(args.items))
    chosen = accuracy.items_answered(items, Path(args.runs), args.length, args.family, args.limit)
    tokenizer, model = quality.load_model()
    far = distant_mass(model, tokenizer, calibration_texts()[0], args.calibration_tokens, args.probe_queries,
                       args.sink, args.window)  # fmt: skip
    fractions = [float(f) for f in args.fractions.split(",")]
    policies = {f"stream{f}": streaming_heads(far, f) for f in fractions}
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    rows = []
    for item in chosen:
        ids = tokenizer(item.prompt, add_special_tokens=False).input_ids
        row = {"id": item.id}
        for name, streaming in [("dense", None)] + list(policies.items()):
            hook = quality.dense if streaming is None else StreamingHook(streaming, args.sink, args.window)
            out = quality.greedy_answer(model, hook, ids, min(item.max_new_tokens, 24), stop)
            row[name] = accuracy.score(item, tokenizer.decode(out, skip_special_tokens=True))
        rows.append(row)
        print(row, flush=True)
    means = {k: round(sum(r[k] for r in rows) / len(rows), 3) for k in rows[0] if k != "id"}
    header = run_header("benchmark.probes.streaming_heads", None, device=str(model.device))
    heads = {name: [int(s.sum()) for s in streaming.values()] for name, streaming in policies.items()}
    save_result({**header, "length": args.length, "sink": args.sink, "window": args.window,
                 "distant_mass": far.tolist(), "streaming_heads_per_layer": heads, "rows": rows,
                 "summary": means}, args.out)  # fmt: skip
    print("means", means)


if __name__ == "__main__":
    main()
