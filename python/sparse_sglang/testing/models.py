"""Model folders for tests and benchmarks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# Llama-3.1-8B's shape (32 layers, 32 q heads, 8 kv heads, head_dim 128) with a
# 128K context; weights come from --load-format dummy.
LLAMA3_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "vocab_size": 128256,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}


def kv_bytes_per_token(element_size: int = 2, config: dict = LLAMA3_8B_CONFIG) -> int:
    """K and V of one token in every layer of ``config`` at ``element_size`` bytes an element
    (bf16 2, fp8 1): the KV footprint per token of a token pool in that dtype."""
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * element_size


# bf16 (128 KiB): the 8B shape's KV footprint per token.
LLAMA3_8B_KV_BYTES_PER_TOKEN = kv_bytes_per_token()
# Token ids for synthetic prompts: clear of the special tokens at both ends of Llama-3's 128256 ids.
LLAMA3_8B_TOKEN_IDS = (1000, 100000)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def write_llama3_8b_random(
    out_dir: str | Path, num_layers: int, seed: int = 0, config: dict = LLAMA3_8B_CONFIG, std: float = 0.02,
    lm_head_std: float = 0.1,
) -> str:  # fmt: skip
    """A folder holding a Llama model of ``config``'s shape cut to ``num_layers`` layers, with
    seeded random weights of real spread (normal, ``std``; norms 1) in ``model.safetensors``: serve
    it without ``--load-format dummy`` (and with ``--skip-tokenizer-init``).

    Why: SGLang's dummy weights are near zero, so the top two logits of a step tie (margin 0),
    and two servers that round differently (TP=1 against TP=2) part at the first token, leaving
    their decode steps uncompared. ``lm_head_std`` spreads the logits so ties are rare.
    """
    import torch
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    c = {**config, "num_hidden_layers": num_layers}
    hidden, inter, head = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * head, c["num_key_value_heads"] * head
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int, scale: float = std) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16)

    ones = lambda n: torch.ones(n, dtype=torch.bfloat16)  # noqa: E731
    weights = {"model.embed_tokens.weight": normal(c["vocab_size"], hidden, scale=1.0),
               "model.norm.weight": ones(hidden), "lm_head.weight": normal(c["vocab_size"], hidden, scale=lm_head_std)}  # fmt: skip
    for i in range(num_layers):
        layer = f"model.layers.{i}"
        weights.update({
            f"{layer}.self_attn.q_proj.weight": normal(q, hidden), f"{layer}.self_attn.k_proj.weight": normal(kv, hidden),
            f"{layer}.self_attn.v_proj.weight": normal(kv, hidden), f"{layer}.self_attn.o_proj.weight": normal(hidden, q),
            f"{layer}.mlp.gate_proj.weight": normal(inter, hidden), f"{layer}.mlp.up_proj.weight": normal(inter, hidden),
            f"{layer}.mlp.down_proj.weight": normal(hidden, inter),
            f"{layer}.input_layernorm.weight": ones(hidden), f"{layer}.post_attention_layernorm.weight": ones(hidden),
        })  # fmt: skip
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(c, indent=2))
    return str(out)


def write_llama3_8b_dummy(
    out_dir: str | Path,
    tokenizer_from: str | Path | None = None,
    num_layers: int | None = None,
    context_len: int | None = None,
) -> str:
    """A folder holding the Llama-3-8B-shaped ``config.json`` (serve with ``--load-format dummy``).

    With ``tokenizer_from`` (a model folder, e.g. the default SmolLM2 one) the
    tokenizer files are copied in and the vocabulary shrinks to that
    tokenizer's, so text endpoints work; without it, serve with
    ``--skip-tokenizer-init`` and send ``input_ids``. ``num_layers`` keeps every layer's shape
    and drops the rest (a shallower model for runs that test machinery, not speed).
    ``context_len`` sets its longest context (``max_position_embeddings``;
    dummy weights make any length fine for machinery and memory runs).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = dict(LLAMA3_8B_CONFIG)
    if num_layers is not None:
        config["num_hidden_layers"] = num_layers
    if context_len is not None:
        config["max_position_embeddings"] = context_len
    if tokenizer_from is not None:
        src = Path(tokenizer_from)
        source_config = json.loads((src / "config.json").read_text())
        config.update(
            vocab_size=source_config["vocab_size"],
            bos_token_id=source_config.get("bos_token_id"),
            eos_token_id=source_config.get("eos_token_id"),
        )
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copy(src / name, out / name)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return str(out)
