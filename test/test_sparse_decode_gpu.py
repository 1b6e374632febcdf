"""Sparse decode on the GPU against dense FlashInfer decode and the plain-torch reference.

- Q1: with the budget covering the context (8B shape, 4K tokens, budget 4096) and the exact
  shortcut off, the full machinery (scoring, selection, retrieval through FlashH2D, FlashInfer
  over per-head page tables) equals dense FlashInfer decode per layer, on the cold step (every
  page loaded from the host) and the warm one (every page a cache hit).
- With a small budget, every step equals the reference sparse attention over the pages the
  decoder selected, while misses load and evict across steps, on the fused path (score kernel
  with forced pages, top-k, ``retrieve_pages``) and on the torch reference path; and both paths
  give the same outputs step after step.
- The fused scoring kernel equals the torch selectors; FlashInfer's top-k selects what
  ``torch.topk`` does.

Run on the GPU host: ``pytest -m gpu test/test_sparse_decode_gpu.py``; Q1's error goes to
``$SPARSE_SGLANG_RESULTS_DIR/q1.json`` when that is set.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from sparse_sglang.attention import sparse_attention_reference
from sparse_sglang.attention.scoring import score_pages, score_pages_reference
from sparse_sglang.config import SparseConfig
from sparse_sglang.testing.decode_setup import DecodeBench, Llama8BShape, make_store

pytestmark = pytest.mark.gpu
SHAPE = Llama8BShape(num_layers=2)


def random_kv(batch, seq_len, gen):
    k = torch.randn(batch, seq_len, SHAPE.num_kv_heads, SHAPE.head_dim, device="cuda", generator=gen)
    v = torch.randn(batch, seq_len, SHAPE.num_kv_heads, SHAPE.head_dim, device="cuda", generator=gen)
    return k.to(torch.bfloat16), v.to(torch.bfloat16)


def bench(config: SparseConfig, batch: int, context: int, **decoder_options) -> DecodeBench:
    store = make_store(SHAPE, config, batch, context)
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    return DecodeBench(store, config, SHAPE.num_q_heads, batch, context, workspace, **decoder_options)


def dense_decode(q, k, v):
    import flashinfer

    return torch.stack([flashinfer.single_decode_with_kv_cache(q[b], k[b], v[b]) for b in range(q.shape[0])])


def test_q1_sparse_decode_equals_dense_flashinfer_when_the_budget_covers_the_context():
    gen = torch.Generator(device="cuda").manual_seed(0)
    config = SparseConfig(token_budget=4096 + 32, exact_shortcut=False, host_cache_gb=1.0)
    b = bench(config, batch=2, context=4096)
    kv = [random_kv(2, b.seq_len, gen) for _ in range(SHAPE.num_layers)]
    for layer, (k, v) in enumerate(kv):
        b.write_kv(layer, k, v)
    worst = 0.0
    for step in ("cold", "warm"):
        b.plan()
        assert not b.decoder.exact
        for layer, (k, v) in enumerate(kv):
            q = torch.randn(2, SHAPE.num_q_heads, SHAPE.head_dim, device="cuda", generator=gen).to(torch.bfloat16)
            out = b.decoder.run(layer, q)
            want = dense_decode(q, k, v)
            err = (out.float() - want.float()).abs().max().item()
            worst = max(worst, err)
            torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2, msg=f"{step} step, layer {layer}")
    if os.environ.get("SPARSE_SGLANG_RESULTS_DIR"):
        Path(os.environ["SPARSE_SGLANG_RESULTS_DIR"], "q1.json").write_text(json.dumps({"q1_max_abs_err": worst}))


@pytest.mark.parametrize("selector", ["quest", "arkvale", "mean"])
@pytest.mark.parametrize("path", ["fused", "reference"])
def test_small_budget_steps_equal_the_reference_over_the_selected_pages(selector, path):
    gen = torch.Generator(device="cuda").manual_seed(1)
    config = SparseConfig(token_budget=512, selector=selector, host_cache_gb=1.0)
    b = bench(config, batch=3, context=3000, fused=path == "fused")
    kv = [random_kv(3, b.seq_len, gen) for _ in range(SHAPE.num_layers)]
    for layer, (k, v) in enumerate(kv):
        b.write_kv(layer, k, v)
    seq = torch.full((3,), b.seq_len, device="cuda")
    for _ in range(4):  # selections move: misses load into the rows and evict older pages
        b.plan()
        for layer, (k, v) in enumerate(kv):
            q = torch.randn(3, SHAPE.num_q_heads, SHAPE.head_dim, device="cuda", generator=gen).to(torch.bfloat16)
            pages = b.decoder.select(layer, q)
            assert ((pages >= 0).sum(-1) == 16).all()  # 16 pages per (request, kv head)
            assert (pages == b.num_pages - 1).any(-1).all() and (pages == 0).any(-1).all()  # recent, sink
            out = b.decoder.run(layer, q)
            want = sparse_attention_reference(q, k.transpose(1, 2), v.transpose(1, 2), pages, 32, seq)
            torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("interval", [1, 3])
def test_fused_and_reference_paths_give_the_same_steps(interval):
    """Mixed lengths (one request holds fewer pages than the budget), misses every step; with
    ``reselect_interval`` 3 the steps between full selections choose among cached pages."""
    gen = torch.Generator(device="cuda").manual_seed(4)
    config = SparseConfig(token_budget=256, host_cache_gb=1.0, reselect_interval=interval)
    runs = {path: bench(config, batch=2, context=1500, fused=path == "fused") for path in ("fused", "reference")}
    kv = [random_kv(2, 1501, gen) for _ in range(SHAPE.num_layers)]
    for b in runs.values():
        for layer, (k, v) in enumerate(kv):
            b.write_kv(layer, k, v)
    host_pages = runs["fused"].host_pages
    loaded = []
    for step in range(5):
        seq_lens = torch.tensor([1501, 200 + step])  # request 1: 7 pages, under the 8-page budget
        outs = {}
        for path, b in runs.items():
            b.store.cache.next_step()
            b.decoder.plan(b.req_slots, seq_lens, host_pages)
            qs = torch.Generator(device="cuda").manual_seed(100 + step)
            outs[path] = [b.decoder.run(layer, torch.randn(2, SHAPE.num_q_heads, SHAPE.head_dim, device="cuda",
                                                           generator=qs).to(torch.bfloat16))
                          for layer in range(SHAPE.num_layers)]  # fmt: skip
        for a, r in zip(outs["fused"], outs["reference"]):
            torch.testing.assert_close(a, r, atol=1e-2, rtol=1e-2)
        loaded.append(runs["fused"].store.cache.stats()["pages_loaded"])
    # New queries pick new pages each step; reusing the rows (request 0 never reaches its next
    # full selection here, its length is fixed) loads nothing after the first step.
    assert (loaded[-1] > loaded[0]) if interval == 1 else (loaded[-1] == loaded[0] > 0)


def test_flashinfer_topk_selects_what_torch_topk_does():
    from sparse_sglang.attention.sparse_decode import topk_pages

    gen = torch.Generator(device="cuda").manual_seed(5)
    prio = torch.randn(4, 8, 4097, device="cuda", generator=gen)
    prio[..., :1] = prio[..., -2:] = float("inf")  # forced pages
    prio[1, :, 3000:] = float("-inf")  # a shorter request
    for k in (16, 64, 128):
        got = topk_pages(prio, k, "flashinfer").sort(-1).values
        want = topk_pages(prio, k, "torch").sort(-1).values
        assert torch.equal(got, want), k


@pytest.mark.parametrize("selector", ["quest", "arkvale", "mean"])
@pytest.mark.parametrize("group_reduce", ["sum", "max"])
def test_score_kernel_equals_the_torch_selectors(selector, group_reduce):
    gen = torch.Generator(device="cuda").manual_seed(2)
    heads, pool, dim, group = 4, 300, 128, 4
    lo = torch.randn(heads, pool, dim, device="cuda", generator=gen)
    summ = {"kmin": lo.bfloat16(), "kmax": (lo + torch.rand(heads, pool, dim, device="cuda", generator=gen)).bfloat16(),
            "mean": lo + 0.5, "radius": torch.rand(heads, pool, dim, device="cuda", generator=gen)}  # fmt: skip
    host_pages = torch.randint(0, pool, (3, 70), device="cuda", generator=gen, dtype=torch.int32)
    num_pages = torch.tensor([70, 33, 1], device="cuda")
    q = torch.randn(3, heads, group, dim, device="cuda", generator=gen).bfloat16()
    got = score_pages(selector, q, summ, host_pages, num_pages, group_reduce)
    want = score_pages_reference(selector, q, summ, host_pages, num_pages, group_reduce)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("interval", [1, 3])
def test_cuda_graph_steps_equal_eager_steps_with_a_padding_row(interval):
    """Graph mode (static buffers, every page scored, slot-0 padding row): a captured step replayed
    over several steps gives the eager fused path's outputs for the real requests, also when the
    steps between full selections reuse the cache rows (``reselect_interval`` 3)."""
    gen = torch.Generator(device="cuda").manual_seed(6)
    config = SparseConfig(token_budget=512, host_cache_gb=1.0, reselect_interval=interval)
    runs = {mode: bench(config, batch=3, context=3000) for mode in ("eager", "graph")}
    kv = [random_kv(3, 3001, gen) for _ in range(SHAPE.num_layers)]
    for b in runs.values():
        for layer, (k, v) in enumerate(kv):
            b.write_kv(layer, k, v)
    g = runs["graph"]
    g.decoder.init_cuda_graph(max_batch=4)
    slots = torch.cat([g.req_slots, torch.zeros(1, dtype=g.req_slots.dtype, device="cuda")])  # + padding slot 0
    seq_lens = torch.tensor([3001, 3001, 3001, 1])
    host_pages = torch.cat([g.host_pages, torch.zeros(1, g.host_pages.shape[1], dtype=g.host_pages.dtype, device="cuda")])
    q_static = torch.zeros(4, SHAPE.num_q_heads, SHAPE.head_dim, device="cuda", dtype=torch.bfloat16)
    outs = [None] * SHAPE.num_layers

    def step():
        for layer in range(SHAPE.num_layers):
            outs[layer] = g.decoder.run(layer, q_static)

    graph = None
    for i in range(4):
        qs = torch.randn(3, SHAPE.num_q_heads, SHAPE.head_dim, device="cuda", generator=gen).to(torch.bfloat16)
        e = runs["eager"]
        e.store.cache.next_step()
        e.decoder.plan(e.req_slots, seq_lens[:3], e.host_pages)
        want = [e.decoder.run(layer, qs) for layer in range(SHAPE.num_layers)]
        g.store.cache.next_step()
        g.decoder.plan(slots, seq_lens, host_pages, graph=True)
        q_static[:3].copy_(qs)
        if graph is None:  # the first step runs eagerly (compiles kernels), then is captured
            step()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()  # records only: the replay below computes this step's outputs
        graph.replay()
        for layer in range(SHAPE.num_layers):
            torch.testing.assert_close(outs[layer][:3], want[layer], atol=1e-2, rtol=1e-2, msg=f"step {i} layer {layer}")
