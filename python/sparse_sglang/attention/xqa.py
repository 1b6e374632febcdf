"""XQA over the selected pages (``--sparse-decode-kernel xqa``): FlashInfer's XQA decode kernel
in the place of its paged decode wrapper, for fp8 KV on Hopper and newer GPUs.

FlashInfer's wrapper reads each (request, kv head) row's pages through ``indptr``/``indices``;
XQA reads a dense page table, ``[rows, K]`` cache slots, and each row's token count. The decoder
therefore lays rows out at a fixed stride of ``K`` (``indptr[r] = r * K``, :func:`strided_indptr`)
so that its indices buffer *is* that table; a row's selected pages come first, in ascending
order, the newest (partial) page last, and :func:`row_tokens` says how many tokens it attends.

What XQA changes: with fp8 KV on an SM90 GPU it runs its fp8 kernel, which rounds the queries and
the attention probabilities to e4m3 before the tensor cores take them (FlashInfer's paged decode
converts the keys and values to 16 bits instead and keeps queries and probabilities in 16 bits).
The queries are rounded as they are, their scale applied to the products after: a query entry
beyond e4m3's 448 saturates, one below about 2e-3 loses bits or vanishes.
That is a precision change, so the answers suite judges it before it could be a default. Its
reference is the same as FlashInfer's: :func:`~sparse_sglang.attention.reference.sparse_attention_reference`
over the selected pages (``test/test_sparse_decode_gpu.py``).

Example (on a GPU; ``k_cache``/``v_cache`` ``[slots, 1, page, head_dim]`` fp8, HND)::

    xqa = XqaAttention(indices, max_rows=64, width=16, page_size=32, sm_scale=128**-0.5, device="cuda")
    xqa.plan(row_tokens(num_pages, seq_lens, width=16, page_size=32, num_kv_heads=8))
    out = xqa.run(q_rows, (k_cache, v_cache), k_scale=1.0, v_scale=1.0)   # [rows, group, head_dim]
"""

from __future__ import annotations

import torch

from sparse_sglang.config import XQA_PAGE_SIZES

# XQA's semaphores (FlashInfer's xqa_batch_decode_with_kv_cache keeps the first 8 MiB of its
# workspace for them; they must start at zero and reset themselves) and its scratch for split
# rows: a row is split only while rows x kv heads are few (at most about a quarter of three rows
# per SM in all), which needs well under a MiB of partial outputs at head_dim 256.
WORKSPACE_BYTES = 16 << 20
ARCHS = (9, 10, 12)  # compute capability majors XQA runs on


