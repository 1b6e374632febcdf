"""Coarse-first selection (``--sparse-coarse-pages``): super-page bounds, their scores, and the
candidate pages the fine pass scores, kernels against their torch references (Triton's
interpreter on CPU, the compiled kernels on the GPU host); the decode paths that use them are
compared on the GPU in ``test_sparse_decode_gpu.py``."""

from __future__ import annotations

import math

import pytest
import torch

from sparse_sglang.attention.reference import score_candidates_reference, score_coarse_reference, score_pages_reference
from sparse_sglang.attention.scoring import candidate_pages, score_candidates, score_coarse
from sparse_sglang.config import SparseConfig, SparseConfigError
from sparse_sglang.mem_cache import PageSummaries
from sparse_sglang.mem_cache.gpu_cache import CachedRows
from sparse_sglang.mem_cache.kernels import build_coarse
from sparse_sglang.mem_cache.plan import fixed_gpu_bytes
from sparse_sglang.mem_cache.summaries import coarse_built

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
S, P, HEADS, GROUP, DIM, HOST_PAGES = 4, 4, 2, 3, 16, 80


def filled_summaries(dtype=torch.bfloat16, bound_format="int8", layers=2, seed=0) -> PageSummaries:
    gen = torch.Generator().manual_seed(seed)
    summ = PageSummaries(layers, HEADS, HOST_PAGES, P, DIM, dtype, DEVICE, bound_format=bound_format, coarse_pages=S)
    for layer in range(layers):
        k = torch.randn(HOST_PAGES * P, HEADS, DIM, generator=gen) * 3
        summ.update(layer, k.to(dtype).to(DEVICE), torch.arange(HOST_PAGES * P, device=DEVICE))
    return summ


def request_pages(seed=1):
    gen = torch.Generator().manual_seed(seed)
    num_pages = torch.tensor([30, 7, 19], device=DEVICE)
    host = torch.stack([torch.randperm(HOST_PAGES, generator=gen)[:32] for _ in range(3)]).to(torch.int32).to(DEVICE)
    return host, num_pages


def as_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


@pytest.mark.parametrize(
    "dtype,bound_format", [(torch.bfloat16, "int8"), (torch.bfloat16, "exact"), (torch.float8_e4m3fn, "auto")]
)
def test_build_kernel_equals_the_reference_and_builds_each_super_page_once(dtype, bound_format):
    ref, got = filled_summaries(dtype, bound_format), filled_summaries(dtype, bound_format)
    host, num_pages = request_pages()
    built = coarse_built(num_pages, S, 2)
    assert built.tolist() == [7, 1, 4]
    ref.build_coarse(host, built)
    build_coarse(got, host, built, int(built.max()))
    for name in ("coarse_kmin", "coarse_kmax", "coarse_exp", "coarse_first"):
        if getattr(ref, name) is not None:
            assert torch.equal(as_bits(getattr(got, name)), as_bits(getattr(ref, name))), name
    last = host[0, S - 1].long()
    assert int(got.coarse_first[last]) == int(host[0, 0])
    # Built super-pages are not read again: a changed page bound stays out of its coarse bound
    # (no token changes a full page in the server), until the page starts anew.
    before = got.coarse_kmax[:, :, last].clone()
    got.kmax[:, :, host[0, 0].long()] = got.kmax[:, :, last]  # anything else
    build_coarse(got, host, built, int(built.max()))
    assert torch.equal(as_bits(got.coarse_kmax[:, :, last]), as_bits(before))
    got.reset(host[0, S - 1 : S].long())
    assert int(got.coarse_first[last]) == -1


def test_coarse_bounds_bound_every_page_of_their_super_page():
    summ = filled_summaries()
    host, num_pages = request_pages()
    built = coarse_built(num_pages, S, 2)
    summ.build_coarse(host, built)
    q = torch.randn(3, HEADS, GROUP, DIM, device=DEVICE)
    fine = score_pages_reference("quest", q, summ.layer(1), host, num_pages)
    coarse = score_coarse_reference(q, summ.coarse_layer(1), host, built, S, 0)
    for b in range(3):
        for s in range(int(built[b])):
            assert (coarse[b, :, s] >= fine[b, :, s * S : (s + 1) * S].amax(-1) - 1e-4).all()
        assert (coarse[b, :, int(built[b]) :] == -math.inf).all()


@pytest.mark.parametrize("group_reduce", ["sum", "max"])
@pytest.mark.parametrize("sink", [0, 1])
def test_coarse_score_kernel_equals_the_reference(group_reduce, sink):
    summ = filled_summaries()
    host, num_pages = request_pages()
    built = coarse_built(num_pages, S, 2)
    build_coarse(summ, host, built, int(built.max()))
    q = torch.randn(3, HEADS, GROUP, DIM, device=DEVICE)
    want = score_coarse_reference(q, summ.coarse_layer(0), host, built, S, sink, group_reduce)
    got = score_coarse(q, summ.coarse_layer(0), host, built, S, sink, group_reduce)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert (got[..., 0] == math.inf).all() == bool(sink) or built.min() == 0


