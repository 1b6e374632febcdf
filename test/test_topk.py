"""The page top-k implementations against torch.topk (as sets: order and tie-breaking are free).

On CPU the radix-select kernel runs in Triton's interpreter (conftest sets TRITON_INTERPRET)."""

import math

import pytest
import torch

from sparse_sglang.attention.topk import TOPK_IMPLS, radix_select_topk, topk_pages

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def assert_is_topk(priority: torch.Tensor, ids: torch.Tensor, k: int) -> None:
    """``ids`` are k distinct in-range indices per row whose values are the row's k largest."""
    assert ids.shape == (*priority.shape[:-1], k)
    ids = ids.long().cpu()
    priority = priority.cpu()
    for row, picked in zip(priority.reshape(-1, priority.shape[-1]), ids.reshape(-1, k)):
        assert picked.unique().numel() == k
        assert int(picked.min()) >= 0 and int(picked.max()) < row.numel()
        want = torch.topk(row, k).values.sort().values
        assert torch.equal(row[picked].sort().values, want)


@pytest.mark.parametrize("n,k", [(1, 1), (5, 5), (37, 8), (256, 64), (1025, 64), (4097, 64)])
def test_radix_select_matches_torch_topk(n, k):
    gen = torch.Generator().manual_seed(n)
    prio = torch.randn(3, n, generator=gen)
    prio[0, : min(n, 3)] = math.inf  # forced pages (sink/recent) rank first
    prio[1, n // 2 :] = -math.inf  # pages past a request's end
    prio[2] = -prio[2].abs()  # negative scores: the key's sign handling
    assert_is_topk(prio, radix_select_topk(prio.to(DEVICE), k), k)


def test_radix_select_with_ties_takes_exactly_k():
    prio = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.5, 2.0, -1.0, 3.0], [0.0] * 8, [-math.inf] * 8])
    ids = radix_select_topk(prio.to(DEVICE), 3)
    assert_is_topk(prio, ids, 3)
    assert 7 in ids[0].tolist()  # the unique maximum, then two of the four 2.0s


def test_radix_select_writes_into_a_strided_output():
    prio = torch.randn(4, 300, generator=torch.Generator().manual_seed(1))
    out = torch.full((4, 40), -7, dtype=torch.int32, device=DEVICE)
    radix_select_topk(prio.to(DEVICE), 16, out=out[:, :16])
    assert_is_topk(prio, out[:, :16], 16)
    assert bool((out[:, 16:] == -7).all())


@pytest.mark.parametrize("impl", TOPK_IMPLS)
def test_topk_pages_every_impl_keeps_leading_dims(impl):
    prio = torch.randn(2, 3, 200, generator=torch.Generator().manual_seed(2))
    ids = topk_pages(prio.to(DEVICE), 20, impl)
    assert_is_topk(prio, ids, 20)


def test_topk_pages_rejects_unknown_impl():
    with pytest.raises(ValueError, match="top-k impl"):
        topk_pages(torch.zeros(1, 4), 2, "bogus")
