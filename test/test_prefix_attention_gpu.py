"""Prefill attention over cached prefixes staged from the host in pieces (GPU).

A batch of four requests (one without a prefix, between two with one) extends its cached prefixes;
per layer, FlashInfer's ragged kernel attends the new tokens causally and
:class:`~sparse_sglang.attention.prefix.PrefixAttention` merges in the prefixes, staged through a
buffer of one piece (all prefixes at once), two planned pieces, or ten pieces re-planned per run;
past the first layer every piece was loaded ahead, on the load stream, while the one before was
attended.
Each must equal float32 attention over prefix + new keys; an fp8 store's prefix is attended as its
stored values times the KV scales.

A prompt prefilled in chunks with a resident prefix (``--sparse-resident-prefix-tokens``) attends
its whole pages up to the buffer's capacity from it, each staged once, and the rest staged as
before, beside another request's prefix: the same reference holds, chunk by chunk.

Run on the GPU host: ``pytest -m gpu test/test_prefix_attention_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from sparse_sglang.attention.prefix import PLANNED_PIECES, PrefixAttention
from sparse_sglang.config import SparseConfig
from sparse_sglang.mem_cache.plan import staging_buffer_pages
from sparse_sglang.testing.decode_setup import Llama8BShape, make_store

pytestmark = pytest.mark.gpu
SHAPE = Llama8BShape(num_layers=3)
PREFIX, NEW = [300, 0, 517, 64], [5, 3, 7, 2]  # 10 + 0 + 17 + 2 pages of 32 tokens


def reference(q, new_k, new_v, host_k, host_v, token_rows, scale, new=NEW):
    """Float32 attention of each request's new tokens over its prefix and, causally, its new tokens."""
    group = SHAPE.num_q_heads // SHAPE.num_kv_heads
    out, start = [], 0
    for tokens, n in zip(token_rows, new):
        k = torch.cat([host_k[:, tokens].transpose(0, 1), new_k[start : start + n]]).float()  # [S, Hkv, D]
        v = torch.cat([host_v[:, tokens].transpose(0, 1), new_v[start : start + n]]).float()
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("thd,shd->hts", q[start : start + n].float(), k) * scale
        p = len(tokens)
        causal = torch.arange(p + n, device="cuda").view(1, -1) <= p + torch.arange(n, device="cuda").view(-1, 1)
        scores = scores.masked_fill(~causal, float("-inf"))
        out.append(torch.einsum("hts,shd->thd", scores.softmax(-1), v))
        start += n
    return torch.cat(out)


# Staging tokens are split between two buffers: pieces of 64, 16 and 3 pages.
@pytest.mark.parametrize("staging_tokens", [4096, 1024, 192], ids=["one-piece", "two-pieces", "ten-pieces-replanned"])
def test_prefix_attention_in_pieces_equals_attention_over_the_whole_prefix(staging_tokens):
    check_prefix_attention(staging_tokens, torch.bfloat16)


@pytest.mark.parametrize("staging_tokens", [4096, 192], ids=["one-piece", "ten-pieces-replanned"])
def test_fp8_prefixes_are_attended_with_their_kv_scales(staging_tokens):
    """fp8 KV stores value / scale: the staged prefix is attended as stored x (k_scale, v_scale)."""
    check_prefix_attention(staging_tokens, torch.float8_e4m3fn, k_scale=0.5, v_scale=0.25)


