"""SparseRuntime: the one owner of a model runner's sparse state.

One runtime per model runner (a tensor-parallel rank, a data-parallel replica), built from the
whole :class:`~sparse_sglang.config.SparseConfig`. It holds

- ``plan`` and ``store``: the memory split and the :class:`~sparse_sglang.mem_cache.kv_store.SparseKVStore`
  (host pages, summaries, GPU page cache), made by :func:`build_runtime` when SGLang allocates the
  KV pool;
- ``decoder``, ``prefix``, ``tracker`` and ``gate``: made by :meth:`SparseRuntime.start_attention`
  when SGLang builds the attention backend, which comes after the pool and owns the FlashInfer
  workspace the decoder plans into;
- ``stats``: the one :class:`~sparse_sglang.stats.SparseStats` the gate, the decoder and the
  segmented-prefill loop write.

It also owns the *step*: :meth:`SparseRuntime.begin_decode` is the one call that prepares a decode
step (rows opened, resized and write-allocated in the page cache, the step counter, the saved-token
count, the host page table, the re-selection phase, the tracker's publication, the save runs) and
returns its frozen :class:`~sparse_sglang.attention.sparse_decode.DecodePlan`, which
``decoder.run(layer, q, plan)`` reads for every layer; :meth:`SparseRuntime.begin_prefill` does the
same for a prefill (:class:`PrefillPlan`). The SGLang adapter (``integration/attention_backend.py``)
only translates SGLang's ``ForwardBatch`` into their arguments. A CUDA-graph step is the same call
with ``graph=True``: its plan's tensors are the decoder's static buffers, rewritten in place, so a
replay reads what the call wrote and nothing is rebound.

Invariants: ``store`` is set once, at build; :meth:`start_attention` runs once; ``tracker`` and
``gate`` are both set exactly when ``config.working_set_admission`` is on. Every other object
reads these through the runtime (SGLang's side reaches it through the KV pool it hands out:
``integration/memory_pool.py``'s ``runtime_of``); none keeps its own copy of a counter, and each
counter has one writer (``test/test_runtime.py`` checks the source). Between steps only the runtime
(and the request slot's release) changes the page cache's rows, which the cache alone records
(:meth:`~sparse_sglang.mem_cache.gpu_cache.GPUPageCache.hold_row`); request slot 0 (padding) never
gets one. A step's plan is made before any of its layers runs and never changes after.

Example (a CUDA machine; the server builds it from SGLang's model runner the same way)::

    import torch
    from sparse_sglang.config import SparseConfig
    from sparse_sglang.mem_cache.plan import plan_memory
    from sparse_sglang.runtime import build_runtime

    config = SparseConfig(host_cache_gb=1.0, token_budget=512)
    plan = plan_memory(config, num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16,
                       context_len=8192, gpu_kv_bytes=256 << 20)
    runtime = build_runtime(config, plan, torch.device("cuda"))
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    runtime.start_attention(num_q_heads=8, workspace=workspace, max_batch=plan.max_running_requests + 1,
                            staging_tokens=4096)
    runtime.report(window=config.working_set_window)  # the counters /get_server_info shows
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch.profiler import record_function

from sparse_sglang.mem_cache.gpu_cache import PADDING_SLOT
from sparse_sglang.mem_cache.kernels import SaveRuns
from sparse_sglang.stats import SparseStats

if TYPE_CHECKING:
    from sparse_sglang.attention.prefix import PrefixAttention
    from sparse_sglang.attention.sparse_decode import DecodePlan, SparseDecoder
    from sparse_sglang.config import SparseConfig
    from sparse_sglang.mem_cache.key_sketch import KeyBasis
    from sparse_sglang.mem_cache.kv_store import SparseKVStore, StoreShape
    from sparse_sglang.mem_cache.plan import MemoryPlan
    from sparse_sglang.scheduler import WorkingSetGate, WorkingSetTracker


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    """One prefill (extend) forward as its layers read it: ``runs``, the tokens it saves (their
    request slots and positions), or None for a batch that saves nothing (SGLang's made-up graph
    warm-up batches in the padding slot). The prefix attention keeps its own plan (``prefix.plan``)."""

    runs: SaveRuns | None


@dataclass
class SparseRuntime:
    config: SparseConfig
    plan: MemoryPlan
    store: SparseKVStore
    stats: SparseStats = field(default_factory=SparseStats)
    decoder: SparseDecoder | None = None
    prefix: PrefixAttention | None = None
    tracker: WorkingSetTracker | None = None
    gate: WorkingSetGate | None = None
    # The last decode step's batch, whose selections the tracker records as the next forward begins.
    tracked_slots: torch.Tensor | None = None

    def start_attention(self, num_q_heads: int, workspace: torch.Tensor, max_batch: int, staging_tokens: int,
                        sm_scale: float | None = None, logits_soft_cap: float | None = None,
                        agree=None, resident_tokens: int = 0) -> None:  # fmt: skip
        """Make the decode and prefill parts over the store: the sparse decoder (planning into
        ``workspace`` for up to ``max_batch`` requests) and the prefix attention (staging
        ``staging_tokens`` per layer, keeping ``resident_tokens`` of a chunked prompt's prefix
        between its chunks), both planning the model's ``sm_scale`` and
        ``logits_soft_cap`` (None: 1/sqrt(head_dim), none); with working-set admission on, the
        tracker the decoder feeds and the gate that reads it (``agree``:
        :func:`~sparse_sglang.scheduler.max_over_ranks` under tensor parallelism, None on one rank)."""
        from sparse_sglang.attention.prefix import PrefixAttention
        from sparse_sglang.attention.sparse_decode import make_decoder
        from sparse_sglang.scheduler import WorkingSetGate, WorkingSetTracker

        if self.decoder is not None:
            raise RuntimeError("SparseRuntime.start_attention runs once per runtime")
        config, store = self.config, self.store
        self.decoder = make_decoder(store, config, num_q_heads, workspace, max_batch, sm_scale=sm_scale,
                                    logits_soft_cap=logits_soft_cap, stats=self.stats)  # fmt: skip
        self.prefix = PrefixAttention(store, num_q_heads, workspace, staging_tokens, sm_scale, logits_soft_cap,
                                      resident_tokens, self.stats)  # fmt: skip
        if config.working_set_admission:
            # The decoder logs each step's selections; the tracker keeps the last window of them
            # per request and counts each one's distinct pages once per step.
            shape = store.shape
            self.tracker = WorkingSetTracker(max_batch, shape.num_layers, shape.num_kv_heads, self.decoder.selected,
                                             config.working_set_window, store.device)  # fmt: skip
            self.decoder.log_selections(max_batch)
            self.gate = WorkingSetGate(store.cache, self.tracker, agree=agree, counts=self.stats.working_set)

    # Per forward, on the host: the step's owner.

    def _begin_forward(self) -> None:
        """What every forward starts with: its stream noted, earlier prefill saves landed (before
        any host read), and the last decode step's selections handed to the tracker (before a row
        opens: a slot reused by a new request must not inherit them)."""
        store = self.store
        store.note_forward_stream()
        with record_function("sparse.wait_saves"):
            store.wait_saves()
        if self.tracked_slots is not None:
            self.tracker.record_step(self.tracked_slots, self.decoder.selection_log[: len(self.tracked_slots)])
            self.tracked_slots = None

    def _hold_rows(self, slots: list[int], generations: list[int]) -> None:
        """Each request its own page-cache row (:meth:`GPUPageCache.hold_row`); a new one starts
        with no working-set history."""
        for slot, generation in zip(slots, generations):
            if self.store.cache.hold_row(slot, generation) and self.tracker is not None:
                self.tracker.forget(slot)

    def begin_decode(self, req_slots: torch.Tensor, slots: list[int], generations: list[int],
                     seq_lens_cpu: torch.Tensor, seq_lens: torch.Tensor, req_to_token: torch.Tensor,
                     graph: bool = False) -> DecodePlan:  # fmt: skip
        """Prepare one decode step and return its plan.

        Parameters
        ----------
        req_slots : torch.Tensor
            ``[B]`` request slots on the device (a CUDA-graph batch padded with slot 0).
        slots, generations : list[int]
            The same slots on the host, and each one's generation (the count of requests the
            slot was given to; the padding slot's is not read).
        seq_lens_cpu, seq_lens : torch.Tensor
            ``[B]`` tokens of each request, the one decoded now included, on the host and the device.
        req_to_token : torch.Tensor
            The request slots' token locations (host page ``loc // page_size``), ``[slots, tokens]``.
        graph : bool
            A CUDA-graph step (captured or replayed): the plan points at static buffers, every
            request planned over the store's ``max_pages``, and the save runs are bound inside the
            graph (:meth:`bind_decode_runs`).
        """
        self._begin_forward()
        store, cache, page = self.store, self.store.cache, self.store.shape.page_size
        lengths = seq_lens_cpu.tolist()
        real = [(slot, n, g) for slot, n, g in zip(slots, lengths, generations) if slot != PADDING_SLOT]
        self._hold_rows([slot for slot, _, _ in real], [g for _, _, g in real])  # open since their prefill, mostly
        cache.next_step()
        store.count_decode_saves(len(real))
        for slot, length, _ in real:
            pages = math.ceil(length / page)
            cache.resize_request(slot, pages)
            if (length - 1) % page == 0:  # this token starts a page
                cache.write_allocate(slot, pages - 1, 1)
        # The step's host page table and the cache's answers first, then the decoder's plan, then
        # the store's runs: a step goes down through its parts once and returns to none it has left.
        longest = math.ceil(max(lengths) / page)  # pages of the longest request
        host_pages = host_page_table(req_to_token, req_slots, store.shape.max_pages if graph else longest, page)
        interval = self.config.reselect_interval
        reselect = None if interval == 1 else cache.due_for_selection(req_slots, seq_lens_cpu, interval)
        plan = self.decoder.plan(req_slots, seq_lens_cpu, host_pages, graph=graph, seq_lens=seq_lens,
                                 reselect=reselect)  # fmt: skip
        if self.tracker is not None:  # counts up to the last step; this step's selection is recorded next forward
            self.tracker.publish([slot for slot, _, _ in real], longest)
            self.tracked_slots = req_slots.clone()
        if not graph:  # (a graph step binds them inside the graph: bind_decode_runs)
            store.bind_runs(SaveRuns.for_decode(req_slots, seq_lens, page))
        return plan

    def bind_decode_runs(self, req_slots: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """The decode step's save runs (one token per request); a CUDA-graph step binds them inside
        the graph (SGLang's ``init_forward_metadata_in_graph``)."""
        self.store.bind_runs(SaveRuns.for_decode(req_slots, seq_lens, self.store.shape.page_size))

    def begin_prefill(self, req_slots: torch.Tensor, slots: list[int], generations: list[int],
                      prefix_lens: list[int], extend_lens: list[int], req_to_token: torch.Tensor) -> PrefillPlan:  # fmt: skip
        """Prepare one prefill (extend) forward: rows held, the new pages resized and
        write-allocated, the save runs bound, the prefix attention planned. A batch in the padding
        slot (SGLang's prefill graph runner warms up and captures on made-up batches there, which
        no request holds) is attended (no prefix) but opens no row and saves nothing."""
        self._begin_forward()
        prefix = self.prefix
        if PADDING_SLOT in slots:
            prefix.plan(req_to_token, req_slots, [0] * len(slots), extend_lens)
            return PrefillPlan(runs=None)
        store, cache, page = self.store, self.store.cache, self.store.shape.page_size
        self._hold_rows(slots, generations)
        for slot, before, new in zip(slots, prefix_lens, extend_lens):
            first, end = math.ceil(before / page), math.ceil((before + new) / page)
            cache.resize_request(slot, end)
            cache.write_allocate(slot, first, end - first)  # new pages go to free row slots while any are left
        runs = SaveRuns.for_extend(slots, prefix_lens, extend_lens, page, req_slots.device)
        store.bind_runs(runs)
        prefix.plan(req_to_token, req_slots, prefix_lens, extend_lens, list(zip(slots, generations)))
        return PrefillPlan(runs=runs)

    def resume_prefill(self, plan: PrefillPlan) -> None:
        """Before the next layer segment of a layer-segmented prefill: its plan (made at its first
        segment) outlives the decode steps run since, which bound their own save runs; its go back."""
        self.store.wait_saves()
        self.store.bind_runs(plan.runs)

    def report(self, window: int) -> dict:
        """The runtime's part of ``/get_server_info``'s ``"sparse"`` entry: the store's counters over
        the last ``window`` decode steps and since start, and :attr:`stats`."""
        counts = None if self.gate is None else self.stats.working_set
        return {
            "working_set_admissions": None if counts is None else counts.admitted,
            "working_set_deferrals": None if counts is None else counts.deferred,
            "working_set_aborted_while_waiting": None if counts is None else counts.aborted_while_holding,
            "working_set_retractions": None if counts is None else counts.retracted,
            # the running requests' distinct selected pages over the window (the tracker's last count)
            "working_set_demand_pages": None if self.tracker is None else sum(self.tracker.published().values()),
            **self.store.stats(window),
            # GPU bytes of the buffers a prefill stages its cached prefix into (start-up sized)
            "prefix_staging_bytes": None if self.prefix is None else self.prefix.staging_bytes,
            # prefix pages prefills attended from the resident buffer (--sparse-resident-prefix-tokens)
            "resident_prefix_pages": self.stats.resident_prefix_pages if self.config.resident_prefix_tokens else None,
            "decode_steps_coarse_first": None if self.decoder is None else self.stats.coarse_first_steps,
            "segmented_prefill": dataclasses.asdict(self.stats.segmented_prefill)
            if self.config.segmented_prefill
            else None,
            # rounds a pending prefill waited for a decode step (--sparse-interleave-prefill)
            "prefills_held": self.stats.prefills_held if self.config.interleave_prefill else None,
        }


def build_store(config: SparseConfig, shape: StoreShape, device: torch.device | str,
                key_basis: KeyBasis | None = None, d2h_threads: int | None = None) -> SparseKVStore:  # fmt: skip
    """The store of ``shape`` on ``device`` as ``config`` says: the selector's summaries, the
    cache's LRU, bound format, coarse pages and key codes (``key_basis`` for the sketch selector;
    ``d2h_threads`` FlashD2H scatter threads, None: the store's default)."""
    from sparse_sglang.attention.selectors import kept_summaries
    from sparse_sglang.mem_cache.kv_store import SparseKVStore

    return SparseKVStore(shape, device, **kept_summaries(config.selector), lru_buckets=config.cache_lru_buckets,
                         lru_steps_per_bucket=config.cache_lru_steps_per_bucket, bound_format=config.bound_format,
                         page_bounds=config.page_bounds, bound_spread=config.bound_spread,
                         coarse_pages=config.coarse_pages, key_basis=key_basis, key_bits=config.key_code_bits,
                         d2h_threads=d2h_threads, d2h_buffers=config.save_staging_buffers)  # fmt: skip


def build_runtime(config: SparseConfig, plan: MemoryPlan, device: torch.device | str,
                  key_basis: KeyBasis | None = None, d2h_threads: int | None = None) -> SparseRuntime:  # fmt: skip
    """The runtime with its store, laid out by ``plan`` (:func:`build_store`)."""
    return SparseRuntime(config, plan, build_store(config, plan.shape, device, key_basis, d2h_threads))


def host_page_table(
    req_to_token: torch.Tensor, req_slots: torch.Tensor, num_pages: int, page_size: int
) -> torch.Tensor:
    """``[B, num_pages]`` int32 host page id of each logical page of each request, read from
    SGLang's ``req_to_token`` rows (token location ``page * page_size + offset``)."""
    cols = torch.arange(num_pages, device=req_to_token.device) * page_size
    return (req_to_token[req_slots.long().unsqueeze(1), cols.unsqueeze(0)] // page_size).to(torch.int32)
