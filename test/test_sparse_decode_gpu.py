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

from sparse_sglang.attention.reference import score_pages_reference, sparse_attention_reference
from sparse_sglang.attention.scoring import score_pages
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


def record_selections(decoder, into: dict, tag: str) -> None:
    """Keep the pages ``decoder`` selects per layer in ``into[tag, layer]`` (in a CUDA graph, the
    captured tensors, which each replay rewrites)."""
    select_raw = decoder.select_raw

    def recording(layer, q, plan):
        into[tag, layer] = ids = select_raw(layer, q, plan)
        return ids

    decoder.select_raw = recording


def assert_same_pages_up_to_ties(pages, want_pages, priority, num_pages, msg=""):
    """Per (request, kv head), ``pages`` and ``want_pages`` ``[B, Hkv, K]`` select the same pages, or
    differ only in pages of one priority: an exact tie at the top-k boundary, which FlashInfer's
    top-k breaks in no fixed order (seen on the H100: two pages scoring 855.493408203125 each,
    picked about half the time each)."""
    for b in range(pages.shape[0]):
        n = int(num_pages[b])
        for h in range(pages.shape[1]):
            got = {p for p in pages[b, h].tolist() if 0 <= p < n}
            want = {p for p in want_pages[b, h].tolist() if 0 <= p < n}
            assert len(got) == len(want), f"{msg} request {b} head {h}: {len(got)} vs {len(want)} pages"
            tied = len({float(priority[b, h, p]) for p in got ^ want}) <= 1
            assert tied, f"{msg} request {b} head {h}: {sorted(got - want)} selected instead of {sorted(want - got)}"


def assert_same_pages_within(pages, want_pages, priority, tolerance: float, msg=""):
    """Per (request, kv head), ``pages`` and ``want_pages`` ``[B, Hkv, K]`` select the same pages, or
    differ only in pages whose priorities lie within ``tolerance`` of each other (rounding at the
    top-k's boundary)."""
    for b in range(pages.shape[0]):
        for h in range(pages.shape[1]):
            got = {p for p in pages[b, h].tolist() if p >= 0}
            want = {p for p in want_pages[b, h].tolist() if p >= 0}
            if got != want:
                swapped = [float(priority[b, h, p]) for p in got ^ want]
                assert max(swapped) - min(swapped) < tolerance, f"{msg} request {b} head {h}"


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
        plan = b.plan()
        assert not plan.exact
        for layer, (k, v) in enumerate(kv):
            q = torch.randn(2, SHAPE.num_q_heads, SHAPE.head_dim, device="cuda", generator=gen).to(torch.bfloat16)
            out = b.decoder.run(layer, q, plan)
            want = dense_decode(q, k, v)
            err = (out.float() - want.float()).abs().max().item()
            worst = max(worst, err)
            torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2, msg=f"{step} step, layer {layer}")
    if os.environ.get("SPARSE_SGLANG_RESULTS_DIR"):
        Path(os.environ["SPARSE_SGLANG_RESULTS_DIR"], "q1.json").write_text(json.dumps({"q1_max_abs_err": worst}))


def test_the_planned_softmax_scale_and_soft_cap_are_the_ones_attended_with():
    """A decoder built with a model's own scale and logits soft cap (Gemma-2-like) attends with them
    (dense FlashInfer given the same, budget covering the context), and refuses a layer whose own
    differ."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    config = SparseConfig(token_budget=2048 + 32, exact_shortcut=False, host_cache_gb=1.0)
    scale, cap = 0.07, 30.0
    b = bench(config, batch=2, context=2048, sm_scale=scale, logits_soft_cap=cap)
    kv = [random_kv(2, b.seq_len, gen) for _ in range(SHAPE.num_layers)]
    for layer, (k, v) in enumerate(kv):
        b.write_kv(layer, k, v)
    plan = b.plan()
    import flashinfer

    for layer, (k, v) in enumerate(kv):
        q = torch.randn(2, SHAPE.num_q_heads, SHAPE.head_dim, device="cuda", generator=gen).to(torch.bfloat16) * 4
        out = b.decoder.run(layer, q, plan, scale, cap)
        want = torch.stack([flashinfer.single_decode_with_kv_cache(q[i], k[i], v[i], sm_scale=scale, logits_soft_cap=cap)
                            for i in range(2)])  # fmt: skip
        torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2, msg=f"layer {layer}")
    with pytest.raises(ValueError, match="softmax scale"):
        b.decoder.run(0, q, plan, 0.1, cap)
    with pytest.raises(ValueError, match="soft cap"):
        b.decoder.run(0, q, plan, scale, None)


def test_fp8_kv_with_calibrated_scales_attends_like_its_dequantized_kv():
    """Keys and values as small as a dummy-weight model's (~1e-5, all 0 in e4m3 at scale 1) are
    stored as value / scale (what the KV pool saves) and attended with the scales: the output is
    dense attention over the dequantized KV."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    config = SparseConfig(token_budget=2048 + 32, exact_shortcut=False, host_cache_gb=1.0)
    store = make_store(SHAPE, config, 2, 2048, dtype=torch.float8_e4m3fn)
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    b = DecodeBench(store, config, SHAPE.num_q_heads, 2, 2048, workspace)
    k_scale, v_scale = 1e-6, 2e-6
    kv = []
    for layer in range(SHAPE.num_layers):
        k, v = (x.float() * 1e-5 for x in random_kv(2, b.seq_len, gen))
        assert (k.to(torch.float8_e4m3fn).float() == 0).all()  # why the scales are needed
        b.write_kv(layer, store.to_store_dtype(k / k_scale), store.to_store_dtype(v / v_scale))
        kv.append(
            (store.to_store_dtype(k / k_scale).float() * k_scale, store.to_store_dtype(v / v_scale).float() * v_scale)
        )
    plan = b.plan()
    for layer, (k, v) in enumerate(kv):
        q = (torch.randn(2, SHAPE.num_q_heads, SHAPE.head_dim, device="cuda", generator=gen) * 1e5).to(torch.bfloat16)
        out = b.decoder.run(layer, q, plan, k_scale=k_scale, v_scale=v_scale).float() / 1e-5
        want = (
            sparse_attention_reference(
                q.float(),
                k.transpose(1, 2),
                v.transpose(1, 2),
                None,
                config.page_size,
                torch.full((2,), b.seq_len, device="cuda"),
            )
            / 1e-5
        )  # every page: dense
        torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2)
    store.close()


