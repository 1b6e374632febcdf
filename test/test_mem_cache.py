"""CPU tests of the KV memory managers: host page allocator, page summaries, two-level page table
and GPU page cache, each against a plain-Python reference."""

from __future__ import annotations

import math
import random

import pytest
import torch

from sparse_sglang.mem_cache import (
    GPUCacheFull,
    GPUPageCache,
    HostKVPool,
    HostMemoryExhausted,
    HostPageAllocator,
    PageSummaries,
    SegmentPoolExhausted,
    TwoLevelPageTable,
    bound_dtype,
    pages_for_budget,
    slots_for_budget,
)
from sparse_sglang.transfer import scatter_tokens_reference

GIB = 1 << 30
FP8 = torch.float8_e4m3fn


# Host page allocator.


def test_allocator_random_operations_keep_refcounts_and_free_every_page_once():
    rng = random.Random(0)
    alloc = HostPageAllocator(40)
    held: dict[int, int] = {}  # page -> reference count (the model)
    requests: dict[int, list[int]] = {}
    handed_out: dict[int, int] = {}  # page -> times allocated
    freed: dict[int, int] = {}  # page -> times returned to the free list

    def note_freed(pages):
        for p in pages.tolist():
            assert held.pop(p) == 0
            freed[p] = freed.get(p, 0) + 1

    for step in range(400):
        op = rng.choice(["alloc", "share", "finish", "abort"])
        if op == "alloc":
            rid, n = rng.randrange(8), rng.randrange(6)
            if n > alloc.available():
                with pytest.raises(HostMemoryExhausted):
                    alloc.alloc_for_request(rid, n)
                continue
            pages = alloc.alloc_for_request(rid, n).tolist()
            assert len(set(pages)) == n and not set(pages) & set(held) and 0 not in pages
            for p in pages:
                held[p], handed_out[p] = 1, handed_out.get(p, 0) + 1
            requests.setdefault(rid, []).extend(pages)
        elif op == "share" and held:
            rid = rng.randrange(8)
            pages = rng.sample(sorted(held), min(3, len(held)))
            alloc.share_with_request(rid, torch.tensor(pages))
            for p in pages:
                held[p] += 1
            requests.setdefault(rid, []).extend(pages)
        elif op in ("finish", "abort") and requests:
            rid = rng.choice(sorted(requests))
            for p in requests.pop(rid):
                held[p] -= 1
            note_freed(alloc.free_request(rid))
        assert all(alloc.refcount[p] == c for p, c in held.items())
        assert int((alloc.refcount > 0).sum()) == len(held)
        assert alloc.available() == alloc.capacity - len(held)
    for rid in sorted(requests):
        note_freed(alloc.free_request(rid))
    assert not held and alloc.available() == alloc.capacity == 39
    assert freed == handed_out  # every page freed exactly once per allocation
    assert sorted(alloc.alloc(39).tolist()) == list(range(1, 40))


def test_allocator_incref_decref_and_errors():
    alloc = HostPageAllocator(6)
    pages = alloc.alloc(3)
    assert pages.tolist() == [1, 2, 3] and pages.dtype == torch.int64
    alloc.incref(pages[:1])
    assert alloc.free(pages).tolist() == [2, 3]  # page 1 still has a holder
    assert alloc.decref(pages[:1]).tolist() == [1]
    for bad, match in (([0], "unknown host pages \\[0\\]"), ([6], "unknown"), ([-1], "unknown"), ([2], "double free")):
        with pytest.raises(ValueError, match=match):
            alloc.free(torch.tensor(bad))
    with pytest.raises(ValueError, match="not allocated"):
        alloc.incref(torch.tensor([4]))
    page = alloc.alloc(1)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(torch.cat([page, page]))  # held once, freed twice in one call
    assert alloc.refcount[page].item() == 1  # the failed call changed nothing
    with pytest.raises(HostMemoryExhausted, match="requested 5 pages, 4 free of 5"):
        alloc.alloc(5)
    assert alloc.available() == 4
    with pytest.raises(KeyError, match="holds no host pages"):
        alloc.free_request("never-seen")
    alloc.alloc_for_request("r", 2)
    alloc.free_request("r")
    with pytest.raises(KeyError):
        alloc.free_request("r")  # finish after abort: a double free


