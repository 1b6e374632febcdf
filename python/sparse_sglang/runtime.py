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

Invariants: ``store`` is set once, at build; :meth:`start_attention` runs once; ``tracker`` and
``gate`` are both set exactly when ``config.working_set_admission`` is on. Every other object
reads these through the runtime (SGLang's side reaches it through the KV pool it hands out:
``integration/memory_pool.py``'s ``runtime_of``); none keeps its own copy of a counter.

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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from sparse_sglang.stats import SparseStats

if TYPE_CHECKING:
    from sparse_sglang.attention.prefix import PrefixAttention
    from sparse_sglang.attention.sparse_decode import SparseDecoder
    from sparse_sglang.config import SparseConfig
    from sparse_sglang.mem_cache.key_sketch import KeyBasis
    from sparse_sglang.mem_cache.kv_store import SparseKVStore, StoreShape
    from sparse_sglang.mem_cache.plan import MemoryPlan
    from sparse_sglang.scheduler import WorkingSetGate, WorkingSetTracker


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

    def start_attention(self, num_q_heads: int, workspace: torch.Tensor, max_batch: int, staging_tokens: int,
                        sm_scale: float | None = None, logits_soft_cap: float | None = None,
                        agree=None) -> None:  # fmt: skip
        """Make the decode and prefill parts over the store: the sparse decoder (planning into
        ``workspace`` for up to ``max_batch`` requests) and the prefix attention (staging
        ``staging_tokens`` per layer), both planning the model's ``sm_scale`` and
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
        self.prefix = PrefixAttention(store, num_q_heads, workspace, staging_tokens, sm_scale, logits_soft_cap)
        if config.working_set_admission:
            # The decoder logs each step's selections; the tracker keeps the last window of them
            # per request and counts each one's distinct pages once per step.
            shape = store.shape
            self.tracker = WorkingSetTracker(max_batch, shape.num_layers, shape.num_kv_heads, self.decoder.width,
                                             config.working_set_window, store.device)  # fmt: skip
            self.decoder.log_selections(max_batch)
            self.gate = WorkingSetGate(store.cache, self.tracker, agree=agree, counts=self.stats.working_set)

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
    cache's LRU, bound format and coarse pages (``key_basis`` for the sketch selector;
    ``d2h_threads`` FlashD2H scatter threads, None: the store's default)."""
    from sparse_sglang.attention.selectors import kept_summaries
    from sparse_sglang.mem_cache.kv_store import SparseKVStore

    return SparseKVStore(shape, device, **kept_summaries(config.selector), lru_buckets=config.cache_lru_buckets,
                         lru_steps_per_bucket=config.cache_lru_steps_per_bucket, bound_format=config.bound_format,
                         page_bounds=config.page_bounds, bound_spread=config.bound_spread,
                         coarse_pages=config.coarse_pages, key_basis=key_basis, d2h_threads=d2h_threads)  # fmt: skip


def build_runtime(config: SparseConfig, plan: MemoryPlan, device: torch.device | str,
                  key_basis: KeyBasis | None = None, d2h_threads: int | None = None) -> SparseRuntime:  # fmt: skip
    """The runtime with its store, laid out by ``plan`` (:func:`build_store`)."""
    return SparseRuntime(config, plan, build_store(config, plan.shape, device, key_basis, d2h_threads))
