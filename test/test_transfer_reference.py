"""CPU tests of the transfer contract: the pure-torch references and the native CPU scatter pool."""

from __future__ import annotations

import pytest
import torch

from sparse_sglang.transfer import (
    PinnedMemoryError,
    alloc_host_store,
    gather_blocks_reference,
    layout,
    scatter_rows_cpu,
    scatter_tokens_reference,
)
from sparse_sglang.transfer.native import host_ext
from sparse_sglang.transfer.reference import as_bytes, random_bits, same_bytes, token_slots

DTYPES = [torch.bfloat16, torch.float16, torch.float8_e4m3fn]


def scatter_loop(host_k, host_v, layer, k, v, slots):
    """The scatter, one row at a time."""
    page_size = host_k.shape[3]
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            for host, x in ((host_k, k), (host_v, v)):
                as_bytes(host)[layer, :, s // page_size, s % page_size] = as_bytes(x)[t]


@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_reference_matches_loop_and_skips_padding(dtype):
    gen = torch.Generator().manual_seed(0)
    layers, heads, pages, page_size, head_dim, slots = 2, 3, 5, 4, 16, 9
    host_k, host_v = (random_bits((layers, heads, pages, page_size, head_dim), dtype, gen) for _ in range(2))
    gpu_k, gpu_v = (random_bits((slots, page_size, head_dim), dtype, gen) for _ in range(2))
    src = torch.randperm(layers * heads * pages, generator=gen)[:6]
    dst = torch.randperm(slots, generator=gen)[:6]
    dst[[1, 4]] = -1  # padding entries: their src must not be read into any slot
    src, dst = torch.cat([src, torch.tensor([0, 0])]), torch.cat([dst, torch.tensor([-1, -1])])
    want_k, want_v = gpu_k.clone(), gpu_v.clone()
    for s, d in zip(src.tolist(), dst.tolist()):
        if d >= 0:
            as_bytes(want_k)[d] = as_bytes(host_k).reshape(-1, page_size, head_dim * host_k.element_size())[s]
            as_bytes(want_v)[d] = as_bytes(host_v).reshape(-1, page_size, head_dim * host_v.element_size())[s]
    for index_dtype in (torch.int32, torch.int64):
        got_k, got_v = gpu_k.clone(), gpu_v.clone()
        gather_blocks_reference(host_k, host_v, got_k, got_v, src.to(index_dtype), dst.to(index_dtype))
        assert same_bytes(got_k, want_k) and same_bytes(got_v, want_v)
    untouched = gpu_k.clone()
    gather_blocks_reference(host_k, host_v, untouched, gpu_v.clone(), src, torch.full_like(dst, -1))
    assert same_bytes(untouched, gpu_k)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_reference_partial_last_page(dtype):
    gen = torch.Generator().manual_seed(1)
    layers, heads, pages, page_size, head_dim = 3, 2, 6, 4, 16
    host_k, host_v = (random_bits((layers, heads, pages, page_size, head_dim), dtype, gen) for _ in range(2))
    slots = token_slots(11, torch.randperm(pages, generator=gen), page_size, pad=(3,))  # 3 pages, the last 3/4 full
    k, v = (random_bits((slots.numel(), heads, head_dim), dtype, gen) for _ in range(2))
    want_k, want_v = host_k.clone(), host_v.clone()
    scatter_loop(want_k, want_v, 1, k, v, slots)
    got_k, got_v = host_k.clone(), host_v.clone()
    scatter_tokens_reference(got_k, got_v, 1, k, v, slots.to(torch.int32))
    assert same_bytes(got_k, want_k) and same_bytes(got_v, want_v)
    page, offset = divmod(slots[-1].item(), page_size)  # the partial page: offsets 0-2 written, 3 untouched
    assert offset == 2 and same_bytes(got_k[1, :, page, 3], host_k[1, :, page, 3])
    assert same_bytes(got_k[[0, 2]], host_k[[0, 2]])  # other layers untouched


def test_reference_rejects_bad_layouts():
    gen = torch.Generator().manual_seed(2)
    host = random_bits((1, 2, 4, 4, 16), torch.bfloat16, gen)
    gpu = random_bits((3, 4, 16), torch.bfloat16, gen)
    kv = random_bits((2, 2, 16), torch.bfloat16, gen)  # 2 tokens x 2 heads
    idx = torch.tensor([0, 1])
    cases = {
        "multiple of 16": lambda: gather_blocks_reference(
            *(random_bits((1, 1, 2, 3, 5), torch.float16, gen),) * 2,
            *(torch.zeros(1, 3, 5, dtype=torch.float16),) * 2,
            idx,
            idx,
        ),
        "do not match": lambda: gather_blocks_reference(host, host, gpu.float(), gpu.float(), idx, idx),
        "differ": lambda: gather_blocks_reference(host, host[:, :1].contiguous(), gpu, gpu, idx, idx),
        "page cache": lambda: gather_blocks_reference(
            host, host, gpu[:, :2].contiguous(), gpu[:, :2].contiguous(), idx, idx
        ),
        "length": lambda: gather_blocks_reference(host, host, gpu, gpu, idx, idx[:1]),
        "int32/int64": lambda: gather_blocks_reference(host, host, gpu, gpu, idx.float(), idx),
        "out of range": lambda: gather_blocks_reference(host, host, gpu, gpu, torch.tensor([0, 8]), idx),
        "layer": lambda: scatter_tokens_reference(host, host, 1, kv, kv, idx),
        "past the host store": lambda: scatter_tokens_reference(host, host, 0, kv, kv, torch.tensor([0, 16])),
        "rows": lambda: scatter_tokens_reference(host, host, 0, kv[:, :1].contiguous(), kv[:, :1].contiguous(), idx),
        "one entry per token": lambda: scatter_tokens_reference(host, host, 0, kv, kv, idx[:1]),
        "k/v differ": lambda: scatter_tokens_reference(host, host, 0, kv, kv.half(), idx),
    }
    for needle, call in cases.items():
        with pytest.raises(ValueError, match=needle):
            call()


def test_alloc_host_store_checks_and_pinned_error(monkeypatch):
    k, v = alloc_host_store(2, 2, 3, 4, 16, torch.bfloat16, pin=False)
    assert k.shape == v.shape == (2, 2, 3, 4, 16) and k.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="multiple of 16"):
        alloc_host_store(2, 2, 3, 3, 5, torch.float16, pin=False)

    class NoPinning:
        def alloc_pinned(self, nbytes):
            raise RuntimeError("cudaHostAlloc failed: out of memory")

        def alloc_pinned_parallel(self, nbytes, chunks, num_threads):  # 1 GiB and more: pinned in parallel first
            raise RuntimeError("cudaHostRegister failed: out of memory")

    monkeypatch.setattr(layout, "host_ext", lambda: NoPinning())
    with pytest.raises(PinnedMemoryError, match=r"1\.00 GiB .*2\.00 GiB for both.*--sparse-host-cache-gb.*ulimit -l"):
        alloc_host_store(1, 1, 1 << 17, 32, 128, torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_threads,nontemporal", [(1, True), (3, True), (3, False)])
def test_native_scatter_matches_reference(dtype, num_threads, nontemporal):
    gen = torch.Generator().manual_seed(3)
    layers, heads, pages, page_size, head_dim = 3, 4, 64, 16, 64
    host_k, host_v = (random_bits((layers, heads, pages, page_size, head_dim), dtype, gen) for _ in range(2))
    slots = token_slots(300, torch.randperm(pages, generator=gen), page_size, pad=(0, 17, 250))
    k, v = (random_bits((slots.numel(), heads, head_dim), dtype, gen) for _ in range(2))
    want_k, want_v = host_k.clone(), host_v.clone()
    scatter_tokens_reference(want_k, want_v, 2, k, v, slots)
    scatter_rows_cpu(k, v, host_k, host_v, 2, slots.to(torch.int32), num_threads=num_threads, nontemporal=nontemporal)
    assert same_bytes(host_k, want_k) and same_bytes(host_v, want_v)


def test_native_scatter_rows_not_multiple_of_16():
    gen = torch.Generator().manual_seed(4)
    host_k, host_v = (random_bits((1, 3, 8, 2, 4), torch.float16, gen) for _ in range(2))  # 8-byte rows
    slots = token_slots(7, torch.randperm(8, generator=gen), 2)
    k, v = (random_bits((7, 3, 4), torch.float16, gen) for _ in range(2))
    want_k, want_v = host_k.clone(), host_v.clone()
    scatter_tokens_reference(want_k, want_v, 0, k, v, slots)
    scatter_rows_cpu(k, v, host_k, host_v, 0, slots, num_threads=2)
    assert same_bytes(host_k, want_k) and same_bytes(host_v, want_v)


def test_native_scatter_pool_tickets_errors_and_shutdown():
    gen = torch.Generator().manual_seed(5)
    host = [random_bits((2, 2, 32, 8, 32), torch.bfloat16, gen) for _ in range(2)]
    rows = [random_bits((64, 2, 32), torch.bfloat16, gen) for _ in range(2)]
    good = token_slots(64, torch.randperm(32, generator=gen), 8)
    bad = good.clone()
    bad[40] = 32 * 8  # one past the last slot
    pool = host_ext().ScatterPool(4)
    assert pool.num_threads == 4
    t1 = pool.submit([0, 0], -1, rows, host, 0, good, 64)
    t2 = pool.submit([0, 0], -1, rows, host, 1, bad, 64)
    t3 = pool.submit([0, 0], -1, rows, host, 1, good, 64)
    assert (t1, t2, t3) == (1, 2, 3) and pool.last_ticket == 3
    pool.wait(t1)
    with pytest.raises(ValueError, match=r"token_slots\[40\] = 256 is past the host store"):
        pool.wait(t3)  # waits for t2 as well and raises its error, raised in a worker thread
    pool.synchronize()  # the error was reported once
    want = [h.clone() for h in host]
    scatter_tokens_reference(*want, 1, *rows, good)
    assert all(same_bytes(h, w) for h, w in zip(host, want))
    with pytest.raises(ValueError, match="never issued"):
        pool.wait(99)
    with pytest.raises(ValueError, match="token_slots"):
        pool.submit([0, 0], -1, rows, host, 0, good.to(torch.int32), 64)  # the pool itself checks its inputs
    with pytest.raises(ValueError, match="one event"):
        pool.submit([0], -1, rows, host, 0, good, 64)
    pool.shutdown()
    pool.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit([0, 0], -1, rows, host, 0, good, 64)


def test_flash_d2h_reference_keeps_flash_d2h_contract():
    """The CPU store's stand-in for FlashD2H and the direct-write kernel: a submit writes what
    scatter_tokens_reference writes, at once (synchronize and close have nothing to do)."""
    from sparse_sglang.transfer.reference import FlashD2HReference

    k_host, v_host = alloc_host_store(2, 2, 4, 4, 16, torch.bfloat16, pin=False)
    k_host.zero_(), v_host.zero_()
    expect_k, expect_v = k_host.clone(), v_host.clone()
    gen = torch.Generator().manual_seed(1)
    k, v = (torch.randn(5, 2, 16, generator=gen).to(torch.bfloat16) for _ in range(2))
    slots = torch.tensor([4, 5, 6, 13, -1])
    engine = FlashD2HReference(k_host, v_host)
    assert engine.submit(1, k, v, slots) == 1 and engine(0, k, v, slots) == 2  # both entry points
    scatter_tokens_reference(expect_k, expect_v, 1, k, v, slots)
    scatter_tokens_reference(expect_k, expect_v, 0, k, v, slots)
    engine.synchronize(), engine.close()
    assert torch.equal(k_host, expect_k) and torch.equal(v_host, expect_v)


def test_flashd2h_threads_are_split_between_the_schedulers_of_a_host(monkeypatch):
    """All CPUs but 4, split between data-parallel replicas, at most 12 each, at least 1."""
    from sparse_sglang.transfer import d2h

    monkeypatch.setattr(d2h.os, "cpu_count", lambda: 32)
    assert [d2h.default_num_threads(share) for share in (1, 2, 4, 8, 64)] == [12, 12, 7, 3, 1]
    monkeypatch.setattr(d2h.os, "cpu_count", lambda: 2)
    assert d2h.default_num_threads() == 1
