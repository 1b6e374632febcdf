"""Top-k of page priorities: which ``K`` pages each (request, kv head) attends.

Three implementations of one contract, ``[R, N]`` float32 priorities -> ``[R, K]`` indices of
the ``K`` largest entries of each row, any order, ties broken arbitrarily:

- ``"radix"``: :func:`radix_select_topk`, one Triton program per row. A decode step's rows are
  short (a 128K context is 4097 pages of 32 tokens) and few at small batch (8 kv heads at batch
  1), where FlashInfer's top-k (built for vocabularies) costs ~16 us of a ~40 us step: here one
  program holds its row in registers, finds the ``K``-th largest value by a bitwise search over
  the float's order-preserving integer key (32 counting passes over registers), then writes the
  ``K`` winners with one prefix sum. One launch, no sorting, no workspace.
- ``"flashinfer"``: FlashInfer's radix top-k (``flashinfer.top_k``).
- ``"torch"``: ``torch.topk`` (the reference; also any device).
"""

from __future__ import annotations

import torch

try:  # Triton comes with CUDA builds of torch; the CPU path does not need it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

TOPK_IMPLS = ("radix", "flashinfer", "torch")
# A row lives in one program's registers; longer rows (contexts past 16384 pages, 512K tokens of
# 32-token pages) take FlashInfer's top-k.
MAX_RADIX_ROW = 16384


if triton is not None:

    @triton.jit
    def _radix_select_kernel(prio_ptr, out_ptr, n, row_stride, out_stride, K: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        x = tl.load(prio_ptr + row * row_stride + offs, mask=offs < n, other=float("-inf"))
        # Order-preserving integer key: flip the magnitude bits of negative floats, then shift to
        # unsigned order (held in int64, so plain signed compares work). Entries past n rank below
        # every float, -inf included.
        bits = x.to(tl.int32, bitcast=True)
        key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64) + 2147483648
        key = tl.where(offs < n, key, -1)
        # The K-th largest key: the largest t with count(key >= t) >= K, built bit by bit.
        kth = tl.zeros([], dtype=tl.int64)
        for i in tl.static_range(32):
            cand = kth | (1 << (31 - i))
            kth = tl.where(tl.sum((key >= cand).to(tl.int32), axis=0) >= K, cand, kth)
        above = key > kth
        tie = key == kth
        # Every key above the K-th, then the first ties (by index) up to K.
        room = K - tl.sum(above.to(tl.int32), axis=0)
        take = above | (tie & (tl.cumsum(tie.to(tl.int32), axis=0) <= room))
        slot = tl.cumsum(take.to(tl.int32), axis=0) - 1
        tl.store(out_ptr + row * out_stride + slot, offs, mask=take)


def radix_select_topk(priority: torch.Tensor, k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``[R, k]`` int32 indices of the ``k`` largest entries of each row of ``priority`` ``[R, N]``
    (float32, ``k <= N <= MAX_RADIX_ROW``; CUDA, or CPU under Triton's interpreter)."""
    rows, n = priority.shape
    assert 0 < k <= n <= MAX_RADIX_ROW, (k, n)
    priority = priority.contiguous().float()
    if out is None:
        out = torch.empty(rows, k, dtype=torch.int32, device=priority.device)
    block = triton.next_power_of_2(n)
    warps = 4 if block <= 1024 else 8 if block <= 4096 else 16
    _radix_select_kernel[(rows,)](priority, out, n, priority.stride(0), out.stride(0), K=k, BLOCK=block, num_warps=warps)
    return out


def topk_pages(priority: torch.Tensor, k: int, impl: str = "radix") -> torch.Tensor:
    """Indices ``[..., k]`` (any order, any integer dtype) of the ``k`` largest entries of each row
    of ``priority`` ``[..., N]``, by ``impl`` (see module doc)."""
    if impl not in TOPK_IMPLS:
        raise ValueError(f"top-k impl must be one of {TOPK_IMPLS}, got {impl!r}")
    rows = priority.reshape(-1, priority.shape[-1])
    if impl == "radix" and triton is not None and rows.shape[-1] <= MAX_RADIX_ROW and (rows.is_cuda or _interpreted()):
        ids = radix_select_topk(rows, k)
    elif impl in ("radix", "flashinfer") and rows.is_cuda:
        import flashinfer

        ids = flashinfer.top_k(rows, k)[1]
    else:
        ids = torch.topk(rows, k, dim=-1, sorted=False).indices
    return ids.view(*priority.shape[:-1], k)


def _interpreted() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"
