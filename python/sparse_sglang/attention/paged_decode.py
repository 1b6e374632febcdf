"""Paged decode attention over few selected pages in one launch (a split-KV Triton kernel).

A sparse step at batch 1 attends 8 (request, kv head) rows of 64 pages each. FlashInfer's decode
runs that as two launches, the split attention and the merge of its splits (about 9 + 3 us on an
H100 whatever the context), with room for only a few programs per row. Here every program takes
``pages_per_split`` pages of one row and writes its partial output and log-sum-exp; the program
that finishes a row's last split (an arrival counter per row) merges them in the same launch.

It reads what FlashInfer's paged decode reads (the HND cache ``[slots, page_size, D]``, CSR
``indptr``/``indices``, ``last_page_len``) and computes the same thing: for each query head of a
row's group, softmax over the row's tokens (the newest page's first ``last_page_len`` tokens) of
``q . k * sm_scale`` (optionally soft-capped), times ``v``; fp8 KV is scaled by ``k_scale`` and
``v_scale``. :func:`paged_decode_reference` is the plain-torch reference.
"""

from __future__ import annotations

import math
import os

import torch

try:  # Triton comes with CUDA builds of torch (and runs on the CPU in its interpreter).
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def paged_decode_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor,
    last_page_len: torch.Tensor, sm_scale: float, logits_soft_cap: float | None = None, k_scale: float | None = None,
    v_scale: float | None = None,
) -> torch.Tensor:  # fmt: skip
    """``[rows, G, D]`` decode attention of each row's query heads over its pages (float32 math).

    ``k_cache``/``v_cache`` ``[slots, page_size, D]``; row ``r`` reads slots
    ``indices[indptr[r] : indptr[r + 1]]``, all of each page but the last, of which
    ``last_page_len[r]`` tokens.
    """
    rows, group, dim = q.shape
    out = torch.empty_like(q)
    for r in range(rows):
        slots = indices[int(indptr[r]) : int(indptr[r + 1])].long()
        keep = (len(slots) - 1) * k_cache.shape[1] + int(last_page_len[r])
        k = k_cache[slots].reshape(-1, dim)[:keep].float() * (k_scale or 1.0)
        v = v_cache[slots].reshape(-1, dim)[:keep].float() * (v_scale or 1.0)
        logits = q[r].float() @ k.T * sm_scale
        if logits_soft_cap:
            logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
        out[r] = (logits.softmax(-1) @ v).to(q.dtype)
    return out


