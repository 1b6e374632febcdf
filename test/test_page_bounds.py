"""Mean/std page corners (``--sparse-page-bounds meanstd``): what the summaries hold, however a
page's tokens arrive, and what Quest's scorer makes of them."""

from __future__ import annotations

import pytest
import torch

from sparse_sglang.attention import get_selector
from sparse_sglang.config import SparseConfig, SparseConfigError
from sparse_sglang.mem_cache import PageSummaries
from sparse_sglang.mem_cache.bounds import quantize_corners, resolve_bound_format


def moments_corners(keys: torch.Tensor, spread: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``[H, P, D]`` keys of one page: mean less and plus ``spread`` population std, per channel."""
    mean, std = keys.mean(1), keys.std(1, correction=0)
    return mean - spread * std, mean + spread * std


@pytest.mark.parametrize("arrival", ["whole", "token_by_token", "in_two_calls"])
def test_meanstd_corners_are_the_page_moments_however_tokens_arrive(arrival):
    gen = torch.Generator().manual_seed(0)
    heads, page, dim, spread = 2, 8, 16, 1.5
    summ = PageSummaries(1, heads, 4, page, dim, torch.float32, page_bounds="meanstd", bound_spread=spread)
    keys = torch.randn(2 * page, heads, dim, generator=gen) * 3 + 1  # pages 0 and 1, an offset mean
    slots = torch.arange(2 * page)
    if arrival == "whole":
        summ.update(0, keys, slots)
    elif arrival == "token_by_token":
        for t in range(2 * page):
            summ.update(0, keys[t : t + 1], slots[t : t + 1])
    else:
        summ.update(0, keys[:5], slots[:5])
        summ.update(0, keys[5:], slots[5:])
    lo, hi = summ.bounds(0)
    for p in range(2):
        want_lo, want_hi = moments_corners(keys[p * page : (p + 1) * page].transpose(0, 1), spread)
        torch.testing.assert_close(lo[:, p], want_lo, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(hi[:, p], want_hi, rtol=1e-4, atol=1e-4)
    assert summ.count[0, :2].tolist() == [page, page]


def test_a_page_started_anew_forgets_its_previous_owner():
    heads, page, dim = 1, 4, 8
    summ = PageSummaries(1, heads, 2, page, dim, torch.float32, page_bounds="meanstd", bound_spread=1.0)
    summ.update(0, torch.full((page, heads, dim), 50.0), torch.arange(page))
    fresh = torch.randn(page, heads, dim)
    summ.update(0, fresh, torch.arange(page))  # offset 0 again: a new owner's tokens
    lo, hi = summ.bounds(0)
    want_lo, want_hi = moments_corners(fresh.transpose(0, 1), 1.0)
    torch.testing.assert_close(lo[:, 0], want_lo, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hi[:, 0], want_hi, rtol=1e-5, atol=1e-5)


def test_int8_corners_round_to_the_nearest_level_and_stay_close_over_a_decode():
    """Decode fills a page a token at a time, each merge reading the corners back from int8:
    nearest rounding keeps the std within a few levels of the true one (outward rounding would
    add a level a merge)."""
    gen = torch.Generator().manual_seed(1)
    heads, page, dim, spread = 2, 32, 64, 1.0
    summ = PageSummaries(
        1, heads, 1, page, dim, torch.bfloat16, bound_format="auto", page_bounds="meanstd", bound_spread=spread
    )
    assert summ.bound_format == "int8"
    keys = (torch.randn(page, heads, dim, generator=gen) * 2).to(torch.bfloat16)
    for t in range(page):
        summ.update(0, keys[t : t + 1], torch.tensor([t]))
    lo, hi = summ.bounds(0)
    want_lo, want_hi = moments_corners(keys.float().transpose(0, 1), spread)
    level = 2.0 ** summ.bound_exp[0, :, 0].float().view(heads, 1)
    assert ((lo[:, 0] - want_lo).abs() / level).max() <= 4
    assert ((hi[:, 0] - want_hi).abs() / level).max() <= 4
    # |corner| <= 1.0 takes the scale 2**-6: 0.26 is 16.64 levels, read as 17 (outward: 16)
    levels_lo, levels_hi, e = quantize_corners(torch.tensor([[0.26, -0.26]]), torch.tensor([[0.74, 1.0]]))
    assert e.tolist() == [-6] and levels_lo.tolist() == [[17, -17]] and levels_hi.tolist() == [[47, 64]]


def test_quest_scores_meanstd_corners_as_mean_plus_spread_std():
    gen = torch.Generator().manual_seed(2)
    mean, std = torch.randn(1, 2, 5, 8, generator=gen), torch.rand(1, 2, 5, 8, generator=gen)
    q = torch.randn(1, 2, 3, 8, generator=gen)
    spread = 2.0
    scores = get_selector("quest").score(q, mean - spread * std, mean + spread * std, None, "sum")
    want = (q @ mean.transpose(-1, -2) + spread * q.abs() @ std.transpose(-1, -2)).sum(2)
    torch.testing.assert_close(scores, want, rtol=1e-5, atol=1e-5)


def test_meanstd_takes_int8_corners_for_fp8_keys_when_auto():
    assert resolve_bound_format("auto", torch.float8_e4m3fn, "meanstd") == "int8"
    assert resolve_bound_format("auto", torch.float8_e4m3fn, "minmax") == "exact"
    assert resolve_bound_format("exact", torch.float8_e4m3fn, "meanstd") == "exact"


@pytest.mark.parametrize("fields,flag", [({"page_bounds": "median"}, "page_bounds"), ({"bound_spread": 0.0}, "bound_spread"),
                                         ({"bound_spread": -1.0}, "bound_spread")])  # fmt: skip
def test_bad_page_bounds_knobs_are_named(fields, flag):
    with pytest.raises(SparseConfigError) as err:
        SparseConfig(host_cache_gb=1.0, **fields)
    assert err.value.field == flag
