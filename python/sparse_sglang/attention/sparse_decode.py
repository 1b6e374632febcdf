"""Sparse decode over the per-head KV hierarchy, as a FlashInfer-style plan/run pair.

``plan`` runs once per decode step on the host (the scheduler's lengths are known there); ``run``
runs once per layer, on the device only:

1. **Score** every page each request holds from the GPU summaries (:func:`score_pages`), unless
   every context fits in the budget (then every page is selected, the exact path);
2. **Select** per (request, kv head) the sink pages, the recent pages (the partial newest one
   included) and the top-scored rest (:func:`select_pages`): ``K`` pages, ascending;
3. **Retrieve**: hits come from the GPU page cache, misses are loaded by FlashH2D into LRU slots
   of the request's cache row (:meth:`GPUPageCache.retrieve`);
4. **Attend** with FlashInfer's paged decode: every (request, kv head) is its own sequence of
   one kv head and its group's ``G`` query heads over its ``K`` cache slots (HND layout), the
   newest page last so ``last_page_len`` covers the partial page.
"""

from __future__ import annotations

import math

import torch

from sparse_sglang.attention.scoring import score_pages
from sparse_sglang.attention.selection import select_pages
from sparse_sglang.config import SparseConfig
from sparse_sglang.mem_cache.kv_store import SparseKVStore


