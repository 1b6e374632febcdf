"""The ``sparse`` attention backend, as SGLang sees it.

SGLang builds attention backends by name from ``ATTENTION_BACKENDS``. We add ``sparse``: a
FlashInfer backend whose

- **prefill** stays dense FlashInfer: new tokens attend to each other with the ragged kernel and
  to a cached prefix through :class:`~sparse_sglang.attention.prefix.PrefixAttention` (staged
  from the host); the new KV is saved to the host store, the summaries and the page cache;
- **decode** runs :class:`~sparse_sglang.attention.sparse_decode.SparseDecoder`: score pages,
  keep the top pages within the token budget per (request, kv head), load misses with FlashH2D,
  FlashInfer paged decode over the selected pages.

Per forward, :meth:`SparseAttnBackend.init_forward_metadata` translates SGLang's ``ForwardBatch``
into one call of the runtime (:meth:`~sparse_sglang.runtime.SparseRuntime.begin_decode` or
``begin_prefill``), which owns the step's host-side work (page-cache rows, write allocation, the
FlashInfer plans, counters) and returns the step's frozen plan; the layers read that plan and run on
the device only. This module keeps no state of its own about rows or counters: it holds the
current forward's plan, as SGLang's backends hold their ``forward_metadata``.
"""

from __future__ import annotations

import itertools
import logging
from typing import TYPE_CHECKING

import torch
from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend
from torch.profiler import record_function

from sparse_sglang.integration.registry import relies_on
from sparse_sglang.mem_cache.gpu_cache import PADDING_SLOT
from sparse_sglang.mem_cache.plan import prefix_staging_tokens, resident_prefix_tokens

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner

    from sparse_sglang.attention.sparse_decode import DecodePlan
    from sparse_sglang.runtime import PrefillPlan

logger = logging.getLogger(__name__)

BACKEND_NAME = "sparse"


