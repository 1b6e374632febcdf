"""``--sparse-budget-share`` on the CPU: the shared selection against its reference, and attention
over unit rows (FlashInfer stood in for by plain attention with log-sum-exps) against each head's
attention over its own pages."""

from __future__ import annotations

import math

import pytest
import torch

from sparse_sglang.attention import unit_rows
from sparse_sglang.attention.budget_share import CAP_UNITS, FLOOR_UNITS, UNITS, head_log_shares, share_budget
from sparse_sglang.attention.reference import share_budget_reference
from sparse_sglang.attention.unit_rows import UnitBuffers, UnitRows, attend_units, plan_unit_rows
from sparse_sglang.config import SparseConfig, SparseConfigError


def _log_shares(scores: torch.Tensor, num_pages: torch.Tensor, scale: float) -> torch.Tensor:
    """Each page's share of its head's mass, as a log: the softmax of ``scores`` times ``scale``
    over the request's pages."""
    past = torch.arange(scores.shape[-1]) >= num_pages.view(-1, 1, 1)
    return torch.log_softmax(scores.masked_fill(past, -math.inf) * scale, dim=-1)


@pytest.mark.parametrize("seed", range(12))
def test_share_budget_matches_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    batch, heads, n_max = 3, 4, int(torch.randint(9, 70, (1,), generator=gen))
    budget = UNITS * int(torch.randint(1, 4, (1,), generator=gen))
    scores = torch.randn(batch, heads, n_max, generator=gen) * 3
    num_pages = torch.randint(1, n_max + 1, (batch,), generator=gen)
    num_pages[0] = n_max
    shares = _log_shares(scores, num_pages, 0.4)
    shares[1, :, num_pages[1] :] = float("nan")  # past a request's pages: ignored
    got = share_budget(shares, num_pages, budget, 1, 1)
    want = share_budget_reference(shares, num_pages, budget, 1, 1)
    assert torch.equal(got.widths, want.widths) and torch.equal(got.page_ids, want.page_ids)


def test_head_log_shares_average_the_query_heads_softmaxes():
    gen = torch.Generator().manual_seed(1)
    scores = torch.randn(2, 3, 4, 10, generator=gen) * 5
    scores[1, :, :, 7:] = -math.inf  # past the second request's pages
    shares = head_log_shares(scores, 0.3).exp()
    torch.testing.assert_close(shares, (scores * 0.3).softmax(-1).mean(2))
    torch.testing.assert_close(shares.sum(-1), torch.ones(2, 3))
    assert (shares[1, :, 7:] == 0).all()


def test_share_budget_invariants():
    gen = torch.Generator().manual_seed(7)
    batch, heads, n_max, budget = 4, 8, 64, 16
    u = budget // UNITS
    scores = torch.randn(batch, heads, n_max, generator=gen) * 4
    scores[:, 3] *= 0.01  # one head's mass spread evenly: it should take more than its floor
    num_pages = torch.tensor([64, 40, 17, 12])
    sel = share_budget(_log_shares(scores, num_pages, 1.0), num_pages, budget, 1, 2)
    for b, n in enumerate(num_pages.tolist()):
        widths = sel.widths[b]
        if n <= budget:  # every page, on every head
            assert widths.tolist() == [n] * heads
            assert all(sel.page_ids[b, h, :n].tolist() == list(range(n)) for h in range(heads))
            continue
        assert int(widths.sum()) == heads * budget  # the layer's pages, shared
        assert (widths % u == 0).all() and (widths >= FLOOR_UNITS * u).all() and (widths <= CAP_UNITS * u).all()
        for h in range(heads):
            pages = sel.page_ids[b, h, : int(widths[h])].tolist()
            assert pages == sorted(set(pages)) and all(0 <= p < n for p in pages)
            assert {0, n - 2, n - 1} <= set(pages)  # the sink and recent pages
            assert (sel.page_ids[b, h, int(widths[h]) :] == -1).all()
        assert int(widths[3]) > FLOOR_UNITS * u


class _PlainAttention:
    """FlashInfer's decode wrapper over unit rows, in plain torch: each row attends its pages
    (read through the indices buffer, the last one ``last_page_len`` tokens long, both read at run
    time as the kernels do) and returns its log-sum-exp."""

    def __init__(self, indptr, indices, last_page_len, scale):
        self.indptr, self.indices, self.last_page_len, self.scale = indptr.tolist(), indices, last_page_len, scale

    def run(self, q, kv, return_lse=True, **_):
        k_cache, v_cache = kv
        out, lse = torch.zeros_like(q), torch.zeros(q.shape[:2])
        for r in range(q.shape[0]):
            slots = self.indices[self.indptr[r] : self.indptr[r + 1]].long()
            k, v = k_cache[slots].flatten(0, 1), v_cache[slots].flatten(0, 1)
            tokens = (len(slots) - 1) * k_cache.shape[1] + int(self.last_page_len[r])
            logits = q[r] @ k[:tokens].T * self.scale
            lse[r] = logits.logsumexp(-1)
            out[r] = logits.softmax(-1) @ v[:tokens]
        return out, lse


def _merge_states(v, s):
    w = (s - s.amax(1, keepdim=True)).exp()
    return (w.unsqueeze(-1) * v).sum(1) / w.sum(1).unsqueeze(-1), None