@pytest.mark.parametrize("selector", ["quest", "arkvale", "mean", "sketch"])
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
        plan = b.plan()
        for layer, (k, v) in enumerate(kv):
            q = torch.randn(3, SHAPE.num_q_heads, SHAPE.head_dim, device="cuda", generator=gen).to(torch.bfloat16)
            pages = b.decoder.select(layer, q, plan)
            assert ((pages >= 0).sum(-1) == 16).all()  # 16 pages per (request, kv head)
            assert (pages == b.num_pages - 1).any(-1).all() and (pages == 0).any(-1).all()  # recent, sink
            out = b.decoder.run(layer, q, plan)
            want = sparse_attention_reference(q, k.transpose(1, 2), v.transpose(1, 2), pages, 32, seq)
            torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("page_size", [16, 64])
def test_other_page_sizes_attend_the_selected_pages_like_the_reference(page_size):
    """``--sparse-page-size``: the same budget in pages of another size (the default's corners, the
    fused path), eagerly, over steps whose selections move."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    config = SparseConfig(token_budget=512, page_size=page_size, host_cache_gb=1.0)
    b = bench(config, batch=3, context=3000)
    assert b.num_pages == -(-b.seq_len // page_size)
    kv = [random_kv(3, b.seq_len, gen) for _ in range(SHAPE.num_layers)]
    for layer, (k, v) in enumerate(kv):
        b.write_kv(layer, k, v)
    seq = torch.full((3,), b.seq_len, device="cuda")
    for _ in range(4):
        plan = b.plan()
        for layer, (k, v) in enumerate(kv):
            q = torch.randn(3, SHAPE.num_q_heads, SHAPE.head_dim, device="cuda", generator=gen).to(torch.bfloat16)
            pages = b.decoder.select(layer, q, plan)
            assert ((pages >= 0).sum(-1) == 512 // page_size).all()
            assert (pages == b.num_pages - 1).any(-1).all() and (pages == 0).any(-1).all()  # recent, sink
            out = b.decoder.run(layer, q, plan)
            want = sparse_attention_reference(q, k.transpose(1, 2), v.transpose(1, 2), pages, page_size, seq)
            torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)
    b.store.close()


@pytest.mark.parametrize(
    "coarse,selector", [(0, "quest"), (4, "quest"), (0, "sketch")], ids=["page-by-page", "coarse-first", "sketch"]
)
@pytest.mark.parametrize("interval", [1, 3])
def test_fused_and_reference_paths_give_the_same_steps(interval, coarse, selector):
    """Mixed lengths (one request holds fewer pages than the budget), misses every step: each path
    attends to exactly the pages it selected, and both select the same pages (up to exact score
    ties); with ``reselect_interval`` 3 the steps between full selections choose among cached pages;
    with ``coarse_pages`` 4 both score 4-page super-pages first (11 built, 8 kept)."""
    gen = torch.Generator(device="cuda").manual_seed(4)
    config = SparseConfig(token_budget=256, host_cache_gb=1.0, reselect_interval=interval, coarse_pages=coarse,
                          coarse_min_pages=0, selector=selector)  # fmt: skip
    runs = {path: bench(config, batch=2, context=1500, fused=path == "fused") for path in ("fused", "reference")}
    kv = [random_kv(2, 1501, gen) for _ in range(SHAPE.num_layers)]
    for b in runs.values():
        for layer, (k, v) in enumerate(kv):
            b.write_kv(layer, k, v)
    host_pages = runs["fused"].host_pages
    selected: dict = {}
    for path, b in runs.items():
        record_selections(b.decoder, selected, path)
    loaded = []
    for step in range(5):
        seq_lens = torch.tensor([1501, 200 + step])  # request 1: 7 pages, under the 8-page budget
        gen_q = torch.Generator(device="cuda").manual_seed(100 + step)
        qs = [torch.randn(2, SHAPE.num_q_heads, SHAPE.head_dim, device="cuda", generator=gen_q).to(torch.bfloat16)
              for _ in range(SHAPE.num_layers)]  # fmt: skip
        plans = {}
        for path, b in runs.items():
            plans[path] = plan = b.step(b.req_slots, seq_lens, host_pages)
            assert plan.use_coarse == bool(coarse)
            assert b.decoder.stats.coarse_first_steps == (step + 1) * bool(
                coarse
            )  # server info's decode_steps_coarse_first
            for layer, (k, v) in enumerate(kv):
                out = b.decoder.run(layer, qs[layer], plan)
                pages = torch.where(selected[path, layer] < plan.num_pages.view(-1, 1, 1), selected[path, layer], -1)
                selected[path, layer] = pages.clone()
                want = sparse_attention_reference(
                    qs[layer], k.transpose(1, 2), v.transpose(1, 2), pages, 32, seq_lens.cuda()
                )
                torch.testing.assert_close(
                    out.float(), want.float(), atol=2e-2, rtol=2e-2, msg=f"{path} step {step} layer {layer}"
                )
        for layer in range(SHAPE.num_layers):  # both paths selected the same pages (up to exact ties)
            b = runs["reference"]
            qg = b.decoder.scoring_query(layer, qs[layer].view(2, SHAPE.num_kv_heads, -1, SHAPE.head_dim))
            num_pages = plans["reference"].num_pages
            priority = score_pages(b.decoder.selector, qg, b.store.summaries.layer(layer), host_pages,
                                   num_pages)  # fmt: skip
            assert_same_pages_up_to_ties(selected["fused", layer], selected["reference", layer], priority,
                                         num_pages, f"step {step} layer {layer}")  # fmt: skip
        loaded.append(runs["fused"].store.cache.stats()["pages_loaded"])
    # New queries pick new pages each step; reusing the rows (request 0 never reaches its next
    # full selection here, its length is fixed) loads nothing after the first step.
    assert (loaded[-1] > loaded[0]) if interval == 1 else (loaded[-1] == loaded[0] > 0)


@pytest.mark.parametrize("batch,interval,due", [(32, 8, 4), (8, 8, 1), (5, 2, 3)])
def test_a_staggered_bench_plan_selects_for_one_request_in_interval(batch, interval, due):
    """``benchmark/decode.py --reselect-interval``: after the first step, which fills every row, the
    timed plan has the server's steady state, ``ceil(batch / interval)`` requests due for a full
    selection and the rest reusing rows that hold the whole budget."""
    config = SparseConfig(token_budget=256, host_cache_gb=1.0, reselect_interval=interval)
    b = bench(config, batch=batch, context=1500)
    q = torch.randn(batch, SHAPE.num_q_heads, SHAPE.head_dim, device="cuda", dtype=torch.bfloat16)
    first = b.plan()
    assert bool(first.reselect.all())
    for layer in range(SHAPE.num_layers):
        b.decoder.run(layer, q, first)
    plan = b.plan(staggered=True)
    assert int(plan.reselect.sum()) == due and bool(plan.reselect[0])
    held = b.store.cache.cached_pages(0, b.req_slots, b.num_pages)  # [B, Hkv, pages]
    assert (held.sum(-1) == config.token_budget // 32).all()  # 32-token pages


def test_a_step_does_not_depend_on_the_order_the_top_k_returns_its_pages():
    """FlashInfer's top-k returns its picks in no fixed order; the step sorts them, so FlashInfer's
    decode sums a row's pages in one order and the same step gives bit-identical outputs (greedy
    tokens through the server flipped on 2 of 10 prompts before the sort)."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    b = bench(SparseConfig(token_budget=512, host_cache_gb=1.0), batch=2, context=3000)
    kv = [random_kv(2, b.seq_len, gen) for _ in range(SHAPE.num_layers)]
    for layer, (k, v) in enumerate(kv):
        b.write_kv(layer, k, v)
    q = torch.randn(2, SHAPE.num_q_heads, SHAPE.head_dim, device="cuda", generator=gen).to(torch.bfloat16)
    select_raw, outs = b.decoder.select_raw, []
    for order in ("as returned", "reversed", "shuffled"):

        def reorder(layer, q, plan, order=order):
            ids = select_raw(layer, q, plan)
            if order == "reversed":
                return ids.flip(-1)
            return ids[..., torch.randperm(ids.shape[-1], device="cuda", generator=gen)] if order == "shuffled" else ids

        b.decoder.select_raw = reorder
        plan = b.plan()
        outs.append([b.decoder.run(layer, q, plan) for layer in range(SHAPE.num_layers)])
    for other in outs[1:]:
        for a, c in zip(outs[0], other):
            assert torch.equal(a, c)


