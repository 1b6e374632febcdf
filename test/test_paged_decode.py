"""The one-launch split-KV decode (``attention.paged_decode``) against its torch reference, and on
the GPU against FlashInfer's paged decode over the same pages.

Without CUDA the kernel runs in Triton's interpreter (``test/conftest.py``); on the GPU host the
same tests run it compiled, and the ``gpu`` test compares it with FlashInfer.
"""

from __future__ import annotations

import pytest
import torch

from sparse_sglang.attention.paged_decode import PagedDecode, paged_decode_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_rows(pages_per_row, group, dim, page, kv_dtype, seed, slots=None):
    """Query heads, a KV cache and CSR page tables of rows holding ``pages_per_row`` pages each."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    rows, total = len(pages_per_row), sum(pages_per_row)
    slots = slots or total + 7
    k_cache = torch.randn(slots, page, dim, device=DEVICE, generator=gen).to(kv_dtype)
    v_cache = torch.randn(slots, page, dim, device=DEVICE, generator=gen).to(kv_dtype)
    q_dtype = torch.bfloat16 if kv_dtype.itemsize == 1 else kv_dtype
    q = torch.randn(rows, group, dim, device=DEVICE, generator=gen).to(q_dtype)
    indptr = torch.zeros(rows + 1, dtype=torch.int32, device=DEVICE)
    indptr[1:] = torch.cumsum(torch.tensor(pages_per_row, device=DEVICE), 0)
    indices = torch.randperm(slots, device=DEVICE, generator=gen)[:total].to(torch.int32)
    last_page_len = torch.randint(1, page + 1, (rows,), device=DEVICE, generator=gen).to(torch.int32)
    return q, k_cache, v_cache, indptr, indices, last_page_len


@pytest.mark.parametrize(
    "pages_per_row, group, dim, page, kv_dtype, soft_cap, pages_per_split",
    [
        ([5, 1, 7, 8], 4, 64, 8, torch.bfloat16, None, 2),  # splits past a row's end; one program a row's only page
        ([3, 2], 3, 32, 16, torch.float16, 30.0, 1),  # a group of 3 (SmolLM2's), soft cap
        ([4, 3], 4, 32, 8, torch.float8_e4m3fn, None, 4),  # fp8 KV with scales, one split per row: no merge
    ],
    ids=["bf16-mixed-rows", "fp16-group3-softcap", "fp8-one-split"],
)
def test_split_decode_equals_the_reference(pages_per_row, group, dim, page, kv_dtype, soft_cap, pages_per_split):
    q, k_cache, v_cache, indptr, indices, last = random_rows(pages_per_row, group, dim, page, kv_dtype, seed=len(pages_per_row))
    decode = PagedDecode(8, max(pages_per_row), group, dim, page, DEVICE, pages_per_split=pages_per_split)
    scales = (0.5, 2.0) if kv_dtype.itemsize == 1 else (None, None)
    want = paged_decode_reference(q, k_cache, v_cache, indptr, indices, last, dim**-0.5, soft_cap, *scales)
    for _ in range(2):  # the merging program resets its row's arrival count for the next launch
        got = decode(q, k_cache, v_cache, indptr, indices, last, dim**-0.5, soft_cap, *scales)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert (decode.arrivals == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("rows", [8, 64])
def test_split_decode_equals_flashinfer_on_the_8b_shape(rows, kv_dtype):
    """Rows of the 8B shape's sparse step (group 4, head_dim 128, pages of 32, 64 selected pages;
    some rows shorter): the split kernel and FlashInfer's paged decode agree within bf16 rounding."""
    import flashinfer

    pages = [64 - (r % 5) * 7 for r in range(rows)]
    q, k_cache, v_cache, indptr, indices, last = random_rows(pages, 4, 128, 32, kv_dtype, seed=rows)
    scales = (0.5, 2.0) if kv_dtype.itemsize == 1 else (None, None)
    got = PagedDecode(rows, 64, 4, 128, 32, DEVICE)(q, k_cache, v_cache, indptr, indices, last, 128**-0.5, None, *scales)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=DEVICE), "HND",
                                                            use_tensor_cores=True)  # fmt: skip
    wrapper.plan(indptr.cpu(), indices, last.cpu(), 4, 1, 128, 32, q_data_type=q.dtype, kv_data_type=kv_dtype)
    want = wrapper.forward(q, (k_cache.unsqueeze(1), v_cache.unsqueeze(1)), sm_scale=128**-0.5, k_scale=scales[0],
                           v_scale=scales[1])  # fmt: skip
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)