class SparseDecoder:
    """Plan once per step, run once per layer (see module doc).

    Parameters
    ----------
    store : SparseKVStore
    config : SparseConfig
    num_q_heads : int
        Query heads per rank (``G = num_q_heads / num_kv_heads``).
    workspace : torch.Tensor
        FlashInfer float workspace (uint8, on the GPU); may be shared with other wrappers on the
        same stream.
    max_batch : int
        Most requests one step decodes.
    use_tensor_cores : bool
        FlashInfer's tensor-core decode (prefill kernels), better for ``G >= 4``.
    """

    def __init__(self, store: SparseKVStore, config: SparseConfig, num_q_heads: int, workspace: torch.Tensor,
                 max_batch: int, use_tensor_cores: bool | None = None):  # fmt: skip
        import flashinfer

        shape = store.shape
        self.store, self.config = store, config
        self.num_kv_heads, self.head_dim, self.page_size = shape.num_kv_heads, shape.head_dim, shape.page_size
        self.group = num_q_heads // shape.num_kv_heads
        self.width = min(config.budget_pages, shape.row_width)  # K: pages per (request, kv head)
        if use_tensor_cores is None:
            use_tensor_cores = self.group >= 4
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "HND", use_tensor_cores=use_tensor_cores)
        device = store.device
        rows = max_batch * shape.num_kv_heads
        # The wrapper reads page indices from this buffer; run() rewrites it per layer. The last
        # entry takes the padding of rows with fewer than K pages.
        self.indices = torch.zeros(rows * self.width + 1, dtype=torch.int32, device=device)
        self.kv = (store.cache.k.unsqueeze(1), store.cache.v.unsqueeze(1))  # [S, 1, P, D] HND
        self.selector = config.selector
        # Per step (plan).
        self.req_slots = self.host_pages = self.num_pages = self.dest = self.all_pages = None
        self.batch = 0
        self.exact = False

    def plan(self, req_slots: torch.Tensor, seq_lens_cpu: torch.Tensor, host_pages: torch.Tensor) -> None:
        """Prepare one decode step.

        Parameters
        ----------
        req_slots : torch.Tensor
            ``[B]`` request slots (GPU).
        seq_lens_cpu : torch.Tensor
            ``[B]`` tokens of each request, the one decoded now included (CPU).
        host_pages : torch.Tensor
            ``[B, N]`` host page id of each logical page (GPU), ``N >= max pages``.
        """
        batch, heads, width, page = req_slots.shape[0], self.num_kv_heads, self.width, self.page_size
        device = req_slots.device
        num_pages_cpu = (seq_lens_cpu + page - 1) // page
        selected_cpu = num_pages_cpu.clamp(max=width).to(torch.int32)  # pages per (request, head)
        per_row = selected_cpu.repeat_interleave(heads)
        indptr = torch.zeros(batch * heads + 1, dtype=torch.int32)
        torch.cumsum(per_row, 0, out=indptr[1:])
        last_page_len = ((seq_lens_cpu - 1) % page + 1).to(torch.int32).repeat_interleave(heads)
        nnz = int(indptr[-1])
        # Where entry (b, h, j) of a [B, Hkv, K] selection goes in the indices buffer.
        j = torch.arange(width).view(1, 1, width)
        dest = torch.where(j < selected_cpu.view(-1, 1, 1), indptr[:-1].view(batch, heads, 1) + j, self.indices.numel() - 1)
        self.dest = dest.view(-1).to(device, non_blocking=True)
        self.wrapper.plan(
            indptr, self.indices[:nnz], last_page_len, self.group, 1, self.head_dim, page,
            q_data_type=self.store.shape.dtype if self.store.shape.dtype.itemsize > 1 else torch.bfloat16,
            kv_data_type=self.store.shape.dtype,
        )  # fmt: skip
        self.req_slots, self.host_pages, self.batch = req_slots, host_pages, batch
        self.num_pages = num_pages_cpu.to(device, non_blocking=True)
        self.exact = self.config.exact_shortcut and int(num_pages_cpu.max()) <= width
        if self.exact:
            pages = torch.arange(width, device=device).view(1, 1, width)
            self.all_pages = torch.where(pages < self.num_pages.view(-1, 1, 1), pages, -1).expand(batch, heads, width)

    def select(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """``[B, Hkv, K]`` logical pages one layer attends (ascending, ``-1`` padded)."""
        if self.exact:
            return self.all_pages
        qg = q.view(self.batch, self.num_kv_heads, self.group, self.head_dim)
        scores = score_pages(self.selector, qg, self.store.summaries.layer(layer), self.host_pages, self.num_pages)
        recent = min(self.config.recent_pages, self.width)
        sink = min(self.config.sink_pages, self.width - recent)
        return select_pages(scores, self.num_pages, self.width, sink, recent).page_ids

    def run(self, layer: int, q: torch.Tensor, sm_scale: float | None = None, logits_soft_cap: float | None = None) -> torch.Tensor:
        """Sparse decode attention of one layer.

        Parameters
        ----------
        layer : int
        q : torch.Tensor
            ``[B, Hq, D]`` decode queries (post-RoPE).

        Returns
        -------
        torch.Tensor
            ``[B, Hq, D]``.
        """
        page_ids = self.select(layer, q)
        store = self.store
        slots = store.cache.retrieve(layer, self.req_slots, page_ids, self.host_pages, store.load, store.shape.num_host_pages)
        self.indices[self.dest] = slots.view(-1).to(torch.int32)
        qs = q.reshape(self.batch * self.num_kv_heads, self.group, self.head_dim)
        scale = self.head_dim**-0.5 if sm_scale is None else sm_scale
        out = self.wrapper.forward(qs, self.kv, sm_scale=scale, logits_soft_cap=logits_soft_cap or None)
        return out.view(q.shape)


def host_page_table(req_to_token: torch.Tensor, req_slots: torch.Tensor, num_pages: int, page_size: int) -> torch.Tensor:
    """``[B, num_pages]`` int32 host page id of each logical page of each request, read from
    SGLang's ``req_to_token`` rows (token location ``page * page_size + offset``)."""
    cols = torch.arange(num_pages, device=req_to_token.device) * page_size
    return (req_to_token[req_slots.long().view(-1, 1), cols.view(1, -1)] // page_size).to(torch.int32)


def exact_budget_pages(seq_len: int, page_size: int) -> int:
    """Pages a context of ``seq_len`` tokens holds (the budget that makes decode exact)."""
    return math.ceil(seq_len / page_size)
