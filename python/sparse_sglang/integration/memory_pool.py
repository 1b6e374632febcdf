"""SGLang's KV memory, sparse: the token pool is the host store, the GPU keeps summaries and a cache.

SGLang sizes its KV pool from free GPU memory and allocates ``[tokens, heads, dim]`` buffers per
layer on the GPU. With sparse decode the KV lives in pinned host memory instead, so
:func:`patch_alloc_memory_pool` replaces ``ModelRunner.alloc_memory_pool`` (when ``--sparse-enabled``)
with :func:`alloc_sparse_memory_pool`: it plans the split (:func:`~sparse_sglang.mem_cache.plan.plan_memory`),
builds the :class:`~sparse_sglang.runtime.SparseRuntime` (the one owner of the store, decoder,
gate and counters; the token pool below holds it, and the attention backend and scheduler hooks
reach it there), and hands SGLang

- a :class:`SparseTokenToKVPool` whose token locations are host slots (page ``loc // page_size``
  of the host store), so SGLang's paged allocator and radix cache manage host pages;
- SGLang's own ``ReqToTokenPool`` and ``PagedTokenToKVPoolAllocator`` over that index space;
- ``max_total_num_tokens`` = the host capacity and ``max_running_requests`` = the requests whose
  GPU cache rows fit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import TYPE_CHECKING

import torch
from sglang.srt.mem_cache.memory_pool import KVCache, unwrap_write_loc

from sparse_sglang.attention.selectors import kept_summaries
from sparse_sglang.config import GIB, machine_ram_bytes
from sparse_sglang.integration.input_length import HostStoreLimit, patch_validate_input_length
from sparse_sglang.integration.registry import relies_on, wrap_once
from sparse_sglang.mem_cache.host_pool import host_memory_turn
from sparse_sglang.mem_cache.kv_store import SparseKVStore
from sparse_sglang.mem_cache.plan import plan_memory
from sparse_sglang.runtime import SparseRuntime, build_runtime
from sparse_sglang.transfer.d2h import default_num_threads

if TYPE_CHECKING:
    from sglang.srt.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@relies_on("sglang.srt.mem_cache.memory_pool:KVCache", at="sglang/srt/mem_cache/memory_pool.py:1609")
class SparseTokenToKVPool(KVCache):
    """SGLang's view of the :class:`SparseKVStore`: token location ``loc`` is host slot ``loc``.

    ``set_kv_buffer`` saves to the host store (plus summaries and cached pages). There are no
    per-layer GPU KV buffers to hand out: the ``sparse`` attention backend reads the page cache and
    stages prefixes itself, so ``get_key_buffer`` and friends fail loudly on any other path.

    The model runner holds this pool, and the scheduler's token allocator hands it out
    (``get_kvcache()``), so it is where both sides find the ``runtime`` (:func:`runtime_of`).
    """

    def __init__(self, runtime: SparseRuntime, size: int, device: str, start_layer: int | None = None,
                 end_layer: int | None = None):  # fmt: skip
        from sglang.srt.layers.quantization.fp4_kv_cache_quant_method import UnquantizedKVCacheMethod

        s = runtime.store.shape
        super().__init__(size, s.page_size, s.dtype, s.num_layers, device, False, start_layer, end_layer)
        self.runtime = runtime
        self.store = runtime.store  # the runtime's; save() writes it on every layer of every forward
        self.head_num, self.head_dim, self.v_head_dim = s.num_kv_heads, s.head_dim, s.head_dim
        self.quant_method = UnquantizedKVCacheMethod()
        self.mem_usage = runtime.store.gpu_bytes / GIB
        logger.info("sparse KV pool: %d host tokens, %.2f GiB on the GPU", size, self.mem_usage)

    def get_kv_size_bytes(self) -> int:
        return self.store.gpu_bytes

    def _no_buffer(self, what: str):
        raise NotImplementedError(
            f"{what}: the sparse KV pool keeps KV on the host and has no per-layer GPU buffer; only "
            "the 'sparse' attention backend (dense ragged prefill, sparse decode) can read it"
        )

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        self._no_buffer("get_key_buffer")

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        self._no_buffer("get_value_buffer")

    def get_kv_buffer(self, layer_id: int):
        self._no_buffer("get_kv_buffer")

    def set_kv_buffer(self, layer, loc_info, cache_k, cache_v, k_scale=None, v_scale=None, **_):
        loc, _, _ = unwrap_write_loc(loc_info)
        self.save(layer.layer_id, loc, cache_k, cache_v, staged=True, k_scale=k_scale, v_scale=v_scale)

    def save(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, staged: bool,
             k_scale=None, v_scale=None) -> None:  # fmt: skip
        """Save new K/V (``[T, Hkv * D]`` or ``[T, Hkv, D]``) of one layer at token locations ``loc``."""
        s = self.store.shape
        k, v = k.view(-1, s.num_kv_heads, s.head_dim), v.view(-1, s.num_kv_heads, s.head_dim)
        if k.dtype != s.dtype and k_scale is not None:  # fp8 KV with a calibrated scale, as SGLang stores it
            k, v = k / k_scale, v / v_scale
        self.store.save(layer_id - self.start_layer, loc, k, v, staged=staged)


def runtime_of(token_to_kv_pool_allocator) -> SparseRuntime | None:
    """The sparse runtime behind SGLang's token allocator (its ``get_kvcache()`` is the sparse
    pool); ``None`` for another pool (sparse off, a draft worker)."""
    get_kvcache = getattr(token_to_kv_pool_allocator, "get_kvcache", None)
    return None if get_kvcache is None else getattr(get_kvcache(), "runtime", None)


@relies_on("sglang.srt.mem_cache.memory_pool:ReqToTokenPool.free", at="sglang/srt/mem_cache/memory_pool.py:319")
def release_rows_on_free(req_to_token_pool, store: SparseKVStore) -> None:
    """Return a request's GPU page-cache row when SGLang frees its request slot (it finished, was
    aborted or retracted), so an idle server holds no rows (its host pages SGLang frees itself).
    The row's GPU state is reset behind the forwards already queued (``on_forward_stream``)."""
    original = req_to_token_pool.free
    cache = store.cache

    def free(req):
        slot = req.req_pool_idx
        if slot is not None and cache.is_open(slot):
            with store.on_forward_stream():
                cache.close_request(slot)
        original(req)

    req_to_token_pool.free = free


