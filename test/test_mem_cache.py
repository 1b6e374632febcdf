"""CPU tests of the KV memory managers: host page allocator, page summaries, two-level page table
and GPU page cache, each against a plain-Python reference."""

from __future__ import annotations

import math
import random

import pytest
import torch

from sparse_sglang.attention import keep_cached, select_pages
from sparse_sglang.attention.reference import retrieve_reference
from sparse_sglang.mem_cache import (
    GPUCacheFull,
    GPUPageCache,
    HostKVPool,
    PageSummaries,
    SegmentPoolExhausted,
    TwoLevelPageTable,
    bound_dtype,
    pages_for_budget,
    slots_for_budget,
)
from sparse_sglang.mem_cache.reference import page_mean_abs_deviation
from sparse_sglang.transfer import gather_blocks_reference, scatter_tokens_reference

GIB = 1 << 30
FP8 = torch.float8_e4m3fn


def test_host_pool_sizes_and_bad_sizes():
    # One page id of 2 layers x 2 heads x 4 tokens x 16 dims, K and V: 512 elements.
    assert pages_for_budget(512 * 2 * 10 / GIB, 2, 2, 4, 16, torch.bfloat16) == 10
    assert pages_for_budget(512 * 2 * 10 / GIB, 2, 2, 4, 16, FP8) == 20  # fp8: one byte per element
    pool = HostKVPool.from_budget(512 * 2 * 7.5 / GIB, 2, 2, 4, 16, torch.bfloat16, pin=False)
    assert pool.k.shape == pool.v.shape == (2, 2, 7, 4, 16) and pool.num_pages == 7
    assert pool.nbytes == 7 * pool.page_bytes == pool.k.nbytes + pool.v.nbytes
    flat = torch.arange(pool.k[..., 0, 0].numel()).view(2, 2, 7)
    heads, pages = torch.tensor([[0], [1]]), torch.tensor([[3, 5]])
    assert torch.equal(pool.block_index(1, heads, pages), flat[1, heads, pages])
    fp8_pool = HostKVPool(1, 1, 2, 16, 16, FP8, pin=False)
    assert fp8_pool.k.dtype == FP8 and fp8_pool.page_bytes == 2 * 16 * 16
    for call, match in (
        (lambda: pages_for_budget(512 * 2 * 1.5 / GIB, 2, 2, 4, 16, torch.bfloat16), "need at least 2"),
        (lambda: pages_for_budget(0, 2, 2, 4, 16, torch.bfloat16), "must be positive"),
        (lambda: pages_for_budget(1, 2, 2, 3, 16, torch.bfloat16), "power of two"),
        (lambda: HostKVPool(2, 2, 0, 4, 16, torch.bfloat16, pin=False), "num_pages must be >= 2"),
        (lambda: HostKVPool(2, 2, 1, 4, 16, torch.bfloat16, pin=False), "page 0 is reserved"),
        (lambda: HostKVPool(0, 2, 4, 4, 16, torch.bfloat16, pin=False), "num_layers must be positive"),
        (lambda: HostKVPool(2, 2, 4, 4, 16, torch.float32, pin=False), "KV dtype"),
        (lambda: HostKVPool(2, 2, 4, 1, 4, torch.bfloat16, pin=False), "multiple of 16"),
    ):
        with pytest.raises(ValueError, match=match):
            call()


# Page summaries.


