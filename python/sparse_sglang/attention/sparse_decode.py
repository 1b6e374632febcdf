"""Sparse decode over the per-head KV hierarchy, as a FlashInfer-style plan/run pair.

Contract: :meth:`SparseDecoder.plan` runs once per decode step on the host (the scheduler's
lengths are known there) and returns the step's :class:`DecodePlan`, a frozen record of every
tensor and size the step's layers read; :meth:`SparseDecoder.run` runs once per layer, on the
device only, and reads the plan it is given. The decoder owns what outlives a step: the FlashInfer
wrappers, the indices and miss buffers, the CUDA-graph static buffers (:class:`GraphBuffers`, which
a graph step's plan points at and which ``plan`` rewrites in place), the selection log. No
attribute of the decoder is rebound per step. It does not own rows, the step counter or
counters of the store: the step's owner (``SparseRuntime.begin_decode``) changes those before it
plans; the decoder reads the cache and summaries and, per layer, retrieves into the request's row.
Its one counter is ``stats.coarse_first_steps``.

Per layer:

1. **Score** every page each request holds from the GPU summaries (:func:`score_pages`), unless
   every context fits in the budget (then every page is selected, the exact path);
2. **Select** per (request, kv head) the sink pages, the recent pages (the partial newest one
   included) and the top-scored rest: ``K`` pages (the score kernel ranks the forced pages
   first, a top-k takes ``K``; :func:`select_pages` is the reference). With
   ``reselect_interval`` N > 1 a request selects from all its pages once every N of its steps and
   in between only among the pages its cache row holds (:func:`keep_cached`). With
   ``coarse_pages`` S > 0 the score is coarse first: super-pages of S pages are scored from their
   joint bounds (:func:`score_coarse`; each super-page's bounds are built once, in ``plan``), a
   top-k keeps ``coarse_candidates`` budgets' worth of them, and only their pages and the newest
   ones are scored page by page (:func:`score_candidates`);
3. **Retrieve**: hits come from the GPU page cache, misses are loaded by FlashH2D into LRU slots
   of the request's cache row (one fused kernel, :func:`retrieve_pages`, finds them and writes
   FlashInfer's indices; :func:`retrieve_reference` is the reference);
   With ``rerank_factor`` F > 1 the selection takes ``F x K`` candidates, retrieval loads them
   all, and the ``K`` with the most exact attention mass (their cached keys against the step's
   queries, :mod:`~sparse_sglang.attention.rerank`) are the ones attended; with ``rerank_by``
   sketch the ``F x K`` candidates are ranked by their tokens' key sketches on the GPU instead,
   with ``quantized`` by their mass from their keys' low-bit codes on the GPU, and only the ``K``
   chosen are loaded;
4. **Attend** with FlashInfer's paged decode: every (request, kv head) is its own sequence of
   one kv head and its group's ``G`` query heads over its ``K`` cache slots (HND layout), the
   newest page last so ``last_page_len`` covers the partial page. With ``decode_kernel`` xqa
   (fp8 KV) FlashInfer's XQA kernel attends instead, over the same rows laid out ``K`` apart
   (:mod:`~sparse_sglang.attention.xqa`).

With ``budget_share`` (``--sparse-budget-share``) steps 1, 2 and 4 change: the score kernel runs
once per query head, a request's ``Hkv x K`` pages of a layer are shared among its kv heads by
their estimated shares of each head's mass (:mod:`~sparse_sglang.attention.budget_share`), and
attention runs over rows of a fixed number of pages, each head's merged
(:mod:`~sparse_sglang.attention.unit_rows`), so that the plan made once per step serves every
layer's widths.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sparse_sglang.attention.budget_share import CAP_UNITS, UNITS, head_log_shares, share_budget
from sparse_sglang.attention.constants import LayerConstants
from sparse_sglang.attention.reference import retrieve_reference, score_coarse_reference
from sparse_sglang.attention.rerank import choose_by_codes, choose_by_sketch, rerank_candidates
from sparse_sglang.attention.retrieval import MAX_RETRIEVE_CELLS, fits_fused_retrieve, next_pow2, retrieve_pages
from sparse_sglang.attention.scoring import candidate_pages, score_candidates, score_coarse, score_pages
from sparse_sglang.attention.selection import keep_cached, select_pages
from sparse_sglang.attention.unit_rows import UnitBuffers, UnitRows, attend_units, plan_unit_rows
from sparse_sglang.attention.xqa import XqaAttention, check_xqa, row_tokens, strided_indptr
from sparse_sglang.config import SparseConfig
from sparse_sglang.mem_cache.kernels import build_coarse
from sparse_sglang.mem_cache.key_sketch import project_query
from sparse_sglang.mem_cache.kv_store import SparseKVStore
from sparse_sglang.mem_cache.summaries import coarse_built
from sparse_sglang.mem_cache.utils import host_to_device, kv_compute_dtype
from sparse_sglang.stats import SparseStats

TOPK_IMPLS = ("flashinfer", "torch")


def topk_pages(priority: torch.Tensor, k: int, impl: str = "flashinfer", lengths: torch.Tensor | None = None,
               offsets: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Indices ``[..., k]`` (any order) of the ``k`` largest entries of each row of ``priority``
    ``[..., N]``, among the first ``lengths`` (``[rows]`` int32, default ``N``) of the row.

    ``"flashinfer"``: FlashInfer's radix top-k in its ragged form (int32 out, ``-1`` past a row
    shorter than ``k``; it reads only each row's own entries, so a CUDA-graph row sized for the
    longest context costs what the request's pages do; ``offsets`` is a ``[rows]`` int32 zero
    buffer to reuse). ``"torch"``: ``torch.topk`` (int64 out; ``lengths`` is not read, so
    entries past a row's length must be ``-inf``).
    """
    rows = priority.reshape(-1, priority.shape[-1])
    if impl == "flashinfer":
        import flashinfer

        num_rows, device = rows.shape[0], rows.device
        if lengths is None:
            lengths = torch.full((num_rows,), rows.shape[1], dtype=torch.int32, device=device)
        if offsets is None:
            offsets = torch.zeros(num_rows, dtype=torch.int32, device=device)
        ids = flashinfer.top_k_ragged_transform(rows, offsets[:num_rows], lengths[:num_rows], k)
    else:
        ids = torch.topk(rows, k, dim=-1, sorted=False).indices
    return ids.view(*priority.shape[:-1], k)


