"""The offline API: ``sparse_sglang.Engine``, SGLang's Engine with sparse decode."""

from __future__ import annotations

from sglang.srt.entrypoints.engine import Engine as SGLangEngine

from sparse_sglang.integration.registry import relies_on
from sparse_sglang.integration.scheduler_process import run_scheduler_process
from sparse_sglang.integration.server_args import SparseServerArgs


@relies_on("sglang.srt.entrypoints.engine:Engine", at="sglang/srt/entrypoints/engine.py:195")
class Engine(SGLangEngine):
    """``sglang.Engine`` taking the same arguments plus ``sparse`` (a SparseConfig or a dict of its fields).

    Example
    -------
    >>> llm = sparse_sglang.Engine(model_path=path, sparse={"token_budget": 1024})
    >>> llm.generate("The capital of France is", {"temperature": 0, "max_new_tokens": 8})
    """

    # SGLang's documented override points for forks (engine.py:209-214).
    server_args_class = SparseServerArgs
    run_scheduler_process_func = staticmethod(run_scheduler_process)

    def __init__(self, **kwargs):
        from sparse_sglang.integration import install

        install()
        if kwargs.get("model_path") is None and "server_args" not in kwargs:
            kwargs["model_path"] = default_model_for_engine(kwargs)
        super().__init__(**kwargs)


def default_model_for_engine(kwargs: dict) -> str:
    """The model an ``Engine`` without ``model_path`` serves: the launcher's default (SmolLM2-135M-
    Instruct, converted once), after the same GPU check, with errors naming the keyword argument."""
    from sparse_sglang.config import SparseConfig
    from sparse_sglang.default_model import DefaultModelUnavailable, default_model_path
    from sparse_sglang.integration.server_args import require_cuda_gpu

    sparse = kwargs.get("sparse")
    enabled = sparse.enabled if isinstance(sparse, SparseConfig) else (sparse or {}).get("enabled", True)
    if enabled and kwargs.get("device") in (None, "cuda"):
        require_cuda_gpu("sparse_sglang.Engine")
    try:
        return default_model_path()
    except DefaultModelUnavailable as err:
        raise DefaultModelUnavailable(f"model_path: {err}") from None
