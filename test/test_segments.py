"""Layer-segmented prefill plans: coverage, order, per-iteration work, in-layer chunking, HBM need."""

import itertools
import random

import pytest

from sparse_sglang.config import PREFILL_CHUNK_TOKENS_EQUIVALENT, SparseConfig
from sparse_sglang.prefill import layers_per_iteration, next_segment_end
from sparse_sglang.prefill.reference import Segment, plan_segments, segment_hbm_pages

INJECT_32 = SparseConfig(host_cache_gb=1.0).inject_tokens(32)  # the default budget of a 32-layer model


def covered(plan):
    return [(token, layer) for s in plan for token in s.tokens for layer in s.layers]


@pytest.mark.parametrize("tokens,layers,inject,chunk", [(1, 1, 1, None), (1000, 32, 65536, None), (65536, 32, 65536, 8192),
                                                        (65537, 32, 65536, None), (131072, 32, 65536, 8192),
                                                        (5000, 30, 12000, 4096), (7, 3, 2, None), (100, 2, 30, 1000)])  # fmt: skip
def test_every_layer_and_token_once_chunk_by_chunk_within_the_budget(tokens, layers, inject, chunk):
    plan = plan_segments(tokens, layers, inject, chunk)
    cells = covered(plan)
    assert len(set(cells)) == len(cells) == tokens * layers
    # chunk-major: a chunk through every layer (bottom-up) before the next chunk starts
    assert [(s.tokens.start, s.layers.start) for s in plan] == sorted((s.tokens.start, s.layers.start) for s in plan)
    assert all(s.work <= inject for s in plan)


def test_the_default_matches_a_2048_token_chunk_through_every_layer():
    assert INJECT_32 == PREFILL_CHUNK_TOKENS_EQUIVALENT * 32 == 65536
    assert plan_segments(1000, 32, INJECT_32) == [Segment(range(0, 32), range(0, 1000))]  # one ordinary prefill
    mid = plan_segments(16384, 32, INJECT_32)
    assert [len(s.layers) for s in mid] == [4] * 8 and all(len(s.tokens) == 16384 for s in mid)
    # SGLang's 8K chunks of a 64K prompt: 8 chunks x 4 iterations of 8 layers, as many iterations
    # as 2048-token chunked prefill takes, and each injects the same work
    chunked = plan_segments(65536, 32, INJECT_32, chunk_tokens=8192)
    assert len(chunked) == 32 and {s.work for s in chunked} == {8192 * 8}


def test_a_layer_too_long_for_one_iteration_is_chunked_inside_the_layer():
    plan = plan_segments(131072, 32, INJECT_32, chunk_tokens=1 << 20)  # chunks are capped at the budget
    assert len(plan) == 64 and all(len(s.layers) == 1 for s in plan)
    assert [(s.tokens.start, s.tokens.stop, s.layers.start) for s in plan[:3]] == [(0, 65536, 0), (0, 65536, 1),
                                                                                    (0, 65536, 2)]  # fmt: skip
    assert (plan[32].tokens, plan[32].layers) == (range(65536, 131072), range(0, 1))
    uneven = plan_segments(100, 2, 30)
    assert [(s.tokens.start, s.tokens.stop, s.layers.start) for s in uneven] == [
        (0, 30, 0), (0, 30, 1), (30, 60, 0), (30, 60, 1), (60, 90, 0), (60, 90, 1), (90, 100, 0)]  # fmt: skip
    assert uneven[-1].layers == range(0, 2)  # the 10-token tail fits both layers in one iteration


def test_the_loop_runs_the_plans_segments():
    """next_segment_end, what the scheduler loop asks each iteration, walks a chunk's segments."""
    for tokens, layers, inject in ((16384, 32, INJECT_32), (5000, 30, 12000), (3, 5, 7), (70000, 32, INJECT_32)):
        ends, done = [], 0
        while done < layers:
            done = next_segment_end(done, tokens, layers, inject)
            ends.append(done)
        per = layers_per_iteration(tokens, inject)
        assert ends == [min(layers, per * (i + 1)) for i in range(len(ends))]
        if tokens <= inject:
            assert [s.layers.stop for s in plan_segments(tokens, layers, inject)] == ends
    with pytest.raises(ValueError, match="no segment after layer 32"):
        next_segment_end(32, 100, 32, INJECT_32)


def test_hbm_need_is_about_one_layer_of_the_prompt_not_all_layers():
    page, heads, layers = 32, 8, 32
    tokens = 131072
    plan = plan_segments(tokens, layers, INJECT_32)
    one_layer = tokens // page * heads
    assert max(segment_hbm_pages(s, page, heads) for s in plan) == one_layer
    assert segment_hbm_pages(plan[0], page, heads) == one_layer // 2  # the first chunk sees only itself
    rng = random.Random(0)  # any prompt, budget and chunk: at most one layer's KV of the prompt
    for _ in range(200):
        tokens, inject, chunk = rng.randrange(1, 200_000), rng.randrange(1, 200_000), rng.randrange(1, 70_000)
        for s in plan_segments(tokens, layers, inject, chunk):
            assert segment_hbm_pages(s, page, heads) <= (-(-tokens // page) + 1) * heads  # + a partial page
    # the staging buffer bounds the staged part: a 128K prompt in 4096-token chunks, 16K staged
    plan = plan_segments(131072, layers, INJECT_32, 4096)
    assert max(segment_hbm_pages(s, page, heads, staging_tokens=16384) for s in plan) == (16384 + 4096) // page * heads


def test_bad_sizes_are_refused():
    for args in itertools.product((0, 5), (0, 5), (0, 5)):
        if 0 in args:
            with pytest.raises(ValueError, match="need positive sizes"):
                plan_segments(*args)
    with pytest.raises(ValueError, match="need positive sizes"):
        plan_segments(5, 5, 5, chunk_tokens=0)