@relies_on(
    "sglang.srt.layers.attention.flashinfer_backend:FlashInferAttnBackend",
    at="sglang/srt/layers/attention/flashinfer_backend.py:288",
)
class SparseAttnBackend(FlashInferAttnBackend):
    """Dense FlashInfer prefill over the host-resident KV; sparse decode over selected pages."""

    def __init__(self, model_runner: ModelRunner, init_new_workspace: bool = False):
        super().__init__(model_runner, init_new_workspace=init_new_workspace)
        self.sparse_config = model_runner.server_args.sparse
        self.kv_pool = model_runner.token_to_kv_pool
        runtime = self.runtime = self.kv_pool.runtime
        self.req_generation = model_runner.req_to_token_pool.req_generation  # bumps when a slot gets a new request
        self.num_q_heads = self.num_qo_heads_per_rank(model_runner)
        max_batch = model_runner.req_to_token_pool.size + 1
        sm_scale, soft_cap = self.attention_constants(model_runner)
        context_len = model_runner.model_config.context_len
        staging = prefix_staging_tokens(self.sparse_config, context_len)
        runtime.start_attention(self.num_q_heads, self.workspace_buffer, max_batch, staging, sm_scale=sm_scale,
                                logits_soft_cap=soft_cap, agree=tp_agreement(),
                                resident_tokens=resident_prefix_tokens(self.sparse_config, context_len))  # fmt: skip
        # The runtime's parts, named here because every layer of every forward uses them.
        self.store, self.decoder, self.prefix = runtime.store, runtime.decoder, runtime.prefix
        self.constants = self.decoder.constants  # the model's scale and soft cap, as every plan here takes them
        self.activation_dtype = model_runner.dtype  # the new tokens' q, k and v: what the ragged prefill reads
        # The current forward's plans (the runtime makes them; the layers read them).
        self.decode_plan: DecodePlan | None = None
        self.prefill_plan: PrefillPlan | None = None
        # The next forward's request slots on the host (``ForwardBatch.init_new`` hands them over):
        # reading the GPU copy back would wait for the forward before it (overlap scheduling).
        self.next_req_slots: list[int] | None = None
        logger.info("sparse attention backend: %s", self.sparse_config)

    @staticmethod
    @relies_on("sglang.srt.layers.radix_attention:RadixAttention", at="sglang/srt/layers/radix_attention.py:91")
    def attention_constants(model_runner: ModelRunner) -> tuple[float | None, float | None]:
        """The model's softmax scale and logits soft cap, from its first ``RadixAttention`` (the
        decoder plans them once per step; it refuses a layer whose own differ). ``(None, None)``
        when the model has none to read (the decoder's defaults)."""
        from sglang.srt.layers.radix_attention import RadixAttention

        model = getattr(model_runner, "model", None)
        layer = next((m for m in model.modules() if isinstance(m, RadixAttention)), None) if model is not None else None
        return (None, None) if layer is None else (layer.scaling, layer.logit_cap or None)

    @staticmethod
    def num_qo_heads_per_rank(model_runner: ModelRunner) -> int:
        from sglang.srt.runtime_context import get_parallel

        return model_runner.model_config.num_attention_heads // get_parallel().attn_tp_size

    # Per forward, on the host.

    def note_req_slots(self, req_slots_cpu: torch.Tensor | None) -> None:
        """The next forward's request slots, from the host mirror SGLang keeps (None: unknown)."""
        self.next_req_slots = None if req_slots_cpu is None else req_slots_cpu.tolist()

    def _req_slots_cpu(self, req_slots: torch.Tensor) -> list[int]:
        """``req_slots`` (GPU, ``[B]``; a CUDA-graph batch padded with slot 0) as a list, from the
        mirror when it matches and by reading the GPU (a sync) when it does not."""
        mirror, self.next_req_slots = self.next_req_slots, None
        batch = req_slots.shape[0]
        if mirror is None or len(mirror) > batch:
            return req_slots.tolist()
        return mirror + [PADDING_SLOT] * (batch - len(mirror))

    def init_forward_metadata(self, forward_batch: ForwardBatch):
        mode = forward_batch.forward_mode
        if mode.is_idle():
            return super().init_forward_metadata(forward_batch)
        if mode.is_decode():
            with record_function("sparse.begin_decode"):
                self._begin_decode(forward_batch)
        elif mode.is_extend() and not mode.is_target_verify() and not mode.is_mixed():
            super().init_forward_metadata(forward_batch)  # plans the ragged (new tokens) prefill
            if not self.forward_metadata.use_ragged:
                raise RuntimeError("the sparse backend needs FlashInfer's ragged prefill (unset SGLANG_FLASHINFER_USE_PAGED, "
                                   "deterministic inference and multimodal inputs)")  # fmt: skip
            with record_function("sparse.begin_extend"):
                self._begin_extend(forward_batch)
                self._plan_ragged(forward_batch)
        else:
            raise NotImplementedError(f"the sparse backend does not run {mode} batches (speculative decoding, "
                                      "mixed chunks); turn those options off")  # fmt: skip

    def _generations(self, slots: list[int]) -> list[int]:
        """Each slot's generation (SGLang bumps it when the slot gets a new request), in one read
        of the host tensor: this runs every decode step, on the host thread the GPU waits for when
        it falls behind."""
        return self.req_generation[slots].tolist() if slots else []

    def _begin_extend(self, fb: ForwardBatch) -> None:
        slots = self._req_slots_cpu(fb.req_pool_indices)
        self.prefill_plan = self.runtime.begin_prefill(fb.req_pool_indices, slots, self._generations(slots),
                                                       fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu,
                                                       self.req_to_token_pool.req_to_token)  # fmt: skip

    def _plan_ragged(self, fb: ForwardBatch) -> None:
        """Plan the ragged (new tokens to new tokens) prefill the way this backend runs it: causal,
        with the model's softmax scale and soft cap, which FlashInfer's ``run`` reads from the plan.
        SGLang plans the same wrapper in ``init_forward_metadata`` for its ``forward``, which takes
        them per call and is deprecated; the plan here replaces that one."""
        indptr = torch.tensor([0, *itertools.accumulate(fb.extend_seq_lens_cpu)], dtype=torch.int32)
        s = self.store.shape
        self.prefill_wrapper_ragged.plan(indptr, indptr, self.num_q_heads, s.num_kv_heads, s.head_dim, causal=True,
                                         sm_scale=self.constants.sm_scale, logits_soft_cap=self.constants.logits_soft_cap,
                                         q_data_type=self.activation_dtype)  # fmt: skip

    def resume_extend(self) -> None:
        """Before the next layer segment of a layer-segmented prefill. Its metadata (the ragged and
        prefix plans, the pages it writes) was set up at its first segment and outlives the decode
        steps run since, which only bound their own save runs; the prefill's go back in place."""
        self.runtime.resume_prefill(self.prefill_plan)

    def _begin_decode(self, fb: ForwardBatch, graph: bool = False) -> None:
        bs = fb.batch_size
        req_slots = fb.req_pool_indices[:bs]
        slots = self._req_slots_cpu(req_slots)
        self.decode_plan = self.runtime.begin_decode(req_slots, slots, self._generations(slots), fb.seq_lens_cpu[:bs],
                                                     fb.seq_lens[:bs], self.req_to_token_pool.req_to_token,
                                                     graph=graph)  # fmt: skip

    # CUDA-graph decode (--sparse-decode-cuda-graph): SGLang's decode graph runner calls these.

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        self.decoder.init_cuda_graph(max_bs)

    def get_cuda_graph_seq_len_fill_value(self):
        return 1

    def init_forward_metadata_out_graph(self, forward_batch: ForwardBatch, in_capture: bool = False):
        if not forward_batch.forward_mode.is_decode():
            raise NotImplementedError(
                f"the sparse backend captures decode steps only, not {forward_batch.forward_mode}"
            )
        if in_capture:  # a batch the graph runner made up, not one init_new built
            self.next_req_slots = None
        with record_function("sparse.begin_decode"):
            self._begin_decode(forward_batch, graph=True)

    def init_forward_metadata_in_graph(self, forward_batch: ForwardBatch):
        bs = forward_batch.batch_size
        self.runtime.bind_decode_runs(forward_batch.req_pool_indices[:bs], forward_batch.seq_lens[:bs])

    # Per layer, on the device.

    def forward_extend(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch, save_kv_cache=True):
        heads, dim = layer.tp_q_head_num, layer.head_dim
        q3 = q.contiguous().view(-1, heads, dim)
        k3, v3 = k.view(-1, layer.tp_k_head_num, dim), v.view(-1, layer.tp_v_head_num, dim)
        self.constants.check(layer.scaling, layer.logit_cap, "sparse backend's prefill")
        k_scale, v_scale = fp8_kv_scales(layer, self.store.shape.dtype)
        if not self.prefix.active:  # the new tokens' own K/V, unquantized
            o = self.prefill_wrapper_ragged.run(q3, k3, v3)
        else:
            o, lse = self.prefill_wrapper_ragged.run(q3, k3, v3, return_lse=True)
            self.prefix.run(layer.layer_id - self.kv_pool.start_layer, q3, o, lse, k_scale=k_scale, v_scale=v_scale)
        if save_kv_cache and self.prefill_plan.runs is not None:  # None: a made-up batch (begin_prefill)
            self.kv_pool.save(layer.layer_id, forward_batch.out_cache_loc, k3, v3, staged=True,
                              k_scale=k_scale, v_scale=v_scale)  # fmt: skip
        return o.view(-1, heads * dim)

    def forward_decode(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch, save_kv_cache=True):
        heads, dim = layer.tp_q_head_num, layer.head_dim
        k_scale, v_scale = fp8_kv_scales(layer, self.store.shape.dtype)
        if save_kv_cache and k is not None:
            self.kv_pool.save(layer.layer_id, forward_batch.out_cache_loc, k, v, staged=False,
                              k_scale=k_scale, v_scale=v_scale)  # fmt: skip
        o = self.decoder.run(layer.layer_id - self.kv_pool.start_layer, q.contiguous().view(-1, heads, dim),
                             self.decode_plan, layer.scaling, layer.logit_cap, k_scale, v_scale)  # fmt: skip
        return o.view(-1, heads * dim)


