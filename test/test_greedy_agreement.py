"""The comparison the GPU quality test applies to greedy completions of two servers."""

from pathlib import Path

import pytest

from sparse_sglang.testing.greedy import (
    TP_LOGPROB_TOL,
    GreedyAgreement,
    completion,
    greedy_agreement,
    tp_agrees_with_tp1,
    tp_logprob_tolerance,
)


def record(ids, logprobs, top2):
    return {"output_ids": ids, "logprobs": logprobs, "top2": top2}


def test_completion_reads_sglang_logprob_fields():
    response = {"output_ids": [5, 7], "meta_info": {
        "output_token_logprobs": [(-0.1, 5, None), (-0.5, 7, None)],
        "output_top_logprobs": [[(-0.1, 5, None), (-2.0, 9, None)], [(-0.5, 7, None), (-0.6, 8, None)]],
        "cached_tokens": 32}}  # fmt: skip
    assert completion(response) == {"output_ids": [5, 7], "logprobs": [-0.1, -0.5],
                                    "top2": [[-0.1, -2.0], [-0.5, -0.6]], "cached_tokens": 32}  # fmt: skip


def test_equal_tokens_with_close_logprobs_agree():
    ref = record([1, 2, 3], [-0.1, -0.2, -0.3], [[-0.1, -3.0]] * 3)
    got = greedy_agreement(ref, record([1, 2, 3], [-0.11, -0.2, -0.28], [[-0.11, -3.0]] * 3))
    assert got.equal and got.first_difference is None and got.max_logprob_gap == pytest.approx(0.02)
    assert got.within(logprob_tol=0.05, near_tie=0.1)


def test_a_switch_at_a_near_tie_agrees_and_one_at_a_sure_step_does_not():
    ref = record([1, 2, 3, 4], [-0.1, -0.69, -0.2, -0.2], [[-0.1, -3.0], [-0.69, -0.71], [-0.2, -3.0], [-0.2, -3.0]])
    tie = greedy_agreement(ref, record([1, 9, 8, 7], [-0.1, -0.70, -1.0, -1.0], [[-0.1, -3.0]] * 4))
    assert not tie.equal and tie.first_difference == 1 and tie.reference_margin == pytest.approx(0.02)
    assert tie.within(logprob_tol=0.05, near_tie=0.1)
    sure = greedy_agreement(ref, record([1, 2, 9, 9], [-0.1, -0.69, -0.5, -0.5], [[-0.1, -3.0]] * 4))
    assert sure.first_difference == 2 and sure.reference_margin == pytest.approx(2.8)
    assert not sure.within(logprob_tol=0.05, near_tie=0.1)


def test_same_tokens_with_logprobs_far_apart_do_not_agree():
    ref = record([1, 2], [-0.1, -0.2], [[-0.1, -3.0]] * 2)
    got = greedy_agreement(ref, record([1, 2], [-0.1, -1.5], [[-0.1, -3.0]] * 2))
    assert got.equal and not got.within(logprob_tol=0.05, near_tie=0.1)


def test_tp_bar_is_vanillas_own_tp_rounding_doubled_and_needs_shared_steps():
    floor = [GreedyAgreement(True, None, 0.2, None), GreedyAgreement(False, 3, 0.1, 0.0)]
    assert tp_logprob_tolerance(floor) == pytest.approx(0.4)
    assert tp_logprob_tolerance([GreedyAgreement(True, None, 0.001, None)]) == TP_LOGPROB_TOL
    assert tp_agrees_with_tp1(GreedyAgreement(True, None, 0.35, None), logprob_tol=0.4)
    assert not tp_agrees_with_tp1(GreedyAgreement(True, None, 0.45, None), logprob_tol=0.4)
    assert tp_agrees_with_tp1(GreedyAgreement(False, 21, 0.3, 0.0), logprob_tol=0.4)  # a tie after 21 steps
    assert not tp_agrees_with_tp1(GreedyAgreement(False, 2, 0.0, 0.0), logprob_tol=0.4)  # parted before it bit
    assert not tp_agrees_with_tp1(GreedyAgreement(False, 21, 0.0, 1.5), logprob_tol=0.4)  # a sure step switched


def test_an_early_stop_is_a_difference():
    ref = record([1, 2, 3], [-0.1] * 3, [[-0.1, -3.0]] * 3)
    got = greedy_agreement(ref, record([1, 2], [-0.1] * 2, [[-0.1, -3.0]] * 2))
    assert got.first_difference == 2 and not got.equal and got.reference_margin == pytest.approx(2.9)


def test_random_weights_load_as_the_model_and_spread_the_logits(tmp_path):
    """``write_llama3_8b_random`` writes every weight a Llama checkpoint has (transformers loads it
    with none missing), and its next-token logits are not tied as dummy weights' are."""
    import torch
    from transformers import LlamaForCausalLM

    from sparse_sglang.testing.models import LLAMA3_8B_CONFIG, write_llama3_8b_random

    tiny = {**LLAMA3_8B_CONFIG, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 4096}  # fmt: skip
    path = write_llama3_8b_random(tmp_path / "tiny", num_layers=2, config=tiny)
    model, info = LlamaForCausalLM.from_pretrained(path, output_loading_info=True, torch_dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = torch.randint(3, 4096, (4, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logprobs = model(ids).logits.log_softmax(-1)
    top2 = logprobs.topk(2, dim=-1).values
    margins = (top2[..., 0] - top2[..., 1]).flatten()
    assert (margins > 0.05).float().mean() > 0.5, margins  # most steps far from a tie
    # seeded: the same folder twice
    again = write_llama3_8b_random(tmp_path / "again", num_layers=2, config=tiny)
    assert (Path(path) / "model.safetensors").read_bytes() == (Path(again) / "model.safetensors").read_bytes()
