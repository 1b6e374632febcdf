"""CPU tests of the sparse-attention selection logic against brute-force loop references."""

from __future__ import annotations

import math

import pytest
import torch

from sparse_sglang import config
from sparse_sglang.attention import NOT_CACHED, SELECTORS, get_selector, keep_cached, select_pages
from sparse_sglang.attention.reference import attention_mass_recall, max_reduce_logical, sparse_attention_reference
from sparse_sglang.mem_cache import PageSummaries
from sparse_sglang.mem_cache.reference import page_mean_abs_deviation

B, HKV, G, D, PS = 2, 3, 4, 16, 8


def random_pages(seed: int, num_pages: int = 7, num_tokens: int | None = None):
    """Keys ``[B, Hkv, T, D]``, their per-page summaries (via PageSummaries) and the radius."""
    gen = torch.Generator().manual_seed(seed)
    num_tokens = num_tokens or num_pages * PS
    k = torch.randn(B, HKV, num_tokens, D, generator=gen)
    summaries = PageSummaries(B, HKV, num_pages, PS, D, torch.float32)
    for b in range(B):  # one "layer" per request
        summaries.update(b, k[b].transpose(0, 1), torch.arange(num_tokens))
    radius = page_mean_abs_deviation(k, summaries.kmin, summaries.kmax, PS)
    q = torch.randn(B, HKV, G, D, generator=gen)
    return q, k, summaries, radius


def loop_head_scores(name, q, k, kmin, kmax, mean):
    """[B, Hkv, G, N] by the papers' formulas, one page and head at a time."""
    out = torch.empty(*q.shape[:3], kmin.shape[2])
    for b, h, g, p in torch.cartesian_prod(*(torch.arange(n) for n in out.shape)).tolist():
        qv = q[b, h, g]
        if name == "quest":
            out[b, h, g, p] = sum(max(qv[d] * kmax[b, h, p, d], qv[d] * kmin[b, h, p, d]) for d in range(D))
        elif name == "arkvale":  # ArkVale infer_state._summarize_keys, then estimate.cu's max
            keys = k[b, h, p * PS : (p + 1) * PS]
            center = (keys.max(0).values + keys.min(0).values) / 2
            dist = (center - keys).abs().mean(0)
            hi, lo = center + dist, center - dist
            out[b, h, g, p] = sum(max(qv[d] * hi[d], qv[d] * lo[d]) for d in range(D))
        else:
            out[b, h, g, p] = sum(qv[d] * mean[b, h, p, d] for d in range(D))
    return out


def test_registry_matches_config():
    assert tuple(SELECTORS) == config.SELECTORS
    assert all(get_selector(name).name == name for name in SELECTORS)
    with pytest.raises(ValueError, match="unknown selector"):
        get_selector("nope")


@pytest.mark.parametrize("name", [s for s in config.SELECTORS if s != "sketch"])  # sketch: test_key_sketch.py
@pytest.mark.parametrize("group_reduce", ["sum", "max"])
def test_selector_matches_brute_force(name, group_reduce):
    q, k, s, radius = random_pages(seed=1)
    got = get_selector(name).score(q, s.kmin, s.kmax, s.mean, group_reduce, radius=radius)
    expected = loop_head_scores(name, q, k, s.kmin, s.kmax, s.mean)
    expected = expected.sum(2) if group_reduce == "sum" else expected.amax(2)
    assert got.shape == (B, HKV, s.kmin.shape[2])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


def test_bad_group_reduce_and_missing_radius_raise():
    q, _, s, _ = random_pages(seed=2)
    with pytest.raises(ValueError, match="group_reduce"):
        get_selector("quest").score(q, s.kmin, s.kmax, s.mean, "mean")
    with pytest.raises(ValueError, match="radius"):
        get_selector("arkvale").score(q, s.kmin, s.kmax, s.mean)


