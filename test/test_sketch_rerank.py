"""The sketch re-rank (``--sparse-rerank-by sketch``): the corners' candidates re-ranked by their
tokens' key sketches in one Triton program per row, in Triton's interpreter on CPU, against its
torch reference."""

from __future__ import annotations

import pytest
import torch

from sparse_sglang.attention.reference import choose_by_sketch_reference
from sparse_sglang.attention.rerank import choose_by_sketch

P, D, R = 8, 32, 8
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(batch=2, heads=2, group=3, kc=12, pages=20, host_total=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    qg = torch.randn(batch, heads, group, D, generator=gen)
    wq = torch.randn(heads, D, R, generator=gen)
    sketch = torch.randn(heads, host_total + 1, P * R, generator=gen).to(torch.bfloat16)
    host_pages = torch.stack([torch.randperm(host_total, generator=gen)[:pages] for _ in range(batch)]).int()
    num_pages = torch.tensor([pages, 9][:batch], dtype=torch.int32)
    candidates = (
        torch.stack([torch.randperm(pages, generator=gen)[:kc] for _ in range(batch * heads)])
        .view(batch, heads, kc)
        .int()
    )
    candidates[0, -1, 3] = -1  # none (the top-k's padding)
    return qg, wq, sketch, host_pages, candidates, num_pages


def _run(*args, **kwargs):
    moved = [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args]
    return choose_by_sketch(*moved, **kwargs).cpu()


@pytest.mark.parametrize("k", [4, 7, 12, 16])  # above the 3 forced pages: no ties among them
def test_the_kernel_matches_its_reference(k):
    case = _case()
    got = _run(*case, k=k, forced=(1, 2))
    want = choose_by_sketch_reference(*case, k=k, forced=(1, 2))
    assert got.shape == want.shape == (2, 2, k)
    assert torch.equal(got.sort(dim=-1).values, want.sort(dim=-1).values)  # the same pages, -1 padded


def test_short_rows_keep_every_valid_candidate_and_pad():
    """Request 1 holds 9 pages: its candidates >= 9 are none, so it keeps what is left and pads -1."""
    qg, wq, sketch, host_pages, candidates, num_pages = _case()
    got = _run(qg, wq, sketch, host_pages, candidates, num_pages, k=12, forced=(1, 2))
    for h in range(2):
        valid = sorted(int(c) for c in candidates[1, h] if 0 <= c < 9)
        kept = sorted(int(c) for c in got[1, h] if c >= 0)
        assert kept == valid
        assert (got[1, h] == -1).sum() == 12 - len(valid)


def test_the_page_whose_best_token_matches_the_query_wins_over_pages_that_match_it_on_average():
    """One token aligned with the query outranks a page of tokens each half aligned: a page is scored
    by its best token, not its mean (a needle is one token's key)."""
    heads, pages = 1, 6
    qg = torch.zeros(1, heads, 1, D)
    qg[..., 0] = 1.0
    wq = torch.eye(D, R).unsqueeze(0)
    sketch = torch.zeros(heads, pages + 1, P * R)
    sketch[0, 2].view(P, R)[:, 0] = 0.5  # every token half aligned
    sketch[0, 4].view(P, R)[5, 0] = 1.0  # one token aligned
    sketch = sketch.to(torch.bfloat16)
    host_pages = torch.arange(pages, dtype=torch.int32).view(1, -1)
    candidates = torch.tensor([[[1, 2, 3, 4]]], dtype=torch.int32)
    got = _run(qg, wq, sketch, host_pages, candidates, torch.tensor([pages], dtype=torch.int32), k=1, forced=(0, 0))
    assert got.tolist() == [[[4]]]


def test_forced_pages_are_kept_whatever_they_score():
    """The sink page (0) and the recent pages (the last two) rank first."""
    qg, wq, sketch, host_pages, _, num_pages = _case(batch=1, heads=1)
    candidates = torch.tensor([[[5, 0, 19, 18, 7, 3]]], dtype=torch.int32)
    got = _run(qg, wq, sketch, host_pages, candidates, num_pages[:1], k=3, forced=(1, 2))
    assert sorted(got.view(-1).tolist()) == [0, 18, 19]
