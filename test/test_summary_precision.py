"""CPU test of the fp8 outward rounding benchmark/probes/summary_precision.py applies to page bounds."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmark.probes.summary_precision import e4m3_values, fp8_outward, int8_outward  # noqa: E402


def test_fp8_bounds_contain_the_originals_and_are_e4m3_values_times_a_power_of_two():
    gen = torch.Generator().manual_seed(0)
    values = e4m3_values()
    assert len(values) == 253 and values.max() == 448  # 256 codes minus 2 NaNs, minus -0
    kmin = torch.randn(3, 20, 16, generator=gen) * torch.tensor([0.01, 1.0, 300.0]).view(3, 1, 1)
    kmax = kmin + torch.rand(3, 20, 16, generator=gen) * torch.tensor([0.01, 1.0, 300.0]).view(3, 1, 1)
    kmin[0, 0, 0] = float("inf")  # a page with no token yet keeps its empty bounds
    lo, hi = fp8_outward(kmin, kmax, values)
    assert lo[0, 0, 0] == float("inf")
    assert (lo <= kmin).all() and (hi >= kmax).all()
    for head in range(3):
        scale = torch.exp2(torch.ceil(torch.log2(torch.maximum(kmin[head][kmin[head].isfinite()].abs().max(),
                                                               kmax[head].abs().max()) / 448)))  # fmt: skip
        for bound in (lo[head], hi[head]):
            b = bound[bound.isfinite()] / scale
            assert torch.isin(b, values).all()  # exactly representable
            assert torch.equal(b * scale, (b * scale).bfloat16().float())  # and exactly a bf16 value
    # Outward but tight: at most one e4m3 step away from the original.
    assert ((kmax - hi).abs() <= hi.abs() / 8 + 1e-6 * 300).all()


def test_int8_bounds_contain_the_originals_and_are_levels_times_a_power_of_two_per_page():
    gen = torch.Generator().manual_seed(1)
    kmin = torch.randn(2, 30, 16, generator=gen) * torch.logspace(-2, 2, 30).view(1, 30, 1)
    kmax = kmin + torch.rand(2, 30, 16, generator=gen)
    lo, hi = int8_outward(kmin, kmax)
    assert (lo <= kmin).all() and (hi >= kmax).all()
    amax = torch.maximum(kmin.abs(), kmax.abs()).amax(-1, keepdim=True)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 127)))
    for bound in (lo, hi):
        levels = bound / scale
        assert torch.equal(levels, levels.round()) and (levels.abs() <= 127).all()
        assert torch.equal(bound, bound.bfloat16().float())  # exactly a bf16 value
    assert ((hi - kmax) <= scale).all() and ((kmin - lo) <= scale).all()  # at most one level away