@dataclass(frozen=True, slots=True)
class DecodePlan:
    """One decode step as every layer of it reads it: made once per step by
    :meth:`SparseDecoder.plan` (in the server through ``SparseRuntime.begin_decode``), read by
    :meth:`SparseDecoder.run`, never changed. In a CUDA-graph step every tensor is a view of the
    decoder's :class:`GraphBuffers` (the same addresses at capture and at each replay, their
    contents rewritten in place); in an eager step they are the step's own.
    """

    # fmt: off
    batch:      int                  # B: requests (a graph batch's padding rows included)
    req_slots:  torch.Tensor         # [B]          request slots (slot 0: padding, no cache row)
    num_pages:  torch.Tensor         # [B]          int32 pages each request holds
    row_pages:  torch.Tensor         # [B * Hkv]    int32 the same per selection row (the top-k's lengths)
    host_pages: torch.Tensor         # [B, N]       int32 host page of each logical page
    max_pages:  int                  # columns of host_pages scored (a graph's: the store's max_pages)
    indptr:     torch.Tensor         # [B * Hkv + 1] int32 FlashInfer indptr: row r's pages at indptr[r]
    wrapper:    object               # the FlashInfer decode wrapper planned for this step
    exact:      bool                 # every page selected: no scoring (the exact shortcut)
    all_pages:  torch.Tensor | None  # [B, Hkv, K]  the exact shortcut's selection
    reselect:   torch.Tensor | None  # [B] bool     requests selecting from all their pages (None: all)
    dest:       torch.Tensor | None  # [B * Hkv * K] where the torch path writes a selection's slots
    use_coarse: bool                 # super-pages scored first (--sparse-coarse-pages)
    built:      torch.Tensor | None  # [B]          int32 complete super-pages per request
    built_rows: torch.Tensor | None  # [B * Hkv]    int32 the same per selection row
    units:      UnitRows | None      # --sparse-budget-share, past the exact shortcut: the step's unit rows
    # fmt: on


def _indptr(per_row: torch.Tensor) -> torch.Tensor:
    """``[R + 1]`` int32 offsets of ``R`` rows holding ``per_row`` entries each, on its device."""
    indptr = torch.zeros(per_row.numel() + 1, dtype=torch.int32, device=per_row.device)
    torch.cumsum(per_row, 0, out=indptr[1:])
    return indptr


