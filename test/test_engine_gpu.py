"""The offline API on a GPU: sparse_sglang.Engine gives vanilla sglang.Engine's greedy outputs."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

PROMPTS = ["The capital of France is", "def fibonacci(n):\n"]
GREEDY = {"temperature": 0, "max_new_tokens": 16}


def _generate(engine_cls, **kwargs) -> list[str]:
    # sglang 0.5.17 has no ServerArgs.cuda_graph_max_bs: --cuda-graph-max-bs sets cuda_graph_max_bs_decode.
    engine = engine_cls(cuda_graph_max_bs_decode=4, mem_fraction_static=0.5, **kwargs)
    try:
        return [out["text"] for out in engine.generate(PROMPTS, GREEDY)]
    finally:
        engine.shutdown()


def test_engine_matches_vanilla_engine():
    import sglang

    import sparse_sglang
    from sparse_sglang.default_model import default_model_path

    path = default_model_path()
    sparse = _generate(sparse_sglang.Engine, model_path=path, sparse={"token_budget": 1024})
    vanilla = _generate(sglang.Engine, model_path=path, attention_backend="flashinfer")
    assert "Paris" in sparse[0]
    assert sparse == vanilla
