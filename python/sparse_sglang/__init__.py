"""sparse-sglang: long-context serving on SGLang with sparse decode over a per-KV-head GPU/CPU KV hierarchy."""

from sparse_sglang.config import SparseConfig, SparseConfigError

__version__ = "0.1.0"
__all__ = ["SparseConfig", "SparseConfigError", "__version__"]
