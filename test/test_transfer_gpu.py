"""GPU tests: the transfer kernels equal the pure-torch references bit for bit (run on the GPU host)."""

from __future__ import annotations

import pytest
import torch

from sparse_sglang.transfer import (
    DirectD2H,
    FlashD2H,
    FlashH2D,
    alloc_host_store,
    alloc_host_tensor,
    copy_blocks_memcpy,
    cuda_view,
    gather_blocks_reference,
    scatter_tokens_reference,
)
from sparse_sglang.transfer.reference import as_bytes, random_bits, same_bytes, token_slots

pytestmark = pytest.mark.gpu

# (page_size, head_dim, dtype): 4, 8, 16 KiB blocks, fp16, fp8, and a 48-byte block (not a 4 KiB multiple).
BLOCKS = [
    (16, 128, torch.bfloat16),
    (32, 128, torch.bfloat16),
    (64, 128, torch.bfloat16),
    (32, 64, torch.float16),
    (64, 128, torch.float8_e4m3fn),
    (3, 8, torch.float16),
]


def pinned_store(layers, heads, pages, page_size, head_dim, dtype, gen):
    host_k, host_v = alloc_host_store(layers, heads, pages, page_size, head_dim, dtype)
    for host in (host_k, host_v):
        as_bytes(host).copy_(as_bytes(random_bits(host.shape, dtype, gen)))
    return host_k, host_v


def miss_list(num_blocks, num_slots, n, pad, gen):
    """``n`` distinct random (src block, dst slot) pairs followed by ``pad`` padding entries."""
    src = torch.randperm(num_blocks, generator=gen)[:n]
    dst = torch.randperm(num_slots, generator=gen)[:n]
    return torch.cat([src, torch.zeros(pad, dtype=torch.long)]), torch.cat([dst, torch.full((pad,), -1)])


@pytest.mark.parametrize("page_size,head_dim,dtype", BLOCKS)
@pytest.mark.parametrize(
    "index_dtypes", [(torch.int64, torch.int64), (torch.int32, torch.int64), (torch.int32, torch.int32)]
)
def test_flash_h2d_matches_reference(page_size, head_dim, dtype, index_dtypes):
    gen = torch.Generator().manual_seed(0)
    host_k, host_v = pinned_store(3, 4, 40, page_size, head_dim, dtype, gen)
    gpu_k, gpu_v = (random_bits((300, page_size, head_dim), dtype, gen, "cuda") for _ in range(2))
    src, dst = miss_list(3 * 4 * 40, 300, 250, 37, gen)
    dst[[5, 100]] = -1  # padding in the middle as well
    want_k, want_v = gpu_k.clone(), gpu_v.clone()
    gather_blocks_reference(host_k, host_v, want_k, want_v, src, dst)
    FlashH2D(host_k, host_v, gpu_k, gpu_v)(src.cuda().to(index_dtypes[0]), dst.cuda().to(index_dtypes[1]))
    assert same_bytes(gpu_k, want_k) and same_bytes(gpu_v, want_v)