@relies_on("sglang.srt.model_executor.model_runner:ModelRunner.alloc_memory_pool",
           at="sglang/srt/model_executor/model_runner.py:769")  # fmt: skip
def patch_alloc_memory_pool() -> None:
    """Make ``ModelRunner.alloc_memory_pool`` build the sparse pools when sparse is enabled."""
    from sglang.srt.model_executor.model_runner import ModelRunner

    def wrap(original):
        def alloc_memory_pool(self: ModelRunner, memory_pool_config=None):
            sparse = getattr(self.server_args, "sparse", None)
            if sparse is None or not sparse.enabled or self.is_draft_worker:
                return original(self, memory_pool_config)
            return alloc_sparse_memory_pool(self)

        return alloc_memory_pool

    wrap_once(ModelRunner, "alloc_memory_pool", wrap)


@relies_on("sglang.srt.mem_cache.kv_cache_configurator:KVCacheConfigurator._profile_available_bytes",
           at="sglang/srt/mem_cache/kv_cache_configurator.py:1614")  # fmt: skip
def alloc_sparse_memory_pool(runner: ModelRunner) -> None:
    """Plan and build the sparse pools and install them on ``runner`` (see module doc)."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.model_executor.pool_configurator import MemoryPoolConfig
    from sglang.srt.runtime_context import get_parallel

    sparse = runner.server_args.sparse
    runner.init_kv_cache_configurator()
    conf = runner.kv_cache_configurator
    model = runner.model_config
    dtype = runner.kv_cache_dtype
    if dtype in (torch.float8_e4m3fnuz,):
        raise ValueError(
            f"sparse KV store: kv cache dtype {dtype} is not supported (bf16, fp16, fp8_e4m3, fp8_e5m2 are)"
        )
    parallel = get_parallel()
    num_kv_heads = model.get_num_kv_heads(parallel.attn_tp_size)
    key_basis = rank_key_basis(sparse, conf.layer_info.num_effective_layers, model.get_total_num_kv_heads(),
                               model.head_dim, parallel.attn_tp_size, parallel.attn_tp_rank)  # fmt: skip
    # Every scheduler of the host (data-parallel replicas, tensor-parallel ranks: each holds its own
    # kv heads' pages) takes an equal share of --sparse-host-cache-gb, the server's total, and of the cores.
    replicas = runner.server_args.dp_size * runner.server_args.tp_size
    if replicas > 1 and sparse.host_cache_gb is not None:
        sparse = dataclasses.replace(sparse, host_cache_gb=sparse.host_cache_gb / replicas)
    gpu_kv_bytes = conf._profile_available_bytes(runner.pre_model_load_memory)
    # Sized by need, a scheduler's store is at most a share of the RAM it may take: tensor-parallel
    # ranks must size theirs alike (SGLang's ranks schedule in lockstep over equal pools), so they
    # share the host's total RAM; otherwise a store takes its share of what is available, read in
    # its turn, and is pinned before the next store on the host is sized.
    from_available = sparse.host_cache_gb is None and runner.server_args.tp_size == 1
    with host_memory_turn() if from_available else contextlib.nullcontext():
        total_ram, available_ram = machine_ram_bytes()
        host_ram = (available_ram if from_available else total_ram) // replicas
        plan = plan_memory(
            sparse,
            num_layers=conf.layer_info.num_effective_layers,
            num_kv_heads=num_kv_heads,
            head_dim=model.head_dim,
            dtype=dtype,
            context_len=model.context_len,
            gpu_kv_bytes=gpu_kv_bytes,
            max_running_requests=runner.server_args.max_running_requests,
            max_total_tokens=runner.server_args.max_total_tokens,
            **kept_summaries(sparse.selector),
            sketch_rank=0 if key_basis is None else key_basis.rank,
            host_ram_bytes=host_ram,
        )
        logger.info("sparse memory plan: %s", plan.describe())
        runtime = build_runtime(sparse, plan, runner.device, key_basis, d2h_threads=default_num_threads(share=replicas))
    # SGLang's prompt-length refusals name the host store when it is what limits prompts.
    patch_validate_input_length(HostStoreLimit(plan.max_total_tokens, plan.host_store_reason, model.context_len))
    pool = SparseTokenToKVPool(runtime, plan.max_total_tokens, runner.device,
                               conf.layer_info.start_layer, conf.layer_info.end_layer)  # fmt: skip
    runner.req_to_token_pool = conf._build_req_to_token_pool(max_num_reqs=plan.max_running_requests)
    release_rows_on_free(runner.req_to_token_pool, runtime.store)
    runner.token_to_kv_pool = pool
    runner.token_to_kv_pool_allocator = PagedTokenToKVPoolAllocator(
        plan.max_total_tokens, page_size=plan.shape.page_size, dtype=dtype, device=runner.device, kvcache=pool,
        need_sort=False,
    )  # fmt: skip
    runner.max_total_num_tokens = plan.max_total_tokens
    runner.max_running_requests = plan.max_running_requests
    runner.memory_pool_config = MemoryPoolConfig(
        max_total_num_tokens=plan.max_total_tokens, max_running_requests=plan.max_running_requests
    )
    runner._unified_memory_pool = None
    runner._init_post_memory_pool_components()


def rank_key_basis(sparse, num_layers: int, total_kv_heads: int, head_dim: int, tp_size: int, tp_rank: int):
    """The key sketches' :class:`~sparse_sglang.mem_cache.key_sketch.KeyBasis` for this rank's
    kv heads, from ``--sparse-key-basis`` (resolved by the launcher), or random for dummy weights
    (no file); ``--sparse-sketch-rank`` keeps its leading directions. None when no sketches are kept."""
    from sparse_sglang.calibrate import default_rank
    from sparse_sglang.mem_cache.key_sketch import KeyBasis

    if not sparse.keeps_key_sketches:
        return None
    if sparse.key_basis is None:
        basis = KeyBasis.random(num_layers, total_kv_heads, head_dim, sparse.sketch_rank or default_rank(head_dim))
    else:
        basis = KeyBasis.load(sparse.key_basis)
    source = f"--sparse-key-basis {sparse.key_basis}"
    basis.check_shape(num_layers, total_kv_heads, head_dim, source)
    heads = rank_kv_heads(total_kv_heads, tp_size, tp_rank)
    try:
        return basis.select(sparse.sketch_rank, heads)
    except ValueError as err:
        raise ValueError(f"--sparse-sketch-rank {sparse.sketch_rank}: {err}") from None


@relies_on("sglang.srt.layers.linear:QKVParallelLinear", at="sglang/srt/layers/linear.py:921")
def rank_kv_heads(total_kv_heads: int, tp_size: int, tp_rank: int) -> slice:
    """The model's kv heads that tensor-parallel rank ``tp_rank`` of ``tp_size`` holds, as SGLang's
    QKV projection splits them: a block of ``total_kv_heads / tp_size``, or, with more ranks than
    kv heads, the one head it shares with ``tp_size / total_kv_heads`` ranks (SGLang's
    ``tp_rank // num_kv_head_replicas``)."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tensor-parallel rank {tp_rank} of {tp_size}")
    if tp_size <= total_kv_heads:
        if total_kv_heads % tp_size:
            raise ValueError(f"{total_kv_heads} kv heads do not split evenly over {tp_size} tensor-parallel ranks")
        per = total_kv_heads // tp_size
        return slice(tp_rank * per, (tp_rank + 1) * per)
    if tp_size % total_kv_heads:
        raise ValueError(f"{tp_size} tensor-parallel ranks do not share {total_kv_heads} kv heads evenly")
    head = tp_rank // (tp_size // total_kv_heads)
    return slice(head, head + 1)
