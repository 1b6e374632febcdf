"""A decode step's selection in one launch: score and top-k together (``fused_select.cu``).

The fused path otherwise scores in one launch (:func:`~sparse_sglang.attention.scoring.score_pages`)
and selects in another (FlashInfer's radix top-k); at batch 1 each costs its launch latency more
than its work. :func:`fused_select` does both: the CTAs scoring a (request, kv head) row also count
their scores in the row's histogram of key bits and their own arrivals, and the last one to arrive
finds the histogram bin of the row's ``K``-th largest score, takes every page above it, and splits
that one bin by radix passes.

It covers the default selection: Quest with the group's scores summed, over one-byte bounds (int8
levels, the default for 16-bit KV, or fp8 ones for fp8 KV), head_dim 64 or 128
(:func:`fused_select_supported`). :func:`fused_select_reference` is the same selection from the
score kernel and ``torch.topk``: the GPU tests compare the two.
"""

from __future__ import annotations

import torch

from sparse_sglang.attention.selectors import DEFAULT_GROUP_REDUCE
from sparse_sglang.transfer.native import attention_ext

ONE_BYTE_BOUNDS = (torch.int8, torch.float8_e4m3fn)
COUNTERS_PER_ROW = 2048 + 1  # the kernel's histogram bins (a key's top 11 bits) and the arrival count


def select_counters(rows: int, device: torch.device | str) -> torch.Tensor:
    """The zeroed ``counters`` buffer :func:`fused_select` needs for up to ``rows`` (request, kv head) rows."""
    return torch.zeros(rows, COUNTERS_PER_ROW, dtype=torch.int32, device=device)


def fused_select_supported(selector: str, bound_dtype: torch.dtype, head_dim: int, q_dtype: torch.dtype,
                           group_reduce: str = DEFAULT_GROUP_REDUCE) -> bool:  # fmt: skip
    """Whether :func:`fused_select` takes this selection (else the score kernel and a top-k do)."""
    return (selector == "quest" and group_reduce == "sum" and bound_dtype in ONE_BYTE_BOUNDS and head_dim in (64, 128)
            and q_dtype in (torch.bfloat16, torch.float16))  # fmt: skip


def fused_select(
    q: torch.Tensor, layer_summaries: dict[str, torch.Tensor], host_pages: torch.Tensor, num_pages: torch.Tensor,
    forced: tuple[int, int], k: int, counters: torch.Tensor, scores: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[B, Hkv, k]`` int32: the ``k`` pages of highest selection priority of each (request, kv
    head) row, in no fixed order, ``-1`` past a row holding fewer than ``k`` pages (what
    :func:`~sparse_sglang.attention.sparse_decode.topk_pages` gives over
    :func:`~sparse_sglang.attention.scoring.score_pages` with ``forced``).

    Parameters
    ----------
    q : torch.Tensor
        ``[B, Hkv, G, D]`` decode queries (bf16 or fp16).
    layer_summaries : dict
        One layer's ``kmin``/``kmax`` ``[Hkv, pages, D]`` (one-byte) and, for int8 levels, ``bound_exp``.
    host_pages : torch.Tensor
        ``[B, N]`` int32 host page of each logical page, rows contiguous, ``N >= num_pages.max()``.
    num_pages : torch.Tensor
        ``[B]`` int32 pages each request holds.
    forced : tuple
        ``(sink, recent)`` pages every row keeps.
    counters : torch.Tensor
        ``[>= B * Hkv, COUNTERS_PER_ROW]`` int32 (:func:`select_counters`), zero before the first
        call (each call leaves it zero): each row's histogram and arrival count, a buffer that lives
        as long as the caller.
    scores : torch.Tensor, optional
        ``[>= B * Hkv, >= N]`` float32 scratch (allocated when not given).
    """
    batch, heads = q.shape[:2]
    if scores is None:
        scores = torch.empty(batch * heads, host_pages.shape[1], dtype=torch.float32, device=q.device)
    out = torch.empty(batch, heads, k, dtype=torch.int32, device=q.device)
    attention_ext().fused_select(q.contiguous(), layer_summaries["kmin"], layer_summaries["kmax"],
                                 layer_summaries.get("bound_exp"), host_pages.to(torch.int32), num_pages.to(torch.int32),
                                 scores, counters, out, *forced)  # fmt: skip
    return out


def fused_select_reference(
    q: torch.Tensor, layer_summaries: dict[str, torch.Tensor], host_pages: torch.Tensor, num_pages: torch.Tensor,
    forced: tuple[int, int], k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, priority)``: the same selection from the score kernel and ``torch.topk`` (``ids``
    ``[B, Hkv, k]`` int64, ``-1`` for none), and the priorities it ranked (``[B, Hkv, N]``)."""
    from sparse_sglang.attention.scoring import score_pages

    priority = score_pages("quest", q, layer_summaries, host_pages, num_pages, forced=forced)
    width = min(k, priority.shape[-1])
    top = priority.topk(width, dim=-1)
    ids = torch.where(top.values > float("-inf"), top.indices, -1)
    if width < k:
        ids = torch.nn.functional.pad(ids, (0, k - width), value=-1)
    return ids, priority