def test_quest_upper_bounds_every_key_in_the_page():
    q, k, s, _ = random_pages(seed=3, num_pages=9)
    bound = get_selector("quest").head_scores(q, kmin=s.kmin, kmax=s.kmax, mean=None, radius=None)
    qk = torch.einsum("bhgd,bhtd->bhgt", q, k).view(B, HKV, G, -1, PS).amax(-1)  # max q.k per page
    assert (bound >= qk - 1e-4).all()
    grouped = get_selector("quest").score(q, s.kmin, s.kmax, None, "max")
    assert (grouped >= qk.amax(2) - 1e-4).all()


def test_mean_abs_deviation_covers_partial_and_missing_pages():
    num_tokens = 3 * PS + 5  # 4 pages with keys, the last partial; summaries hold 6
    _, k, _, radius = random_pages(seed=4, num_pages=6, num_tokens=num_tokens)
    for p in range(4):
        keys = k[:, :, p * PS : min((p + 1) * PS, num_tokens)]
        center = (keys.amax(2) + keys.amin(2)) / 2
        torch.testing.assert_close(radius[:, :, p], (keys - center.unsqueeze(2)).abs().mean(2))
    assert (radius[:, :, 4:] == 0).all()


def check_selection(page_ids, num_selected, scores, num_pages, budget, sink, recent):
    """Every documented invariant of one select_pages result, row by row."""
    assert page_ids.shape == (*scores.shape[:2], budget) and page_ids.dtype == torch.int32
    for b, n in enumerate(num_pages.tolist()):
        assert num_selected[b] == min(n, budget)
        for h in range(scores.shape[1]):
            row = page_ids[b, h].tolist()
            ids = [p for p in row if p >= 0]
            assert row == ids + [-1] * (budget - len(ids)), "padding must come last"
            assert len(ids) == min(n, budget) and len(set(ids)) == len(ids)
            assert ids == sorted(ids) and ids[-1] == n - 1, "ascending, newest page last"
            if n <= budget:
                assert ids == list(range(n))
                continue
            forced = set(range(min(sink, n))) | set(range(n - recent, n))
            assert forced <= set(ids)
            free = [p for p in range(n) if p not in forced]
            chosen = [p for p in free if p in ids]
            dropped = [p for p in free if p not in ids]
            assert len(chosen) == budget - len(forced)
            if chosen:
                assert min(scores[b, h, chosen]) >= max(scores[b, h, dropped])


@pytest.mark.parametrize("budget,sink,recent", [(6, 1, 2), (4, 0, 1), (5, 2, 3), (3, 1, 2)])
def test_select_pages_ragged_batch(budget, sink, recent):
    gen = torch.Generator().manual_seed(budget * 10 + sink)
    num_pages = torch.tensor([1, 2, 3, 5, 6, 7, 12, 20])
    scores = torch.randn(len(num_pages), HKV, 20, generator=gen)
    scores[0, :, 5:] = float("nan")  # junk past a request's pages is ignored
    sel = select_pages(scores, num_pages, budget, sink, recent)
    check_selection(sel.page_ids, sel.num_selected, scores, num_pages, budget, sink, recent)


def test_select_pages_pads_when_fewer_pages_than_budget():
    scores = torch.randn(2, HKV, 3)  # N < K: nothing to choose from beyond three pages
    sel = select_pages(scores, torch.tensor([3, 2]), 8, 1, 2)
    assert sel.page_ids[0, 0].tolist() == [0, 1, 2] + [-1] * 5
    assert sel.page_ids[1, 2].tolist() == [0, 1] + [-1] * 6
    assert sel.num_selected.tolist() == [3, 2]


def test_select_pages_picks_the_top_scored_pages():
    scores = torch.zeros(1, 1, 10)
    scores[0, 0, [3, 6]] = 5.0
    sel = select_pages(scores, torch.tensor([10]), 5, 1, 2)
    assert sel.page_ids[0, 0].tolist() == [0, 3, 6, 8, 9]


def test_max_reduce_logical_matches_loop():
    g, n_logical = 4, 10
    scores = torch.randn(B, HKV, n_logical)
    num_logical = torch.tensor([10, 6])
    got = max_reduce_logical(scores, g, num_logical)
    assert got.shape == (B, HKV, 3)
    for b in range(B):
        for h in range(HKV):
            for p in range(3):
                held = [scores[b, h, j] for j in range(p * g, min((p + 1) * g, int(num_logical[b])))]
                assert got[b, h, p] == (max(held) if held else -math.inf)