def test_flash_h2d_cuda_graph_replays_new_indices():
    gen = torch.Generator().manual_seed(1)
    host_k, host_v = pinned_store(2, 8, 64, 32, 128, torch.bfloat16, gen)
    gpu_k, gpu_v = (random_bits((512, 32, 128), torch.bfloat16, gen, "cuda") for _ in range(2))
    load = FlashH2D(host_k, host_v, gpu_k, gpu_v)
    capacity = 300  # fixed length of the captured (padded) miss list
    src_buf = torch.zeros(capacity, dtype=torch.int32, device="cuda")
    dst_buf = torch.full((capacity,), -1, dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        load(src_buf, dst_buf)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        load(src_buf, dst_buf)
    for n in (300, 17, 0, 150):
        src, dst = miss_list(2 * 8 * 64, 512, n, capacity - n, gen)
        src_buf.copy_(src)
        dst_buf.copy_(dst)
        want_k, want_v = gpu_k.clone(), gpu_v.clone()
        gather_blocks_reference(host_k, host_v, want_k, want_v, src, dst)
        graph.replay()
        torch.cuda.synchronize()
        assert same_bytes(gpu_k, want_k) and same_bytes(gpu_v, want_v), n


@pytest.mark.parametrize(
    "page_size,head_dim,dtype", [(64, 128, torch.bfloat16), (16, 64, torch.float16), (32, 128, torch.float8_e4m3fn)]
)
@pytest.mark.parametrize("slots_on", ["cpu", "cuda"])
def test_flash_d2h_matches_reference(page_size, head_dim, dtype, slots_on):
    gen = torch.Generator().manual_seed(2)
    layers, heads, pages = 4, 8, 48
    host_k, host_v = pinned_store(layers, heads, pages, page_size, head_dim, dtype, gen)
    want_k, want_v = host_k.clone(), host_v.clone()
    with FlashD2H(host_k, host_v, max_tokens=600, num_buffers=2, num_threads=3) as engine:
        assert engine.sms_used == 0 and engine.num_threads == 3
        tickets = []
        for step in range(6):  # more submits than staging buffers: the ring is reused
            layer = step % layers
            slots = token_slots(300 + 50 * step, torch.randperm(pages, generator=gen), page_size, pad=(7,))
            k, v = (random_bits((slots.numel(), heads, head_dim), dtype, gen, "cuda") for _ in range(2))
            scatter_tokens_reference(want_k, want_v, layer, k, v, slots)
            index_dtype = torch.int32 if step % 2 else torch.int64
            tickets.append(engine.submit(layer, k, v, slots.to(slots_on, index_dtype)))
            del k, v  # the engine keeps them alive until copied (record_stream)
        engine.wait(tickets[2])
        engine.synchronize()
    assert same_bytes(host_k, want_k) and same_bytes(host_v, want_v)


def test_flash_d2h_errors():
    gen = torch.Generator().manual_seed(3)
    host_k, host_v = pinned_store(2, 2, 8, 16, 64, torch.bfloat16, gen)
    engine = FlashD2H(host_k, host_v, max_tokens=32, num_buffers=1, num_threads=2)
    k = torch.zeros(33, 2, 64, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="max_tokens=32"):
        engine.submit(0, k, k, torch.arange(33))
    with pytest.raises(ValueError, match="past the host store"):
        engine.submit(0, k[:2], k[:2], torch.tensor([0, 8 * 16]))
    bad = engine.submit(0, k[:2], k[:2], torch.tensor([0, 8 * 16], device="cuda"))  # seen only by the scatter
    with pytest.raises(ValueError, match="past the host store"):
        engine.wait(bad)
    engine.wait(engine.submit(1, k[:3], k[:3], torch.tensor([3, 4, 5])))  # still usable
    engine.close()
    engine.close()
    with pytest.raises(RuntimeError, match="shut down"):
        engine.submit(0, k[:1], k[:1], torch.tensor([0]))


@pytest.mark.parametrize(
    "page_size,head_dim,dtype", [(64, 128, torch.bfloat16), (32, 128, torch.float8_e4m3fn), (16, 64, torch.float16)]
)
@pytest.mark.parametrize("num_ctas", [1, 16])
def test_direct_d2h_matches_reference(page_size, head_dim, dtype, num_ctas):
    gen = torch.Generator().manual_seed(4)
    layers, heads, pages = 3, 8, 40
    host_k, host_v = pinned_store(layers, heads, pages, page_size, head_dim, dtype, gen)
    want_k, want_v = host_k.clone(), host_v.clone()
    save = DirectD2H(host_k, host_v, num_ctas=num_ctas)
    assert save.sms_used == num_ctas
    for layer, n in ((0, 500), (2, 77), (1, 1)):
        slots = token_slots(n, torch.randperm(pages, generator=gen), page_size, pad=(0,))
        k, v = (random_bits((slots.numel(), heads, head_dim), dtype, gen, "cuda") for _ in range(2))
        scatter_tokens_reference(want_k, want_v, layer, k, v, slots)
        assert 1 <= save(layer, k, v, slots.cuda().int()) <= num_ctas
    torch.cuda.synchronize()
    assert same_bytes(host_k, want_k) and same_bytes(host_v, want_v)


def test_pinned_alloc_views_and_memcpy_baseline():
    gen = torch.Generator().manual_seed(5)
    host = alloc_host_tensor((1000, 64), torch.float8_e4m3fn)
    assert host.is_pinned() and host.untyped_storage().nbytes() == 64000  # exact size, no power-of-two rounding
    as_bytes(host).copy_(as_bytes(random_bits(host.shape, host.dtype, gen)))
    view = cuda_view(host[10:], torch.device("cuda"))
    assert view.is_cuda and same_bytes(view.clone(), host[10:])
    gpu = torch.zeros(50, 64, dtype=torch.uint8, device="cuda")
    src, dst = torch.randperm(1000, generator=gen)[:40], torch.randperm(50, generator=gen)[:40]
    copy_blocks_memcpy(as_bytes(host), gpu, src, dst, 64)
    want = torch.zeros(50, 64, dtype=torch.uint8)
    want[dst] = as_bytes(host)[src]
    assert torch.equal(gpu.cpu(), want)
    with pytest.raises(ValueError, match="pinned"):
        FlashH2D(
            *(torch.zeros(1, 1, 2, 16, 8, dtype=torch.bfloat16),) * 2,
            *(torch.zeros(4, 16, 8, dtype=torch.bfloat16, device="cuda"),) * 2,
        )


def test_save_then_load_round_trip_sees_each_new_write():
    """FlashD2H then FlashH2D of the same pages, three times over: each load sees the latest save."""
    gen = torch.Generator().manual_seed(6)
    layers, heads, pages, page_size, head_dim, layer = 2, 4, 32, 16, 128, 1
    host_k, host_v = pinned_store(layers, heads, pages, page_size, head_dim, torch.bfloat16, gen)
    gpu_k, gpu_v = (torch.zeros(64, page_size, head_dim, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    load = FlashH2D(host_k, host_v, gpu_k, gpu_v)
    chosen = torch.randperm(pages, generator=gen)[:4]
    slots = token_slots(4 * page_size, chosen, page_size)
    src = ((layer * heads + torch.arange(heads)[:, None]) * pages + chosen).reshape(-1).cuda()  # (head, page)
    dst = torch.arange(src.numel(), device="cuda")
    with FlashD2H(host_k, host_v, max_tokens=4 * page_size) as save:
        for _ in range(3):
            k, v = (random_bits((4 * page_size, heads, head_dim), torch.bfloat16, gen, "cuda") for _ in range(2))
            save.wait(save.submit(layer, k, v, slots))
            load(src, dst)
            for gpu, x in ((gpu_k, k), (gpu_v, v)):
                want = x.view(4, page_size, heads, head_dim).permute(2, 0, 1, 3).reshape(-1, page_size, head_dim)
                assert same_bytes(gpu[: src.numel()], want)
