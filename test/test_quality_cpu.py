"""CPU checks of the quality benchmark's machinery on SmolLM2 (a 256-token input, a few seconds):
the captured post-RoPE q/K/V reproduce the model's attention, and sparse decode with a budget
covering the whole context is dense decode."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")
quality = pytest.importorskip("benchmark.quality")

from sparse_sglang.default_model import DefaultModelUnavailable

TOKENS = 256


@pytest.fixture(scope="module")
def smollm():
    try:
        tokenizer, model = quality.load_model()
    except DefaultModelUnavailable as err:
        pytest.skip(str(err))
    text = (quality.LICENSES / "GPL-3").read_text() if quality.LICENSES.is_dir() else quality.FILLER * 40
    return tokenizer, model, tokenizer(text).input_ids[:TOKENS]


def test_captured_qkv_reproduce_the_models_attention(smollm):
    _, model, ids = smollm
    cap = quality.capture(model, torch.tensor([ids]), num_queries=8)
    scale = model.model.layers[0].self_attn.scaling
    seq_len = torch.arange(TOKENS - 8, TOKENS) + 1
    for layer in (0, len(cap.k) - 1):
        k, v = cap.k[layer].unsqueeze(0), cap.v[layer].unsqueeze(0)
        out = quality.sparse_attention_reference(cap.q[layer], k, v, None, quality.PAGE_SIZE, seq_len, scale)
        torch.testing.assert_close(out, cap.out[layer], rtol=1e-4, atol=1e-5)


def test_sparse_decode_is_dense_when_the_budget_covers_the_context(smollm):
    from transformers import DynamicCache

    _, model, ids = smollm
    prefix, suffix = ids[:-3], ids[-3:]
    cache = DynamicCache(config=model.config)
    prefill = quality.SparseDecoder(model, quality.Policy(selector=None), TOKENS + 4)
    quality.run_with(prefill, model, input_ids=torch.tensor([prefix]), past_key_values=cache, logits_to_keep=1)
    runs = {}
    for budget in (None, 512, 128):
        policy = quality.Policy(selector=None if budget is None else "quest", budget=budget or 512)
        hook = prefill.fork(policy)
        runs[budget] = (quality.decode(model, hook, copy.deepcopy(cache), suffix, 4), hook.recall)
    assert runs[512][0] == runs[None][0]
    assert all(r == pytest.approx(1.0) for r in runs[512][1])  # every page selected: exact path
    assert 0 < min(runs[128][1]) < 1  # 4 of 8 pages: sparse, really
