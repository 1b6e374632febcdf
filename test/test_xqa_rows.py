"""The row layout ``--sparse-decode-kernel xqa`` attends (CPU): rows ``K`` pages apart and each
row's token count, as XQA reads a page table; what XQA refuses, refused in one line. The kernel
itself is checked on a GPU (``test/test_sparse_decode_gpu.py``)."""

import pytest
import torch

from sparse_sglang.attention.xqa import XqaAttention, check_xqa, row_tokens, strided_indptr


def test_rows_are_k_pages_apart():
    assert strided_indptr(3, 16).tolist() == [0, 16, 32, 48]


def test_a_rows_tokens_are_its_selected_pages_with_the_newest_partial_one_last():
    # 150 tokens: 5 pages, all selected (the newest holds 22); 640 tokens: 20 pages, 16 selected,
    # the newest full; 1 token (a CUDA graph's padding row): one page of one token
    num_pages, seq_lens = torch.tensor([5, 20, 1]), torch.tensor([150, 640, 1])
    tokens = row_tokens(num_pages, seq_lens, width=16, page_size=32, num_kv_heads=2)
    assert tokens.dtype == torch.int32
    assert tokens.tolist() == [150, 150, 15 * 32 + 32, 15 * 32 + 32, 1, 1]
    assert row_tokens(torch.tensor([20]), torch.tensor([625]), 16, 32, 1).tolist() == [15 * 32 + 17]


def test_the_plan_writes_the_static_buffer_and_refuses_more_rows_than_it_holds():
    indices = torch.zeros(4 * 16 + 1, dtype=torch.int32)
    xqa = XqaAttention(indices, max_rows=4, width=16, page_size=32, sm_scale=0.1, device="cpu")
    buffer = xqa.tokens.data_ptr()
    assert xqa.plan(torch.tensor([7, 9], dtype=torch.int32)) is xqa
    assert xqa.tokens[:2].tolist() == [7, 9] and xqa.tokens.data_ptr() == buffer
    with pytest.raises(ValueError, match="5 rows planned, the buffers hold 4"):
        xqa.plan(torch.ones(5, dtype=torch.int32))
    with pytest.raises(ValueError, match="pages of 16, 32, 64, 128 tokens, not 8"):
        XqaAttention(indices, max_rows=4, width=16, page_size=8, sm_scale=0.1, device="cpu")
    with pytest.raises(ValueError, match="holds 65 entries, 5 rows of 16 need more"):
        XqaAttention(indices, max_rows=5, width=16, page_size=32, sm_scale=0.1, device="cpu")


def test_what_xqa_cannot_attend_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match=r"^--sparse-decode-kernel xqa attends fp8_e4m3 KV only"):
        check_xqa(torch.bfloat16, 128, None, "cpu")
    with pytest.raises(ValueError, match=r"^--sparse-decode-kernel xqa takes head dimensions of 16-256 .* is 72"):
        check_xqa(torch.float8_e4m3fn, 72, None, "cpu")
    with pytest.raises(ValueError, match=r"^--sparse-decode-kernel xqa has no logits soft cap"):
        check_xqa(torch.float8_e4m3fn, 128, 30.0, "cpu")