def test_logical_pages_score_physical_pages_by_their_best_part():
    # Logical pages of PS // 2 tokens from the same keys: a physical page scores the max of its two
    # halves, which is <= its own (coarser) Quest bound.
    q, k, s, _ = random_pages(seed=5)
    half = PageSummaries(B, HKV, 2 * s.kmin.shape[2], PS // 2, D, torch.float32)
    for b in range(B):
        half.update(b, k[b].transpose(0, 1), torch.arange(k.shape[2]))
    quest = get_selector("quest")
    fine = max_reduce_logical(quest.score(q, half.kmin, half.kmax, None, "max"), 2)
    coarse = quest.score(q, s.kmin, s.kmax, None, "max")
    assert fine.shape == coarse.shape and (fine <= coarse + 1e-4).all()


def dense_loop(q, k, v, seq_len, keep=None):
    """Per request and query head: softmax(q.k / sqrt(D)) v over kept tokens, plus the dense mass on them."""
    out, mass = torch.zeros_like(q), torch.zeros(q.shape[:2])
    group = q.shape[1] // k.shape[1]
    for b in range(q.shape[0]):
        n = int(seq_len[b])
        for h in range(q.shape[1]):
            kh, vh = k[b, h // group, :n], v[b, h // group, :n]
            logits = kh @ q[b, h] / math.sqrt(D)
            m = torch.ones(n, dtype=torch.bool) if keep is None else keep[b, h // group, :n]
            out[b, h] = torch.softmax(logits[m], 0) @ vh[m]
            mass[b, h] = torch.softmax(logits, 0)[m].sum()
    return out, mass


def test_sparse_attention_reference_dense_and_masked():
    gen = torch.Generator().manual_seed(6)
    num_tokens = 9 * PS
    q = torch.randn(B, HKV * G, D, generator=gen)
    k, v = torch.randn(2, B, HKV, num_tokens, D, generator=gen)
    seq_len = torch.tensor([num_tokens, 5 * PS + 3])
    num_pages = (seq_len + PS - 1) // PS
    dense, _ = dense_loop(q, k, v, seq_len)

    all_pages = select_pages(torch.randn(B, HKV, 9, generator=gen), num_pages, 9, 1, 2).page_ids
    torch.testing.assert_close(sparse_attention_reference(q, k, v, all_pages, PS, seq_len), dense)
    torch.testing.assert_close(sparse_attention_reference(q, k, v, None, PS, seq_len), dense)
    assert torch.allclose(attention_mass_recall(q, k, all_pages, PS, seq_len), torch.ones(B, HKV * G))

    sel = select_pages(torch.randn(B, HKV, 9, generator=gen), num_pages, 4, 1, 2).page_ids
    keep = torch.zeros(B, HKV, num_tokens, dtype=torch.bool)
    for b, h, j in torch.cartesian_prod(torch.arange(B), torch.arange(HKV), torch.arange(4)).tolist():
        if sel[b, h, j] >= 0:
            keep[b, h, int(sel[b, h, j]) * PS : (int(sel[b, h, j]) + 1) * PS] = True
    expected, mass = dense_loop(q, k, v, seq_len, keep)
    torch.testing.assert_close(sparse_attention_reference(q, k, v, sel, PS, seq_len), expected)
    torch.testing.assert_close(attention_mass_recall(q, k, sel, PS, seq_len), mass)
    assert not torch.allclose(expected, dense)


@pytest.mark.parametrize("selector", ["quest", "arkvale", "mean"])
@pytest.mark.parametrize("group_reduce", ["sum", "max"])
@pytest.mark.parametrize("programs", [2048, 1], ids=["a-column-per-block", "one-column-loops-over-blocks"])
def test_score_kernel_and_its_forced_priorities_equal_the_torch_path(selector, group_reduce, programs, monkeypatch):
    """The Triton scoring kernel (in Triton's interpreter here, compiled on the GPU host) against
    the torch selectors; with ``forced`` its output is a priority that a plain top-k turns into
    ``select_pages``'s selection. Each (request, kv head) row's blocks of pages are split among
    the grid's columns, one block each or all in one column."""
    from sparse_sglang.attention import scoring
    from sparse_sglang.attention.reference import score_pages_reference
    from sparse_sglang.attention.scoring import score_pages
    from sparse_sglang.attention.selection import force_pages

    monkeypatch.setattr(scoring, "SCORE_PROGRAMS", programs)

    gen = torch.Generator().manual_seed(2)
    heads, pool, dim, group = 2, 60, 16, 3
    lo = torch.randn(heads, pool, dim, generator=gen)
    summ = {"kmin": lo.bfloat16(), "kmax": (lo + torch.rand(heads, pool, dim, generator=gen)).bfloat16(),
            "mean": lo + 0.5, "radius": torch.rand(heads, pool, dim, generator=gen)}  # fmt: skip
    host_pages = torch.randint(0, pool, (3, 100), generator=gen, dtype=torch.int32)
    num_pages = torch.tensor([100, 17, 2], dtype=torch.int32)
    q = torch.randn(3, heads, group, dim, generator=gen).bfloat16()
    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the kernel runs in Triton's interpreter
    summ, host_pages, num_pages, q = ({k: t.to(device) for k, t in summ.items()}, host_pages.to(device),
                                      num_pages.to(device), q.to(device))  # fmt: skip
    want = score_pages_reference(selector, q, summ, host_pages, num_pages, group_reduce)
    got = score_pages(selector, q, summ, host_pages, num_pages, group_reduce)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)
    prio = score_pages(selector, q, summ, host_pages, num_pages, group_reduce, forced=(1, 2))
    torch.testing.assert_close(prio, force_pages(want, num_pages, 1, 2), atol=1e-3, rtol=1e-4)
    # Left unwritten past each request's pages (for the ragged top-k), at another launch shape.
    out = torch.full_like(prio, 7.0)
    score_pages(selector, q, summ, host_pages, num_pages, group_reduce, out=out, forced=(1, 2),
                fill_tail=False, block_n=64, num_warps=2)  # fmt: skip
    held = torch.arange(prio.shape[-1], device=device) < num_pages.view(-1, 1, 1)
    torch.testing.assert_close(out[held.expand_as(out)], prio[held.expand_as(prio)])
    # Past the end: -inf in the request's last block, the whole blocks after it unwritten.
    assert ((out == 7.0) | (out == -math.inf) | held).all() and (out == 7.0).any()
    top = prio.topk(8, dim=-1).indices
    top = torch.where(top < num_pages.view(-1, 1, 1).long(), top, -1).sort(-1).values.cpu()
    ref = select_pages(want, num_pages, 8, 1, 2).page_ids.long().cpu()
    assert torch.equal(top.sort(-1).values.clamp_min(-1), torch.where(ref < 0, -1, ref).sort(-1).values)


@pytest.mark.parametrize("forced", [(1, 2), None])
def test_score_kernel_with_reuse_scores_only_the_cached_pages_of_rows_not_due(forced):
    """``reuse``: the kernels (a full-row pass that reads no summary for rows reusing their
    selection, then a pass over their cache rows) equal the torch path's ``keep_cached``."""
    from sparse_sglang.attention.reference import score_pages_reference
    from sparse_sglang.attention.scoring import score_pages
    from sparse_sglang.mem_cache.gpu_cache import CachedRows

    gen = torch.Generator().manual_seed(5)
    heads, pool, dim, group, width = 2, 60, 16, 2, 20
    lo = torch.randn(heads, pool, dim, generator=gen)
    summ = {"kmin": lo.bfloat16(), "kmax": (lo + torch.rand(heads, pool, dim, generator=gen)).bfloat16()}
    host_pages = torch.randint(0, pool, (3, 40), generator=gen, dtype=torch.int32)
    num_pages = torch.tensor([40, 30, 9], dtype=torch.int32)
    q = torch.randn(3, heads, group, dim, generator=gen).bfloat16()
    num_slots = 200
    # Request slots 4, 1, 2 (0 is the padding row: no slots); each row holds distinct pages, some
    # past its request's end (30..39 of request slot 1), -1 for empty slots.
    slot_page = torch.full((num_slots + 1,), -1, dtype=torch.int64)
    rows = torch.full((5, heads, width), -1, dtype=torch.int64)
    free = iter(torch.randperm(num_slots, generator=gen).tolist())
    for req, held in ((4, 14), (1, 18), (2, 6)):
        for h in range(heads):
            for col, page in enumerate(torch.randperm(40, generator=gen)[:held].tolist()):
                rows[req, h, col] = slot = next(free)
                slot_page[slot] = page
    req_slots = torch.tensor([4, 1, 2], dtype=torch.int32)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the kernels run in Triton's interpreter
    summ = {k: t.to(device) for k, t in summ.items()}
    host_pages, num_pages, q, rows, req_slots, slot_page = (
        t.to(device) for t in (host_pages, num_pages, q, rows, req_slots, slot_page)
    )
    for due in ([False, False, True], [True, True, True], [False, True, False]):
        reuse = CachedRows(torch.tensor(due, device=device), rows, req_slots, slot_page)
        want = score_pages_reference("quest", q, summ, host_pages, num_pages, forced=forced, reuse=reuse)
        got = score_pages("quest", q, summ, host_pages, num_pages, forced=forced, reuse=reuse)
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)
        assert (got[~torch.tensor(due, device=device)] == NOT_CACHED).any() or all(
            due
        )  # some pages really were left out


@pytest.mark.parametrize("selector", ["quest", "arkvale"])
@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "torch"])
def test_scores_of_fp8_bounds_equal_those_of_the_same_bounds_in_bf16(selector, use_kernel):
    """Bounds of fp8 keys stored as fp8 (what an fp8 store keeps) score exactly as the same
    values stored as bf16: both paths widen the bounds to float32 before any arithmetic."""
    from sparse_sglang.attention.reference import score_pages_reference
    from sparse_sglang.attention.scoring import score_pages

    gen = torch.Generator().manual_seed(9)
    heads, pool, dim, group = 2, 50, 16, 3
    lo = torch.randn(heads, pool, dim, generator=gen) * 20
    hi = lo + torch.rand(heads, pool, dim, generator=gen) * 20
    fp8 = {"kmin": lo.to(torch.float8_e4m3fn), "kmax": hi.to(torch.float8_e4m3fn), "radius": (hi - lo) / 3}
    bf16 = {name: t.to(torch.bfloat16) if t.element_size() == 1 else t for name, t in fp8.items()}
    host_pages = torch.randint(0, pool, (2, 40), generator=gen, dtype=torch.int32)
    num_pages = torch.tensor([40, 13], dtype=torch.int32)
    q = torch.randn(2, heads, group, dim, generator=gen).bfloat16()
    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the kernel runs in Triton's interpreter
    fp8, bf16 = ({k: t.to(device) for k, t in summ.items()} for summ in (fp8, bf16))
    host_pages, num_pages, q = host_pages.to(device), num_pages.to(device), q.to(device)
    score = score_pages if use_kernel else score_pages_reference
    got = score(selector, q, fp8, host_pages, num_pages, forced=(1, 2))
    want = score(selector, q, bf16, host_pages, num_pages, forced=(1, 2))
    assert torch.equal(got, want) and got[1, :, :13].isfinite().any()