def test_flashinfer_topk_selects_what_torch_topk_does():
    """The ragged top-k reads each row only up to its length (past it: garbage, here +inf) and
    pads a row shorter than k with -1; torch.topk sees the same rows with -inf past the length."""
    from sparse_sglang.attention.sparse_decode import topk_pages

    gen = torch.Generator(device="cuda").manual_seed(5)
    prio = torch.randn(4, 8, 4097, device="cuda", generator=gen)
    prio[..., :1] = prio[..., -2:] = float("inf")  # forced pages
    lengths = torch.full((4, 8), 4097, dtype=torch.int32, device="cuda")
    lengths[1], lengths[2] = 3000, 100  # shorter requests: 100 pages hold fewer than k = 128
    past = torch.arange(4097, device="cuda") >= lengths.unsqueeze(-1)
    for k in (16, 64, 128):
        got = topk_pages(prio.masked_fill(past, float("inf")), k, "flashinfer", lengths.view(-1)).sort(-1).values
        want = topk_pages(prio.masked_fill(past, float("-inf")), k, "torch").sort(-1).values
        want = torch.where(past.gather(-1, want), -1, want).sort(-1).values  # picks past the end: none
        assert got.dtype == torch.int32
        assert torch.equal(got.long(), want), k


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


@pytest.mark.parametrize("coarse", [0, 4], ids=["page-by-page", "coarse-first"])
@pytest.mark.parametrize("interval", [1, 3])
def test_cuda_graph_steps_equal_eager_steps_with_a_padding_row(interval, coarse):
    """Graph mode (static buffers, every page scored, slot-0 padding row): a captured step replayed
    over several steps attends to exactly the pages it selected, and selects what the eager fused
    path does (up to exact score ties), also when the steps between full selections reuse the cache
    rows (``reselect_interval`` 3), and when super-pages are scored first (``coarse_pages`` 4)."""
    gen = torch.Generator(device="cuda").manual_seed(6)
    config = SparseConfig(
        token_budget=512, host_cache_gb=1.0, reselect_interval=interval, coarse_pages=coarse, coarse_min_pages=0
    )
    runs = {mode: bench(config, batch=3, context=3000) for mode in ("eager", "graph")}
    kv = [random_kv(3, 3001, gen) for _ in range(SHAPE.num_layers)]
    for b in runs.values():
        for layer, (k, v) in enumerate(kv):
            b.write_kv(layer, k, v)
    g = runs["graph"]
    g.decoder.init_cuda_graph(max_batch=4)
    slots = torch.cat([g.req_slots, torch.zeros(1, dtype=g.req_slots.dtype, device="cuda")])  # + padding slot 0
    seq_lens = torch.tensor([3001, 3001, 3001, 1])
    host_pages = torch.cat(
        [g.host_pages, torch.zeros(1, g.host_pages.shape[1], dtype=g.host_pages.dtype, device="cuda")]
    )
    q_static = torch.zeros(4, SHAPE.num_q_heads, SHAPE.head_dim, device="cuda", dtype=torch.bfloat16)
    outs = [None] * SHAPE.num_layers

    def step(plan):
        for layer in range(SHAPE.num_layers):
            outs[layer] = g.decoder.run(layer, q_static, plan)

    selected: dict = {}
    for mode, b in runs.items():
        record_selections(b.decoder, selected, mode)
    e, seq = runs["eager"], torch.full((3,), 3001, device="cuda")
    graph = None
    for i in range(4):
        qs = torch.randn(3, SHAPE.num_q_heads, SHAPE.head_dim, device="cuda", generator=gen).to(torch.bfloat16)
        eager_plan = e.step(e.req_slots, seq_lens[:3], e.host_pages)
        for layer in range(SHAPE.num_layers):
            e.decoder.run(layer, qs, eager_plan)
        eager_pages = [selected["eager", layer].clone() for layer in range(SHAPE.num_layers)]
        graph_plan = g.step(slots, seq_lens, host_pages, graph=True)  # rewrites the static buffers in place
        q_static[:3].copy_(qs)
        if graph is None:  # the first step runs eagerly (compiles kernels), then is captured
            step(graph_plan)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step(graph_plan)  # records only: the replay below computes this step's outputs
        graph.replay()
        for layer, (k, v) in enumerate(kv):
            # The replayed step attends exactly to the pages it selected (cache contents, indices,
            # misses loaded inside the graph), and it selected what the eager step did.
            pages = torch.where(selected["graph", layer][:3] < g.num_pages, selected["graph", layer][:3], -1)
            want = sparse_attention_reference(qs, k.transpose(1, 2), v.transpose(1, 2), pages, 32, seq)
            torch.testing.assert_close(
                outs[layer][:3].float(), want.float(), atol=2e-2, rtol=2e-2, msg=f"step {i} layer {layer}"
            )
            priority = score_pages(
                e.decoder.selector,
                qs.view(3, SHAPE.num_kv_heads, -1, SHAPE.head_dim),
                e.store.summaries.layer(layer),
                e.host_pages,
                eager_plan.num_pages,
            )
            assert_same_pages_up_to_ties(
                pages, eager_pages[layer], priority, eager_plan.num_pages, f"step {i} layer {layer}"
            )


