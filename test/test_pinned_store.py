"""Pinning the host KV store in parallel: the chunk plan (CPU), the choice of path and its fallback
(CPU, with the extension stood in), and the real pinned store (``gpu``)."""

from __future__ import annotations

import time
import types

import pytest
import torch

from sparse_sglang.transfer import layout
from sparse_sglang.transfer.layout import HUGE_PAGE_BYTES, PARALLEL_PIN_MIN_BYTES, plan_pin_chunks


@pytest.mark.parametrize("nbytes,threads,align", [
    (92 << 30, 16, HUGE_PAGE_BYTES), (PARALLEL_PIN_MIN_BYTES + 12345, 8, HUGE_PAGE_BYTES),
    (3 * HUGE_PAGE_BYTES, 16, HUGE_PAGE_BYTES), (1000, 4, HUGE_PAGE_BYTES),
    (40 << 30, 12, 4096),
])  # fmt: skip
def test_chunks_tile_the_store_in_whole_aligned_units(nbytes, threads, align):
    chunks = plan_pin_chunks(nbytes, threads, align)
    assert chunks[0][0] == 0 and sum(size for _, size in chunks) == nbytes
    assert all(a + sa == b for (a, sa), (b, _) in zip(chunks, chunks[1:]))  # in order, no gap, no overlap
    assert all(offset % align == 0 for offset, _ in chunks) and all(size > 0 for _, size in chunks)
    assert len(chunks) <= max(1, threads * layout.CHUNKS_PER_THREAD)
    if nbytes >= threads * layout.CHUNKS_PER_THREAD * align:
        assert len(chunks) == threads * layout.CHUNKS_PER_THREAD  # every thread has work
        sizes = [size for _, size in chunks[:-1]]
        assert max(sizes) - min(sizes) <= align  # balanced


def test_bad_plan_arguments_are_refused():
    with pytest.raises(ValueError, match="positive"):
        plan_pin_chunks(0, 4)


def fake_extension(calls: list, parallel_fails: bool = False):
    def alloc_pinned_parallel(nbytes, chunks, num_threads):
        calls.append(("parallel", nbytes, len(chunks), num_threads))
        if parallel_fails:
            raise RuntimeError("no unified addressing")
        return torch.empty(nbytes, dtype=torch.uint8)

    def alloc_pinned(nbytes):
        calls.append(("one call", nbytes))
        return torch.empty(nbytes, dtype=torch.uint8)

    return types.SimpleNamespace(alloc_pinned_parallel=alloc_pinned_parallel, alloc_pinned=alloc_pinned)


def test_large_stores_pin_in_parallel_small_ones_in_one_call_and_failure_falls_back(monkeypatch):
    calls: list = []
    monkeypatch.setattr(layout, "host_ext", lambda: fake_extension(calls))
    big = layout.alloc_host_tensor((2, PARALLEL_PIN_MIN_BYTES // 4), torch.bfloat16)
    assert big.shape == (2, PARALLEL_PIN_MIN_BYTES // 4) and big.dtype == torch.bfloat16
    small = layout.alloc_host_tensor((4, 1024), torch.float16)
    assert [c[0] for c in calls] == ["parallel", "one call"] and calls[0][1] == PARALLEL_PIN_MIN_BYTES
    assert small.shape == (4, 1024)
    calls.clear()
    monkeypatch.setattr(layout, "host_ext", lambda: fake_extension(calls, parallel_fails=True))
    again = layout.alloc_host_tensor((PARALLEL_PIN_MIN_BYTES,), torch.uint8)
    assert [c[0] for c in calls] == ["parallel", "one call"] and again.numel() == PARALLEL_PIN_MIN_BYTES


@pytest.mark.gpu
def test_a_store_pinned_in_parallel_is_pinned_and_copies_right():
    """A 2 GiB K/V pair through the real extension: pinned (torch says so), one base pointer for
    the whole range (cuda_view_of_host), bytes copied to the GPU and back intact by copies that
    span the whole tensor (one registration, not one per chunk); prints the rate."""
    from sparse_sglang.transfer.native import host_ext

    started = time.perf_counter()
    k, v = layout.alloc_host_store(4, 8, 4096, 32, 128, torch.bfloat16, pin=True)
    seconds = time.perf_counter() - started
    print(f"pinned {2 * k.nbytes / (1 << 30):.1f} GiB in {seconds:.2f} s ({2 * k.nbytes / seconds / 1e9:.1f} GB/s)")
    assert k.is_pinned() and v.is_pinned()
    k[-1, -1, -1].fill_(3.0)
    k[0, 0, 0].fill_(-2.0)
    view = host_ext().cuda_view_of_host(k, torch.cuda.current_device())
    assert float(view[-1, -1, -1].float().mean()) == 3.0 and float(view[0, 0, 0].float().mean()) == -2.0
    gpu = k.to("cuda", non_blocking=True)  # one cudaMemcpy over all of it
    torch.cuda.synchronize()
    assert torch.equal(gpu[-1].cpu(), k[-1]) and float(gpu[0, 0, 0].float().mean()) == -2.0
    v.copy_(gpu, non_blocking=True)  # and back, into the other tensor
    torch.cuda.synchronize()
    assert torch.equal(v[-1], k[-1])
    del k, v, view, gpu  # unregisters and unmaps
    k2, _ = layout.alloc_host_store(4, 8, 4096, 32, 128, torch.bfloat16, pin=True)  # the same range again
    assert k2.is_pinned()
