"""The block-sparse prefill probe's mask (``benchmark.probes.block_sparse_prefill``): what each
prompt position may attend, per kv head."""

from __future__ import annotations

import torch

from benchmark.probes.block_sparse_prefill import allowed_keys

T, PAGE, BLOCK, SINK, WINDOW = 300, 32, 64, 8, 64


def _mask(budget: int, dense_tail: int = 0, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(1, 6, T, 16, generator=gen), torch.randn(1, 2, T, 16, generator=gen)
    return allowed_keys(q, k, PAGE, BLOCK, budget, SINK, WINDOW, "max", dense_tail)


def test_a_budget_past_the_prompt_is_causal_attention():
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    assert torch.equal(_mask(budget=10**6), causal.expand(2, -1, -1))


def test_a_position_attends_its_sink_its_window_and_its_blocks_best_pages():
    mask = _mask(budget=PAGE)
    for head in range(2):
        keys = mask[head, 260].nonzero().flatten()
        start = 260 // BLOCK * BLOCK  # its block's first position: 256
        window = set(range(start - WINDOW, 261))
        sink = set(range(SINK))
        far = set(keys.tolist()) - window - sink
        assert window | sink <= set(keys.tolist())
        assert len(far) <= PAGE and len({t // PAGE for t in far}) <= 1  # one page beyond them, whole
        assert all((t // PAGE + 1) * PAGE <= start - WINDOW for t in far)
        # the positions of one block choose alike
        assert torch.equal(mask[head, 257, : start - WINDOW], mask[head, 290, : start - WINDOW])


def test_the_dense_tail_attends_every_earlier_key():
    mask = _mask(budget=PAGE, dense_tail=20)
    assert mask[:, T - 20 :].sum(-1).tolist() == [list(range(T - 19, T + 1))] * 2
    assert mask[:, T - 21].sum() < 2 * (T - 20)