def oracle_priority(q, k, group: int, page: int = 32):
    """``[B, Hkv, N]`` each page's softmax mass (per query head over the whole context but the
    newest page), summed over the kv head's group, as a log: what the re-rank computes when every
    page is a candidate."""
    batch, tokens, heads, dim = k.shape
    logits = torch.einsum("bhgd,bthd->bhgt", q.float().view(batch, heads, group, dim), k.float()) * dim**-0.5
    logits = torch.nn.functional.pad(logits, (0, -tokens % page), value=-float("inf"))
    lse = logits.view(batch, heads, group, -1, page).logsumexp(-1)  # [B, Hkv, G, N]
    return (lse - lse[..., :-1].logsumexp(-1, keepdim=True)).logsumexp(2)


def three_request_steps(b: DecodeBench, mode: str, steps: int, gen):
    """``steps`` decode steps of ``b``'s 3 requests over random KV, eagerly or replayed from one
    CUDA graph with a padding row; yields ``(step, queries [3, Hq, D], per-layer outputs, per-layer
    [3, Hkv, K] pages attended, per-layer (k, v))``."""
    kv = [random_kv(3, b.seq_len, gen) for _ in range(SHAPE.num_layers)]
    for layer, (k, v) in enumerate(kv):
        b.write_kv(layer, k, v)
    log = b.decoder.log_selections(max_batch=4)
    seq_lens = torch.tensor([b.seq_len] * 3 + [1])
    slots = torch.cat([b.req_slots, torch.zeros(1, dtype=b.req_slots.dtype, device="cuda")])
    host_pages = torch.cat([b.host_pages, torch.zeros_like(b.host_pages[:1])])
    rows = 4 if mode == "graph" else 3
    q_static = torch.zeros(rows, SHAPE.num_q_heads, SHAPE.head_dim, device="cuda", dtype=torch.bfloat16)
    outs = [None] * SHAPE.num_layers
    if mode == "graph":
        b.decoder.init_cuda_graph(max_batch=4)
    graph = None

    def step(plan):
        for layer in range(SHAPE.num_layers):
            outs[layer] = b.decoder.run(layer, q_static, plan)

    for i in range(steps):
        qs = torch.randn(3, SHAPE.num_q_heads, SHAPE.head_dim, device="cuda", generator=gen).to(torch.bfloat16)
        q_static[:3].copy_(qs)
        if mode == "graph":
            plan = b.step(slots, seq_lens, host_pages, graph=True)
            if graph is None:  # the first step runs eagerly (compiles kernels), then is captured
                step(plan)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    step(plan)
            graph.replay()
        else:
            step(b.step(b.req_slots, seq_lens[:3], b.host_pages))
        yield i, qs, [o[:3] for o in outs], [log[:3, layer].clone() for layer in range(SHAPE.num_layers)], kv


