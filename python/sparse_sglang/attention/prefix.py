"""Dense prefill over a cached prefix whose KV lives on the host.

Prefill stays dense: new tokens attend to each other with FlashInfer's ragged kernel, and to
their prefix (an earlier chunk of a chunked prefill, or a prefix the radix cache shares) with
FlashInfer's paged kernel. Here the prefix is on the host, so per layer FlashH2D first stages
the prefix pages of every kv head into a GPU buffer laid out ``[pages, Hkv, P, D]`` (HND), then
the paged kernel reads them. The caller merges both halves by their log-sum-exp.
"""

from __future__ import annotations

import math

import torch

from sparse_sglang.mem_cache.kv_store import SparseKVStore


class PrefixAttention:
    """Stage prefixes from the host and attend to them (plan once per forward, run per layer).

    Parameters
    ----------
    store : SparseKVStore
    num_q_heads : int
    workspace : torch.Tensor
        FlashInfer float workspace (GPU, uint8).
    staging_tokens : int
        Prefix tokens one forward may stage without growing the buffer (e.g. the context length).
    """

    def __init__(self, store: SparseKVStore, num_q_heads: int, workspace: torch.Tensor, staging_tokens: int):
        import flashinfer

        shape = store.shape
        self.store, self.num_q_heads = store, num_q_heads
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "HND")
        self._allocate(math.ceil(staging_tokens / shape.page_size))
        self.active = False

    def _allocate(self, pages: int) -> None:
        from sparse_sglang.transfer import FlashH2D

        s = self.store.shape
        self.k = torch.empty(pages * s.num_kv_heads, s.page_size, s.head_dim, dtype=s.dtype, device=self.store.device)
        self.v = torch.empty_like(self.k)
        self.load = FlashH2D(self.store.host.k, self.store.host.v, self.k, self.v)
        self.kv = tuple(t.view(pages, s.num_kv_heads, s.page_size, s.head_dim) for t in (self.k, self.v))
        self.capacity = pages

    def plan(self, req_to_token: torch.Tensor, req_slots: torch.Tensor, prefix_lens_cpu: list[int],
             extend_lens_cpu: list[int]) -> None:  # fmt: skip
        """Prepare one extend forward; no-op (``active`` false) when no request has a prefix."""
        s = self.store.shape
        page, heads = s.page_size, s.num_kv_heads
        self.active = any(prefix_lens_cpu)
        if not self.active:
            return
        prefix = torch.tensor(prefix_lens_cpu, dtype=torch.int64)
        pages = (prefix + page - 1) // page
        total = int(pages.sum())
        if total > self.capacity:  # a batch of long cached prefixes: grow once, keep the size
            self._allocate(total)
        device = req_slots.device
        # Host page of every prefix page, request by request.
        owner = torch.repeat_interleave(torch.arange(len(prefix)), pages).to(device)
        first = torch.cumsum(pages, 0) - pages
        column = (torch.arange(total) - torch.repeat_interleave(first, pages)).to(device) * page
        host_page = req_to_token[req_slots.long()[owner], column].long() // page  # [total]
        head = torch.arange(heads, device=device)
        self.src_base = (head.view(1, -1) * s.num_host_pages + host_page.view(-1, 1)).reshape(-1)  # + layer * H * N
        self.dst = torch.arange(total * heads, device=device)
        qo_indptr = torch.zeros(len(prefix) + 1, dtype=torch.int32)
        torch.cumsum(torch.tensor(extend_lens_cpu, dtype=torch.int32), 0, out=qo_indptr[1:])
        kv_indptr = torch.zeros(len(prefix) + 1, dtype=torch.int32)
        torch.cumsum(pages.to(torch.int32), 0, out=kv_indptr[1:])
        last_page_len = torch.where(pages > 0, prefix - (pages - 1) * page, 0).to(torch.int32)
        indices = torch.arange(total, dtype=torch.int32, device=device)
        q_dtype = s.dtype if s.dtype.itemsize > 1 else torch.bfloat16
        self.wrapper.plan(qo_indptr, kv_indptr, indices, last_page_len, self.num_q_heads, heads, s.head_dim, page,
                          causal=False, q_data_type=q_dtype, kv_data_type=s.dtype)  # fmt: skip

    def run(self, layer: int, q: torch.Tensor, sm_scale: float, logits_soft_cap: float | None = None):
        """``(out, lse)`` of ``q`` ``[T, Hq, D]`` over the prefixes of one layer."""
        s = self.store.shape
        self.load(self.src_base + layer * s.num_kv_heads * s.num_host_pages, self.dst)
        return self.wrapper.forward_return_lse(q, self.kv, causal=False, sm_scale=sm_scale,
                                               logits_soft_cap=logits_soft_cap or None)  # fmt: skip