@dataclass(frozen=True, slots=True)
class GraphBuffers:
    """The static buffers of CUDA-graph decode steps (on the GPU), for batches of up to
    ``max_batch`` requests: a captured step reads its per-step values from here, and
    :meth:`SparseDecoder.plan` rewrites their first ``batch`` (or ``batch * Hkv``) entries in
    place before each replay; each step's :class:`DecodePlan` holds views of them. Allocated once, before any capture; never reallocated (the graphs hold their
    addresses).
    """

    # fmt: off
    indptr:        torch.Tensor  # [max_batch * Hkv + 1] int32  FlashInfer indptr (the graph wrappers' buffer)
    last_page_len: torch.Tensor  # [max_batch * Hkv]     int32  FlashInfer last_page_len
    num_pages:     torch.Tensor  # [max_batch]           int32  pages each request holds
    row_pages:     torch.Tensor  # [max_batch * Hkv]     int32  the same per selection row (the top-k's lengths)
    host_pages:    torch.Tensor  # [max_batch, max_pages] int32 host page of each logical page
    reselect:      torch.Tensor  # [max_batch]           bool   requests selecting from all their pages
    built:         torch.Tensor  # [max_batch]           int32  complete super-pages (coarse-first)
    built_rows:    torch.Tensor  # [max_batch * Hkv]     int32  the same per selection row
    # fmt: on

    @classmethod
    def allocate(cls, max_batch: int, num_kv_heads: int, max_pages: int, device: torch.device) -> GraphBuffers:
        rows = max_batch * num_kv_heads
        i32 = dict(dtype=torch.int32, device=device)
        return cls(
            indptr=torch.zeros(rows + 1, **i32), last_page_len=torch.ones(rows, **i32),
            num_pages=torch.ones(max_batch, **i32), row_pages=torch.ones(rows, **i32),
            host_pages=torch.zeros(max_batch, max_pages, **i32),
            reselect=torch.ones(max_batch, dtype=torch.bool, device=device),
            built=torch.zeros(max_batch, **i32), built_rows=torch.zeros(rows, **i32),
        )  # fmt: skip


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
    topk : str
        ``"flashinfer"`` (radix top-k) or ``"torch"``.
    sm_scale, logits_soft_cap : float, optional
        The model's softmax scale (default ``head_dim ** -0.5``) and logits soft cap (default
        none), planned once per step as FlashInfer's ``run`` takes them: every layer's must be
        these (:meth:`run` refuses another, rather than attend with the wrong one).

    Each layer runs the fused kernels: the score kernel writes selection priorities, a top-k
    selects, :func:`~sparse_sglang.attention.retrieval.retrieve_pages` does the cache bookkeeping
    and writes FlashInfer's indices, FlashH2D loads the misses. :class:`TorchPathDecoder` is the
    same decoder over the torch references (:func:`make_decoder` picks between them).
    """

    def __init__(self, store: SparseKVStore, config: SparseConfig, num_q_heads: int, workspace: torch.Tensor,
                 max_batch: int, use_tensor_cores: bool | None = None, topk: str = "flashinfer",
                 sm_scale: float | None = None, logits_soft_cap: float | None = None,
                 stats: SparseStats | None = None):  # fmt: skip
        import flashinfer

        shape = store.shape
        self.store, self.config = store, config
        self.num_kv_heads, self.head_dim, self.page_size = shape.num_kv_heads, shape.head_dim, shape.page_size
        self.constants = LayerConstants.of(shape.head_dim, sm_scale, logits_soft_cap)
        self.group = num_q_heads // shape.num_kv_heads
        self.width = min(config.budget_pages, shape.row_width)  # K: pages per (request, kv head)
        # Kc > K with re-ranking (--sparse-rerank-factor): candidates loaded, the K with the most
        # exact mass attended; 0: off.
        candidates = min(config.candidate_pages, shape.row_width)
        self.candidates = candidates if candidates > self.width else 0
        # Kc > K re-ranked by their key sketches (--sparse-rerank-by sketch): only the K chosen
        # are loaded; 0: off.
        self.sketch_candidates = config.sketch_candidates if config.sketch_candidates > self.width else 0
        if self.sketch_candidates and store.summaries.key_basis is None:
            raise ValueError("the sketch re-rank needs a store that keeps key sketches (SparseKVStore(key_basis=...))")
        # Kc > K re-ranked by their mass from their key codes (--sparse-rerank-by quantized): only
        # the K chosen are loaded; 0: off.
        self.code_candidates = config.code_candidates if config.code_candidates > self.width else 0
        if self.code_candidates and store.summaries.key_codes is None:
            raise ValueError("the quantized re-rank needs a store that keeps key codes (SparseKVStore(key_bits=...))")
        # --sparse-budget-share: a layer's pages shared among its heads, up to CAP_UNITS quarters
        # of K each (the config admits it only without re-ranks and coarse-first selection).
        self.share = config.budget_share
        self.selected = CAP_UNITS * self.width // UNITS if self.share else self.width  # most pages a head attends
        if use_tensor_cores is None:
            use_tensor_cores = self.group >= 4
        self.workspace, self.use_tensor_cores = workspace, use_tensor_cores
        self.q_data_type = kv_compute_dtype(shape.dtype)  # the dtype FlashInfer attends in
        self.eager_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "HND", use_tensor_cores=use_tensor_cores
        )
        self.graph_wrappers: dict = {}  # batch size -> CUDA-graph wrapper (init_cuda_graph)
        self.unit_wrappers: dict = {}  # batch size -> wrapper over unit rows (--sparse-budget-share)
        if topk not in TOPK_IMPLS:
            raise ValueError(f"topk must be one of {TOPK_IMPLS}, got {topk!r}")
        self.topk = topk
        # --sparse-decode-kernel xqa: rows at a fixed stride of K pages, so that the indices
        # buffer is XQA's page table (:mod:`~sparse_sglang.attention.xqa`)
        self.xqa = config.decode_kernel == "xqa"
        if self.xqa:
            check_xqa(shape.dtype, shape.head_dim, self.constants.logits_soft_cap, store.device)
        self._alloc_row_buffers(max_batch * shape.num_kv_heads)
        self.kv = (store.cache.k.unsqueeze(1), store.cache.v.unsqueeze(1))  # [S, 1, P, D] HND
        self.selector, self.group_reduce = config.selector, config.group_reduce
        if self.selector == "sketch" and store.summaries.key_basis is None:
            raise ValueError("the sketch selector needs a store that keeps key sketches (SparseKVStore(key_basis=...))")
        recent = min(config.recent_pages, self.width)
        self.forced = (min(config.sink_pages, self.width - recent), recent)  # (sink, recent) pages
        self.interval = config.reselect_interval
        # Coarse-first selection, where a request can hold more super-pages than it keeps.
        self.coarse = config.coarse_pages if store.summaries.coarse_pages else 0
        self.supers = config.coarse_supers(max(self.width, self.candidates)) if self.coarse else 0
        if self.coarse and shape.max_pages // self.coarse <= self.supers:
            self.coarse = 0
        self.coarse_tail = self.coarse + self.forced[1] - 1  # most pages a request holds from built * S on
        self.stats = SparseStats() if stats is None else stats  # counts coarse-first steps (server info)
        self.graph: GraphBuffers | None = None  # static buffers of CUDA-graph mode (init_cuda_graph)
        # [max_batch, num_layers, Hkv, K] each layer's selection of the current step, -1 = none
        # (allocated by log_selections: the working-set tracker reads it after the step).
        self.selection_log: torch.Tensor | None = None

    def _alloc_row_buffers(self, rows: int) -> None:
        """Buffers sized by the most (request, kv head) rows a step selects for."""
        device = self.store.device
        # The wrapper reads page indices from this buffer; run() rewrites it per layer. The last
        # entry takes the padding of rows with fewer than K pages (reference path); unit rows'
        # padding rows take UNITS more per row. Entries only ever hold cache slots (zeros at first).
        per_row = self.width + (UNITS if self.share else 0)
        self.indices = torch.zeros(rows * per_row + 1, dtype=torch.int32, device=device)
        # FlashH2D's copy list, written by retrieve_pages.
        self.miss_src = torch.empty(rows * max(self.selected, self.candidates), dtype=torch.int64, device=device)
        self.miss_dst = torch.empty_like(self.miss_src)
        # Re-ranking: each row's candidates' cache slots at row * Kc (a fixed layout the retrieve
        # kernel writes through its indptr), and a row's ranks 0..K-1 (where its choice goes).
        kc = self.candidates
        self.candidate_slots = torch.zeros(rows * kc, dtype=torch.int32, device=device)
        self.candidate_indptr = (torch.arange(rows + 1, dtype=torch.int32) * kc).to(device)
        self.ranks = torch.arange(self.width, dtype=torch.int64, device=device).view(1, -1)
        self.topk_offsets = torch.zeros(rows, dtype=torch.int32, device=device)  # ragged top-k: rows start at 0
        self.unit_buffers = (
            UnitBuffers.allocate(rows // self.num_kv_heads, self.num_kv_heads, device) if self.share else None
        )
        self.xqa_indptr = strided_indptr(rows, self.width, device) if self.xqa else None
        self.xqa_attention = (
            XqaAttention(self.indices, rows, self.width, self.page_size, self.constants.sm_scale, device)
            if self.xqa
            else None
        )

    def log_selections(self, max_batch: int) -> torch.Tensor:
        """Keep each step's selections (every layer's) in :attr:`selection_log`, a static buffer
        that CUDA-graph steps write too."""
        shape = (max_batch, self.store.shape.num_layers, self.num_kv_heads, self.selected)
        self.selection_log = torch.full(shape, -1, dtype=torch.int32, device=self.store.device)
        return self.selection_log

    def init_cuda_graph(self, max_batch: int) -> None:
        """Static buffers for decode steps captured in CUDA graphs, batches of up to ``max_batch``.

        A captured step cannot change its path or shapes, so in graph mode every step scores (no
        exact shortcut) over the most pages a request can hold (the store's ``max_pages``; pages
        past a request's end score ``-inf``, or go unread by FlashInfer's ragged top-k), and
        per-step values live in these buffers, rewritten by :meth:`plan` before each replay.
        Request slot 0 (SGLang's padding row) has no cache row: ``retrieve_pages`` skips it.
        """
        heads, device = self.num_kv_heads, self.store.device
        rows = max_batch * heads
        if self.miss_src.numel() < rows * self.selected:  # before any capture: the buffers never move after
            self._alloc_row_buffers(rows)
        self.graph = GraphBuffers.allocate(max_batch, heads, self.store.shape.max_pages, device)

    def _graph_wrapper(self, batch: int):
        """FlashInfer's wrapper over ``batch`` requests' (request, kv head) rows, on the graph buffers."""
        rows = batch * self.num_kv_heads
        return self._static_wrapper(self.graph_wrappers, batch, self.graph.indptr[: rows + 1],
                                    self.graph.last_page_len[:rows])  # fmt: skip

    def _unit_wrapper(self, batch: int):
        """FlashInfer's wrapper over ``batch`` requests' unit rows, on the static unit buffers (a
        layer rewrites their ``last_page_len``; one per batch size, eager or captured)."""
        rows = batch * UNITS * self.num_kv_heads
        return self._static_wrapper(self.unit_wrappers, batch, self.unit_buffers.indptr[: rows + 1],
                                    self.unit_buffers.last_page_len[:rows])  # fmt: skip

    def _static_wrapper(self, wrappers: dict, batch: int, indptr: torch.Tensor, last_page_len: torch.Tensor):
        """``wrappers[batch]``, made on first use: a CUDA-graph-ready FlashInfer wrapper reading
        ``indptr``, :attr:`indices` and ``last_page_len`` (static buffers, never reallocated)."""
        import flashinfer

        if batch not in wrappers:
            wrappers[batch] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "HND", use_cuda_graph=True, use_tensor_cores=self.use_tensor_cores,
                paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=self.indices,
                paged_kv_last_page_len_buffer=last_page_len,
            )  # fmt: skip
        return wrappers[batch]

    def plan(self, req_slots: torch.Tensor, seq_lens_cpu: torch.Tensor, host_pages: torch.Tensor, *,
             seq_lens: torch.Tensor, graph: bool = False, reselect: torch.Tensor | None = None) -> DecodePlan:  # fmt: skip
        """Plan one decode step: FlashInfer's plan, the step's tensors, the coarse bounds it needs.

        Parameters
        ----------
        req_slots : torch.Tensor
            ``[B]`` request slots (GPU).
        seq_lens_cpu, seq_lens : torch.Tensor
            ``[B]`` tokens of each request, the one decoded now included, on the host (FlashInfer's
            plan reads it) and on the device (the step's device tensors are computed there: no
            copy from the host, which for pageable memory may wait for the forward before, which
            the overlap scheduler runs while this plans).
        host_pages : torch.Tensor
            ``[B, N]`` host page id of each logical page (GPU), ``N >= max pages``.
        graph : bool
            A step of a CUDA graph (captured or replayed; see :meth:`init_cuda_graph`): the plan's
            tensors are views of the static :class:`GraphBuffers`, rewritten in place.
        reselect : torch.Tensor, optional
            ``[B]`` bool, which requests select from all their pages (``--sparse-reselect-interval``
            > 1: :meth:`GPUPageCache.due_for_selection`, which the step's owner asks); None: all.

        Returns
        -------
        DecodePlan
            What :meth:`run` reads for every layer of the step. No attribute of the decoder changes.
        """
        batch, heads, width, page = req_slots.shape[0], self.num_kv_heads, self.width, self.page_size
        device = req_slots.device
        num_pages_cpu = (seq_lens_cpu + page - 1) // page
        num_pages_dev = ((seq_lens + page - 1) // page).to(torch.int32)
        if graph:  # a captured step cannot change its path: it scores, over the store's most pages
            max_pages, exact = self.graph.host_pages.shape[1], False
        else:
            max_pages = int(num_pages_cpu.max())
            exact = self.config.exact_shortcut and max_pages <= width
        units = None
        if self.share and not exact:  # unit rows: every layer's widths under one plan
            indptr = plan_unit_rows(num_pages_cpu, width, heads)
            last_page_len = torch.full((indptr.numel() - 1,), page, dtype=torch.int32)  # a layer's units end heads
            wrapper, dest = self._unit_wrapper(batch), None
            units = UnitRows.build(num_pages_dev, seq_lens, width, heads, page, self.unit_buffers, batch)
        else:
            selected_cpu = num_pages_cpu.clamp(max=width).to(torch.int32)  # pages per (request, head)
            if self.xqa:  # rows K apart: the indices buffer is XQA's page table; each row's token
                # count computed on the device into XQA's static buffer
                indptr = strided_indptr(batch * heads, width)
                wrapper = self.xqa_attention.plan(row_tokens(num_pages_dev, seq_lens, width, page, heads))
            else:
                indptr = torch.zeros(batch * heads + 1, dtype=torch.int32)
                torch.cumsum(selected_cpu.repeat_interleave(heads), 0, out=indptr[1:])
                last_page_len = ((seq_lens_cpu - 1) % page + 1).to(torch.int32).repeat_interleave(heads)
                wrapper = self._graph_wrapper(batch) if graph else self.eager_wrapper
            dest = self._plan_indices(indptr, selected_cpu, device)
        if not self.xqa:  # FlashInfer's wrappers (unit rows' included) plan on the host
            wrapper.plan(
                indptr, self.indices[: int(indptr[-1])], last_page_len, self.group, 1, self.head_dim, page,
                q_data_type=self.q_data_type,
                kv_data_type=self.store.shape.dtype,
                sm_scale=self.constants.sm_scale, logits_soft_cap=self.constants.logits_soft_cap,
            )  # fmt: skip
        g = self.graph if graph else None
        if graph:  # into the static buffers the captured kernels read (the same at capture and every replay)
            g.host_pages[:batch, : host_pages.shape[1]].copy_(host_pages)
        coarse = self._plan_coarse(batch, max_pages, num_pages_dev, num_pages_cpu, g, host_pages, exact)
        if graph:
            return DecodePlan(
                batch=batch, req_slots=req_slots, num_pages=g.num_pages[:batch].copy_(num_pages_dev),
                row_pages=g.row_pages[: batch * heads].copy_(num_pages_dev.repeat_interleave(heads)),
                host_pages=g.host_pages[:batch], max_pages=max_pages,
                # the graph wrapper's (its plan filled it), or XQA's fixed strides
                indptr=self.xqa_indptr[: batch * heads + 1] if self.xqa else g.indptr[: batch * heads + 1],
                wrapper=wrapper, exact=False, all_pages=None, dest=dest,
                reselect=None if reselect is None else g.reselect[:batch].copy_(reselect), units=units, **coarse,
            )  # fmt: skip
        all_pages = None
        if exact:
            # Every page is selected: no scoring (pages >= n are padding).
            pages = torch.arange(width, device=device).view(1, 1, width)
            all_pages = torch.where(pages < num_pages_dev.view(-1, 1, 1), pages, -1).expand(batch, heads, width)
        row_pages = num_pages_dev.repeat_interleave(heads)
        step_indptr = self.xqa_indptr[: batch * heads + 1] if self.xqa else _indptr(row_pages.clamp(max=width))
        return DecodePlan(batch=batch, req_slots=req_slots, num_pages=num_pages_dev, row_pages=row_pages,
                          host_pages=host_pages, max_pages=max_pages, indptr=step_indptr,
                          wrapper=wrapper, exact=exact, all_pages=all_pages, reselect=reselect, dest=dest,
                          units=units, **coarse)  # fmt: skip

    def _plan_indices(
        self, indptr: torch.Tensor, selected_cpu: torch.Tensor, device: torch.device
    ) -> torch.Tensor | None:
        """Where a layer's selection goes in FlashInfer's indices: nothing to plan here, the
        retrieve kernel writes each row at its ``indptr`` (:class:`TorchPathDecoder` plans it)."""
        return None

    def _plan_coarse(self, batch: int, max_pages: int, num_pages: torch.Tensor, num_pages_cpu: torch.Tensor,
                     g: GraphBuffers | None = None, host_pages: torch.Tensor | None = None,
                     exact: bool = False) -> dict:  # fmt: skip
        """The plan's coarse-first fields: complete super-pages per request, and their coarse
        bounds built where missing (one launch for every layer: new super-pages since the last
        step, all of a new request's)."""
        off = dict(use_coarse=False, built=None, built_rows=None)
        if not self.coarse or exact:
            return off
        heads, recent = self.num_kv_heads, self.forced[1]
        built = coarse_built(num_pages, self.coarse, recent)
        max_built = int(coarse_built(num_pages_cpu, self.coarse, recent).max())  # on the host: sizes a grid
        pays = self.config.coarse_pays(batch, max_pages, self.width)
        if g is not None:  # a CUDA graph's path is fixed per batch size, for the longest context
            built = g.built[:batch].copy_(built)
            built_rows = g.built_rows[: batch * heads].copy_(built.repeat_interleave(heads))
            host_pages, use_coarse = g.host_pages[:batch], pays
        else:
            built_rows = built.repeat_interleave(heads)
            use_coarse = max_built > self.supers and pays  # else every super-page would be kept
        if not use_coarse:
            return off
        coarse = dict(use_coarse=True, built=built, built_rows=built_rows)
        if torch.cuda.is_current_stream_capturing():  # capture: no real pages
            return coarse
        self.stats.coarse_first_steps += 1
        if max_built > 0:
            self._build_coarse(host_pages, built, max_built)
        return coarse

    def _build_coarse(self, host_pages: torch.Tensor, built: torch.Tensor, max_built: int) -> None:
        """The coarse bounds of the super-pages not built yet (one launch for every layer)."""
        build_coarse(self.store.summaries, host_pages, built, max_built)

    def select(self, layer: int, q: torch.Tensor, plan: DecodePlan) -> torch.Tensor:
        """``[B, Hkv, K]`` logical pages one layer attends (``-1`` padded; any order)."""
        ids = self.select_raw(layer, q, plan)
        return torch.where(ids < plan.num_pages.view(-1, 1, 1), ids, -1)

    def select_raw(self, layer: int, q: torch.Tensor, plan: DecodePlan, width: int | None = None) -> torch.Tensor:
        """The selection as :meth:`run` uses it: entries ``-1`` or ``>= num_pages`` (what the top-k
        gives a request holding fewer than ``K`` pages) stand for none. ``width``: pages per
        (request, kv head), ``K`` by default (the re-rank's candidates take ``Kc``)."""
        if plan.exact:
            return plan.all_pages
        width = self.width if width is None else width
        qg = q.view(plan.batch, self.num_kv_heads, self.group, self.head_dim)
        summaries = self.store.summaries.layer(layer)
        # FlashInfer's ragged top-k reads each row up to its request's pages, so the score kernel
        # leaves the rest of the row unwritten; torch.topk reads whole rows, so there the rest
        # scores -inf and its picks (of a request holding < K pages) are ids >= num_pages, which
        # retrieve_pages ignores like the ragged top-k's -1. Requests reusing their selection
        # score only the pages their rows hold (TorchPathDecoder masks full scores: the GPU tests
        # compare them).
        ragged = self.topk == "flashinfer"
        reuse = None if plan.reselect is None else self.store.cache.cached_rows(layer, plan.req_slots, plan.reselect)
        if plan.use_coarse:
            host_pages = plan.host_pages[:, : plan.max_pages]
            coarse = score_coarse(qg, self.store.summaries.coarse_layer(layer), host_pages, plan.built, self.coarse,
                                  self.forced[0], self.group_reduce, reselect=plan.reselect)  # fmt: skip
            supers = topk_pages(coarse, self.supers, self.topk, plan.built_rows, self.topk_offsets)
            priority = score_candidates(self.selector, qg, summaries, host_pages, plan.num_pages, supers, plan.built,
                                        self.coarse, self.coarse_tail, self.group_reduce, forced=self.forced,
                                        reuse=reuse)  # fmt: skip
            return topk_pages(priority, width, self.topk, plan.row_pages, self.topk_offsets)
        priority = score_pages(self.selector, self.scoring_query(layer, qg), summaries,
                               plan.host_pages[:, : plan.max_pages], plan.num_pages, self.group_reduce,
                               forced=self.forced, reuse=reuse, fill_tail=not ragged)  # fmt: skip
        if plan.max_pages <= width:  # every page fits (the exact shortcut is off): pad, so the
            priority = F.pad(priority, (0, width + 1 - plan.max_pages), value=-math.inf)  # top-k has a choice
        return topk_pages(priority, width, self.topk, plan.row_pages, self.topk_offsets)

    def scoring_query(self, layer: int, qg: torch.Tensor) -> torch.Tensor:
        """What the score kernel takes for queries ``[B, Hkv, G, D]``: themselves, or for the
        sketch selector the group's sum projected by the layer's key basis (``[B, Hkv, 1, rank]``)."""
        if self.selector != "sketch":
            return qg
        return project_query(qg, self.store.summaries.key_basis.queries[layer])

    def run(self, layer: int, q: torch.Tensor, plan: DecodePlan, sm_scale: float | None = None,
            logits_soft_cap: float | None = None, k_scale: float | None = None,
            v_scale: float | None = None) -> torch.Tensor:  # fmt: skip
        """Sparse decode attention of one layer.

        Parameters
        ----------
        layer : int
        q : torch.Tensor
            ``[B, Hq, D]`` decode queries (post-RoPE).
        plan : DecodePlan
            The step's (:meth:`plan`; in the server, ``SparseRuntime.begin_decode``).
        sm_scale, logits_soft_cap : float, optional
            The layer's; ``None``, or equal to the decoder's (a mismatch raises ``ValueError``).
        k_scale, v_scale : float, optional
            Per-tensor scales of fp8 KV (stored = value / scale), as FlashInfer takes them.

        Returns
        -------
        torch.Tensor
            ``[B, Hq, D]``.
        """
        self.constants.check(sm_scale, logits_soft_cap, "sparse decoder")
        if plan.units is not None:
            return self._run_shared(layer, q, plan, k_scale, v_scale)
        if self.candidates and not plan.exact:  # the exact re-rank loads its candidates first
            page_ids = self._rerank(layer, q, plan, k_scale)
        else:
            page_ids = self._choose(layer, q, plan, k_scale)
            self._retrieve(layer, page_ids, plan)
        if self.selection_log is not None:  # -1 for none (the top-k's picks past a request's end)
            log = self.selection_log[: plan.batch, layer]
            log[..., : self.width] = torch.where(page_ids < plan.num_pages.view(-1, 1, 1), page_ids, -1)
            log[..., self.width :] = -1  # a shared budget's wider log, on an exact step
        qs = q.reshape(plan.batch * self.num_kv_heads, self.group, self.head_dim)
        return plan.wrapper.run(qs, self.kv, k_scale=k_scale, v_scale=v_scale).view(q.shape)

    def _run_shared(self, layer: int, q: torch.Tensor, plan: DecodePlan, k_scale: float | None,
                    v_scale: float | None) -> torch.Tensor:  # fmt: skip
        """One layer under ``--sparse-budget-share``: the heads' scores, the layer's pages shared
        among them (:func:`share_budget`), retrieval at this layer's widths, attention over the
        step's unit rows with each head's units merged (:func:`attend_units`)."""
        store, batch, heads = self.store, plan.batch, self.num_kv_heads
        qg = q.view(batch, heads, self.group, self.head_dim)
        chosen = share_budget(self.log_shares(layer, qg, plan), plan.num_pages, self.width, *self.forced)
        rows = plan.units.layer(chosen.widths)
        n = batch * heads * self.selected
        src, dst = self.miss_src[:n], self.miss_dst[:n]
        retrieve_pages(store.cache.view, layer, plan.req_slots, chosen.page_ids, plan.num_pages, plan.host_pages,
                       store.shape.num_host_pages, rows.indptr, self.indices, src, dst)  # fmt: skip
        store.load(src, dst)
        if self.selection_log is not None:
            self.selection_log[:batch, layer] = chosen.page_ids
        return attend_units(plan.wrapper, qg, self.kv, rows, k_scale=k_scale, v_scale=v_scale).view(q.shape)

    def log_shares(self, layer: int, qg: torch.Tensor, plan: DecodePlan) -> torch.Tensor:
        """``[B, Hkv, N]`` each page's estimated share of its kv head's mass, as a log
        (:func:`head_log_shares`): the score kernel once per query head of the group, each over
        the pages a request selects from (only those its cache row holds, when it reuses its
        selection)."""
        store = self.store
        reuse = None if plan.reselect is None else store.cache.cached_rows(layer, plan.req_slots, plan.reselect)
        summaries, host_pages = store.summaries.layer(layer), plan.host_pages[:, : plan.max_pages]
        # [G, B, Hkv, N]: each query head's scores written in place (a contiguous [B, Hkv, N] each)
        per_head = torch.empty(self.group, *qg.shape[:2], plan.max_pages, dtype=torch.float32, device=qg.device)
        for g in range(self.group):
            score_pages(self.selector, qg[:, :, g : g + 1], summaries, host_pages, plan.num_pages, reuse=reuse,
                        out=per_head[g])  # fmt: skip
        return head_log_shares(per_head.permute(1, 2, 0, 3), self.constants.sm_scale)

    def _rerank(self, layer: int, q: torch.Tensor, plan: DecodePlan, k_scale: float | None) -> torch.Tensor:
        """Select ``Kc`` candidates, load them (hits, misses, LRU as any selection), keep the ``K``
        with the most exact attention mass (:mod:`~sparse_sglang.attention.rerank`) and write
        FlashInfer's indices for them; returns the ``[B, Hkv, K]`` pages attended (``-1``: none)."""
        store, kc, rows = self.store, self.candidates, plan.batch * self.num_kv_heads
        candidates = self.select_raw(layer, q, plan, kc)
        n = rows * kc
        slots, src, dst = self.candidate_slots[:n], self.miss_src[:n], self.miss_dst[:n]
        retrieve_pages(store.cache.view, layer, plan.req_slots, candidates, plan.num_pages, plan.host_pages,
                       store.shape.num_host_pages, self.candidate_indptr[: rows + 1], slots, src, dst)  # fmt: skip
        store.load(src, dst)
        c = self.constants
        chosen_pages, chosen_slots = rerank_candidates(candidates, plan.row_pages, slots.view(rows, kc),
                                                       q.reshape(rows, self.group, self.head_dim), store.cache.k,
                                                       self.width, self.forced, c.sm_scale, k_scale,
                                                       c.logits_soft_cap)  # fmt: skip
        # Row r's choice at indptr[r] .. (min(num_pages, K) of them, as planned); the padding to
        # the buffer's last entry.
        at = torch.where(
            chosen_pages >= 0, plan.indptr[:-1].view(rows, 1).long() + self.ranks, self.indices.numel() - 1
        )
        self.indices.scatter_(0, at.view(-1), chosen_slots.view(-1).to(torch.int32))
        return chosen_pages.view(plan.batch, self.num_kv_heads, self.width)

    def _choose(self, layer: int, q: torch.Tensor, plan: DecodePlan, k_scale: float | None) -> torch.Tensor:
        """The ``[B, Hkv, K]`` pages one layer attends, chosen from what the GPU holds before any
        page is loaded: the summaries' top ``K``, or their ``Kc`` candidates re-ranked by key
        sketches or key codes."""
        if plan.exact or not (self.sketch_candidates or self.code_candidates):
            return self.select_raw(layer, q, plan)
        if self.sketch_candidates:
            return self._sketch_rerank(layer, q, plan)
        return self._code_rerank(layer, q, plan, k_scale)

    def _sketch_rerank(self, layer: int, q: torch.Tensor, plan: DecodePlan) -> torch.Tensor:
        """``Kc`` candidates from the summaries, the ``K`` whose best token's key sketch scores
        highest (:func:`~sparse_sglang.attention.rerank.choose_by_sketch`): ``[B, Hkv, K]`` pages,
        ``-1`` padded."""
        candidates = self.select_raw(layer, q, plan, self.sketch_candidates)
        qg = q.view(plan.batch, self.num_kv_heads, self.group, self.head_dim)
        summaries = self.store.summaries
        return choose_by_sketch(qg, summaries.key_basis.queries[layer], summaries.layer(layer)["sketch"],
                                plan.host_pages[:, : plan.max_pages], candidates, plan.num_pages, self.width,
                                self.forced)  # fmt: skip

    def _code_rerank(self, layer: int, q: torch.Tensor, plan: DecodePlan, k_scale: float | None) -> torch.Tensor:
        """``Kc`` candidates from the summaries, the ``K`` with the most attention mass estimated
        from their key codes (:func:`~sparse_sglang.attention.rerank.choose_by_codes`): ``[B, Hkv, K]``
        pages, ``-1`` padded."""
        candidates = self.select_raw(layer, q, plan, self.code_candidates)
        qg = q.view(plan.batch, self.num_kv_heads, self.group, self.head_dim)
        codes, c = self.store.summaries.key_codes, self.constants
        return choose_by_codes(qg, codes.layer(layer), codes.bits, plan.host_pages[:, : plan.max_pages], candidates,
                               plan.num_pages, self.width, self.forced, c.sm_scale, k_scale,
                               c.logits_soft_cap)  # fmt: skip

    def _retrieve(self, layer: int, page_ids: torch.Tensor, plan: DecodePlan) -> None:
        """Hits and misses of one layer's selection, the misses loaded, FlashInfer's indices
        written (retrieve_pages takes each row's pages in ascending order: a fixed FlashInfer sum
        order)."""
        store = self.store
        n = plan.batch * self.num_kv_heads * self.width
        src, dst = self.miss_src[:n], self.miss_dst[:n]
        retrieve_pages(store.cache.view, layer, plan.req_slots, page_ids, plan.num_pages, plan.host_pages,
                       store.shape.num_host_pages, plan.indptr, self.indices, src, dst)  # fmt: skip
        store.load(src, dst)


class TorchPathDecoder(SparseDecoder):
    """:class:`SparseDecoder` over the torch references: the scores (the score kernel where it
    runs) masked and selected by :func:`select_pages` (ascending pages), the cache bookkeeping by
    :func:`~sparse_sglang.attention.reference.retrieve_reference`, the coarse bounds by
    :meth:`PageSummaries.build_coarse`. The server takes it for rows too wide for the retrieve
    kernel's one program (:func:`fits_fused_retrieve`, large budgets), outside CUDA graphs; the GPU
    tests compare the two decoders step by step.
    """

    def __init__(self, store: SparseKVStore, config: SparseConfig, *args, **kwargs):
        if config.budget_share:
            raise ValueError(f"--sparse-budget-share runs the fused kernels on a GPU, which take up to "
                             f"{MAX_RETRIEVE_CELLS} (selected x row) page pairs: lower --sparse-token-budget")  # fmt: skip
        if config.rerank_factor > 1:
            raise ValueError(f"--sparse-rerank-factor {config.rerank_factor}: re-ranking runs the fused kernels, which "
                             f"take up to {MAX_RETRIEVE_CELLS} (candidates x row) page pairs; lower the factor or "
                             f"--sparse-token-budget")  # fmt: skip
        super().__init__(store, config, *args, **kwargs)

    def init_cuda_graph(self, max_batch: int) -> None:
        raise ValueError(f"--sparse-decode-cuda-graph: CUDA-graph decode runs the fused kernels, which take up to "
                         f"{MAX_RETRIEVE_CELLS} (selected x row) page pairs; this budget's rows need "
                         f"{next_pow2(self.width) * next_pow2(self.store.shape.row_width)}: lower --sparse-token-budget")  # fmt: skip

    def _plan_indices(self, indptr: torch.Tensor, selected_cpu: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Where entry (b, h, j) of a ``[B, Hkv, K]`` selection goes in the indices buffer (the
        last entry takes the padding)."""
        batch, width = selected_cpu.shape[0], self.width
        j = torch.arange(width).view(1, 1, width)
        dest = torch.where(j < selected_cpu.view(-1, 1, 1), indptr[:-1].view(batch, self.num_kv_heads, 1) + j,
                           self.indices.numel() - 1)  # fmt: skip
        return host_to_device(dest.view(-1), device, dest.dtype)

    def _build_coarse(self, host_pages: torch.Tensor, built: torch.Tensor, max_built: int) -> None:
        self.store.summaries.build_coarse(host_pages, built)

    def select(self, layer: int, q: torch.Tensor, plan: DecodePlan) -> torch.Tensor:
        """``[B, Hkv, K]`` logical pages one layer attends (``-1`` padded; ascending)."""
        return self.select_raw(layer, q, plan)

    def select_raw(self, layer: int, q: torch.Tensor, plan: DecodePlan) -> torch.Tensor:
        if plan.exact:
            return plan.all_pages
        qg = q.view(plan.batch, self.num_kv_heads, self.group, self.head_dim)
        summaries = self.store.summaries.layer(layer)
        scores = score_pages(self.selector, self.scoring_query(layer, qg), summaries, plan.host_pages, plan.num_pages,
                             self.group_reduce)  # fmt: skip
        if plan.use_coarse:  # only the candidates of requests due for a full selection
            scores = scores.masked_fill(~self._coarse_candidates_reference(layer, qg, plan), -math.inf)
        scores = self._keep_cached(layer, scores, plan)
        return select_pages(scores, plan.num_pages, self.width, *self.forced).page_ids

    def _coarse_candidates_reference(self, layer: int, qg: torch.Tensor, plan: DecodePlan) -> torch.Tensor:
        """``[B, Hkv, N]`` bool: the pages the coarse pass leaves to score (all of a request
        reusing its selection), in plain torch (``torch.topk`` breaks ties its own way)."""
        coarse = score_coarse_reference(qg, self.store.summaries.coarse_layer(layer), plan.host_pages, plan.built,
                                        self.coarse, self.forced[0], self.group_reduce)  # fmt: skip
        top = coarse.topk(min(self.supers, coarse.shape[-1]), dim=-1)
        supers = torch.where(top.values > -math.inf, top.indices, -1)
        keep = candidate_pages(supers, plan.built, plan.num_pages, self.coarse, plan.host_pages.shape[1])
        return keep if plan.reselect is None else keep | ~plan.reselect.view(-1, 1, 1)

    def _keep_cached(self, layer: int, scores: torch.Tensor, plan: DecodePlan) -> torch.Tensor:
        if plan.reselect is None:
            return scores
        return keep_cached(
            scores, self.store.cache.cached_pages(layer, plan.req_slots, scores.shape[-1]), plan.reselect
        )

    def _retrieve(self, layer: int, page_ids: torch.Tensor, plan: DecodePlan) -> None:
        store = self.store
        slots = retrieve_reference(store.cache, layer, plan.req_slots, page_ids, plan.host_pages, store.load,
                                   store.shape.num_host_pages)  # fmt: skip
        self.indices[plan.dest] = slots.view(-1).to(torch.int32)


def make_decoder(store: SparseKVStore, config: SparseConfig, num_q_heads: int, workspace: torch.Tensor,
                 max_batch: int, *, fused: bool | None = None, **options) -> SparseDecoder:  # fmt: skip
    """The decoder for ``store``: :class:`SparseDecoder` (the fused kernels) or, with ``fused``
    false, :class:`TorchPathDecoder`. By default the fused one on CUDA for rows
    :func:`fits_fused_retrieve` takes; wider rows, from large budgets, take the torch path.
    ``options`` go to the decoder (``use_tensor_cores``, ``topk``, ``stats``)."""
    if fused is None:
        width = min(config.candidate_pages, store.shape.row_width)  # the pages a step loads
        if config.budget_share:  # a head attends up to CAP_UNITS quarters of the budget
            width = CAP_UNITS * min(config.budget_pages, store.shape.row_width) // UNITS
        fused = store.device.type == "cuda" and fits_fused_retrieve(width, store.shape.row_width)
    decoder = SparseDecoder if fused else TorchPathDecoder
    return decoder(store, config, num_q_heads, workspace, max_batch, **options)