class BruteSummaries:
    """Every key written so far, densely; summaries by a loop over pages."""

    def __init__(self, layers, heads, pages, page_size, dim):
        self.keys = torch.zeros(layers, pages, page_size, heads, dim)
        self.written = torch.zeros(layers, pages, page_size, dtype=torch.bool)
        self.page_size = page_size

    def write(self, layer, k, slots):
        for t, s in enumerate(slots.tolist()):
            if s >= 0:
                self.keys[layer, s // self.page_size, s % self.page_size] = k[t].float()
                self.written[layer, s // self.page_size, s % self.page_size] = True

    def check(self, summ: PageSummaries, layer):
        for page in range(self.keys.shape[1]):
            rows = self.keys[layer, page][self.written[layer, page]]  # [n, H, D]
            assert summ.count[layer, page] == rows.shape[0]
            if rows.shape[0] == 0:
                lo, hi = summ.empty_bounds
                assert (summ.kmin[layer, :, page].float() == lo).all() and (
                    summ.kmax[layer, :, page].float() == hi
                ).all()
                assert (summ.mean[layer, :, page] == 0).all()
                continue
            assert torch.equal(summ.kmin[layer, :, page].float(), rows.amin(0))  # exact
            assert torch.equal(summ.kmax[layer, :, page].float(), rows.amax(0))
            torch.testing.assert_close(summ.mean[layer, :, page], rows.mean(0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, FP8])
def test_summaries_match_brute_force_over_multi_call_out_of_order_fills(dtype):
    gen = torch.Generator().manual_seed(3)
    layers, heads, pages, page_size, dim = 2, 3, 7, 4, 8
    summ = PageSummaries(layers, heads, pages, page_size, dim, dtype)
    assert summ.kmin.dtype == bound_dtype(dtype) and summ.mean.dtype == torch.float32
    ref = BruteSummaries(layers, heads, pages, page_size, dim)
    for layer in range(layers):
        # Pages 1-5: 1-4 full, 5 partial (3 of 4 tokens), page 6 untouched; tokens shuffled and
        # split over several calls, so pages fill across calls and out of order.
        slots = torch.cat([torch.arange(page_size, 5 * page_size), torch.arange(5 * page_size, 5 * page_size + 3)])
        slots = slots[torch.randperm(slots.numel(), generator=gen)]
        # A page's offset-0 token starts it (and clears a previous owner's summaries), so it comes
        # first, as SGLang writes a page's tokens in position order; the others arrive in any order.
        slots = torch.cat([slots[slots % page_size == 0], slots[slots % page_size != 0]])
        for chunk in torch.split(slots, [1, 5, 2, 6, 5]):
            chunk = torch.cat([chunk, torch.tensor([-1])])  # a padding row, holding NaNs
            k = (torch.randn(chunk.numel(), heads, dim, generator=gen) * 3).to(dtype)
            k[-1] = float("nan")
            summ.update(layer, k, chunk.to(torch.int32))
            ref.write(layer, k, chunk)
            ref.check(summ, layer)
        assert summ.count[layer].tolist() == [0, 4, 4, 4, 4, 3, 0]
    ref.check(summ, 0)  # layer 1's updates left layer 0 alone
    # Decode: the partial page fills its last token, and a new page starts.
    for layer in range(layers):
        slots = torch.tensor([5 * page_size + 3, 6 * page_size])
        k = torch.randn(2, heads, dim, generator=gen).to(dtype)
        summ.update(layer, k, slots)
        ref.write(layer, k, slots)
        ref.check(summ, layer)
    center, half = summ.center(1), summ.half_extent(1)
    assert center.dtype == half.dtype == torch.float32 and center.shape == (heads, pages, dim)
    assert torch.equal((center + half)[:, 1:], summ.kmax[1, :, 1:].float())
    assert torch.equal((center - half)[:, 1:], summ.kmin[1, :, 1:].float())
    # Freed pages start over.
    summ.reset(torch.tensor([2, 5]))
    ref.written[:, [2, 5]] = False
    for layer in range(layers):
        ref.check(summ, layer)
    k = torch.randn(2, heads, dim, generator=gen).to(dtype)
    summ.update(0, k, torch.tensor([2 * page_size + 1, 2 * page_size]))
    ref.write(0, k, torch.tensor([2 * page_size + 1, 2 * page_size]))
    ref.check(summ, 0)


def test_summaries_of_a_reused_page_start_over_at_its_offset_0_token():
    summ = PageSummaries(1, 1, 3, 4, 2, torch.bfloat16)
    summ.update(0, torch.full((4, 1, 2), 9.0).to(torch.bfloat16), torch.arange(4, 8))  # page 1, old owner
    k = torch.tensor([[[1.0, -1.0]], [[3.0, 1.0]]]).to(torch.bfloat16)
    summ.update(0, k, torch.tensor([5, 4]))  # new owner: offsets 1 and 0 (page freed without reset)
    assert (
        summ.count[0, 1] == 2
        and summ.kmax[0, 0, 1].tolist() == [3.0, 1.0]
        and summ.kmin[0, 0, 1].tolist() == [1.0, -1.0]
    )
    assert summ.mean[0, 0, 1].tolist() == [2.0, 0.0]


def test_arkvale_radius_of_a_page_filled_in_one_call_is_the_mean_abs_deviation():
    gen = torch.Generator().manual_seed(5)
    heads, pages, page_size, dim = 2, 4, 8, 16
    summ = PageSummaries(1, heads, pages, page_size, dim, torch.float16, with_radius=True)
    k = torch.randn(2 * page_size + 3, heads, dim, generator=gen).to(torch.float16)  # pages 1, 2 full, 3 partial
    summ.update(0, k, torch.arange(page_size, 3 * page_size + 3))
    keys = torch.cat([torch.zeros(page_size, heads, dim), k.float()]).transpose(0, 1)  # [H, T, D] from page 0
    expect = page_mean_abs_deviation(keys, summ.kmin[0], summ.kmax[0], page_size)
    torch.testing.assert_close(summ.radius[0, :, 1:], expect[:, 1:], rtol=1e-5, atol=1e-5)
    assert summ.layer(0)["radius"].shape == (heads, pages + 1, dim)


def test_fp8_summaries_are_of_dequantized_keys():
    k = torch.tensor([[[448.0, -0.001953125]], [[-3.5, 0.0625]]]).to(FP8)  # fp8 extremes, one head, dim 2
    summ = PageSummaries(1, 1, 2, 2, 2, FP8)
    summ.update(0, k, torch.tensor([2, 3]))
    assert summ.kmax[0, 0, 1].tolist() == [448.0, 0.0625] and summ.kmin[0, 0, 1].tolist() == [-3.5, -0.001953125]
    assert summ.mean[0, 0, 1].tolist() == [222.25, (0.0625 - 0.001953125) / 2]


def test_fp8_bounds_are_stored_as_fp8_and_equal_bf16_bounds_of_the_same_keys():
    """fp8 keys' min and max are fp8 values: stored in fp8 (half of bf16's bytes) they equal the
    bounds a bf16 store of the same (dequantized) keys keeps, through multi-call fills, padding,
    a reset and a refill. e4m3 has no infinity, so an empty page's bounds are +-448."""
    gen = torch.Generator().manual_seed(8)
    layers, heads, pages, page_size, dim = 2, 2, 6, 4, 8
    fp8 = PageSummaries(layers, heads, pages, page_size, dim, FP8, with_radius=True)
    bf16 = PageSummaries(layers, heads, pages, page_size, dim, torch.bfloat16, with_radius=True)
    assert fp8.kmin.dtype == fp8.kmax.dtype == FP8 and fp8.empty_bounds == (448.0, -448.0)
    assert fp8.kmin.element_size() * 2 == bf16.kmin.element_size()

    def update_both(layer, slots):
        k = (torch.randn(len(slots), heads, dim, generator=gen) * 50).to(FP8)
        for summ in (fp8, bf16):
            summ.update(layer, k.to(summ.kmin.dtype), torch.tensor(slots))

    def assert_equal():  # on the pages holding keys (empty ones differ: +-448 against +-inf)
        held = bf16.count > 0
        assert torch.equal(fp8.count, bf16.count)
        for name in ("kmin", "kmax", "mean", "radius"):
            got, want = (getattr(summ, name).float().transpose(1, 2)[held] for summ in (fp8, bf16))
            assert torch.equal(got, want), name

    for layer in range(layers):
        update_both(layer, [4, 9, 8, 5, -1, 12, 6])  # pages 1-3 partly, in any order, a padding row
        update_both(layer, [7, 10, 13, 20, 21])  # pages 1-3 fill further, page 5 starts
    assert_equal()
    assert (fp8.kmin[:, :, [0, 4]].float() == 448).all() and (fp8.kmax[:, :, [0, 4]].float() == -448).all()
    fp8.reset(torch.tensor([1, 5]))
    bf16.reset(torch.tensor([1, 5]))
    assert (fp8.kmin[:, :, 1].float() == 448).all() and (fp8.kmax[:, :, 5].float() == -448).all()
    assert (fp8.count[:, [1, 5]] == 0).all()
    update_both(0, [5, 4, 6])  # page 1 refilled
    assert_equal()


# Two-level page table.


def test_page_table_random_operations_match_dict_and_memory_tracks_mapped_pages():
    rng = random.Random(4)
    reqs, layers, heads, max_pages, seg = 3, 2, 2, 21, 4
    pool = TwoLevelPageTable.segments_needed(layers, heads, 30, reqs, seg)
    table = TwoLevelPageTable(reqs, layers, heads, max_pages, pool, seg, debug=True)
    ref: dict[tuple[int, int, int, int], int] = {}
    sizes = [0] * reqs
    everything = torch.cartesian_prod(*(torch.arange(n) for n in (reqs, layers, heads, max_pages)))

    for _ in range(300):
        op = rng.choice(["resize", "assign", "assign", "invalidate"])
        r = rng.randrange(reqs)
        if op == "resize":
            n = rng.randrange(max_pages + 1)
            if sum(sizes) - sizes[r] + n > 30:
                n = 0
            table.resize(r, n)
            sizes[r] = n
            ref = {key: s for key, s in ref.items() if key[0] != r or key[3] < n}
        elif sizes[r]:
            keys = {(r, rng.randrange(layers), rng.randrange(heads), rng.randrange(sizes[r])) for _ in range(5)}
            coords = torch.tensor(sorted(keys)).unbind(1)
            if op == "assign":
                slots = torch.randint(0, 1000, (len(keys),))
                table.assign(*coords, slots)
                ref.update(zip(sorted(keys), slots.tolist()))
            else:
                table.invalidate(*coords)
                for key in keys:
                    ref.pop(key, None)
        got = table.lookup(*everything.unbind(1))
        want = torch.tensor([ref.get(tuple(key), -1) for key in everything.tolist()], dtype=torch.int32)
        assert torch.equal(got, want)
        segs = layers * heads * sum(math.ceil(n / seg) for n in sizes)
        report = table.memory_report()
        assert table.segments_in_use == segs and report["segments_in_use"] == segs * seg * 4
        assert report["used"] == report["directory"] + report["segments_in_use"]
    # Padding reads -1; a broadcast lookup has the broadcast shape.
    table.resize(0, 5)
    table.assign(0, 1, torch.tensor([0, 1]), 4, torch.tensor([7, 8]))
    assert table.lookup(torch.tensor([-1, 0]), 1, torch.tensor([[0], [1]]), 4).tolist() == [[-1, 7], [-1, 8]]
    assert table.lookup(0, 1, 1, torch.tensor([-1, 4])).tolist() == [-1, 8]


def test_page_table_grows_by_segment_shrinks_and_reports_memory():
    reqs, layers, heads, max_pages, seg = 4, 3, 2, 4096, 64
    table = TwoLevelPageTable(reqs, layers, heads, max_pages, 2 * layers * heads * 3, seg, debug=True)
    assert table.directory.shape == (reqs, layers, heads, max_pages // seg)
    table.resize(1, 1)
    assert table.segments_in_use == layers * heads  # one segment per (layer, head)
    table.resize(1, seg)
    assert table.segments_in_use == layers * heads  # still inside the first segment
    table.resize(1, seg + 1)  # crosses the boundary
    assert table.segments_in_use == 2 * layers * heads
    table.assign(1, 2, 1, torch.tensor([3, seg]), torch.tensor([10, 11]))
    with pytest.raises(IndexError, match="beyond its request's size"):
        table.assign(1, 0, 0, 3 * seg, 5)
    table.resize(1, 3)  # shrink inside the first segment: entries >= 3 are dropped
    assert table.segments_in_use == layers * heads
    table.resize(1, seg + 1)
    assert table.lookup(1, 2, 1, torch.tensor([3, seg])).tolist() == [-1, -1]
    with pytest.raises(SegmentPoolExhausted, match="needs 30 segments to grow to 320 pages, 24 free of 36"):
        table.resize(2, 5 * seg)
    assert table.segments_in_use == 2 * layers * heads  # the failed resize took nothing
    with pytest.raises(ValueError, match="num_pages must be in"):
        table.resize(2, max_pages + 1)
    report = table.memory_report(dense_requests=reqs, dense_pages=max_pages)
    assert report["dense"] == reqs * max_pages * layers * heads * 4
    assert report["used"] == table.directory.numel() * 4 + 2 * layers * heads * seg * 4
    assert report["used"] * 40 < report["dense"]  # 65 mapped pages of a 4 x 4096 worst case
    table.release(1)
    assert table.segments_in_use == 0 and (table.segments[: table.num_segments] == -1).all()
    # Without debug an assign past the size is dropped, never seen by lookups.
    loose = TwoLevelPageTable(1, 1, 1, 8, 2, 4)
    loose.assign(0, 0, 0, 5, 9)
    loose.resize(0, 8)
    assert loose.lookup(0, 0, 0, torch.arange(8)).tolist() == [-1] * 8


# GPU page cache.


def make_cache(slots, reqs=3, layers=2, heads=2, max_pages=16, page_size=4, dim=16, dtype=torch.bfloat16, width=4):
    return GPUPageCache(slots, layers, heads, page_size, dim, dtype, max_requests=reqs, row_width=width,
                        max_pages=max_pages, total_pages=2 * max_pages)  # fmt: skip


def test_gpu_cache_rows_open_close_and_refuse_when_full():
    cache = make_cache(2 * 2 * 4 * 2 + 3)  # room for two rows of 16 slots
    assert cache.row_slots == 16 and cache.max_open_requests == 2
    cache.open_request(1, 5)
    cache.open_request(2)
    with pytest.raises(GPUCacheFull, match="needs 16 slots, 3 of 35 are free"):
        cache.open_request(0)
    with pytest.raises(ValueError, match="already has a row"):
        cache.open_request(1)
    rows = cache.rows[[1, 2]]
    assert len(set(rows.view(-1).tolist())) == 32 and (cache.rows[0] == -1).all()
    assert cache.write_allocate(1, 0, 6) == 4  # the row holds 4 pages per layer and head
    assert cache.write_allocate(1, 4, 1) == 0
    assert torch.equal(
        cache.page_table.lookup(1, 1, 1, torch.arange(5)), torch.cat([rows[0, 1, 1], torch.tensor([-1])]).int()
    )
    cache.close_request(1)
    assert cache.num_free == 19 and (cache.rows[1] == -1).all() and (cache.slot_page == -1).all()
    assert cache.page_table.segments_in_use == 0  # request 2 holds no pages yet
    cache.open_request(0, 3)
    assert cache.page_table.lookup(0, 0, 0, torch.arange(3)).tolist() == [-1, -1, -1]


def test_write_allocate_unmaps_a_page_a_decode_step_loaded_into_its_column():
    """A radix hit: the prefill writes only the new pages (columns 0-1); decode steps load cached-
    prefix pages into the empty columns; a new page then write-allocated into such a column must
    unmap the page it replaces, or that page would read the new page's KV."""
    cache = make_cache(2 * 2 * 6, width=6)
    cache.open_request(1, 12)
    assert cache.write_allocate(1, 8, 2) == 2  # prefix pages 0-7 stay on the host
    cache.next_step()
    for layer in range(2):
        retrieve_reference(cache, layer, torch.tensor([1]), torch.tensor([[[0, 1, 2]] * 2]), torch.arange(12).view(1, -1),
                       lambda src, dst: None, 12)  # fmt: skip
    assert cache.write_allocate(1, 10, 1) == 1  # column 2, which a step filled with page 0
    for layer in range(2):
        for head in range(2):
            slots = cache.page_table.lookup(1, layer, head, torch.arange(12))
            mapped = slots >= 0
            assert cache.slot_page[slots[mapped].long()].tolist() == torch.arange(12)[mapped].tolist()
            assert int(slots[0]) == -1 and int(slots[10]) >= 0


@pytest.mark.parametrize("elastic", [False, True])
def test_gpu_cache_random_operations_keep_table_rows_and_blocks_consistent(elastic):
    """Random opens (with and without radix-cached prefixes: pages the prefill did not write),
    new pages, decode steps loading misses, and closes, with fixed and with elastic rows. After
    every operation: each cached page's
    slot is in its request's row, holds that page and its host block; each row slot holding a page
    is where the table finds it; open rows and free slots partition the pool."""
    rng = random.Random(3)
    gen = torch.Generator().manual_seed(3)
    layers, heads, page_size, dim, width, max_pages = 2, 2, 4, 8, 4, 12
    if elastic:  # rows of 3 to 6 columns: opens shrink the widest rows, closes grow the narrowest
        cache = GPUPageCache(layers * heads * 3 * 4, layers, heads, page_size, dim, torch.bfloat16, max_requests=5,
                             row_width=6, max_pages=max_pages, total_pages=2 * max_pages, min_row_width=3)  # fmt: skip
    else:
        cache = make_cache(layers * heads * width * 3, reqs=5, layers=layers, heads=heads, max_pages=max_pages,
                           page_size=page_size, dim=dim, width=width)  # fmt: skip
    host = host_with_pages(layers, heads, 5 * max_pages + 1, page_size, dim, torch.bfloat16, gen)
    host_page = lambda r, p: r * max_pages + p + 1  # noqa: E731
    num_pages: dict[int, int] = {}

    def write(r, first, n):  # what the save path does for write-allocated pages
        for layer in range(layers):
            for head in range(heads):
                for p in range(first, first + n):
                    slot = int(cache.page_table.lookup(r, layer, head, p))
                    if slot >= 0:
                        cache.k[slot] = host.k[layer, head, host_page(r, p)]

    def check():
        rows = {r: cache.rows[r] for r in num_pages}
        held = torch.cat([row.reshape(-1) for row in rows.values()]) if rows else torch.empty(0, dtype=torch.int64)
        held = held[held >= 0]
        assert len(set(held.tolist())) == held.numel() and held.numel() + cache.num_free == cache.num_slots
        for r, n in num_pages.items():
            for layer in range(layers):
                for head in range(heads):
                    row = set(rows[r][layer, head].tolist()) - {-1}
                    slots = cache.page_table.lookup(r, layer, head, torch.arange(n))
                    for p, slot in enumerate(slots.tolist()):
                        if slot >= 0:
                            assert slot in row and int(cache.slot_page[slot]) == p, (r, layer, head, p)
                            assert torch.equal(
                                cache.k[slot].view(torch.uint8), host.k[layer, head, host_page(r, p)].view(torch.uint8)
                            )
                    for slot in row:
                        p = int(cache.slot_page[slot])
                        if p >= 0:
                            assert int(cache.page_table.lookup(r, layer, head, p)) == slot

    for _ in range(250):
        op = rng.choice(["open", "open", "page", "step", "step", "step", "close"])
        closed = [r for r in range(1, 5) if r not in num_pages]
        if op == "open" and closed:
            r, n = rng.choice(closed), rng.randrange(1, max_pages - 2)
            try:
                cache.open_request(r, n)
            except GPUCacheFull:
                continue
            num_pages[r] = n
            first = rng.choice([0, 0, rng.randrange(n)])  # a radix hit: pages [0, first) come from the host only
            write(r, first, cache.write_allocate(r, first, n - first))
        elif op == "page" and num_pages:
            r = rng.choice(sorted(num_pages))
            if num_pages[r] < max_pages:
                num_pages[r] += 1
                cache.resize_request(r, num_pages[r])
                write(r, num_pages[r] - 1, cache.write_allocate(r, num_pages[r] - 1, 1))
        elif op == "step" and num_pages:
            reqs = sorted(num_pages)
            cache.next_step()
            host_pages = torch.tensor([[host_page(r, p) for p in range(max_pages)] for r in reqs])
            for layer in range(layers):
                ids = torch.full((len(reqs), heads, 3), -1)
                for b, r in enumerate(reqs):
                    for h in range(heads):
                        chosen = rng.sample(range(num_pages[r]), min(3, num_pages[r]))
                        ids[b, h, : len(chosen)] = torch.tensor(chosen)
                load = lambda src, dst: gather_blocks_reference(host.k, host.v, cache.k, cache.v, src, dst)  # noqa: E731
                retrieve_reference(cache, layer, torch.tensor(reqs), ids, host_pages, load, host.num_pages)
        elif op == "close" and num_pages:
            r = rng.choice(sorted(num_pages))
            cache.close_request(r)
            del num_pages[r]
        check()


def test_elastic_rows_grow_into_free_slots_and_give_back_their_least_recently_used_ones():
    lh = 2 * 2  # layers x kv heads
    cache = GPUPageCache(lh * 12, 2, 2, 4, 16, torch.bfloat16, max_requests=8, row_width=6, max_pages=12,
                         total_pages=48, min_row_width=2)  # fmt: skip
    assert cache.max_open_requests == 6
    no_load = lambda src, dst: None  # noqa: E731 (the test follows the mapping, not the data)
    cache.open_request(1, 12)
    assert cache.width(1) == 6 and cache.num_free == lh * 6  # alone: as wide as a row may be
    for page in range(6):  # fill request 1's rows: page p last used at step p + 1
        cache.next_step()
        for layer in range(2):
            retrieve_reference(
                cache, layer, torch.tensor([1]), torch.full((1, 2, 1), page), torch.arange(12).view(1, -1), no_load, 12
            )
    cache.open_request(2, 12)
    assert (cache.width(1), cache.width(2), cache.num_free) == (6, 6, 0)
    cache.open_request(3, 12)  # a third of the pool each: requests 1 and 2 give back 2 columns
    assert [cache.width(r) for r in (1, 2, 3)] == [4, 4, 4] and cache.num_free == 0
    for layer in range(2):
        for head in range(2):
            slots = cache.page_table.lookup(1, layer, head, torch.arange(6))
            assert slots[:2].tolist() == [-1, -1]  # pages 0 and 1 were the least recently used
            assert set(slots[2:].tolist()) == set(cache.rows[1, layer, head, :4].tolist())
            assert sorted(cache.slot_page[cache.rows[1, layer, head, :4]].tolist()) == [2, 3, 4, 5]
    open_rows = cache.rows[[1, 2, 3]]
    assert (open_rows[..., 4:] == -1).all() and len(set(open_rows[..., :4].reshape(-1).tolist())) == 3 * lh * 4
    assert cache.write_allocate(1, 6, 1) == 0  # a narrowed row is no longer filled in page order
    for r in (4, 5, 6):
        cache.open_request(r)
    assert all(cache.width(r) == 2 for r in range(1, 7)) and cache.num_free == 0
    with pytest.raises(GPUCacheFull):
        cache.open_request(7)
    assert cache.num_open == 6 and cache.num_free == 0  # the refusal changed nothing
    for r in (3, 4, 5, 6):
        cache.close_request(r)
    assert (cache.width(1), cache.width(2)) == (6, 6) and cache.num_free == 0  # half the pool each, at most 6
    # Misses go to the grown (empty) columns first; the pages request 1 kept stay cached.
    cache.next_step()
    kept = cache.page_table.lookup(1, 0, 0, torch.arange(12))
    slots = retrieve_reference(
        cache, 0, torch.tensor([1]), torch.tensor([[[10], [10]]]), torch.arange(12).view(1, -1), no_load, 12
    )
    assert int(slots[0, 0, 0]) in cache.rows[1, 0, 0, 2:].tolist()  # it had shrunk to 2 columns
    assert kept[4] >= 0 and kept[5] >= 0  # its two most recently used pages
    assert torch.equal(cache.page_table.lookup(1, 0, 0, torch.arange(10)), kept[:10])


@pytest.mark.parametrize("lru_buckets", [0, 4])
def test_rows_narrowed_in_one_pass_are_those_narrowed_one_at_a_time(lru_buckets):
    """A new request narrows several rows at once: the same slots stay, the same pages go back to
    the host only, and the same slots return to the free stack in the same order as when each row
    is cut by its own sort (:func:`shrink_rows_reference`), with ties in last use and rows of
    different widths."""
    import copy

    from sparse_sglang.mem_cache.reference import shrink_rows_reference

    rng = random.Random(5)
    layers, heads, max_pages = 2, 3, 16
    cache = GPUPageCache(layers * heads * 40, layers, heads, 4, 8, torch.bfloat16, max_requests=8, row_width=10,
                         max_pages=max_pages, total_pages=6 * max_pages, min_row_width=2, lru_buckets=lru_buckets,
                         lru_steps_per_bucket=2)  # fmt: skip
    no_load = lambda src, dst: None  # noqa: E731 (the test follows the mapping, not the data)
    for r in (1, 2, 3, 4):
        cache.open_request(r, max_pages)
        cache.write_allocate(r, 0, rng.randrange(1, 5))
    for _ in range(12):  # decode steps: pages used at different steps, some at the same one
        cache.next_step()
        for layer in range(layers):
            ids = torch.tensor([[rng.sample(range(max_pages), 2) for _ in range(heads)] for _ in range(4)])
            host_pages = torch.arange(max_pages).repeat(4, 1)
            retrieve_reference(cache, layer, torch.tensor([1, 2, 3, 4]), ids, host_pages, no_load, max_pages)
    widths = {r: cache.width(r) for r in (1, 2, 3, 4)}
    assert len(set(widths.values())) == 1 and widths[1] >= 8
    narrowed = {3: 2, 1: widths[1] - 3, 4: widths[4] - 1}
    one_by_one = copy.deepcopy(cache)
    cached_before = int((cache.slot_page >= 0).sum())
    shrink_rows_reference(one_by_one, narrowed)
    cache._shrink_rows(narrowed)
    assert int((cache.slot_page >= 0).sum()) < cached_before  # cached pages went back to the host only
    for name in ("rows", "slot_page", "last_used"):
        assert torch.equal(getattr(cache, name), getattr(one_by_one, name)), name
    assert torch.equal(cache.page_table.segments, one_by_one.page_table.segments)
    assert len(cache._free) == len(one_by_one._free) == layers * heads * (3 + (widths[3] - 2) + 1 + 40 - 4 * widths[1])
    assert torch.equal(cache._free.pop(len(cache._free)), one_by_one._free.pop(len(one_by_one._free)))
    assert cache._width == one_by_one._width and cache._filled == one_by_one._filled


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_row_bookkeeping_never_waits_for_the_device():
    """What runs on the host between steps, while the step before is still on the GPU: opening
    rows (which narrows others), growing and shrinking page tables, write-allocating, closing rows
    (which widens others), the reselection stamps, the working-set tracker, an extend batch's save
    runs. None of them synchronizes."""
    from sparse_sglang.attention.scoring import candidate_pages
    from sparse_sglang.mem_cache.kernels import SaveRuns
    from sparse_sglang.scheduler import WorkingSetTracker

    cuda = torch.device("cuda")
    cache = GPUPageCache(2 * 2 * 12, 2, 2, 4, 16, torch.bfloat16, max_requests=8, row_width=6, max_pages=12,
                         total_pages=48, min_row_width=2, device=cuda)  # fmt: skip
    table = TwoLevelPageTable(2, 2, 2, 12, 16, 4, cuda)
    tracker = WorkingSetTracker(8, 2, 2, 3, window=2, device=cuda)
    # inputs built before debug mode: a tensor made from a Python list is copied from pageable memory
    slots = torch.tensor([1, 3, -1], device=cuda)
    reqs, pages, values, two, eight = (torch.arange(1, 7, device=cuda), torch.tensor([5, 7], device=cuda),
                                       torch.tensor([50, 70], device=cuda), torch.arange(2, device=cuda),
                                       torch.arange(8, device=cuda))  # fmt: skip
    counts, steps = torch.full((3, 2, 2), 4, device=cuda), torch.full((3, 2, 2, 3), 5, device=cuda)
    rows, starts, ends = (
        torch.tensor([[[0, -1]]], device=cuda),
        torch.tensor([2], device=cuda),
        torch.tensor([10], device=cuda),
    )
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for r in range(1, 7):
            cache.open_request(r, 4)  # from the third on, the widest rows narrow
            cache.write_allocate(r, 0, 4)
            cache.resize_request(r, 12)
        due = cache.due_for_selection(reqs, torch.full((6,), 9), 4)  # host lengths
        for r in (2, 4, 6):
            cache.close_request(r)
        table.resize(1, 10)
        table.assign(1, 0, 0, pages, values)
        table.resize(1, 6)  # drops a segment and clears the kept last one past page 5
        table.resize(1, 8)
        table.invalidate(1, 1, 1, two)
        kept = table.lookup(1, 0, 0, eight)
        table.release(0)
        tracker.next_step()
        tracker.record(slots, 0, counts)
        tracker.record_step(slots, steps)
        tracker.publish([1, 3])
        tracker.forget(3)
        runs = SaveRuns.for_extend([1, 3], [0, 5], [6, 3], 4, cuda)
        chosen = candidate_pages(rows, starts, ends, 4, 12)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [cache.width(r) for r in (1, 3, 5)] == [4, 4, 4] and cache.num_free == 0
    assert due.all() and cache.selected_at[1:7].tolist() == [9] * 6
    assert kept.tolist() == [-1] * 5 + [50, -1, -1] and table.segments_in_use == 2 * 2 * 2
    assert tracker.sizes(torch.tensor([1, 3], device=cuda)).tolist() == [
        (2 + 1) * 2,
        0,
    ]  # layer 0: pages 4 and 5, layer 1: 5
    assert runs.token_positions.tolist() == [0, 1, 2, 3, 4, 5, 5, 6, 7] and runs.length.tolist() == [4, 2, 3]
    assert chosen.view(-1).tolist() == [True] * 4 + [False] * 4 + [True] * 2 + [False] * 2


def host_with_pages(layers, heads, pages, page_size, dim, dtype, gen):
    host = HostKVPool(layers, heads, pages, page_size, dim, dtype, pin=False)
    host.k.view(torch.uint8).copy_(
        torch.randint(0, 256, host.k.view(torch.uint8).shape, generator=gen, dtype=torch.uint8)
    )
    host.v.view(torch.uint8).copy_(
        torch.randint(0, 256, host.v.view(torch.uint8).shape, generator=gen, dtype=torch.uint8)
    )
    return host


@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8])
def test_gpu_cache_retrieve_loads_misses_into_lru_victims_like_a_per_row_lru(dtype):
    """Random selections over many steps: every returned slot holds the selected page's host
    block, and the loads are exactly the misses of a per-(request, layer, head) LRU model. The
    rows are padded to the selection width with -1."""
    gen = torch.Generator().manual_seed(7)
    rng = random.Random(7)
    layers, heads, page_size, dim, width, k_sel = 2, 2, 4, 16, 5, 3
    cache = make_cache(64, layers=layers, heads=heads, dtype=dtype, width=width)
    host = host_with_pages(layers, heads, 40, page_size, dim, dtype, gen)
    host_pages = torch.tensor([[3 + i for i in range(12)], [20 + i for i in range(12)]])  # [B, N]
    req_slots = torch.tensor([2, 0])
    for r in req_slots.tolist():
        cache.open_request(r, 12)
    loads = []

    def load(src, dst):
        loads.append(int((dst >= 0).sum()))
        gather_blocks_reference(host.k, host.v, cache.k, cache.v, src, dst)

    model = {(b, layer, h): [] for b in range(2) for layer in range(layers) for h in range(heads)}  # LRU lists
    selected = loaded = 0
    last_use = {}  # (request, layer, head, page) -> step
    for step in range(1, 41):  # the cache's step counter after next_step()
        cache.next_step()
        for layer in range(layers):
            page_ids = torch.full((2, heads, k_sel), -1)
            expected_misses = 0
            for b in range(2):
                for h in range(heads):
                    # One page per row and step keeps the LRU order total (no ties to break).
                    chosen = [rng.randrange(12)]
                    page_ids[b, h, : len(chosen)] = torch.tensor(chosen)
                    lru = model[b, layer, h]
                    missing = [p for p in chosen if p not in lru]
                    expected_misses += len(missing)
                    hits = [p for p in lru if p in chosen]
                    kept = [p for p in lru if p not in chosen][
                        len(missing) - (width - len(lru)) if len(lru) + len(missing) > width else 0 :
                    ]
                    model[b, layer, h] = kept + hits + missing
            slots = retrieve_reference(cache, layer, req_slots, page_ids, host_pages, load, host.num_pages)
            for b, h, j in (page_ids >= 0).nonzero().tolist():
                last_use[b, layer, h, int(page_ids[b, h, j])] = step
            assert loads.pop() == expected_misses
            selected, loaded = selected + int((page_ids >= 0).sum()), loaded + expected_misses
            stats = cache.stats(window=3)  # the metrics' counters
            assert (stats["pages_selected"], stats["pages_loaded"]) == (selected, loaded)
            # The last 3 steps' pages (at most 3 per row of 5) are all still cached, one slot each.
            assert stats["working_set_pages"] == sum(1 for used in last_use.values() if used > step - 3)
            assert stats["hit_ratio"] == pytest.approx(1 - loaded / selected)
            assert torch.equal(slots < 0, page_ids < 0)
            for b, h, j in (page_ids >= 0).nonzero().tolist():
                page = host_pages[b, page_ids[b, h, j]]
                assert torch.equal(cache.k[slots[b, h, j]].view(torch.uint8), host.k[layer, h, page].view(torch.uint8))
                assert torch.equal(cache.v[slots[b, h, j]].view(torch.uint8), host.v[layer, h, page].view(torch.uint8))
                assert slots[b, h, j] in cache.rows[req_slots[b], layer, h]


def test_reselect_interval_reuses_cached_pages_between_full_selections():
    """--sparse-reselect-interval 3 over a growing context (the decoder's reference path, on the
    real cache): a request selects from all its pages on its first step and every third token
    after; in between it selects among the pages its row holds, so the only loads are forced pages
    the row lacks. ``cached_pages`` agrees with the page table throughout; reopening a row starts
    with a full selection."""
    gen = torch.Generator().manual_seed(11)
    layers, heads, page_size, width, budget, sink, recent, interval = 1, 2, 4, 7, 5, 1, 1, 3
    cache = make_cache(64, layers=layers, heads=heads, max_pages=32, width=width)
    host = host_with_pages(layers, heads, 40, page_size, 16, torch.bfloat16, gen)
    req, host_pages = torch.tensor([1]), torch.arange(1, 33).view(1, -1)
    cache.open_request(1, 32)
    cache.write_allocate(1, 0, 10)  # prefill: the row holds the first pages, as in the server
    loads = []
    for step in range(24):
        seq_len = 40 + step
        num_pages = torch.tensor([-(-seq_len // page_size)])
        cache.next_step()
        due = cache.due_for_selection(req, torch.tensor([seq_len]), interval)
        assert due.tolist() == [step % interval == 0]
        held = cache.cached_pages(0, req, 32)
        want_held = cache.page_table.lookup(1, 0, torch.arange(heads).view(-1, 1), torch.arange(32).view(1, -1)) >= 0
        assert torch.equal(held[0], want_held)
        scores = torch.randn(1, heads, 32, generator=gen)
        sel = select_pages(keep_cached(scores, held, due), num_pages, budget, sink, recent).page_ids
        retrieve_reference(
            cache, 0, req, sel, host_pages, lambda src, dst: loads.append(int((dst >= 0).sum())), host.num_pages
        )
        if due.item():
            assert torch.equal(sel, select_pages(scores, num_pages, budget, sink, recent).page_ids)
            continue
        n = int(num_pages)
        forced = {*range(sink), *range(n - recent, n)}
        for h in range(heads):
            picked = {int(p) for p in sel[0, h]}
            assert picked <= {int(p) for p in held[0, h].nonzero()} | forced
        assert loads[-1] == sum(int(not held[0, h, p]) for h in range(heads) for p in forced)
    assert sum(loads[1::interval]) + sum(loads[2::interval]) < sum(loads[::interval])  # reuse steps load less
    cache.close_request(1)
    cache.open_request(1, 32)
    assert cache.due_for_selection(req, torch.tensor([41]), interval).tolist() == [True]


@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8])
def test_gpu_cache_write_allocate_holds_every_token_like_the_host_store(dtype):
    """Prefill then decode with rows wide enough for every page: each page's block in the cache
    equals its host block, so a decode step selecting every page loads nothing from the host."""
    gen = torch.Generator().manual_seed(5)
    layers, heads, page_size, dim = 2, 2, 4, 16
    cache = make_cache(64, layers=layers, heads=heads, dtype=dtype, width=4)
    host = HostKVPool(layers, heads, 16, page_size, dim, dtype, pin=False)
    lengths = {0: 9, 1: 4}  # prompt tokens of request slots 0 and 1
    host_pages = torch.arange(1, 1 + 4 * len(lengths)).view(
        len(lengths), 4
    )  # [request slot, page]: distinct ids, 0 reserved
    for r in lengths:
        cache.open_request(r)

    def run(positions_by_req):
        for r, ps in positions_by_req.items():  # the scheduler's side: pages started now
            first, last = ps[0] // page_size + (ps[0] % page_size > 0), ps[-1] // page_size
            cache.resize_request(r, last + 1)
            cache.write_allocate(r, first, last - first + 1)
        reqs = torch.tensor([r for r, ps in positions_by_req.items() for _ in ps] + [-1])  # one padding token
        pos = torch.tensor([p for ps in positions_by_req.values() for p in ps] + [-1])
        host_page = host_pages[reqs.clamp_min(0), pos.clamp_min(0) // page_size]
        slots = torch.where(pos >= 0, host_page * page_size + pos % page_size, -1)
        for layer in range(layers):
            k, v = (torch.randn(pos.numel(), heads, dim, generator=gen).to(dtype) for _ in range(2))
            cache.store(layer, reqs, pos, k, v)
            scatter_tokens_reference(host.k, host.v, layer, k, v, slots)

    run({r: list(range(n)) for r, n in lengths.items()})  # prefill
    for _ in range(6):  # decode
        run({r: [lengths[r]] for r in lengths})
        lengths = {r: n + 1 for r, n in lengths.items()}
    for r, n in lengths.items():
        for layer in range(layers):
            for lp in range(math.ceil(n / page_size)):
                filled = min(page_size, n - lp * page_size)
                slots = cache.page_table.lookup(r, layer, torch.arange(heads), lp)
                page = host_pages[r][lp]
                for gpu, store in ((cache.k, host.k), (cache.v, host.v)):
                    want = store[layer, :, page, :filled].view(torch.uint8)
                    assert torch.equal(gpu[slots.long(), :filled].view(torch.uint8), want)
    every = torch.tensor([[0, 1, 2, 3], [0, 1, 2, -1]]).view(2, 1, 4).expand(2, heads, 4)  # 15 and 10 tokens
    loads = []
    slots = retrieve_reference(cache, 1, torch.tensor([0, 1]), every, host_pages, lambda s, d: loads.append(d), 16)
    assert (loads[0] < 0).all()  # all hits
    want = cache.page_table.lookup(torch.tensor([0, 1]).view(2, 1, 1), 1, torch.arange(heads).view(1, -1, 1), every)
    assert torch.equal(slots, want.long())


def test_slots_for_budget():
    assert slots_for_budget(1, 32, 128, torch.bfloat16) == GIB // (2 * 32 * 128 * 2)
    assert slots_for_budget(1, 32, 128, FP8) == GIB // (2 * 32 * 128)
    with pytest.raises(ValueError, match="need at least 1"):
        slots_for_budget(1e-6, 32, 128, torch.bfloat16)
    with pytest.raises(ValueError, match="power of two"):
        slots_for_budget(1, 24, 128, torch.bfloat16)
    assert slots_for_budget(64 * 2 * 4 * 16 * 2 / GIB, 4, 16, torch.bfloat16) == 64


def test_int8_bounds_hold_every_key_as_pages_fill_token_by_token():
    """int8 bounds (levels x 2**e per page and kv head), updated as a decode step would, one token
    at a time, and as a prefill would, whole pages at once: every key stays inside its page's box,
    the box is at most a level or two wider than the exact one, a page starting over forgets its
    old keys, and ``reset`` empties pages to +-inf."""
    from sparse_sglang.mem_cache.bounds import resolve_bound_format

    gen = torch.Generator().manual_seed(4)
    layers, heads, pages, page_size, dim = 1, 2, 6, 8, 16
    assert resolve_bound_format("auto", torch.bfloat16) == "int8" and resolve_bound_format("auto", FP8) == "exact"
    int8 = PageSummaries(layers, heads, pages, page_size, dim, torch.bfloat16, bound_format="auto", with_mean=False)
    exact = PageSummaries(layers, heads, pages, page_size, dim, torch.bfloat16, with_mean=False)
    assert int8.kmin.dtype == torch.int8 and int8.nbytes < exact.nbytes
    keys = (
        torch.randn(pages * page_size, heads, dim, generator=gen)
        * torch.linspace(0.01, 50, pages * page_size).view(-1, 1, 1)
    ).bfloat16()
    for t in range(3 * page_size):  # pages 0-2, token by token (magnitudes grow: scales change)
        for summ in (int8, exact):
            summ.update(0, keys[t : t + 1], torch.tensor([t]))
    for summ in (int8, exact):  # pages 3-5 in one call
        summ.update(0, keys[3 * page_size :], torch.arange(3 * page_size, pages * page_size))
    lo, hi = int8.bounds(0)
    true_lo, true_hi = exact.bounds(0)
    assert torch.equal(true_lo, keys.float().view(pages, page_size, heads, dim).amin(1).transpose(0, 1))
    assert (lo <= true_lo).all() and (hi >= true_hi).all()
    level = torch.ldexp(torch.ones(int8.bound_exp[0].shape), int8.bound_exp[0].int()).unsqueeze(
        -1
    )  # one level of each page
    assert ((true_lo - lo) <= 2 * level).all() and ((hi - true_hi) <= 2 * level).all()
    assert (int8.kmax[0].int().abs() <= 127).all() and (int8.kmin[0].int().abs() <= 127).all()
    small = torch.full((1, heads, dim), 0.5).bfloat16()
    int8.update(0, small, torch.tensor([2 * page_size]))  # page 2 starts over
    lo, hi = int8.bounds(0)
    assert (lo[:, 2] <= 0.5).all() and (hi[:, 2] >= 0.5).all() and (hi[:, 2] - lo[:, 2] < 0.01).all()
    int8.reset(torch.tensor([1]))
    lo, hi = int8.bounds(0)
    assert (lo[:, 1] == math.inf).all() and (hi[:, 1] == -math.inf).all() and int8.count[0, 1] == 0


@pytest.mark.parametrize("bound_format,dtype", [("exact", torch.bfloat16), ("int8", torch.bfloat16), ("exact", FP8)])
def test_set_bounds_stores_one_layer_exactly_or_rounded_outward(bound_format, dtype):
    gen = torch.Generator().manual_seed(5)
    summ = PageSummaries(2, 2, 10, 8, 16, dtype, bound_format=bound_format, coarse_pages=2)
    summ.coarse_first.fill_(3)
    lo = torch.randn(2, 10, 16, generator=gen)
    hi = lo + torch.rand(2, 10, 16, generator=gen)
    summ.set_bounds(1, lo, hi)
    got_lo, got_hi = summ.bounds(1)
    if bound_format == "exact":
        assert torch.equal(got_lo, lo.to(dtype).float()) and torch.equal(got_hi, hi.to(dtype).float())
    else:
        assert (got_lo <= lo).all() and (got_hi >= hi).all()
    assert torch.equal(summ.count, torch.zeros_like(summ.count)) and (summ.coarse_first == -1).all()  # rebuilt later
    assert torch.equal(
        summ.kmin[0].float(), torch.full_like(summ.kmin[0].float(), summ.empty_bounds[0])
    )  # layer 0 untouched
