"""The quantized re-rank (``--sparse-rerank-by quantized``): the corners' candidates re-ranked by
their attention mass estimated from their keys' low-bit codes, in Triton's interpreter on CPU,
against its torch reference and against the exact re-rank."""

from __future__ import annotations

import pytest
import torch

from sparse_sglang.attention.reference import (
    candidate_page_lse_reference,
    choose_by_codes_reference,
    choose_reranked_reference,
)
from sparse_sglang.attention.rerank import choose_by_codes
from sparse_sglang.mem_cache.kernels import SaveRuns, encode_runs
from sparse_sglang.mem_cache.key_codes import PageKeyCodes

P, D, H, G = 8, 32, 2, 3
HOST = 64
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _random_codes(bits: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    codes = PageKeyCodes(1, H, HOST, P, D, bits, torch.bfloat16).layer(0)
    codes["codes"].copy_(torch.randint(0, 256, codes["codes"].shape, generator=gen).to(torch.uint8))
    lo = torch.randn(codes["lo"].shape, generator=gen)
    codes["lo"].copy_(lo)
    codes["hi"].copy_(lo + torch.rand(lo.shape, generator=gen) * 2)
    return codes


def _case(bits=2, batch=2, kc=12, pages=20, seed=0):
    gen = torch.Generator().manual_seed(seed)
    qg = torch.randn(batch, H, G, D, generator=gen)
    host_pages = torch.stack([torch.randperm(HOST, generator=gen)[:pages] for _ in range(batch)]).int()
    num_pages = torch.tensor([pages, 9][:batch], dtype=torch.int32)
    candidates = (
        torch.stack([torch.randperm(pages, generator=gen)[:kc] for _ in range(batch * H)]).view(batch, H, kc).int()
    )
    candidates[0, -1, 3] = -1  # none (the top-k's padding)
    return qg, _random_codes(bits, gen), bits, host_pages, candidates, num_pages


def _run(qg, codes, bits, *rest, **kwargs):
    moved = [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in (qg, *rest)]
    codes = {name: t.to(DEVICE) for name, t in codes.items()}
    return choose_by_codes(moved[0], codes, bits, *moved[1:], **kwargs).cpu()


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("k", [4, 7, 12, 16])  # above the 3 forced pages: no ties among them
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])  # the kernel scores in float32 either way
def test_the_kernels_match_their_reference(bits, k, q_dtype):
    qg, *rest = _case(bits)
    case = (qg.to(q_dtype), *rest)
    got = _run(*case, k=k, forced=(1, 2), sm_scale=0.2)
    want = choose_by_codes_reference(*case, k=k, forced=(1, 2), sm_scale=0.2)
    assert got.shape == want.shape == (2, H, k)
    assert torch.equal(got.sort(dim=-1).values, want.sort(dim=-1).values)  # the same pages, -1 padded


def test_soft_capped_logits_and_fp8_scales_match_the_reference():
    case = _case()
    kwargs = dict(k=6, forced=(1, 2), sm_scale=0.2, k_scale=1.7, logits_soft_cap=5.0)
    got = _run(*case, **kwargs)
    assert torch.equal(got.sort(dim=-1).values, choose_by_codes_reference(*case, **kwargs).sort(dim=-1).values)


def test_short_rows_keep_every_valid_candidate_and_pad():
    """Request 1 holds 9 pages: its candidates >= 9 are none, so it keeps what is left and pads -1."""
    qg, codes, bits, host_pages, candidates, num_pages = _case()
    got = _run(qg, codes, bits, host_pages, candidates, num_pages, k=12, forced=(1, 2), sm_scale=0.2)
    for h in range(H):
        valid = sorted(int(c) for c in candidates[1, h] if 0 <= c < 9)
        assert sorted(int(c) for c in got[1, h] if c >= 0) == valid
        assert (got[1, h] == -1).sum() == 12 - len(valid)


def test_forced_pages_are_kept_whatever_they_score():
    """The sink page (0) and the recent pages (the last two) rank first."""
    qg, codes, bits, host_pages, _, num_pages = _case(batch=1)
    candidates = torch.tensor([[[5, 0, 19, 18, 7, 3]] * H], dtype=torch.int32)
    got = _run(qg, codes, bits, host_pages, candidates, num_pages[:1], k=3, forced=(1, 2), sm_scale=0.2)
    assert all(sorted(row) == [0, 18, 19] for row in got[0].tolist())