def check_prefix_attention(staging_tokens, dtype, k_scale=None, v_scale=None):
    import flashinfer

    config = SparseConfig(host_cache_gb=1.0)
    page = config.page_size
    store = make_store(SHAPE, config, max_batch=len(PREFIX), max_context=40 * page, dtype=dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)
    host = store.host
    for t in (host.k, host.v):
        t.copy_(torch.randn(t.shape, device="cuda", generator=gen).to(t.dtype).cpu())
    # Request r (slot r + 1) holds host pages 1 + 40 r, 2 + 40 r, ... in reverse order (not contiguous).
    max_tokens = 40 * page
    req_to_token = torch.zeros(len(PREFIX) + 1, max_tokens, dtype=torch.int32, device="cuda")
    token_rows = []
    for r, n in enumerate(PREFIX):
        t = torch.arange(max_tokens, device="cuda")
        pages = 1 + 40 * r + (39 - t // page)
        req_to_token[r + 1] = (pages * page + t % page).to(torch.int32)
        token_rows.append(req_to_token[r + 1, :n].long().cpu())
    req_slots = torch.arange(1, len(PREFIX) + 1, device="cuda")
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    prefix = PrefixAttention(store, SHAPE.num_q_heads, workspace, staging_tokens)
    prefix.plan(req_to_token, req_slots, PREFIX, NEW)
    assert len(prefix.pieces) == -(-29 // staging_buffer_pages(staging_tokens, page))
    assert prefix.replans == (len(prefix.pieces) > PLANNED_PIECES)
    if torch.cuda.get_device_capability() == (9, 0) and not prefix.replans:
        # bf16 queries and KV (an fp8 prefix is staged as bf16): FlashInfer picks its Hopper kernels
        assert {w._backend for w in prefix.wrappers[: len(prefix.pieces)]} == {"fa3"}

    ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD")
    indptr = torch.tensor([0, *torch.tensor(NEW).cumsum(0).tolist()], dtype=torch.int32)
    total, scale = sum(NEW), SHAPE.head_dim**-0.5
    ragged.plan(indptr, indptr, SHAPE.num_q_heads, SHAPE.num_kv_heads, SHAPE.head_dim, causal=True, sm_scale=scale,
                q_data_type=torch.bfloat16)  # fmt: skip
    for layer in range(SHAPE.num_layers):
        q = torch.randn(total, SHAPE.num_q_heads, SHAPE.head_dim, device="cuda", generator=gen).bfloat16()
        new_k, new_v = (torch.randn(total, SHAPE.num_kv_heads, SHAPE.head_dim, device="cuda", generator=gen).bfloat16()
                        for _ in range(2))  # fmt: skip
        out, lse = ragged.run(q, new_k, new_v, return_lse=True)
        prefix.run(layer, q, out, lse, scale, k_scale=k_scale, v_scale=v_scale)
        host_k = host.k[layer].flatten(1, 2).cuda().float() * (k_scale or 1.0)  # [Hkv, host tokens, D]
        host_v = host.v[layer].flatten(1, 2).cuda().float() * (v_scale or 1.0)
        want = reference(q, new_k, new_v, host_k, host_v, token_rows, scale)
        torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
    store.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_a_chunked_prompts_resident_prefix_equals_attention_over_the_whole_prefix(dtype):
    """Slot 1's prompt in chunks: prefixes 0, 320 (10 pages staged into the buffer), 704 (20, the
    capacity; pages 20-21 staged as a piece) and 1000 (20 resident, 12 staged, the last one 8
    tokens long), the last chunk beside a new request (slot 2, a 100-token cached prefix) that
    takes the buffer over."""
    import flashinfer

    scales = (0.5, 0.25) if dtype == torch.float8_e4m3fn else (None, None)
    config = SparseConfig(host_cache_gb=1.0)
    page = config.page_size
    store = make_store(SHAPE, config, max_batch=3, max_context=40 * page, dtype=dtype)  # host pages up to 120
    gen = torch.Generator(device="cuda").manual_seed(1)
    host = store.host
    for t in (host.k, host.v):
        t.copy_(torch.randn(t.shape, device="cuda", generator=gen).to(t.dtype).cpu())
    max_tokens = 40 * page
    req_to_token = torch.zeros(3, max_tokens, dtype=torch.int32, device="cuda")
    t = torch.arange(max_tokens, device="cuda")
    for slot in (1, 2):  # host pages in reverse order, as above
        req_to_token[slot] = ((1 + 40 * slot + (39 - t // page)) * page + t % page).to(torch.int32)
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    prefix = PrefixAttention(store, SHAPE.num_q_heads, workspace, staging_tokens=1024, resident_tokens=20 * page)
    ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD")
    scale = SHAPE.head_dim**-0.5
    forwards = [([1], [0], [320]), ([1], [320], [384]), ([1], [704], [296]), ([1, 2], [1000, 100], [40, 9])]
    expected = [(None, 0), (10, 10), (20, 10), (20, 0)]  # (resident pages attended, pages staged into the buffer)
    for (slots, prefix_lens, new), (pages, filled) in zip(forwards, expected):
        prefix.plan(req_to_token, torch.tensor(slots, device="cuda"), prefix_lens, new, [(s, 1) for s in slots])
        assert (prefix.resident.pages or None, len(prefix.resident.fill)) == (pages, filled)
        if not prefix.active:
            continue
        indptr = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
        ragged.plan(indptr, indptr, SHAPE.num_q_heads, SHAPE.num_kv_heads, SHAPE.head_dim, causal=True,
                    sm_scale=scale, q_data_type=torch.bfloat16)  # fmt: skip
        token_rows = [req_to_token[s, :n].long().cpu() for s, n in zip(slots, prefix_lens)]
        for layer in range(SHAPE.num_layers):
            q = torch.randn(sum(new), SHAPE.num_q_heads, SHAPE.head_dim, device="cuda", generator=gen).bfloat16()
            new_k, new_v = (torch.randn(sum(new), SHAPE.num_kv_heads, SHAPE.head_dim, device="cuda",
                                        generator=gen).bfloat16() for _ in range(2))  # fmt: skip
            out, lse = ragged.run(q, new_k, new_v, return_lse=True)
            prefix.run(layer, q, out, lse, scale, k_scale=scales[0], v_scale=scales[1])
            host_k = host.k[layer].flatten(1, 2).cuda().float() * (scales[0] or 1.0)
            host_v = host.v[layer].flatten(1, 2).cuda().float() * (scales[1] or 1.0)
            want = reference(q, new_k, new_v, host_k, host_v, token_rows, scale, new)
            torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
    assert prefix.owner == (2, 1) and prefix.owner_pages == 0
    assert prefix.stats.resident_prefix_pages == 10 + 20 + 20
    store.close()
