"""CPU checks of the quality benchmark's machinery on SmolLM2 (a 256-token input, a few seconds):
the captured post-RoPE q/K/V reproduce the model's attention, and sparse decode with a budget
covering the whole context is dense decode, and so is one leaving every layer dense
(``dense_layers``); dense leading layers count as recall 1 in the recall table."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")
quality = pytest.importorskip("benchmark.quality")

from sparse_sglang.default_model import DefaultModelUnavailable  # noqa: E402 (after the skips above)

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


@pytest.fixture(scope="module")
def prefilled(smollm):
    """(model, dense prefill hook, cache) after all but the last 3 tokens, and those 3 tokens."""
    from transformers import DynamicCache

    _, model, ids = smollm
    prefix, suffix = ids[:-3], ids[-3:]
    cache = DynamicCache(config=model.config)
    prefill = quality.SparseDecoder(model, quality.Policy(selector=None), TOKENS + 4)
    quality.run_with(prefill, model, input_ids=torch.tensor([prefix]), past_key_values=cache, logits_to_keep=1)
    return model, prefill, cache, suffix


def test_sparse_decode_is_dense_when_the_budget_covers_the_context(prefilled):
    model, prefill, cache, suffix = prefilled
    runs = {}
    for budget in (None, 512, 128):
        policy = quality.Policy(selector=None if budget is None else "quest", budget=budget or 512)
        hook = prefill.fork(policy)
        runs[budget] = (quality.decode(model, hook, copy.deepcopy(cache), suffix, 4), hook.recall)
    assert runs[512][0] == runs[None][0]
    assert all(r == pytest.approx(1.0) for r in runs[512][1])  # every page selected: exact path
    assert 0 < min(runs[128][1]) < 1  # 4 of 8 pages: sparse, really


def test_dense_layers_leave_those_layers_dense_in_decode(prefilled):
    model, prefill, cache, suffix = prefilled
    layers, steps = model.config.num_hidden_layers, len(suffix) + 4
    runs = {}
    for name, policy in {
        "dense": quality.Policy(selector=None),
        "all_dense": quality.Policy(budget=128, dense_layers=layers),  # 4 of 8 pages, but no sparse layer
        "two_dense": quality.Policy(budget=128, dense_layers=2),
    }.items():
        hook = prefill.fork(policy)
        runs[name] = (quality.decode(model, hook, copy.deepcopy(cache), suffix, 4), hook.recall)
    assert runs["all_dense"] == (runs["dense"][0], [])  # equal to dense; no sparse step at all
    assert len(runs["two_dense"][1]) == steps * (layers - 2)  # one recall per sparse (layer, step)
    assert 0 < min(runs["two_dense"][1]) < 1


def test_recall_table_counts_dense_layers_as_exact(smollm):
    _, model, ids = smollm
    cap = quality.capture(model, torch.tensor([ids]), num_queries=4)
    scale = model.model.layers[0].self_attn.scaling
    sparse, two_dense, all_dense = quality.recall_table(
        cap, [quality.Policy(budget=128, dense_layers=0), quality.Policy(budget=128, dense_layers=2),
              quality.Policy(budget=128, dense_layers=len(cap.k))], scale)  # fmt: skip
    assert two_dense["recall_per_layer"] == [1.0, 1.0] + sparse["recall_per_layer"][2:]
    assert two_dense["rel_err_per_layer"][:2] == [0.0, 0.0]
    assert two_dense["recall_mean_sparse_layers"] == pytest.approx(sparse["recall_mean_from_layer2"])
    assert sparse["recall_mean_sparse_layers"] == pytest.approx(sparse["recall_mean"])
    assert sparse["recall_mean"] < 1  # 4 of 8 pages: sparse, really
    assert all_dense["recall_mean"] == 1.0 and all_dense["recall_mean_sparse_layers"] is None


def test_policy_names_name_the_knobs_that_differ_from_the_defaults():
    assert quality.Policy().name == quality.DEFAULT_SELECTOR
    assert quality.Policy(selector=None, dense_layers=3).name == "dense"
    name = quality.Policy(budget=1024, dense_layers=quality.Policy().dense_layers + 1).name
    assert name == f"{quality.DEFAULT_SELECTOR}(budget=1024,dense_layers={quality.Policy().dense_layers + 1})"
    names = [p.name for p in quality.passkey_policies()]
    assert len(set(names)) == len(names) and "dense" not in names


@pytest.mark.parametrize("protocol", sorted(quality.PASSKEY_PROTOCOLS))
def test_passkey_protocols_decode_like_dense_when_the_budget_covers_the_prompt(smollm, protocol):
    # "prompt" prefills the question too and takes the prefill's greedy token as the answer's
    # first; with every page selected the answer is dense's under either protocol, every step exact.
    tokenizer, model, _ = smollm
    rows = quality.passkey_table(tokenizer, model, [320], [0.5], [quality.Policy(budget=512)], new_tokens=3,
                                 seed=0, protocol=protocol)  # fmt: skip
    row = rows[0]
    assert row["quest"]["equal_dense"] and row["quest"]["answer"] == row["dense"]["answer"]
    assert row["quest"]["answer_equal_dense"]
    assert row["quest"]["decode_recall_mean"] == pytest.approx(1.0)


def test_the_pass_key_answer_is_the_first_number_of_the_completion():
    assert quality.passkey_answer(" 72468. Remember") == quality.passkey_answer(" 72468. ") == "72468"
    assert quality.passkey_answer(" a key that unlocks") is None