def _save_keys(keys: torch.Tensor, bits: int) -> PageKeyCodes:
    """Host pages ``0..N-1`` coded from ``keys`` ``[N * P, H, D]``, each page saved whole."""
    pages = keys.shape[0] // P
    codes = PageKeyCodes(1, H, pages, P, D, bits, keys.dtype, DEVICE)
    runs = SaveRuns.for_extend([1], [0], [keys.shape[0]], P, DEVICE)
    encode_runs(codes, 0, keys.contiguous().to(DEVICE), torch.arange(keys.shape[0], device=DEVICE), runs)
    return codes


def test_the_page_whose_one_token_the_query_wants_outranks_a_page_that_matches_it_on_average():
    """A needle is one token's key: its page's mass comes from that token, and the codes keep it
    (the page's max in that channel is its frame's top level)."""
    pages = 6
    keys = torch.zeros(pages * P, H, D)
    keys[:, :, 1] = torch.linspace(-1, 1, pages * P).view(-1, 1)  # channel 1 varies, unwatched
    keys[2 * P : 3 * P, :, 0] = 0.5  # every token of page 2 half aligned
    keys[4 * P + 5, :, 0] = 1.0  # one token of page 4 aligned
    codes = _save_keys(keys.to(torch.bfloat16), 2)
    qg = torch.zeros(1, H, G, D)
    qg[..., 0] = 1.0
    candidates = torch.tensor([[[1, 2, 3, 4]] * H], dtype=torch.int32)
    got = _run(qg, codes.layer(0), 2, torch.arange(pages, dtype=torch.int32).view(1, -1), candidates,
               torch.tensor([pages], dtype=torch.int32), k=1, forced=(0, 0), sm_scale=20.0)  # fmt: skip
    assert got.view(-1).tolist() == [4] * H


def test_on_keys_the_codes_hold_exactly_it_chooses_what_the_exact_rerank_chooses():
    """Keys taking 4 evenly spaced values per (page, channel) (their min and max among them) are
    coded without loss in 2 bits: the quantized re-rank's choice is then the exact re-rank's."""
    gen = torch.Generator().manual_seed(3)
    pages, kc, k = 16, 10, 4
    lo = torch.randn(pages, 1, H, D, generator=gen)
    step = torch.rand(pages, 1, H, D, generator=gen) + 0.1
    levels = torch.randint(0, 4, (pages, P, H, D), generator=gen)
    levels[:, 0], levels[:, 1] = 0, 3  # the page's min and max are levels 0 and 3
    keys = (lo + levels * step).view(pages * P, H, D)
    codes = _save_keys(keys, 2)  # float32 keys and frames
    qg = torch.randn(1, H, G, D, generator=gen)
    candidates = torch.randperm(pages - 1, generator=gen)[:kc].view(1, 1, kc).repeat(1, H, 1).int()
    host_pages = torch.arange(pages, dtype=torch.int32).view(1, -1)
    num_pages = torch.tensor([pages], dtype=torch.int32)
    got = _run(qg, codes.layer(0), 2, host_pages, candidates, num_pages, k=k, forced=(0, 1), sm_scale=0.3)
    keys = keys.cpu()
    # The exact re-rank over the same candidates, their keys as the cache would hold them.
    rows = H
    sorted_pages = candidates.view(rows, kc).sort(dim=-1).values
    k_cache = keys.view(pages, P, H, D).permute(0, 2, 1, 3).reshape(pages * H, P, D)  # slot = page * H + h
    slots = sorted_pages * H + torch.arange(H).view(-1, 1)
    lse = candidate_page_lse_reference(qg.view(rows, G, D), k_cache, slots, torch.full((rows,), kc), 0.3)
    want, _ = choose_reranked_reference(candidates.view(rows, kc), num_pages.expand(rows), lse, slots, k, (0, 1))
    assert torch.equal(got.view(rows, k).sort(dim=-1).values, want.sort(dim=-1).values)
