"""Fit the key basis the ``sketch`` selector projects keys with, from forwards over calibration texts.

    python -m sparse_sglang.calibrate --model-path MODEL [--out FILE] [--rank R]

Runs the model (transformers, on the CPU unless ``--device`` says otherwise) over calibration
texts, a window of each, records every layer's post-RoPE keys and queries, and fits each (layer,
kv head)'s rank-``rank`` key and query projections on all of them
(:class:`~sparse_sglang.mem_cache.key_sketch.KeyBasis`). By default the file goes into the model
folder as ``sparse_key_basis.safetensors``, where the server finds it without
``--sparse-key-basis``. The default text is the docstrings of torch.nn's classes: prose every
installation has, and none of the accuracy suite's texts. The basis carries the kind of text it
was fitted on (docs/decisions/0015-key-sketch-selection.md): ``--text`` fits on your own, several
files together.
"""

from __future__ import annotations

import argparse
import inspect
from pathlib import Path

import torch

from sparse_sglang.mem_cache.key_sketch import BASIS_FILE, KeyBasis

CALIBRATION_TOKENS = 4096  # per text


def calibration_texts() -> list[str]:
    """The default calibration text: the long docstrings of ``torch.nn``'s public classes, in name
    order (deterministic for a torch version)."""
    import torch.nn as nn

    docs = [inspect.getdoc(obj) or "" for name, obj in sorted(vars(nn).items()) if inspect.isclass(obj)]
    return ["\n\n".join(d for d in docs if len(d) > 200)]


def record_keys(model, input_ids: torch.Tensor) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """Per layer, ``[Hkv, T, D]`` post-RoPE keys and queries summed over each kv head's group, of
    one forward (a registered transformers attention function records them, then attends with SDPA)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    keys: dict[int, torch.Tensor] = {}
    queries: dict[int, torch.Tensor] = {}

    def recording(module, query, key, value, attention_mask, **kwargs):
        heads = key.shape[1]
        keys[module.layer_idx] = key[0].detach().float().cpu()
        queries[module.layer_idx] = query[0].detach().float().view(heads, -1, *query.shape[2:]).sum(1).cpu()
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("sparse_sglang_calibrate", recording)
    previous = model.config._attn_implementation
    model.set_attn_implementation("sparse_sglang_calibrate")
    try:
        with torch.inference_mode():
            model(input_ids=input_ids, use_cache=False, logits_to_keep=1)
    finally:
        model.set_attn_implementation(previous)
    return keys, queries


def calibrate(model_path: str, rank: int | None = None, texts: list[str] | None = None, device: str = "cpu",
              window: int = CALIBRATION_TOKENS) -> KeyBasis:  # fmt: skip
    """The key basis of ``model_path`` (``rank`` defaults to a quarter of the head dim)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device).eval()
    return fit_basis(model, tokenizer, texts or calibration_texts(), rank, window)


def fit_basis(
    model, tokenizer, texts: list[str], rank: int | None = None, window: int = CALIBRATION_TOKENS
) -> KeyBasis:
    """Keys and queries of the first ``window`` tokens of each text, one forward each, fitted together."""
    keys: dict[int, list[torch.Tensor]] = {}
    queries: dict[int, list[torch.Tensor]] = {}
    device = next(model.parameters()).device
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[:, :window]
        k, q = record_keys(model, ids.to(device))
        for layer in k:
            keys.setdefault(layer, []).append(k[layer])
            queries.setdefault(layer, []).append(q[layer])
    keys = {layer: torch.cat(parts, dim=1) for layer, parts in keys.items()}  # [Hkv, sum of T, D]
    queries = {layer: torch.cat(parts, dim=1) for layer, parts in queries.items()}
    head_dim = keys[0].shape[-1]
    return KeyBasis.fit(keys, queries, rank or default_rank(head_dim))


def default_rank(head_dim: int) -> int:
    """A quarter of the head dim (docs/decisions/0015-key-sketch-selection.md)."""
    return max(1, head_dim // 4)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True)
    p.add_argument("--out", default=None, help=f"default: MODEL/{BASIS_FILE}")
    p.add_argument("--rank", type=int, default=None, help="directions per (layer, kv head); default head_dim / 4")
    p.add_argument(
        "--text",
        action="append",
        default=[],
        help="a text file to calibrate on (repeat for several); default: torch.nn's docstrings",
    )
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    texts = [Path(t).read_text() for t in args.text] or None
    basis = calibrate(args.model_path, args.rank, texts, args.device)
    out = Path(args.out) if args.out else Path(args.model_path) / BASIS_FILE
    basis.save(out)
    print(f"key basis {tuple(basis.keys.shape)} -> {out}")


if __name__ == "__main__":
    main()