def strided_indptr(rows: int, width: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[rows + 1]`` int32 offsets of rows ``width`` entries apart: row ``r``'s pages at ``r * width``."""
    return torch.arange(rows + 1, dtype=torch.int32, device=device) * width


def row_tokens(num_pages: torch.Tensor, seq_lens: torch.Tensor, width: int, page_size: int,
               num_kv_heads: int) -> torch.Tensor:  # fmt: skip
    """``[B * Hkv]`` int32 tokens each (request, kv head) row attends: its ``min(pages, K)``
    selected pages, the newest (partial, ``(seq_len - 1) % page + 1`` tokens) last."""
    selected = num_pages.clamp(max=width).to(torch.int32)
    newest = ((seq_lens - 1) % page_size + 1).to(torch.int32)
    return ((selected - 1) * page_size + newest).repeat_interleave(num_kv_heads)


class XqaAttention:
    """XQA decode over rows of ``width`` pages at a fixed stride in ``indices``, planned and run
    as FlashInfer's wrappers are: :meth:`plan` once per step (it writes each row's token count
    into a static buffer, on the device), :meth:`run` once per layer. Every buffer it reads is
    allocated here, once, so a step captured in a CUDA graph replays against the same addresses.

    Parameters
    ----------
    indices : torch.Tensor
        The decoder's int32 indices buffer, at least ``max_rows * width`` entries: row ``r``'s
        cache slots at ``r * width``.
    max_rows : int
        Most (request, kv head) rows a step attends.
    width : int
        ``K``, pages per row.
    page_size : int
        Tokens per page (one of ``XQA_PAGE_SIZES``).
    sm_scale : float
        The model's softmax scale.
    device : torch.device
    """

    def __init__(self, indices: torch.Tensor, max_rows: int, width: int, page_size: int, sm_scale: float,
                 device: torch.device | str):  # fmt: skip
        if page_size not in XQA_PAGE_SIZES:
            raise ValueError(f"XQA takes pages of {', '.join(map(str, XQA_PAGE_SIZES))} tokens, not {page_size}")
        if indices.numel() < max_rows * width:
            raise ValueError(
                f"the indices buffer holds {indices.numel()} entries, {max_rows} rows of {width} need more"
            )
        self.indices, self.width, self.page_size, self.sm_scale = indices, width, page_size, sm_scale
        self.tokens = torch.ones(max_rows, dtype=torch.int32, device=device)  # each row's, rewritten by plan
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)

    def plan(self, tokens: torch.Tensor) -> XqaAttention:
        """Take this step's ``[rows]`` token counts (:func:`row_tokens`, on the device) into the
        static buffer; returns ``self`` (the step's plan holds it as its wrapper)."""
        rows = tokens.numel()
        if rows > self.tokens.numel():
            raise ValueError(f"{rows} rows planned, the buffers hold {self.tokens.numel()}")
        self.tokens[:rows].copy_(tokens)
        return self

    def run(self, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], k_scale: float | None = None,
            v_scale: float | None = None) -> torch.Tensor:  # fmt: skip
        """``[rows, G, D]`` attention of the planned rows' queries ``q`` ``[rows, G, D]`` (16-bit)
        over their pages of ``kv`` (``[slots, 1, page, D]`` K and V, HND); ``k_scale``/``v_scale``:
        fp8 KV's per-tensor scales (stored = value / scale), as FlashInfer's ``run`` takes them.
        ``q``'s rows are the last :meth:`plan`'s."""
        from flashinfer.decode import xqa_batch_decode_with_kv_cache

        rows = q.shape[0]
        k_scale = 1.0 if k_scale is None else k_scale
        v_scale = 1.0 if v_scale is None else v_scale
        return xqa_batch_decode_with_kv_cache(
            q, kv, self.workspace, self.indices[: rows * self.width].view(rows, self.width),
            self.tokens[:rows].view(torch.uint32), self.width * self.page_size,
            bmm1_scale=self.sm_scale * k_scale, bmm2_scale=v_scale, kv_layout="HND",
        )  # fmt: skip


def check_xqa(kv_dtype: torch.dtype, head_dim: int, logits_soft_cap: float | None, device: torch.device | str) -> None:
    """Refuse, in one line naming the flag, what XQA cannot attend: KV other than fp8 e4m3, a head
    dimension its kernels are not built for, a logits soft cap (XQA has none), a GPU older than
    Hopper."""
    flag = "--sparse-decode-kernel xqa"
    if kv_dtype != torch.float8_e4m3fn:
        raise ValueError(f"{flag} attends fp8_e4m3 KV only, this KV is {kv_dtype} (set --kv-cache-dtype fp8_e4m3)")
    if head_dim % 16 or not 16 <= head_dim <= 256:
        raise ValueError(f"{flag} takes head dimensions of 16-256 in steps of 16; this model's is {head_dim}")
    if logits_soft_cap:
        raise ValueError(f"{flag} has no logits soft cap, which this model's attention needs: use flashinfer")
    major = torch.cuda.get_device_capability(device)[0]
    if major not in ARCHS:
        raise ValueError(
            f"{flag} runs on compute capability {', '.join(f'{a}.x' for a in ARCHS)}; this GPU is {major}.x"
        )