@relies_on(
    "sglang.srt.models.llama:LlamaModel.load_kv_cache_scales",
    at="sglang/srt/models/llama.py:464",
)
def fp8_kv_scales(layer: RadixAttention, kv_dtype: torch.dtype) -> tuple[float | None, float | None]:
    """The per-tensor (K, V) scales of an fp8 KV store (stored = value / scale), ``(None, None)``
    for a 16-bit store. SGLang keeps them in ``k_scale_float`` when an fp8 checkpoint carries them
    and as a plain float ``k_scale`` when ``--quantization-param-path`` gives them."""
    if kv_dtype.itemsize > 1:
        return None, None

    def scale(as_float, as_set) -> float | None:
        if as_float is not None:
            return float(as_float)
        return float(as_set) if isinstance(as_set, (int, float)) else None

    return scale(layer.k_scale_float, layer.k_scale), scale(layer.v_scale_float, layer.v_scale)


@relies_on(
    "sglang.srt.layers.attention.attention_registry:register_attention_backend",
    at="sglang/srt/layers/attention/attention_registry.py:34",
)
def register_sparse_attention_backend() -> None:
    """Make ``--attention-backend sparse`` build :class:`SparseAttnBackend` (in every process that builds models)."""
    from sglang.srt.layers.attention.attention_registry import (
        ATTENTION_BACKENDS,
        register_attention_backend,
    )

    if BACKEND_NAME in ATTENTION_BACKENDS:
        return

    @register_attention_backend(BACKEND_NAME)
    def create_sparse_backend(runner: ModelRunner) -> SparseAttnBackend:
        if runner.use_mla_backend:
            raise ValueError(
                "--attention-backend sparse serves MHA/GQA models; this model uses MLA "
                "(run it with --sparse-enabled false)"
            )
        return SparseAttnBackend(runner, init_new_workspace=runner.init_new_workspace)


@relies_on(
    "sglang.srt.server_args:add_attention_backend_choices",
    at="sglang/srt/server_args.py:386",
)
def add_sparse_backend_choice() -> None:
    """Let the CLI accept ``sparse`` wherever it accepts an attention backend name."""
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])


@relies_on("sglang.srt.runtime_context:get_parallel", at="sglang/srt/runtime_context.py:1070")
def tp_agreement():
    """The working-set gate's ``agree`` under tensor parallelism: the max over the TP group's ranks
    (attention's: DP attention is refused), through its CPU (gloo) group; None on one rank."""
    from sglang.srt.runtime_context import get_parallel

    from sparse_sglang.scheduler import max_over_ranks

    parallel = get_parallel()
    if parallel.attn_tp_size <= 1:
        return None
    return max_over_ranks(parallel.tp_group.cpu_group)