def test_host_pool_sizes_and_bad_sizes():
    # One page id of 2 layers x 2 heads x 4 tokens x 16 dims, K and V: 512 elements.
    assert pages_for_budget(512 * 2 * 10 / GIB, 2, 2, 4, 16, torch.bfloat16) == 10
    assert pages_for_budget(512 * 2 * 10 / GIB, 2, 2, 4, 16, FP8) == 20  # fp8: one byte per element
    pool = HostKVPool.from_budget(512 * 2 * 7.5 / GIB, 2, 2, 4, 16, torch.bfloat16, pin=False)
    assert pool.k.shape == pool.v.shape == (2, 2, 7, 4, 16) and pool.allocator.capacity == 6
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
                assert torch.isinf(summ.kmin[layer, :, page]).all() and (summ.kmax[layer, :, page] < 0).all()
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


def test_fp8_summaries_are_of_dequantized_keys():
    k = torch.tensor([[[448.0, -0.001953125]], [[-3.5, 0.0625]]]).to(FP8)  # fp8 extremes, one head, dim 2
    summ = PageSummaries(1, 1, 2, 2, 2, FP8)
    summ.update(0, k, torch.tensor([2, 3]))
    assert summ.kmax[0, 0, 1].tolist() == [448.0, 0.0625] and summ.kmin[0, 0, 1].tolist() == [-3.5, -0.001953125]
    assert summ.mean[0, 0, 1].tolist() == [222.25, (0.0625 - 0.001953125) / 2]


# Two-level page table.


def test_page_table_random_operations_match_dict_and_memory_tracks_mapped_pages():
    rng = random.Random(4)
    reqs, layers, heads, max_pages, seg = 3, 2, 2, 21, 4
    pool = TwoLevelPageTable.segments_needed(layers, heads, 30, reqs, seg)
    table = TwoLevelPageTable(reqs, layers, heads, max_pages, pool, seg, debug=True)
    ref: dict[tuple[int, int, int, int], int] = {}
    sizes = [0] * reqs
    everything = torch.cartesian_prod(*(torch.arange(n) for n in (reqs, layers, heads, max_pages)))

    for step in range(300):
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


def make_cache(slots, reqs=2, layers=2, heads=2, max_pages=16, page_size=4, dim=16, dtype=torch.bfloat16):
    table = TwoLevelPageTable(reqs, layers, heads, max_pages, 64, segment_pages=4, debug=True)
    return GPUPageCache(slots, page_size, dim, dtype, table)


def test_gpu_cache_write_allocate_fills_free_slots_then_evicts_lru_and_invalidates():
    cache = make_cache(6)
    table = cache.page_table
    cache.resize_request(0, 4)
    first = cache.write_allocate(0, torch.tensor([0]), torch.tensor([0]))  # step 0: page 0, 2 heads
    assert first.shape == (1, 2) and cache.num_free == 4
    cache.next_step()
    second = cache.write_allocate(0, torch.tensor([0, 0]), torch.tensor([1, 2]))  # step 1
    assert cache.num_free == 0 and len(set(torch.cat([first, second]).view(-1).tolist())) == 6
    assert cache.owner[second[1, 0]].tolist() == [0, 0, 0, 2]
    cache.next_step()
    cache.touch(torch.cat([first.view(-1), second[1], torch.tensor([-1])]))  # step 2: pages 0, 2 hit; padding
    third = cache.write_allocate(0, torch.tensor([0]), torch.tensor([3]))  # evicts page 1 (step 1)
    assert sorted(third.view(-1).tolist()) == sorted(second[0].tolist())
    assert table.lookup(0, 0, torch.arange(2), 1).tolist() == [-1, -1]  # invalidated
    assert torch.equal(table.lookup(0, 0, torch.arange(2), 3), third[0].int())
    assert torch.equal(table.lookup(0, 0, torch.arange(2), 0), first[0].int())
    # Everything left was used in step 2: nothing may be evicted, and nothing changes.
    with pytest.raises(GPUCacheFull, match="unused in this step"):
        cache.admit(0, 1, 0, 0)
    assert cache.num_free == 0 and (cache.owner[:, 0] == 0).all()
    # Shrinking frees the dropped pages' slots; finishing frees the rest.
    cache.resize_request(0, 3)
    assert cache.num_free == 2 and table.lookup(0, 0, 0, 3).item() == -1
    cache.free_request(0)
    assert cache.num_free == 6 and (cache.owner == -1).all() and (cache.last_used == -1).all()
    assert table.segments_in_use == 0
    with pytest.raises(IndexError, match="resize the request first"):
        cache.admit(1, 0, 0, 0)  # request slot 1 has no pages yet
    assert cache.num_free == 6 and (cache.owner == -1).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8])