def assert_attends_16_pages(out, pages, qs, k, v, seq, msg):
    """Every row attended 16 pages, and ``out`` is the reference attention over them."""
    assert ((pages >= 0).sum(-1) == 16).all(), msg
    want = sparse_attention_reference(qs, k.transpose(1, 2), v.transpose(1, 2), pages, 32, seq)
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2, msg=msg)


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("interval", [1, 3])
def test_rerank_attends_the_pages_with_the_most_exact_mass(mode, interval):
    """``--sparse-rerank-factor``: with every page a candidate (factor 8: up to 128 candidates, a
    94-page context), the re-rank is the oracle. Per (request, kv head) the 16 pages attended are
    the sink and recent pages and those with the most softmax mass (the group's shares summed), up
    to rounding at the boundary; the output is the reference over them; eagerly and replayed in a
    CUDA graph with a padding row, with and without steps reusing the cache rows."""
    from sparse_sglang.attention import select_pages

    gen = torch.Generator(device="cuda").manual_seed(7)
    config = SparseConfig(token_budget=512, host_cache_gb=1.0, rerank_factor=8, reselect_interval=interval)
    b = bench(config, batch=3, context=3000)
    assert b.decoder.candidates > b.decoder.width == 16
    group = SHAPE.num_q_heads // SHAPE.num_kv_heads
    num_pages, seq = torch.full((3,), b.num_pages, device="cuda"), torch.full((3,), b.seq_len, device="cuda")
    for i, qs, outs, pages_by_layer, kv in three_request_steps(b, mode, 4, gen):
        for layer, (k, v) in enumerate(kv):
            pages = pages_by_layer[layer]
            assert_attends_16_pages(outs[layer], pages, qs, k, v, seq, f"step {i} layer {layer}")
            priority = oracle_priority(qs, k, group)
            oracle = select_pages(priority, num_pages, 16, *b.decoder.forced).page_ids
            assert_same_pages_within(pages, oracle, priority, 1e-3, f"step {i} layer {layer}")


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_sketch_rerank_attends_the_candidates_whose_best_token_sketch_scores_highest(mode):
    """``--sparse-rerank-by sketch``: with every page a candidate (factor 8: up to 128 candidates, a
    94-page context), the pages attended are the sketch selector's best 16 (each page's best token's
    sketch against the group's summed query, forced pages first) up to ties, only they are loaded
    (the rows stay one budget wide), and the output is the reference over them; eagerly and replayed
    in a CUDA graph with a padding row."""
    from sparse_sglang.attention import select_pages
    from sparse_sglang.mem_cache.key_sketch import project_query, sketch_page_scores

    gen = torch.Generator(device="cuda").manual_seed(11)
    config = SparseConfig(token_budget=512, host_cache_gb=1.0, rerank_factor=8, rerank_by="sketch")
    b = bench(config, batch=3, context=3000)
    assert b.decoder.sketch_candidates == 128 and b.decoder.candidates == 0 and b.decoder.width == 16
    summaries, group = b.store.summaries, SHAPE.num_q_heads // SHAPE.num_kv_heads
    num_pages, seq = torch.full((3,), b.num_pages, device="cuda"), torch.full((3,), b.seq_len, device="cuda")
    for i, qs, outs, pages_by_layer, kv in three_request_steps(b, mode, 3, gen):
        for layer, (k, v) in enumerate(kv):
            pages = pages_by_layer[layer]
            assert_attends_16_pages(outs[layer], pages, qs, k, v, seq, f"step {i} layer {layer}")
            qg = qs.view(3, SHAPE.num_kv_heads, group, SHAPE.head_dim)
            rows = summaries.layer(layer)["sketch"][:, b.host_pages[:, : b.num_pages].long()].transpose(0, 1)
            priority = sketch_page_scores(project_query(qg, summaries.key_basis.queries[layer]), rows).squeeze(2)
            expect = select_pages(priority, num_pages, 16, *b.decoder.forced).page_ids
            assert_same_pages_up_to_ties(pages, expect, priority, num_pages, f"step {i} layer {layer}")


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_quantized_rerank_attends_the_candidates_with_the_most_mass_from_their_key_codes(mode):
    """``--sparse-rerank-by quantized``: with every page a candidate (factor 8: up to 128
    candidates, a 94-page context), the pages attended are the best 16 by their mass from their
    keys' 2-bit codes (the oracle's priority over the decoded keys, forced pages first) up to pages
    within the kernel's rounding of each other,
    only they are loaded (the rows stay one budget wide), and the output is the reference over them;
    eagerly and replayed in a CUDA graph with a padding row."""
    from sparse_sglang.attention import select_pages

    gen = torch.Generator(device="cuda").manual_seed(13)
    config = SparseConfig(token_budget=512, host_cache_gb=1.0, rerank_factor=8, rerank_by="quantized")
    b = bench(config, batch=3, context=3000)
    assert b.decoder.code_candidates == 128 and b.decoder.candidates == 0 and b.decoder.width == 16
    codes, group = b.store.summaries.key_codes, SHAPE.num_q_heads // SHAPE.num_kv_heads
    num_pages, seq = torch.full((3,), b.num_pages, device="cuda"), torch.full((3,), b.seq_len, device="cuda")
    for i, qs, outs, pages_by_layer, kv in three_request_steps(b, mode, 3, gen):
        for layer, (k, v) in enumerate(kv):
            pages = pages_by_layer[layer]
            assert_attends_16_pages(outs[layer], pages, qs, k, v, seq, f"step {i} layer {layer}")
            decoded = codes.decode(layer, b.host_pages[:, : b.num_pages].long())  # [Hkv, B, N, P, D]
            keys = decoded.permute(1, 2, 3, 0, 4).reshape(3, -1, SHAPE.num_kv_heads, SHAPE.head_dim)
            priority = oracle_priority(qs, keys, group)
            expect = select_pages(priority, num_pages, 16, *b.decoder.forced).page_ids
            # the kernel's dot is three tf32 products: pages within its rounding may swap
            assert_same_pages_within(pages, expect, priority, 1e-2, f"step {i} layer {layer}")


