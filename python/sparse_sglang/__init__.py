"""sparse-sglang: long-context serving on SGLang with sparse decode over a per-KV-head GPU/CPU KV hierarchy."""

from sparse_sglang.config import SparseConfig, SparseConfigError

__version__ = "0.1.0"
__all__ = ["Engine", "SparseConfig", "SparseConfigError", "__version__"]


def __getattr__(name: str):
    # Lazy: importing SGLang's engine is slow, and the config must stay importable without it.
    if name == "Engine":
        from sparse_sglang.integration.engine import Engine

        return Engine
    raise AttributeError(f"module 'sparse_sglang' has no attribute {name!r}")