def test_gpu_cache_write_allocate_holds_every_token_like_the_host_store(dtype):
    """Prefill then decode with a cache big enough for everything: each page's block in the cache
    equals its host block, so attention never needs the host."""
    gen = torch.Generator().manual_seed(5)
    layers, heads, page_size, dim = 2, 2, 4, 16
    cache = make_cache(64, layers=layers, heads=heads, dtype=dtype)
    host = HostKVPool(layers, heads, 16, page_size, dim, dtype, pin=False)
    lengths = {0: 9, 1: 4}  # prompt tokens of request slots 0 and 1
    host_pages = torch.stack([host.allocator.alloc_for_request(r, 4) for r in lengths])  # [request slot, page]

    def run(positions_by_req):
        reqs = torch.tensor([r for r, ps in positions_by_req.items() for _ in ps] + [-1])  # one padding token
        pos = torch.tensor([p for ps in positions_by_req.values() for p in ps] + [-1])
        new = (pos % page_size == 0) & (pos >= 0)  # pages started now: the scheduler knows them
        for r, ps in positions_by_req.items():
            cache.resize_request(r, ps[-1] // page_size + 1)
        host_page = host_pages[reqs.clamp_min(0), pos.clamp_min(0) // page_size]
        slots = torch.where(pos >= 0, host_page * page_size + pos % page_size, -1)
        for layer in range(layers):
            cache.write_allocate(layer, reqs[new], pos[new] // page_size)
            k, v = (torch.randn(pos.numel(), heads, dim, generator=gen).to(dtype) for _ in range(2))
            cache.store(layer, reqs, pos, k, v)
            scatter_tokens_reference(host.k, host.v, layer, k, v, slots)

    run({r: list(range(n)) for r, n in lengths.items()})  # prefill
    for _ in range(6):  # decode
        run({r: [lengths[r]] for r in lengths})
        lengths = {r: n + 1 for r, n in lengths.items()}
    assert cache.num_free == 64 - layers * heads * (4 + 3)
    for r, n in lengths.items():
        for layer in range(layers):
            for lp in range(math.ceil(n / page_size)):
                filled = min(page_size, n - lp * page_size)
                slots = cache.page_table.lookup(r, layer, torch.arange(heads), lp)
                page = host_pages[r][lp]
                for gpu, store in ((cache.k, host.k), (cache.v, host.v)):
                    want = store[layer, :, page, :filled].view(torch.uint8)
                    assert torch.equal(gpu[slots.long(), :filled].view(torch.uint8), want)


def test_slots_for_budget():
    assert slots_for_budget(1, 32, 128, torch.bfloat16) == GIB // (2 * 32 * 128 * 2)
    assert slots_for_budget(1, 32, 128, FP8) == GIB // (2 * 32 * 128)
    with pytest.raises(ValueError, match="need at least 1"):
        slots_for_budget(1e-6, 32, 128, torch.bfloat16)
    with pytest.raises(ValueError, match="power of two"):
        slots_for_budget(1, 24, 128, torch.bfloat16)
    cache = GPUPageCache.from_budget(64 * 2 * 4 * 16 * 2 / GIB, 4, 16, torch.bfloat16, make_cache(1).page_table)
    assert cache.k.shape == (64, 4, 16) and cache.k.is_contiguous()