def test_the_save_kernel_codes_keys_on_the_gpu_as_its_reference_does():
    """The prefill and decode saves of the timing bench, coded by the Triton kernel on the GPU, read
    back within a level of the torch reference's codes (GPU division may round a tie the other way)."""
    from sparse_sglang.mem_cache.kernels import SaveRuns, encode_runs
    from sparse_sglang.mem_cache.key_codes import PageKeyCodes, frame_step
    from sparse_sglang.mem_cache.reference import encode_codes_reference

    gen = torch.Generator(device="cuda").manual_seed(5)
    heads, dim, page = SHAPE.num_kv_heads, SHAPE.head_dim, 32
    got = PageKeyCodes(1, heads, 8, page, dim, 2, torch.bfloat16, "cuda")
    want = PageKeyCodes(1, heads, 8, page, dim, 2, torch.bfloat16, "cpu")
    k = torch.randn(100, heads, dim, device="cuda", generator=gen).to(torch.bfloat16)
    slots = torch.arange(page, page + 100, device="cuda")
    encode_runs(got, 0, k, slots, SaveRuns.for_extend([1], [0], [100], page, "cuda"))
    encode_codes_reference(want, 0, k.cpu(), slots.cpu())
    for pos in range(100, 140):
        k = (torch.randn(1, heads, dim, device="cuda", generator=gen) * 2).to(torch.bfloat16)
        slot = torch.tensor([page + pos], device="cuda")
        runs = SaveRuns.for_decode(torch.tensor([1], device="cuda"), torch.tensor([pos + 1], device="cuda"), page)
        encode_runs(got, 0, k, slot, runs)
        encode_codes_reference(want, 0, k.cpu(), slot.cpu())
    used = torch.arange(1, 6)
    for name in ("lo", "hi"):
        assert torch.equal(got.layer(0)[name][:, used].cpu(), want.layer(0)[name][:, used])
    step = frame_step(want.layer(0)["lo"][:, used], want.layer(0)["hi"][:, used], 2).unsqueeze(2)
    off = (got.decode(0, used.cuda()).cpu() - want.decode(0, used)).abs() / step
    assert off.max() <= 1.0 + 1e-4 and (off > 0.5).float().mean() < 1e-3


