"""The fused Triton kernels of ``mem_cache.kernels`` against their torch references.

On a machine without CUDA these run in Triton's interpreter (``test/conftest.py`` sets
``TRITON_INTERPRET=1``); on the GPU host the same tests run the compiled kernels.
"""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch

from sparse_sglang.attention.reference import retrieve_reference
from sparse_sglang.attention.retrieval import retrieve_pages
from sparse_sglang.mem_cache import GPUPageCache, PageSummaries
from sparse_sglang.mem_cache.kernels import SaveRuns, index_runs
from sparse_sglang.mem_cache.reference import index_runs_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def loads_into(loads: list):
    """A ``load`` callback recording each (source, destination) pair into ``loads``."""
    return lambda src, dst: loads.append((src, dst))


def make_cache(num_slots, layers=2, heads=2, page_size=8, dim=16, dtype=torch.bfloat16, width=4, max_pages=24,
               min_width=None, lru=(0, 1)):  # fmt: skip
    return GPUPageCache(num_slots, layers, heads, page_size, dim, dtype, max_requests=4, row_width=width,
                        max_pages=max_pages, total_pages=64, device=DEVICE, segment_pages=4, min_row_width=min_width,
                        lru_buckets=lru[0], lru_steps_per_bucket=lru[1])  # fmt: skip


def test_save_runs_split_each_request_at_its_page_boundaries():
    runs = SaveRuns.for_extend([3, 1, 2], [5, 0, 16], [12, 3, 0], page_size=8, device="cpu")
    # request 3: positions 5..16 -> pages 0 (5..7), 1 (8..15), 2 (16); request 1: 0..2 in page 0.
    assert runs.start.tolist() == [0, 3, 11, 12]
    assert runs.length.tolist() == [3, 8, 1, 3]
    assert runs.req_slot.tolist() == [3, 3, 3, 1]
    assert runs.logical_page.tolist() == [0, 1, 2, 0]
    assert runs.page_offset.tolist() == [5, 0, 0, 0]
    assert runs.token_req_slots.tolist() == [3] * 12 + [1] * 3
    assert runs.token_positions.tolist() == list(range(5, 17)) + [0, 1, 2]
    rng = random.Random(0)
    for _ in range(50):
        prefix = [rng.randrange(40) for _ in range(4)]
        new = [rng.randrange(30) for _ in range(4)]
        r = SaveRuns.for_extend([0, 1, 2, 3], prefix, new, page_size=8, device="cpu")
        got = [
            (int(q), p * 8 + o + i)
            for s, n, q, p, o in zip(
                *(x.tolist() for x in (r.start, r.length, r.req_slot, r.logical_page, r.page_offset))
            )
            for i in range(n)
        ]
        assert got == list(zip(r.token_req_slots.tolist(), r.token_positions.tolist()))
        assert all(0 < n <= 8 and o + n <= 8 for n, o in zip(r.length.tolist(), r.page_offset.tolist()))
    decode = SaveRuns.for_decode(torch.tensor([2, 0]), torch.tensor([9, 16]), page_size=8)
    assert decode.logical_page.tolist() == [1, 1] and decode.page_offset.tolist() == [0, 7]
    assert decode.token_positions.tolist() == [8, 15] and decode.length.tolist() == [1, 1]


