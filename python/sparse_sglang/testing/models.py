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