@pytest.mark.parametrize("tensor_cores", [True, False], ids=["tensor-cores", "cuda-cores"])
@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("interval", [1, 3])
def test_shared_budget_attends_each_heads_share_of_the_layer(mode, interval, tensor_cores):
    """``--sparse-budget-share``: each layer's 16 x Hkv pages per request are shared among its kv
    heads in whole quarters of the budget (8 to 20 pages a head), the selection is
    :func:`share_budget` over each page's share from the score kernel run per query head, and each
    head's output, its unit rows merged, is the reference attention over its own pages; eagerly and
    replayed in a CUDA graph with a padding row (FlashInfer planned once per step, each layer's
    widths its own), with and without steps reusing the cache rows, on both FlashInfer decode paths."""
    from sparse_sglang.attention.budget_share import head_log_shares, share_budget

    gen = torch.Generator(device="cuda").manual_seed(9)
    config = SparseConfig(token_budget=512, host_cache_gb=1.0, budget_share=True, reselect_interval=interval)
    b = bench(config, batch=3, context=3000, use_tensor_cores=tensor_cores)
    assert b.decoder.selected == 20
    seq, heads = torch.full((3,), b.seq_len, device="cuda"), SHAPE.num_kv_heads
    widths_seen = set()
    for i, qs, outs, pages_by_layer, kv in three_request_steps(b, mode, 4, gen):
        for layer, (k, v) in enumerate(kv):
            pages, msg = pages_by_layer[layer], f"step {i} layer {layer}"
            widths = (pages >= 0).sum(-1)
            assert (widths.sum(-1) == 16 * heads).all() and (widths % 4 == 0).all(), msg
            widths_seen |= set(widths.flatten().tolist())
            want = sparse_attention_reference(qs, k.transpose(1, 2), v.transpose(1, 2), pages, 32, seq)
            torch.testing.assert_close(outs[layer].float(), want.float(), atol=2e-2, rtol=2e-2, msg=msg)
            if interval == 1:  # a full selection: share_budget over each query head's kernel scores
                qg, num_pages = qs.view(3, heads, -1, SHAPE.head_dim), seq.new_full((3,), b.num_pages)
                per_head = [score_pages(b.decoder.selector, qg[:, :, g : g + 1], b.store.summaries.layer(layer),
                                        b.host_pages, num_pages) for g in range(qg.shape[2])]  # fmt: skip
                shares = head_log_shares(torch.stack(per_head, dim=2), SHAPE.head_dim**-0.5)
                chosen = share_budget(shares, num_pages, 16, *b.decoder.forced)
                assert torch.equal(chosen.page_ids, pages), msg
    assert len(widths_seen) > 1  # the heads' widths differ


