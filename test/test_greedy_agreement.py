"""The comparison the GPU quality test applies to greedy completions of two servers."""

import pytest

from sparse_sglang.testing.greedy import completion, greedy_agreement


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


def test_an_early_stop_is_a_difference():
    ref = record([1, 2, 3], [-0.1] * 3, [[-0.1, -3.0]] * 3)
    got = greedy_agreement(ref, record([1, 2], [-0.1] * 2, [[-0.1, -3.0]] * 2))
    assert got.first_difference == 2 and not got.equal and got.reference_margin == pytest.approx(2.9)