def test_keep_cached_restricts_only_the_rows_that_reuse_their_selection():
    scores = torch.tensor([[[5.0, 4.0, 3.0, math.inf, -math.inf]], [[5.0, 4.0, 3.0, math.inf, -math.inf]]])
    cached = torch.tensor([[[False, False, True, False, False]]] * 2)
    out = keep_cached(scores, cached, torch.tensor([True, False]))
    assert torch.equal(out[0], scores[0])  # selecting from all its pages: unchanged
    # Reusing: the uncached pages drop below every score, forced (+inf) and past-end (-inf) stay.
    assert torch.equal(out[1, 0], torch.tensor([NOT_CACHED, NOT_CACHED, 3.0, math.inf, -math.inf]))
    sel = select_pages(out, torch.tensor([4, 4]), budget_pages=2, sink_pages=0, recent_pages=1)
    assert sel.page_ids[0, 0].tolist() == [0, 3] and sel.page_ids[1, 0].tolist() == [2, 3]
    # A row holding too few pages fills up with uncached ones rather than padding.
    sel = select_pages(out, torch.tensor([4, 4]), budget_pages=3, sink_pages=0, recent_pages=1)
    assert (sel.page_ids[1, 0] >= 0).all() and {2, 3} <= set(sel.page_ids[1, 0].tolist())