def test_units_attend_as_each_head_over_its_pages(monkeypatch):
    import flashinfer

    monkeypatch.setattr(flashinfer, "merge_states", _merge_states, raising=False)
    gen = torch.Generator().manual_seed(3)
    heads, group, dim, page, budget = 3, 2, 8, 4, 8
    seq_lens = torch.tensor([75, 18, 35, 1])  # 19 pages; 5 and 1 within the budget; 9 past it
    num_pages = (seq_lens + page - 1) // page
    batch = len(seq_lens)
    scores = torch.randn(batch, heads, int(num_pages.max()), generator=gen) * 3
    sel = share_budget(_log_shares(scores, num_pages, 0.5), num_pages, budget, 1, 1)
    # One cache slot per (request, head, page), holding that page's keys and values.
    k_cache = torch.randn(batch * heads * int(num_pages.max()), page, dim, generator=gen)
    v_cache = torch.randn_like(k_cache)
    slot = lambda b, h, p: (b * heads + h) * int(num_pages.max()) + p  # noqa: E731

    buffers = UnitBuffers.allocate(batch, heads, torch.device("cpu"))
    units = UnitRows.build(num_pages, seq_lens, budget, heads, page, buffers, batch)
    indptr = plan_unit_rows(num_pages, budget, heads)
    layer = units.layer(sel.widths)
    indices = torch.full((int(indptr[-1]) + 1,), 0, dtype=torch.int32)
    for b in range(batch):  # what the retrieve kernel writes: each head's pages at its indptr
        for h in range(heads):
            pages = [p for p in sel.page_ids[b, h].tolist() if p >= 0]
            at = int(layer.indptr[b * heads + h])
            indices[at : at + len(pages)] = torch.tensor([slot(b, h, p) for p in pages], dtype=torch.int32)
    q = torch.randn(batch, heads, group, dim, generator=gen)
    wrapper = _PlainAttention(indptr, indices, units.last_page_len, dim**-0.5)
    out = attend_units(wrapper, q, (k_cache, v_cache), layer).view(batch, heads, group, dim)
    for b in range(batch):
        last = int(seq_lens[b]) - (int(num_pages[b]) - 1) * page
        for h in range(heads):
            pages = [p for p in sel.page_ids[b, h].tolist() if p >= 0]
            k = torch.cat([k_cache[slot(b, h, p)][: last if p == num_pages[b] - 1 else page] for p in pages])
            v = torch.cat([v_cache[slot(b, h, p)][: last if p == num_pages[b] - 1 else page] for p in pages])
            want = (q[b, h] @ k.T * dim**-0.5).softmax(-1) @ v
            torch.testing.assert_close(out[b, h], want, atol=1e-5, rtol=1e-5)


def test_every_layer_keeps_the_planned_row_lengths():
    """The plan's row lengths in pages hold for any layer's widths: a layer changes only which
    head a unit serves and where heads end (``last_page_len``)."""
    heads, budget, page = 4, 16, 32
    num_pages = torch.tensor([100, 7, 16, 17])
    seq_lens = num_pages * page - 5
    indptr = plan_unit_rows(num_pages, budget, heads)
    units = UnitRows.build(num_pages, seq_lens, budget, heads, page,
                           UnitBuffers.allocate(4, heads, torch.device("cpu")), 4)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        sel = share_budget(
            _log_shares(torch.randn(4, heads, 100, generator=gen), num_pages, 1.0), num_pages, budget, 1, 2
        )
        layer = units.layer(sel.widths)
        # each head's pages cover whole rows, from where the retrieve kernel writes them
        starts = set(indptr.tolist())
        assert all(int(p) in starts for p in layer.indptr[:-1])
        ends = layer.indptr[:-1] + sel.widths.view(-1)
        assert all(int(p) in starts for p in ends)
        lpl = units.last_page_len.view(4, -1)
        assert int((lpl != page).sum()) <= 4 * heads
        assert ((lpl == page) | (lpl == page - 5)).all()


def test_config_names_what_a_shared_budget_cannot_run_with():
    assert SparseConfig(budget_share=True).budget_share
    for fields, flag in ((dict(token_budget=32 * 6), "token_budget"), (dict(rerank_factor=2), "rerank_factor"),
                         (dict(coarse_pages=4), "coarse_pages"), (dict(cache_row_ratio=1.1), "cache_row_ratio"),
                         (dict(selector="sketch"), "selector")):  # fmt: skip
        with pytest.raises(SparseConfigError) as err:
            SparseConfig(budget_share=True, **fields)
        assert err.value.field == flag and "budget_share" in str(err.value)


def test_unit_plan_pages():
    heads, budget = 2, 8
    indptr = plan_unit_rows(torch.tensor([30, 3]), budget, heads)
    rows = UNITS * heads
    lengths = (indptr[1:] - indptr[:-1]).view(2, rows)
    assert lengths[0].tolist() == [budget // UNITS] * rows
    # 3 pages per head: a unit of 2 and one of 1, then padding rows of one page
    assert lengths[1].tolist() == [2, 1, 2, 1] + [1] * (rows - 4)
    assert math.isclose(float(indptr[-1]), heads * budget + 2 * 3 + rows - 4)
    assert unit_rows.CAP_UNITS == CAP_UNITS
