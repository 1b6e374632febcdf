"""Layer-segmented prefill plans: coverage, order, per-iteration work, in-layer chunking, HBM need."""

import itertools
import random

import pytest

from sparse_sglang.model_runner import Segment, default_max_inject_tokens, plan_segments, segment_hbm_pages


def covered(plan):
    return [(layer, token) for s in plan for layer in s.layers for token in s.tokens]


@pytest.mark.parametrize("tokens,layers,inject", [(1, 1, 1), (1000, 32, 65536), (65536, 32, 65536), (65537, 32, 65536),
                                                  (131072, 32, 65536), (5000, 30, 12000), (7, 3, 2)])  # fmt: skip
def test_every_layer_and_token_once_in_layer_major_order_within_the_budget(tokens, layers, inject):
    plan = plan_segments(tokens, layers, inject)
    cells = covered(plan)
    assert len(cells) == len(set(cells)) == tokens * layers
    assert cells == sorted(cells)  # layer-major: a layer's tokens (in order) before the next layer's
    firsts = [s.layers.start for s in plan]
    assert firsts == sorted(firsts)
    assert all(s.work <= max(inject, 1) for s in plan)


def test_the_default_matches_a_2048_token_chunk_through_every_layer():
    assert default_max_inject_tokens(32) == 2048 * 32
    inject = default_max_inject_tokens(32)
    short = plan_segments(1000, 32, inject)
    assert short == [Segment(range(0, 32), range(0, 1000))]  # a short prompt: one ordinary prefill
    mid = plan_segments(16384, 32, inject)
    assert [len(s.layers) for s in mid] == [4] * 8 and all(len(s.tokens) == 16384 for s in mid)


def test_a_layer_too_long_for_one_iteration_is_chunked_inside_the_layer():
    plan = plan_segments(131072, 32, default_max_inject_tokens(32))  # 128K tokens, 64K token-layers per iteration
    assert len(plan) == 64 and all(len(s.layers) == 1 for s in plan)
    assert [(s.layers.start, s.tokens.start, s.tokens.stop) for s in plan[:3]] == [(0, 0, 65536), (0, 65536, 131072),
                                                                                    (1, 0, 65536)]  # fmt: skip
    uneven = plan_segments(100, 2, 30)
    assert [(s.layers.start, s.tokens.start, s.tokens.stop) for s in uneven] == [
        (0, 0, 30), (0, 30, 60), (0, 60, 90), (0, 90, 100), (1, 0, 30), (1, 30, 60), (1, 60, 90), (1, 90, 100)]  # fmt: skip


def test_hbm_need_is_about_one_layer_of_the_prompt_not_all_layers():
    page, heads, layers = 32, 8, 32
    tokens = 131072
    plan = plan_segments(tokens, layers, default_max_inject_tokens(layers))
    one_layer = tokens // page * heads
    assert max(segment_hbm_pages(s, page, heads) for s in plan) == one_layer
    assert segment_hbm_pages(plan[0], page, heads) == one_layer // 2  # the first chunk sees only itself
    # Any prompt and budget: one layer's KV of the prompt, or (short prompts, several layers at
    # once) no more than the iteration's budget of token-layers, rounded up to pages.
    rng = random.Random(0)
    for tokens, inject in ((rng.randrange(1, 200_000), rng.randrange(1, 200_000)) for _ in range(200)):
        for s in plan_segments(tokens, layers, inject):
            pages = segment_hbm_pages(s, page, heads)
            if len(s.layers) == 1:
                assert pages <= -(-tokens // page) * heads
            else:
                assert s.tokens == range(tokens) and pages <= (inject // page + len(s.layers)) * heads


def test_bad_sizes_are_refused():
    for args in itertools.product((0, 5), (0, 5), (0, 5)):
        if 0 in args:
            with pytest.raises(ValueError, match="need positive sizes"):
                plan_segments(*args)