@pytest.mark.parametrize("dtype,with_radius,with_mean,bound_format,page_bounds", [
    (torch.bfloat16, True, True, "exact", "minmax"), (torch.float16, False, False, "exact", "minmax"),
    (torch.float8_e4m3fn, True, False, "auto", "minmax"), (torch.bfloat16, True, False, "int8", "minmax"),
    (torch.float16, False, True, "auto", "minmax"), (torch.bfloat16, False, False, "auto", "meanstd"),
    (torch.float8_e4m3fn, False, False, "auto", "meanstd"), (torch.float16, False, True, "exact", "meanstd"),
])  # fmt: skip
def test_index_runs_equals_its_reference(dtype, with_radius, with_mean, bound_format, page_bounds):
    """Prefill batches with prefixes, then decode steps: the fused kernel leaves the summaries and
    the cached blocks as the torch reference does (fp8: bounds stored in fp8, compared as floats;
    int8: the same levels and scales, bit for bit); a page started anew ends no built super-page.
    Mean/std corners are sums in another order: within a level of int8 corners, float rounding of
    exact ones."""
    gen = torch.Generator().manual_seed(3)
    layers, heads, page, dim, host_pages = 2, 2, 8, 16, 40
    ref_summ = PageSummaries(layers, heads, host_pages, page, dim, dtype, DEVICE, with_radius=with_radius, with_mean=with_mean,
                             bound_format=bound_format, page_bounds=page_bounds, coarse_pages=2)  # fmt: skip
    ref_summ.coarse_first.fill_(7)  # as if every page ended a built super-page
    ref_cache = make_cache(80, layers, heads, page, dim, dtype, width=4)
    summ, cache = copy.deepcopy(ref_summ), copy.deepcopy(ref_cache)
    reqs = {1: 0, 3: 0}  # request slot -> tokens saved so far
    page_of = {1: list(range(1, 13)), 3: list(range(20, 32))}  # logical page -> host page
    for c in (ref_cache, cache):
        for r in reqs:
            c.open_request(r)

    def forward(new_tokens: dict[int, int]):
        slots = list(new_tokens)
        runs = SaveRuns.for_extend(slots, [reqs[r] for r in slots], list(new_tokens.values()), page, DEVICE)
        for c in (ref_cache, cache):
            for r, n in new_tokens.items():
                first, end = math.ceil(reqs[r] / page), math.ceil((reqs[r] + n) / page)
                c.resize_request(r, end)
                c.write_allocate(r, first, end - first)
        pos, req = runs.token_positions, runs.token_req_slots
        loc = torch.tensor(
            [page_of[r][p // page] * page + p % page for r, p in zip(req.tolist(), pos.tolist())], device=DEVICE
        )
        for layer in range(layers):
            k, v = (torch.randn(len(loc), heads, dim, generator=gen) for _ in range(2))
            if dtype.itemsize == 1:  # fp8: keys over e4m3's range, channel 0 an outlier channel (all in 300..448)
                k = k * 30
                k[..., 0] = (300 + k[..., 0].abs() * 3).clamp(max=448)
            k, v = k.to(dtype).to(DEVICE), v.to(dtype).to(DEVICE)
            index_runs_reference(ref_summ, ref_cache, layer, k, v, loc, runs)
            index_runs(summ, cache, layer, k, v, loc, runs)
        for r, n in new_tokens.items():
            reqs[r] += n

    forward({1: 13, 3: 5})  # prefill
    forward({3: 17})  # the rest of request 3's prompt (a chunk continuing a partial page)
    for _ in range(12):  # decode, one token each; pages fill and start
        forward({1: 1, 3: 1})
    held = [p for pages in page_of.values() for p in pages]
    int8 = bound_format == "int8" or (bound_format == "auto" and (dtype.itemsize == 2 or page_bounds == "meanstd"))
    assert summ.bound_format == ("int8" if int8 else "exact")
    if page_bounds == "meanstd":
        got = [torch.stack(summ.bounds(layer))[..., held, :] for layer in range(layers)]
        want = [torch.stack(ref_summ.bounds(layer))[..., held, :] for layer in range(layers)]
        for layer, (g, w) in enumerate(zip(got, want)):
            if int8:  # a level at the larger of the two scales
                e = torch.maximum(summ.bound_exp[layer][:, held], ref_summ.bound_exp[layer][:, held])
                step = 2.0 ** e.float().unsqueeze(-1)
            else:
                step = w.abs() * 2**-9
            filled = ref_summ.count[layer, held] > 0  # empty pages hold +-inf corners in both
            assert ((g - w).abs() <= step * 1.001 + 1e-6)[:, :, filled].all(), layer
            assert torch.equal(g[:, :, ~filled], w[:, :, ~filled]), layer
    else:
        for name in ("kmin", "kmax"):
            assert torch.equal(
                getattr(summ, name)[..., held, :].float(), getattr(ref_summ, name)[..., held, :].float()
            ), name
    if summ.bound_format == "int8" and page_bounds == "minmax":
        assert summ.kmin.dtype == torch.int8 and torch.equal(summ.bound_exp[:, :, held], ref_summ.bound_exp[:, :, held])
    elif summ.bound_format == "int8":
        assert (summ.bound_exp[:, :, held].int() - ref_summ.bound_exp[:, :, held].int()).abs().max() <= 1
    else:
        assert summ.bound_exp is None and "bound_exp" not in summ.layer(0)
    assert torch.equal(summ.count[:, held], ref_summ.count[:, held])
    assert torch.equal(summ.coarse_first, ref_summ.coarse_first)
    started = [p for r, pages in page_of.items() for p in pages[: math.ceil(reqs[r] / page)]]
    assert (summ.coarse_first[started] == -1).all() and (summ.coarse_first == 7).sum() == host_pages - len(started)
    if with_mean:
        torch.testing.assert_close(summ.mean[:, :, held], ref_summ.mean[:, :, held], rtol=1e-5, atol=1e-5)
    else:
        assert summ.mean is None and "mean" not in summ.layer(0)
    if with_radius:
        torch.testing.assert_close(summ.radius[:, :, held], ref_summ.radius[:, :, held], rtol=1e-4, atol=1e-4)
    assert torch.equal(cache.k.view(torch.uint8), ref_cache.k.view(torch.uint8))
    assert torch.equal(cache.v.view(torch.uint8), ref_cache.v.view(torch.uint8))


@pytest.mark.parametrize("lru", [(0, 1), (2, 3)], ids=["exact-lru", "bucketed-lru"])
@pytest.mark.parametrize("k_sel", [4, 3], ids=["k4", "k3-a-padded-lane"])
@pytest.mark.parametrize("elastic", [False, True])
def test_retrieve_pages_makes_the_reference_choices_and_writes_flashinfer_indices(elastic, k_sel, lru):
    """Random selections over many steps, each row shuffled (some rows partly padded, pages past a
    request's end ignored): the kernel's hits, victims, table updates and copies equal the
    reference's given the rows in ascending page order, and each row's FlashInfer indices are its
    slots in ascending page order (the newest page last). Elastic: the rows are
    5 of 6 columns wide (the second request's opening narrowed the first), the last one -1.
    Bucketed LRU: 2 buckets of 3 steps, so most of a row's slots tie and position decides."""
    rng = random.Random(11)
    layers, heads, width, page, dim = 2, 3, 6, 8, 16
    if elastic:
        ref = make_cache(layers * heads * (width + 4), layers, heads, page, dim, width=width, max_pages=16, min_width=k_sel,
                         lru=lru)  # fmt: skip
    else:
        ref = make_cache(2 * layers * heads * width + 5, layers, heads, page, dim, width=width, max_pages=16, lru=lru)
    host_pages = torch.tensor(
        [[3 + i for i in range(16)], [30 + i for i in range(16)]], device=DEVICE, dtype=torch.int32
    )
    req_slots = torch.tensor([2, 1], device=DEVICE)
    for r in req_slots.tolist():
        ref.open_request(r, 16)
    ref.write_allocate(2, 0, 3)  # some pages cached from the prefill
    assert [ref.width(r) for r in (2, 1)] == ([5, 5] if elastic else [6, 6])
    cache = copy.deepcopy(ref)
    for step in range(30):
        ref.next_step()
        cache.next_step()
        num_pages = torch.tensor([rng.randrange(k_sel, 17), rng.randrange(1, 17)], device=DEVICE)
        selected = num_pages.clamp(max=k_sel)
        indptr = torch.zeros(2 * heads + 1, dtype=torch.int32, device=DEVICE)
        indptr[1:] = torch.cumsum(selected.repeat_interleave(heads), 0)
        for layer in range(layers):
            page_ids = torch.full((2, heads, k_sel), -1, dtype=torch.int64)
            for b, n in enumerate(num_pages.tolist()):
                for h in range(heads):
                    chosen = rng.sample(range(n - 1), min(n, k_sel) - 1) + [n - 1]  # the newest page always
                    rng.shuffle(chosen)
                    page_ids[b, h, : len(chosen)] = torch.tensor(chosen)
                    if len(chosen) < k_sel and rng.random() < 0.5:
                        page_ids[b, h, len(chosen)] = n + rng.randrange(3)  # past the end: ignored
            page_ids = page_ids.to(DEVICE)
            # The kernel takes each row in ascending page order: the reference gets the rows sorted.
            ascending = page_ids.sort(dim=-1).values
            ref_ids = torch.where(ascending < num_pages.view(-1, 1, 1), ascending, -1)
            loads = []
            slots = retrieve_reference(ref, layer, req_slots, ref_ids, host_pages, loads_into(loads), 50)
            indices = torch.full((int(indptr[-1]),), -7, dtype=torch.int32, device=DEVICE)
            miss_src = torch.empty(2 * heads * k_sel, dtype=torch.int64, device=DEVICE)
            miss_dst = torch.empty_like(miss_src)
            retrieve_pages(
                cache.view, layer, req_slots, page_ids, num_pages, host_pages, 50, indptr, indices, miss_src, miss_dst
            )
            src, dst = loads[0]
            assert torch.equal(miss_dst, dst.view(-1)), (step, layer)
            assert torch.equal(miss_src[dst.view(-1) >= 0], src.view(-1)[dst.view(-1) >= 0])
            for name in ("slot_page", "last_used"):  # the reference's scratch entry (last) aside
                assert torch.equal(getattr(cache, name)[:-1], getattr(ref, name)[:-1]), name
            assert torch.equal(cache.page_table.segments, ref.page_table.segments)
            assert torch.equal(cache.counters, ref.counters)  # pages selected and loaded, for metrics
            for b in range(2):
                n = int(num_pages[b])
                for h in range(heads):
                    row = indices[indptr[b * heads + h] : indptr[b * heads + h + 1]].tolist()
                    valid = ref_ids[b, h] >= 0
                    assert row == slots[b, h][valid].tolist()  # ascending pages, so the newest last
                    assert row[-1] == int(slots[b, h][ref_ids[b, h] == n - 1])


def test_retrieve_pages_reads_a_selection_shared_by_every_head_as_its_own_rows():
    """The exact shortcut's selection is one row of pages per request expanded over its heads (no
    copy): the kernel reads it as the same selection written out head by head."""
    heads, width = 3, 4
    runs = {}
    for kind in ("expanded", "contiguous"):
        cache = make_cache(64, layers=1, heads=heads, width=width, max_pages=16)
        for r in (1, 2):
            cache.open_request(r, 16)
        cache.next_step()
        req_slots, num_pages = torch.tensor([1, 2], device=DEVICE), torch.tensor([4, 3], device=DEVICE)
        rows = torch.tensor([[[0, 1, 2, 3]], [[0, 1, 2, -1]]], device=DEVICE).expand(2, heads, width)
        page_ids = rows if kind == "expanded" else rows.contiguous()
        indptr = torch.tensor([0, 4, 8, 12, 15, 18, 21], dtype=torch.int32, device=DEVICE)
        indices = torch.full((21,), -7, dtype=torch.int32, device=DEVICE)
        miss_src = torch.empty(2 * heads * width, dtype=torch.int64, device=DEVICE)
        miss_dst = torch.empty_like(miss_src)
        host_pages = torch.arange(32, dtype=torch.int32, device=DEVICE).view(2, 16)
        retrieve_pages(
            cache.view, 0, req_slots, page_ids, num_pages, host_pages, 50, indptr, indices, miss_src, miss_dst
        )
        runs[kind] = (indices, miss_src, miss_dst, cache.page_table.segments.clone())
    for got, want in zip(runs["expanded"], runs["contiguous"]):
        assert torch.equal(got, want)
    assert (runs["contiguous"][0] >= 0).all()


def test_retrieve_pages_leaves_padding_rows_alone():
    """Request slot 0 (SGLang's CUDA-graph padding, no cache row) in a batch: nothing of the cache
    changes for it, nothing loads, and its indptr span gets slot 0 (a valid index to read)."""
    heads, width = 2, 4
    cache = make_cache(64, layers=1, heads=heads, width=width, max_pages=16)
    cache.open_request(3, 6)
    cache.next_step()
    before = {name: getattr(cache, name).clone() for name in ("slot_page", "last_used", "rows")}
    segments = cache.page_table.segments.clone()
    req_slots = torch.tensor([0, 3], device=DEVICE)
    num_pages = torch.tensor([1, 6], device=DEVICE)
    page_ids = torch.tensor([[[0, 5, 9, 9]] * heads, [[0, 5, 2, 3]] * heads], device=DEVICE)
    indptr = torch.tensor([0, 1, 2, 6, 10], dtype=torch.int32, device=DEVICE)
    indices = torch.full((10,), -7, dtype=torch.int32, device=DEVICE)
    host_pages = torch.arange(32, dtype=torch.int32, device=DEVICE).view(2, 16)
    miss_src = torch.empty(2 * heads * width, dtype=torch.int64, device=DEVICE)
    miss_dst = torch.empty_like(miss_src)
    retrieve_pages(cache.view, 0, req_slots, page_ids, num_pages, host_pages, 40, indptr, indices, miss_src, miss_dst)
    assert indices[:2].tolist() == [0, 0] and (indices[2:] >= 0).all()  # padding rows, then request 3's slots
    assert (miss_dst[: heads * width] == -1).all() and (
        miss_dst[heads * width :] >= 0
    ).sum() == 2 * 4  # 4 misses per head
    changed = cache.slot_page != before["slot_page"]
    assert set(changed.nonzero().view(-1).tolist()) <= set(cache.rows[3].reshape(-1).tolist())
    assert torch.equal(cache.rows, before["rows"])
    assert (cache.page_table.segments != segments).sum() == 2 * 4