if triton is not None:

    @triton.jit
    def _paged_decode_kernel(
        q_ptr, k_ptr, v_ptr, indptr_ptr, indices_ptr, last_len_ptr, out_ptr, part_o_ptr, part_lse_ptr, arrivals_ptr,
        sm_scale, k_scale, v_scale, soft_cap,
        G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, P: tl.constexpr, PAGES: tl.constexpr,
        SPLITS: tl.constexpr, GQ: tl.constexpr, SOFT_CAP: tl.constexpr, DOT_F32: tl.constexpr,
    ):  # fmt: skip
        # Program (row, split): the row's pages split * PAGES .. (split + 1) * PAGES, as one tile
        # of PAGES * P tokens. GP >= 16 query rows (tensor-core tiles; rows >= G are zero).
        row = tl.program_id(0)
        split = tl.program_id(1)
        start = tl.load(indptr_ptr + row)
        n = tl.load(indptr_ptr + row + 1) - start
        last_len = tl.load(last_len_ptr + row)
        t = tl.arange(0, PAGES * P)
        page = split * PAGES + t // P
        offset = t % P
        token = (page < n) & ((page < n - 1) | (offset < last_len))
        slot = tl.load(indices_ptr + start + page, mask=page < n, other=0).to(tl.int64)
        d = tl.arange(0, D)
        kv = slot[:, None] * (P * D) + offset[:, None] * D + d[None, :]
        g = tl.arange(0, GP)
        q = tl.load(q_ptr + (row * G + g[:, None]) * D + d[None, :], mask=g[:, None] < G, other=0.0)
        if DOT_F32:  # Triton's interpreter (CPU tests) has no bf16 matmul
            q = q.to(tl.float32)
        k = tl.load(k_ptr + kv, mask=token[:, None], other=0.0).to(q.dtype)
        logits = tl.dot(q, tl.trans(k)) * (sm_scale * k_scale)  # [GP, tokens] float32
        if SOFT_CAP:
            logits = soft_cap * (2.0 * tl.sigmoid(2.0 * logits / soft_cap) - 1.0)  # soft_cap * tanh(x / soft_cap)
        logits = tl.where(token[None, :], logits, float("-inf"))
        m = tl.max(logits, axis=1)
        m = tl.where(m > float("-inf"), m, 0.0)  # a split past the row's end: no tokens, no NaN
        p = tl.exp(logits - m[:, None])
        l = tl.sum(p, axis=1)
        # p stays float32 (a bf16 p flipped greedy tokens against dense decode on 4 of 10 prompts
        # through the server); "ieee": true float32 products, not TF32's 10-bit mantissas.
        v = tl.load(v_ptr + kv, mask=token[:, None], other=0.0).to(tl.float32)
        o = tl.dot(p, v, input_precision="ieee") * (v_scale / tl.where(l > 0, l, 1.0))[:, None]  # [GP, D]
        if SPLITS == 1:
            tl.store(out_ptr + (row * G + g[:, None]) * D + d[None, :], o.to(out_ptr.dtype.element_ty), mask=g[:, None] < G)
        else:
            part = row * SPLITS + split
            tl.store(part_o_ptr + (part * G + g[:, None]) * D + d[None, :], o, mask=g[:, None] < G)
            lse = tl.where(l > 0, m + tl.log(l), float("-inf"))
            tl.store(part_lse_ptr + part * G + g, lse, mask=g < G)
            # The row's last split to arrive merges (acq_rel: the others' partials are visible
            # to it; .cg loads skip L1, which never held them). It resets the counter for the next launch.
            if tl.atomic_add(arrivals_ptr + row, 1) == SPLITS - 1:
                s = tl.arange(0, SPLITS)[:, None]
                gq = tl.arange(0, GQ)[None, :]
                parts = (row * SPLITS + s) * G + gq  # [SPLITS, GQ] (split, query head) entries
                lse_all = tl.load(part_lse_ptr + parts, mask=gq < G, other=float("-inf"), cache_modifier=".cg")
                top = tl.max(lse_all, axis=0)
                w = tl.exp(lse_all - tl.where(top > float("-inf"), top, 0.0)[None, :])
                o_all = tl.load(part_o_ptr + parts[:, :, None] * D + d[None, None, :], mask=(gq < G)[:, :, None], other=0.0,
                                cache_modifier=".cg")  # fmt: skip
                merged = tl.sum(w[:, :, None] * o_all, axis=0) / tl.sum(w, axis=0)[:, None]  # [GQ, D]
                gd = tl.arange(0, GQ)[:, None] * D + d[None, :]
                tl.store(out_ptr + row * G * D + gd, merged.to(out_ptr.dtype.element_ty), mask=gd < G * D)
                tl.store(arrivals_ptr + row, 0)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class PagedDecode:
    """:func:`paged_decode_reference` in one Triton launch, for rows of up to ``max_pages`` pages.

    Parameters
    ----------
    max_rows : int
        Most (request, kv head) rows of one call (sizes the split buffers).
    max_pages : int
        Most pages a row holds.
    group, head_dim, page_size : int
    pages_per_split, num_warps : int
        Pages one program attends (a tile of ``pages_per_split * page_size`` tokens), and its warps.
    """

    def __init__(self, max_rows: int, max_pages: int, group: int, head_dim: int, page_size: int, device,
                 pages_per_split: int = 4, num_warps: int = 4):  # fmt: skip
        self.group, self.head_dim, self.page_size = group, head_dim, page_size
        self.pages_per_split, self.num_warps = pages_per_split, num_warps
        self.splits = next_pow2(math.ceil(max_pages / pages_per_split))
        self.max_rows = max_rows
        self.part_o = torch.empty(max_rows * self.splits * group * head_dim, dtype=torch.float32, device=device)
        self.part_lse = torch.empty(max_rows * self.splits * group, dtype=torch.float32, device=device)
        self.arrivals = torch.zeros(max_rows, dtype=torch.int32, device=device)

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, indptr: torch.Tensor,
                 indices: torch.Tensor, last_page_len: torch.Tensor, sm_scale: float, logits_soft_cap: float | None = None,
                 k_scale: float | None = None, v_scale: float | None = None, out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """``q`` ``[rows, G, D]`` (16-bit), the cache ``[slots, page_size, D]`` (16-bit or fp8),
        ``indptr`` ``[rows + 1]`` and ``indices`` int32, ``last_page_len`` ``[rows]`` int32 (all on
        the device; every row holds at least one page). Returns ``[rows, G, D]`` in ``q``'s dtype."""
        rows = q.shape[0]
        assert rows <= self.max_rows and q.shape[1:] == (self.group, self.head_dim), (q.shape, self.max_rows)
        assert k_cache.shape[1:] == (self.page_size, self.head_dim) and k_cache.is_contiguous() and v_cache.is_contiguous()
        if out is None:
            out = torch.empty_like(q)
        _paged_decode_kernel[(rows, self.splits)](
            q.contiguous(), k_cache, v_cache, indptr, indices, last_page_len, out, self.part_o, self.part_lse,
            self.arrivals, sm_scale, k_scale or 1.0, v_scale or 1.0, logits_soft_cap or 0.0,
            G=self.group, GP=max(16, next_pow2(self.group)), D=self.head_dim, P=self.page_size,
            PAGES=self.pages_per_split, SPLITS=self.splits, GQ=next_pow2(self.group),
            SOFT_CAP=bool(logits_soft_cap), DOT_F32=INTERPRETED, num_warps=self.num_warps,
        )  # fmt: skip
        return out
