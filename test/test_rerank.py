"""The re-rank of candidate pages (``--sparse-rerank-factor``): its two kernels (the per-page
log-masses; the priorities and the choice), in Triton's interpreter on CPU, against their torch
references."""

from __future__ import annotations

import math

import pytest
import torch

from sparse_sglang.attention import get_selector
from sparse_sglang.attention.reference import (
    candidate_page_lse_reference,
    choose_reranked_reference,
    rerank_priority_reference,
)
from sparse_sglang.attention.rerank import candidate_page_lse, choose_reranked

P, D = 16, 32
# The kernels run compiled on a GPU, in Triton's interpreter on CPU tensors without one.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def on_device(kernel, *args, **kwargs):
    """``kernel`` on ``DEVICE`` copies of its tensor arguments; its outputs back on the CPU."""
    moved = [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args]
    out = kernel(*moved, **kwargs)
    return tuple(t.cpu() for t in out) if isinstance(out, tuple) else out.cpu()


def _case(rows=3, kc=5, group=3, slots_total=12, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(slots_total, P, D, generator=gen).to(dtype)
    q = torch.randn(rows, group, D, generator=gen)
    slots = torch.randint(0, slots_total, (rows, kc), generator=gen, dtype=torch.int32)
    count = torch.tensor([kc, 2, 0][:rows], dtype=torch.int32)
    return q, k_cache, slots, count


@pytest.mark.parametrize(
    "q_dtype,dtype",
    [(torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
     (torch.bfloat16, torch.float8_e4m3fn)],
)  # fmt: skip
@pytest.mark.parametrize("soft_cap", [None, 5.0])
def test_kernel_matches_its_reference(q_dtype, dtype, soft_cap):
    """fp32 queries: the fp32 dot; bf16 queries (the server's) against bf16 or fp8 keys: the 16-bit
    dot, whose products are exact."""
    if q_dtype != torch.float32 and DEVICE == "cpu":
        pytest.skip("Triton's interpreter takes 16-bit dot operands for their raw bits: the 16-bit dot on a GPU only")
    q, k_cache, slots, count = _case(dtype=dtype)
    q = q.to(q_dtype)
    got = on_device(
        candidate_page_lse, q, k_cache, slots, count, sm_scale=D**-0.5, k_scale=0.5, logits_soft_cap=soft_cap
    )
    want = candidate_page_lse_reference(q, k_cache, slots, count, D**-0.5, 0.5, soft_cap)
    assert got.shape == (3, 5, 3)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.isinf(got[1, 2:]).all() and torch.isinf(got[2]).all()  # past each row's count
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-4, atol=1e-4)


def test_priority_is_the_groups_summed_share_and_forces_sink_and_recent_pages():
    pages = torch.tensor([[0, 3, 5, 9]])
    lse = torch.log(torch.tensor([[[1.0, 1.0], [6.0, 1.0], [2.0, 7.0], [float("nan"), 5.0]]]))
    count, num_pages = torch.tensor([4]), torch.tensor([10])
    priority = rerank_priority_reference(lse, pages, count, num_pages, forced=(1, 1))
    assert priority[0, 0] == math.inf and priority[0, 3] == math.inf  # page 0 (sink), page 9 (recent)
    # head shares over the candidates but the newest page (9: read whole, its mass unknown):
    # head 0 [1, 6, 2] / 9, head 1 [1, 1, 7] / 9
    torch.testing.assert_close(priority[0, 1:3], torch.log(torch.tensor([(6 + 1) / 9, (2 + 7) / 9])))
    fewer = rerank_priority_reference(lse, pages, torch.tensor([2]), num_pages, forced=(1, 1))
    assert fewer[0, 2:].eq(-math.inf).all()  # past the count: never chosen


def test_choice_keeps_the_best_in_ascending_page_order_and_pads_short_rows():
    """Row 0: candidates in any order, sink page 0 and newest page 11 forced, 4 and 7 compete for
    the one place left (7 has more mass for both heads). Row 1: two candidates of a request of 3
    pages (page 5 is past its end), fewer than k."""
    candidates = torch.tensor([[7, 11, 0, 4, 8], [2, 0, 5, -1, -1]])
    row_pages = torch.tensor([12, 3])
    lse = torch.log(torch.tensor([[[1.0, 1.0], [1.0, 2.0], [6.0, 5.0], [0.5, 0.5], [3.0, 3.0]],
                                  [[1.0, 1.0], [2.0, 2.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]]))  # fmt: skip
    slots = torch.tensor([[10, 14, 17, 18, 21], [30, 32, 0, 0, 0]], dtype=torch.int32)
    for choose in (choose_reranked, choose_reranked_reference):
        pages, chosen_slots = on_device(choose, candidates, row_pages, lse, slots, 3, forced=(1, 1))
        assert pages.tolist() == [[0, 7, 11], [0, 2, -1]], choose.__name__
        assert chosen_slots.tolist() == [[10, 17, 21], [30, 32, -1]], choose.__name__


@pytest.mark.parametrize("k", [1, 4, 9, 40])
def test_the_choice_kernel_matches_its_reference(k):
    """Random rows (shuffled candidates, some past their request's end, some short), group 3, the
    sink and two recent pages forced: the kernel keeps the reference's pages and slots."""
    gen = torch.Generator().manual_seed(k)
    rows, kc, group = 6, 24, 3
    row_pages = torch.randint(5, 60, (rows,), generator=gen)
    candidates = torch.full((rows, kc), -1, dtype=torch.int64)
    for r in range(rows):
        n = min(int(torch.randint(1, kc + 1, (), generator=gen)), int(row_pages[r]) + 3)
        picked = torch.randperm(int(row_pages[r]) + 3, generator=gen)[:n]  # a few past the end
        candidates[r, :n] = picked
        candidates[r] = candidates[r, torch.randperm(kc, generator=gen)]
    lse = torch.randn(rows, kc, group, generator=gen) * 3
    slots = torch.randint(0, 1000, (rows, kc), generator=gen, dtype=torch.int32)
    forced = (1, 2) if k >= 3 else (0, 1)  # never more forced pages than places (the decoder's contract)
    got = on_device(choose_reranked, candidates, row_pages, lse, slots, k, forced)
    want = choose_reranked_reference(candidates, row_pages, lse, slots, k, forced)
    width = min(k, kc)
    assert torch.equal(got[0][:, :width], want[0][:, :width])
    assert torch.equal(got[1][:, :width], want[1][:, :width])
    assert (got[0][:, width:] == -1).all() and (got[1][:, width:] == -1).all()


def test_ties_at_the_threshold_keep_the_lower_pages():
    candidates = torch.tensor([[9, 3, 6, 1]])
    lse = torch.zeros(1, 4, 1)  # every page the same mass
    slots = torch.tensor([[1, 3, 6, 9]], dtype=torch.int32)
    pages, chosen = on_device(choose_reranked, candidates, torch.tensor([20]), lse, slots, 2, forced=(0, 0))
    assert pages.tolist() == [[1, 3]] and chosen.tolist() == [[1, 3]]


def test_rerank_recovers_the_page_a_bound_ranks_below_a_wide_distractor():
    """Quest's bound scores a page by its bounding box: a page whose keys spread widely over the
    query's channels outranks one holding the single key the query matches. The exact mass of the
    same candidates puts the matching page first."""
    q = torch.zeros(1, 1, D)
    q[0, 0, :4] = 1.0
    needle = torch.zeros(P, D)
    needle[3, :4] = 3.0  # one token aligned with the query: logit 12 * scale
    wide = torch.zeros(P, D)
    wide[:, :4] = -4.0
    wide[torch.arange(P), torch.arange(P) % 4] = 4.0  # each channel high on some token, no token high on all
    k_cache = torch.stack([needle, wide])
    kmin, kmax = k_cache.amin(1).view(1, 1, 2, D), k_cache.amax(1).view(1, 1, 2, D)
    bound = get_selector("quest").score(q.view(1, 1, 1, D), kmin, kmax, None)
    assert bound[0, 0, 1] > bound[0, 0, 0]  # the bound prefers the distractor
    slots, count = torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([2], dtype=torch.int32)
    lse = on_device(candidate_page_lse, q, k_cache, slots, count, sm_scale=1.0)
    pages, _ = on_device(choose_reranked, torch.tensor([[6, 5]]), torch.tensor([20]), lse, slots, 1, forced=(0, 0))
    assert pages.tolist() == [[5]]


def test_a_layers_rerank_reads_each_candidates_own_slot_whatever_order_the_top_k_gave():
    """The selection's candidates come in any order (some rows short, entries past a request's end);
    the retrieve kernel writes a row's slots in ascending page order. The re-rank pairs each page
    with its own slot: it attends the pages whose keys (in those slots) carry the most mass."""
    from sparse_sglang.attention.rerank import rerank_candidates

    gen = torch.Generator().manual_seed(3)
    batch, heads, group, kc, k = 2, 2, 2, 6, 3
    num_pages = torch.tensor([9, 4])
    q = torch.randn(batch * heads, 1, D, generator=gen).expand(-1, group, -1)  # every head the same: mass ~ strength
    candidates = torch.full((batch, heads, kc), -1, dtype=torch.int64)
    candidates[0, 0] = torch.tensor([8, 2, 5, 0, 6, 3])
    candidates[0, 1] = torch.tensor([1, 8, 0, 7, 4, 5])
    candidates[1, 0] = torch.tensor([3, 0, 2, 9, -1, -1])  # 9: past the request's end
    candidates[1, 1] = torch.tensor([0, 1, 3, -1, -1, -1])
    k_cache = torch.zeros(40, P, D)
    slots = torch.zeros(batch * heads, kc, dtype=torch.int32)
    mass = {}  # (row, page) -> the page's keys' strength along the row's summed query
    for row in range(batch * heads):
        b, h = divmod(row, heads)
        pages = sorted(p for p in candidates[b, h].tolist() if 0 <= p < int(num_pages[b]))
        for j, p in enumerate(pages):
            slot = 1 + row * kc + j
            slots[row, j] = slot
            strength = float(torch.rand((), generator=gen)) * 4
            k_cache[slot, 0] = strength * q[row].sum(0) / q[row].sum(0).norm()
            mass[row, p] = strength
    chosen_pages, chosen_slots = on_device(rerank_candidates, candidates, num_pages.repeat_interleave(heads), slots, q, k_cache, k, forced=(1, 1),
                                                   sm_scale=1.0)  # fmt: skip
    for row in range(batch * heads):
        b = row // heads
        n = int(num_pages[b])
        held = [p for (r, p) in mass if r == row]
        free = sorted((p for p in held if 0 < p < n - 1), key=lambda p: -mass[row, p])
        want = sorted({p for p in held if p == 0 or p == n - 1} | set(free[: k - sum(p in (0, n - 1) for p in held)]))
        got = [p for p in chosen_pages[row].tolist() if p >= 0]
        assert got == want, f"row {row}"
        pages = sorted(held)
        assert [int(s) for s in chosen_slots[row][: len(got)]] == [int(slots[row, pages.index(p)]) for p in got]


def test_the_cpu_reference_reranks_as_the_oracle_when_every_page_is_a_candidate():
    """``benchmark/quality.py``'s decoder (the accuracy suite's reference) with ``rerank_factor``:
    candidates covering the context leave the exact mass to choose, so the one page besides the
    forced ones is the oracle's best."""
    from benchmark import quality
    from sparse_sglang.mem_cache import PageSummaries

    gen = torch.Generator().manual_seed(5)
    heads, group, tokens, dim = 2, 3, 200, 16
    keys = torch.randn(1, heads, tokens, dim, generator=gen)
    q = torch.randn(1, heads * group, dim, generator=gen) * 2
    summaries = PageSummaries(1, heads, 8, 32, dim, torch.float32, bound_format="exact")
    summaries.update(0, keys[0].transpose(0, 1), torch.arange(tokens))
    seq_len = torch.tensor([tokens])
    policy = quality.Policy(budget=128, sink_pages=1, recent_pages=2, rerank_factor=2)
    pages = quality.choose_pages(policy, q, summaries, 0, keys, seq_len, scale=dim**-0.5)
    mass = quality.oracle_page_mass(q, keys, seq_len, dim**-0.5)  # [1, Hkv, 7]
    for h in range(heads):
        best = 1 + int(mass[0, h, 1:5].argmax())
        assert pages[0, h].tolist() == sorted([0, best, 5, 6])


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU store; test_sparse_decode_gpu.py's re-rank test on a GPU")
def test_the_decoder_loads_its_candidates_and_points_flashinfer_at_the_pages_it_chose(monkeypatch):
    """The decoder's re-rank step on the CPU (its kernels in Triton's interpreter; FlashInfer's
    wrapper, which needs a GPU, stubbed: the step writes the indices that wrapper reads). Each
    (request, kv head) attends its sink page, its 2 recent pages and the candidate with the most
    exact mass; FlashInfer's indices hold those pages' cache slots, in ascending page order, and
    the slots hold the pages' keys."""
    import flashinfer

    from sparse_sglang.attention.sparse_decode import SparseDecoder
    from sparse_sglang.config import SparseConfig
    from sparse_sglang.mem_cache.kernels import SaveRuns
    from sparse_sglang.mem_cache.kv_store import SparseKVStore, StoreShape

    class NoWrapper:  # plan() is all a step asks of it before run()
        def __init__(self, *args, **kwargs):
            pass

        def plan(self, *args, **kwargs):
            pass

    monkeypatch.setattr(flashinfer, "BatchDecodeWithPagedKVCacheWrapper", NoWrapper)
    batch, heads, group, dim, page, tokens = 2, 2, 2, 32, 32, 300  # 10 pages a request
    config = SparseConfig(token_budget=128, rerank_factor=2, sink_pages=1, recent_pages=2, host_cache_gb=1.0)
    shape = StoreShape(num_layers=1, num_kv_heads=heads, head_dim=dim, page_size=page, dtype=torch.bfloat16,
                       num_host_pages=batch * 10 + 1, num_slots=batch * heads * 10 + 4, max_requests=batch + 1,
                       row_width=10, max_pages=10, max_save_tokens=1024, min_row_width=10)  # fmt: skip
    store = SparseKVStore(shape, "cpu", fused=False)
    gen = torch.Generator().manual_seed(9)
    k = torch.randn(batch, tokens, heads, dim, generator=gen).bfloat16()
    v = torch.randn(batch, tokens, heads, dim, generator=gen).bfloat16()
    req_slots = torch.tensor([1, 2])
    host_pages = (1 + torch.arange(batch).view(-1, 1) * 10 + torch.arange(10).view(1, -1)).to(torch.int32)
    t = torch.arange(tokens)
    token_slots = (host_pages.long()[:, t // page] * page + t % page).reshape(-1)
    store.bind_runs(SaveRuns.for_extend([1, 2], [0, 0], [tokens] * batch, page, "cpu"))
    store.save(0, token_slots, k.reshape(-1, heads, dim), v.reshape(-1, heads, dim), staged=True)
    store.wait_saves()
    for slot in (1, 2):
        store.cache.open_request(slot, 10)
    decoder = SparseDecoder(store, config, heads * group, torch.empty(1), max_batch=batch, topk="torch")
    assert (decoder.width, decoder.candidates) == (4, 8)
    candidates = {}
    select_raw = decoder.select_raw

    def recording(layer, q, plan, width=None):
        candidates[width] = ids = select_raw(layer, q, plan, width)
        return ids

    decoder.select_raw = recording
    store.cache.next_step()
    seq_lens = torch.tensor([tokens] * batch)
    plan = decoder.plan(req_slots, seq_lens, host_pages, seq_lens=seq_lens)
    q = torch.randn(batch, heads * group, dim, generator=gen)
    chosen = decoder._rerank(0, q, plan, None)
    logits = torch.einsum("bhgd,bthd->bhgt", q.view(batch, heads, group, dim), k.float()) * dim**-0.5
    lse = (
        torch.nn.functional.pad(logits, (0, 20), value=-float("inf")).view(batch, heads, group, 10, page).logsumexp(-1)
    )
    for b in range(batch):
        for h in range(heads):
            offered = sorted(p for p in candidates[8][b, h].tolist() if 0 <= p < 10)
            assert len(offered) == 8 and {0, 8, 9} <= set(offered)
            counted = [p for p in offered if p != 9]  # the newest page is read whole: not in the totals
            share = (lse[b, h, :, offered] - lse[b, h, :, counted].logsumexp(-1, keepdim=True)).logsumexp(0)
            free = [p for p in offered if p not in (0, 8, 9)]
            best = free[int(share[[offered.index(p) for p in free]].argmax())]
            assert chosen[b, h].tolist() == sorted([0, best, 8, 9])
            row = b * heads + h
            start = int(plan.indptr[row])
            slots = decoder.indices[start : start + 4].long()
            want = store.cache.page_table.lookup(req_slots[b], 0, torch.tensor(h), chosen[b, h].long())
            assert slots.tolist() == want.tolist()
            for p, slot in zip(chosen[b, h].tolist(), slots.tolist()):
                end = min(page, tokens - p * page)
                torch.testing.assert_close(store.cache.k[slot, :end], k[b, p * page : p * page + end, h])
