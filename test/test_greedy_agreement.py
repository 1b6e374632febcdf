"""The comparison the GPU quality test applies to greedy completions of two servers."""

from pathlib import Path

import pytest

from sparse_sglang.testing.greedy import (
    TP_LOGPROB_TOL,
    GreedyAgreement,
    completion,
    forced_steps,
    greedy_agreement,
    nearer_than_selection,
    switched_steps,
    tp_logprob_tolerance,
    tp_steps_agree,
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


def two_tokens(prefill: int, token: int, logprob: float, margin: float) -> dict:
    """A two-token completion: ``prefill`` from the dense prefill, then one decode step."""
    return record([prefill, token], [-0.1, logprob], [[-0.1, -3.0], [logprob, logprob - margin]])


def test_forced_steps_compare_each_decode_step_where_the_prefills_agree():
    ref = [two_tokens(5, 7, -0.2, 1.0), two_tokens(5, 8, -0.3, 0.02), two_tokens(6, 9, -0.1, 1.0)]
    other = [two_tokens(5, 7, -0.25, 1.0), two_tokens(5, 4, -0.31, 0.02), two_tokens(3, 9, -0.1, 1.0)]
    same, switched, not_compared = forced_steps(ref, other)
    assert same.equal and same.max_logprob_gap == pytest.approx(0.05)
    assert not switched.equal and switched.first_difference == 0 and switched.reference_margin == pytest.approx(0.02)
    assert not_compared is None  # the prefills chose different tokens: the decode contexts differ
    with pytest.raises(ValueError, match="3 forced contexts against 2"):
        forced_steps(ref, other[:2])


def test_tp_bar_is_the_larger_rounding_floor_doubled():
    floor = [GreedyAgreement(True, None, 0.2, None), GreedyAgreement(False, 0, 0.0, 0.01), None]
    assert tp_logprob_tolerance(floor) == pytest.approx(0.4)
    # the sparse floor (page swaps from rounding) can be the larger one
    assert tp_logprob_tolerance(floor, [GreedyAgreement(True, None, 0.3, None)]) == pytest.approx(0.6)
    assert switched_steps(floor) == 1
    assert tp_logprob_tolerance([GreedyAgreement(True, None, 0.001, None)]) == TP_LOGPROB_TOL
    same = GreedyAgreement(True, None, 0.35, None)
    assert tp_steps_agree([same] * 4, logprob_tol=0.4)
    assert not tp_steps_agree([same] * 3 + [GreedyAgreement(True, None, 0.45, None)], logprob_tol=0.4)
    # a switch where the reference's top two are within the bar is rounding; a sure step switched is not
    assert tp_steps_agree([same] * 3 + [GreedyAgreement(False, 0, 0.0, 0.3)], logprob_tol=0.4)
    assert not tp_steps_agree([same] * 3 + [GreedyAgreement(False, 0, 0.0, 1.5)], logprob_tol=0.4)
    # too few steps compared (the dense prefills parted), or none at all: the test did not bite
    assert tp_steps_agree([same] * 3 + [None], logprob_tol=0.4)
    assert not tp_steps_agree([same] * 2 + [None] * 2, logprob_tol=0.4)
    assert not tp_steps_agree([], logprob_tol=0.4)
    # more switches than rounding makes: a wrong selection, even where each switch is a near tie
    near_tie = GreedyAgreement(False, 0, 0.0, 0.3)
    assert tp_steps_agree([same] * 2 + [near_tie] * 2, logprob_tol=0.4, max_switched=2)
    assert not tp_steps_agree([same] + [near_tie] * 3, logprob_tol=0.4, max_switched=2)


def test_at_depth_tp2_must_stay_far_nearer_tp1_than_selection_moves():
    same = lambda gap: GreedyAgreement(True, None, gap, None)  # noqa: E731
    switched = GreedyAgreement(False, 0, 0.0, 0.5)
    selection = [same(1.2)] + [switched] * 8  # sparse against dense: 8 switches, a 1.2 gap
    assert nearer_than_selection([same(0.6), switched, switched, same(0.1)], selection)
    assert not nearer_than_selection([same(0.7), same(0.1), same(0.1), same(0.1)], selection)  # over half its gap
    assert not nearer_than_selection([switched] * 3 + [same(0.1)], selection)  # over a quarter of its switches
    assert not nearer_than_selection([same(0.1), None, None, same(0.1)], selection)  # too few compared
    # selection that moved nothing (contexts within the budget) is no scale
    assert not nearer_than_selection([same(0.0)] * 4, [same(0.0)] * 4)


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