def test_shared_budget_with_requests_within_the_budget_in_the_batch():
    """A request holding no more pages than the budget attends every page on every head beside
    requests sharing theirs (its unit rows short, padded to the request's count), eagerly; a step
    whose requests all fit in the budget takes the exact shortcut, its log as wide as a shared one."""
    gen = torch.Generator(device="cuda").manual_seed(10)
    config = SparseConfig(token_budget=512, host_cache_gb=1.0, budget_share=True)
    b = bench(config, batch=3, context=3000)
    kv = [random_kv(3, b.seq_len, gen) for _ in range(SHAPE.num_layers)]
    for layer, (k, v) in enumerate(kv):
        b.write_kv(layer, k, v)
    log = b.decoder.log_selections(max_batch=3)
    # 95, 14 and 63 pages: the second within the budget; then all three within it
    for step, seq_lens in enumerate([torch.tensor([3001, 437, 2000])] * 2 + [torch.tensor([300, 437, 510])]):
        qs = torch.randn(3, SHAPE.num_q_heads, SHAPE.head_dim, device="cuda", generator=gen).to(torch.bfloat16)
        plan = b.step(b.req_slots, seq_lens, b.host_pages)
        assert (plan.units is None) == (step == 2)
        for layer, (k, v) in enumerate(kv):
            out = b.decoder.run(layer, qs, plan)
            pages = log[:3, layer]
            assert ((pages[1] >= 0).sum(-1) == 14).all()
            if step < 2:
                assert ((pages[[0, 2]] >= 0).sum(-1).sum(-1) == 16 * SHAPE.num_kv_heads).all()
            want = sparse_attention_reference(qs, k.transpose(1, 2), v.transpose(1, 2), pages, 32, seq_lens.cuda())
            torch.testing.assert_close(
                out.float(), want.float(), atol=2e-2, rtol=2e-2, msg=f"step {step} layer {layer}"
            )


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_xqa_attends_the_selected_fp8_pages_like_the_reference(mode):
    """``--sparse-decode-kernel xqa`` (fp8 KV): rows laid out K pages apart are XQA's page table,
    and each row's token count its length. Over steps whose selections move (misses loading,
    older pages evicted), eagerly and replayed from a CUDA graph with SGLang's padding row:

    - zero queries, which XQA's fp8 rounding leaves exact: every probability is equal, so the
      output is the mean of exactly the selected tokens' values (the newest page's 25 included, its
      other 7 not), to within fp32 sums;
    - random queries: attention over the selected pages of the stored KV, within what XQA's fp8
      queries and probabilities round away (emulated in float32: about 3.6% of the output's norm,
      3% of its largest entry, on these inputs)."""
    if torch.cuda.get_device_capability()[0] not in (9, 10, 12):
        pytest.skip("XQA runs on Hopper and newer")
    gen = torch.Generator(device="cuda").manual_seed(9)
    config = SparseConfig(token_budget=512, host_cache_gb=1.0, decode_kernel="xqa")
    store = make_store(SHAPE, config, 3, 3000, dtype=torch.float8_e4m3fn)
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    b = DecodeBench(store, config, SHAPE.num_q_heads, 3, 3000, workspace)
    assert b.decoder.xqa_attention is not None and b.seq_len % 32 == 25
    kv = []
    for layer in range(SHAPE.num_layers):
        k, v = random_kv(3, b.seq_len, gen)
        k, v = store.to_store_dtype(k), store.to_store_dtype(v)
        b.write_kv(layer, k, v)
        kv.append((k.float(), v.float()))  # what the reference attends: the stored fp8 values
    selected: dict = {}
    record_selections(b.decoder, selected, mode)
    q_static = torch.zeros(4, SHAPE.num_q_heads, SHAPE.head_dim, device="cuda", dtype=torch.bfloat16)
    outs = [None] * SHAPE.num_layers
    seq = torch.full((3,), b.seq_len, device="cuda")
    graph = None
    if mode == "graph":
        b.decoder.init_cuda_graph(max_batch=4)
        slots = torch.cat([b.req_slots, torch.zeros(1, dtype=b.req_slots.dtype, device="cuda")])  # + padding slot 0
        seq_lens = torch.tensor([b.seq_len] * 3 + [1])
        host_pages = torch.cat([b.host_pages, torch.zeros_like(b.host_pages[:1])])
    for i in range(6):
        qs = torch.randn(3, SHAPE.num_q_heads, SHAPE.head_dim, device="cuda", generator=gen).to(torch.bfloat16)
        # zero queries on odd steps: the first step runs twice in graph mode (eagerly, then
        # replayed), and under a zero query every page ties, so the replay could choose others
        exact = i % 2 == 1
        if exact:
            qs.zero_()
        if mode == "eager":
            plan = b.plan()
            for layer in range(SHAPE.num_layers):
                outs[layer] = b.decoder.run(layer, qs, plan)
        else:
            plan = b.step(slots, seq_lens, host_pages, graph=True)
            q_static[:3].copy_(qs)

            def step(plan=plan):
                for layer in range(SHAPE.num_layers):
                    outs[layer] = b.decoder.run(layer, q_static, plan)

            if graph is None:  # the first step runs eagerly (compiles the kernels), then is captured
                step()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    step()
            graph.replay()
        for layer, (k, v) in enumerate(kv):
            ids = selected[mode, layer][:3]
            pages = torch.where(ids < b.num_pages, ids, -1)
            msg = f"step {i} layer {layer}"
            assert ((pages >= 0).sum(-1) == 16).all(), msg
            want = sparse_attention_reference(qs, k.transpose(1, 2), v.transpose(1, 2), pages, 32, seq).float()
            out = outs[layer][:3].float()
            if exact:
                torch.testing.assert_close(out, want, atol=2e-3, rtol=1e-2, msg=msg)
            else:
                assert (out - want).abs().max() <= 0.08 * want.abs().max(), msg
                assert (out - want).norm() <= 0.06 * want.norm(), msg
    store.close()