@pytest.mark.parametrize("selector", ["quest", "arkvale"])
@pytest.mark.parametrize("reuse", [False, True], ids=["full", "reuse"])
@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "torch"])
def test_int8_bounds_score_as_their_values_and_still_bound_the_keys(selector, reuse, use_kernel):
    """int8 bounds (levels x a power-of-two scale per page and kv head) score as their float32
    values do, in the kernels (full rows and cached rows) and the torch path; rounded outward,
    each page's Quest score stays at or above ``q . k`` of every key in it."""
    from sparse_sglang.attention.reference import score_pages_reference
    from sparse_sglang.attention.scoring import score_pages
    from sparse_sglang.mem_cache.bounds import dequantize_bounds, quantize_bounds
    from sparse_sglang.mem_cache.gpu_cache import CachedRows

    gen = torch.Generator().manual_seed(11)
    heads, pool, dim, group, page = 2, 50, 16, 3, 4
    keys = torch.randn(heads, pool, page, dim, generator=gen) * torch.rand(1, pool, 1, 1, generator=gen) * 40
    lo, hi, e = quantize_bounds(keys.amin(2), keys.amax(2))
    int8 = {"kmin": lo, "kmax": hi, "bound_exp": e, "radius": (keys.amax(2) - keys.amin(2)) / 3}
    values = {"kmin": dequantize_bounds(lo, e), "kmax": dequantize_bounds(hi, e), "radius": int8["radius"]}
    assert (values["kmin"] <= keys.amin(2)).all() and (values["kmax"] >= keys.amax(2)).all()
    host_pages = torch.randint(0, pool, (2, 40), generator=gen, dtype=torch.int32)
    num_pages = torch.tensor([40, 13], dtype=torch.int32)
    q = torch.randn(2, heads, group, dim, generator=gen).bfloat16()
    rows = torch.randperm(200, generator=gen)[: 2 * heads * 10].view(2, heads, 10)  # request slots 0, 1
    slot_page = torch.full((201,), -1, dtype=torch.int64)
    slot_page[rows.flatten()] = torch.randint(0, 13, (rows.numel(),), generator=gen)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the kernels run in Triton's interpreter
    int8, values = ({k: t.to(device) for k, t in summ.items()} for summ in (int8, values))
    host_pages, num_pages, q, keys = host_pages.to(device), num_pages.to(device), q.to(device), keys.to(device)
    cached = None
    if reuse:
        cached = CachedRows(torch.tensor([True, False], device=device), rows.to(device),
                            torch.tensor([0, 1], dtype=torch.int32, device=device), slot_page.to(device))  # fmt: skip
    score = score_pages if use_kernel else score_pages_reference
    got = score(selector, q, int8, host_pages, num_pages, reuse=cached)
    want = score_pages_reference(selector, q, values, host_pages, num_pages, reuse=cached)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)
    if selector == "quest" and not reuse:  # an upper bound of q . k over each held page's keys
        qk = torch.einsum("bhgd,hbptd->bhgpt", q.float(), keys[:, host_pages.long()].float()).amax(-1).sum(2)
        held = torch.arange(40, device=device) < num_pages.view(-1, 1, 1)
        assert (got >= qk - 1e-3)[held.expand_as(got)].all()