def test_candidate_pages_are_the_kept_super_pages_and_the_tail():
    supers = torch.tensor([[[2, 0, -1]], [[5, 1, 9]]])  # 5 and 9 are past request 1's built super-pages
    built, num_pages = torch.tensor([3, 2]), torch.tensor([14, 10])
    keep = candidate_pages(supers, built, num_pages, 4, 16)
    assert keep[0, 0].nonzero().view(-1).tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 12, 13]
    assert keep[1, 0].nonzero().view(-1).tolist() == [4, 5, 6, 7, 8, 9]


@pytest.mark.parametrize("selector", ["quest", "arkvale", "mean"])
@pytest.mark.parametrize("group_reduce", ["sum", "max"])
@pytest.mark.parametrize("reuse", [False, True], ids=["full", "reuse"])
def test_candidate_score_kernel_equals_the_reference(selector, group_reduce, reuse):
    gen = torch.Generator().manual_seed(5)
    summ = PageSummaries(1, HEADS, HOST_PAGES, P, DIM, torch.bfloat16, DEVICE, bound_format="int8", coarse_pages=S,
                         with_radius=selector == "arkvale", with_mean=selector == "mean")  # fmt: skip
    summ.update(0, (torch.randn(HOST_PAGES * P, HEADS, DIM, generator=gen) * 3).to(torch.bfloat16).to(DEVICE),
                torch.arange(HOST_PAGES * P, device=DEVICE))  # fmt: skip
    host, num_pages = request_pages()
    built = coarse_built(num_pages, S, 2)
    q = torch.randn(3, HEADS, GROUP, DIM, generator=gen).to(DEVICE)
    supers = torch.tensor([[3, 0, 6], [0, -1, -1], [2, 0, 1]], dtype=torch.int32, device=DEVICE)
    supers = supers.view(3, 1, 3).expand(3, HEADS, 3).contiguous()
    cached = None
    if reuse:  # request 1 reuses its selection: its cache row holds pages 0, 2 and 5
        rows = torch.full((4, HEADS, 4), -1, dtype=torch.int32, device=DEVICE)
        rows[2, :, :3] = torch.tensor([0, 1, 2], dtype=torch.int32)
        slot_page = torch.tensor([0, 2, 5, -1], dtype=torch.int32, device=DEVICE)  # + the scratch slot
        reselect = torch.tensor([True, False, True], device=DEVICE)
        cached = CachedRows(reselect, rows, torch.tensor([0, 2, 1], dtype=torch.int32, device=DEVICE), slot_page)
    args = (selector, q, summ.layer(0), host, num_pages, supers, built, S, S + 1, group_reduce)
    want = score_candidates_reference(*args, forced=(1, 2), reuse=cached)
    got = score_candidates(*args, forced=(1, 2), reuse=cached)
    for b in range(3):
        n = int(num_pages[b])
        w, g = want[b, :, :n], got[b, :, :n]
        assert torch.equal(w == -math.inf, g == -math.inf) and torch.equal(w == math.inf, g == math.inf)
        finite = w.isfinite()
        torch.testing.assert_close(g[finite], w[finite], rtol=1e-5, atol=1e-4)
    assert (
        want[0, 0, :30].isfinite().sum() + (want[0, 0, :30] == math.inf).sum()
    ) == 3 * S + 2  # 3 supers + pages 28, 29


def test_config_and_memory_of_coarse_selection():
    with pytest.raises(SparseConfigError, match="coarse_pages.*power of two"):
        SparseConfig(host_cache_gb=1.0, coarse_pages=6)
    with pytest.raises(SparseConfigError, match="coarse_candidates"):
        SparseConfig(host_cache_gb=1.0, coarse_pages=8, coarse_candidates=0.5)
    config = SparseConfig(host_cache_gb=1.0, coarse_pages=8)
    assert config.coarse_supers(64) == 32
    # Only where it spares the page-by-page score enough pages: batch 8 at 128K, not batch 1.
    assert config.coarse_pays(8, 4096, 64) and not config.coarse_pays(1, 4096, 64)
    assert not SparseConfig(host_cache_gb=1.0).coarse_pays(32, 4096, 64)  # off
    with pytest.raises(SparseConfigError, match="coarse_min_pages"):
        SparseConfig(host_cache_gb=1.0, coarse_min_pages=-1)
    for bound_format in ("int8", "exact"):
        plain = PageSummaries(3, 2, 100, 32, 64, torch.bfloat16, with_mean=False, bound_format=bound_format)
        coarse = PageSummaries(
            3, 2, 100, 32, 64, torch.bfloat16, with_mean=False, bound_format=bound_format, coarse_pages=8
        )
        for summ, pages in ((plain, 0), (coarse, 8)):
            want = fixed_gpu_bytes(
                100, 3, 2, 64, torch.bfloat16, 0, with_mean=False, bound_format=bound_format, coarse_pages=pages
            )[0]
            assert summ.nbytes == want
        assert coarse.nbytes > 1.9 * plain.nbytes
