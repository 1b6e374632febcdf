"""The answers probe's shared budget (``answer_levers.ShareDecoder``, decision 29): a layer's
``Hkv x K`` pages shared among its kv heads by estimated mass, each head keeping its floor and
its forced pages, none past its cap."""

from __future__ import annotations

import pytest
import torch

from benchmark import quality
from benchmark.probes.answer_levers import ShareDecoder

HEADS, GROUP, DIM, PAGES, K = 3, 2, 16, 40, 8


def _decoder(floor: float, cap: float = 0.0) -> ShareDecoder:
    decoder = object.__new__(ShareDecoder)  # select() reads only the policy and the share's knobs
    decoder.policy = quality.Policy(budget=K * quality.PAGE_SIZE, sink_pages=1, recent_pages=2)
    decoder.floor, decoder.cap, decoder.pool = floor, cap, "probs"
    return decoder


def _corners(seed: int = 0):
    """Head 0's pages all alike (its mass spread evenly); heads 1 and 2 each with one page whose
    keys the queries match far better than the rest (their mass in that page)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, HEADS * GROUP, DIM, generator=gen)
    keys = torch.randn(1, HEADS, PAGES, DIM, generator=gen) * 0.1
    keys[0, 0] = 0.0
    for h in (1, 2):
        keys[0, h, 10 + h] = 4.0 * q[0, h * GROUP : (h + 1) * GROUP].mean(0)
    return q, keys


def _select(decoder: ShareDecoder, q, keys) -> list[set[int]]:
    tokens = PAGES * quality.PAGE_SIZE
    pages = decoder.select(0, q, None, torch.tensor([tokens]), 1.0, keys, keys)
    rows = [[int(p) for p in row if p >= 0] for row in pages[0]]
    assert all(len(row) == len(set(row)) for row in rows), "a page twice in a row"
    return [set(row) for row in rows]


@pytest.mark.parametrize("floor", [0.25, 0.5])
def test_the_layer_attends_the_budgets_pages_in_total_each_head_its_floor_and_forced_pages(floor):
    rows = _select(_decoder(floor), *_corners())
    assert sum(len(r) for r in rows) == HEADS * K
    forced = {0, PAGES - 2, PAGES - 1}
    assert all(len(r) >= int(floor * K) and forced <= r for r in rows)


def test_the_head_whose_mass_is_spread_takes_the_pages_the_peaked_heads_do_not_need():
    rows = _select(_decoder(0.5), *_corners())
    assert len(rows[0]) > K > max(len(rows[1]), len(rows[2]))
    assert all(10 + h in rows[h] for h in (1, 2))  # each peaked head keeps its page


def test_a_cap_bounds_every_head_and_keeps_the_total():
    rows = _select(_decoder(0.5, cap=1.25), *_corners())
    assert max(len(r) for r in rows) <= int(1.25 * K)
    assert sum(len(r) for r in rows) == HEADS * K
