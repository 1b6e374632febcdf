"""The ``sparse`` attention backend, as SGLang sees it.

SGLang builds attention backends by name from ``ATTENTION_BACKENDS``. We add
``sparse``: a FlashInfer backend whose prefill stays dense FlashInfer and whose
decode is where sparse attention over the per-head KV hierarchy plugs in. Until
that lands it delegates decode to FlashInfer unchanged (a passthrough), which
the serving benchmark holds to within 3% of vanilla SGLang.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend

from sparse_sglang.integration.registry import relies_on

if TYPE_CHECKING:
    from sglang.srt.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

BACKEND_NAME = "sparse"


@relies_on(
    "sglang.srt.layers.attention.flashinfer_backend:FlashInferAttnBackend",
    at="sglang/srt/layers/attention/flashinfer_backend.py:288",
)
class SparseAttnBackend(FlashInferAttnBackend):
    """Dense FlashInfer prefill; decode over the selected KV pages (passthrough for now)."""

    def __init__(self, model_runner: ModelRunner, init_new_workspace: bool = False):
        super().__init__(model_runner, init_new_workspace=init_new_workspace)
        self.sparse_config = model_runner.server_args.sparse
        logger.info("sparse attention backend: %s", self.sparse_config)


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
