"""The offline API: ``sparse_sglang.Engine``, SGLang's Engine with sparse decode."""

from __future__ import annotations

from sglang.srt.entrypoints.engine import Engine as SGLangEngine

from sparse_sglang.config import SparseConfig
from sparse_sglang.integration.registry import relies_on
from sparse_sglang.integration.scheduler_process import run_scheduler_process
from sparse_sglang.integration.server_args import SparseServerArgs, require_cuda_gpu


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
        # First, whatever the arguments: without a GPU SGLang's own start-up fails deep inside
        # (chained tracebacks), after the default model's conversion has already run.
        require_gpu_for_engine(kwargs)
        from sparse_sglang.integration import install

        install()
        if kwargs.get("model_path") is None and "server_args" not in kwargs:
            kwargs["model_path"] = default_model_for_engine()
        super().__init__(**kwargs)


def require_gpu_for_engine(kwargs: dict) -> None:
    """:func:`require_cuda_gpu` for an ``Engine(**kwargs)`` that would decode sparsely on CUDA (its
    ``device`` left out or ``"cuda"``; ``device="cpu"`` is the CPU tests'). The error names the
    ``device`` argument only where the caller passed it."""
    server_args = kwargs.get("server_args")
    if server_args is not None:
        sparse, device = getattr(server_args, "sparse", None), server_args.device
    else:
        sparse, device = kwargs.get("sparse"), kwargs.get("device")
    if isinstance(sparse, SparseConfig):
        enabled = sparse.enabled
    elif isinstance(sparse, dict):
        enabled = sparse.get("enabled", True)
    else:  # left out (the default config), or a wrong type that SparseServerArgs refuses later
        enabled = True
    if enabled and device in (None, "cuda"):
        require_cuda_gpu("sparse_sglang.Engine(device='cuda')" if device else "sparse_sglang.Engine")


def default_model_for_engine() -> str:
    """The model an ``Engine`` without ``model_path`` serves: the launcher's default (SmolLM2-135M-
    Instruct, converted once), with errors naming the keyword argument."""
    from sparse_sglang.default_model import DefaultModelUnavailable, default_model_path

    try:
        return default_model_path()
    except DefaultModelUnavailable as err:
        raise DefaultModelUnavailable(f"model_path: {err}") from None
