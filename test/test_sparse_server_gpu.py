"""The sparse server end to end on the Llama-3-8B shape (dummy weights, ``input_ids`` in).

Concurrent requests whose prompts are shorter and longer than the token budget (2048, the
default): the long ones decode sparsely, the longest is prefilled in chunks (its later chunks
attend to the earlier ones staged from the host), and a request sharing a cached prefix gets a
radix hit (its prefix staged from the host too). Every request completes with its token count,
the server stays healthy and stops cleanly. Dummy weights make the tokens meaningless; the
quality checks are ``test_sparse_quality_gpu.py`` (SmolLM2, real weights).

It runs twice: decode eagerly and decode under SGLang's CUDA graphs (``--sparse-decode-cuda-graph``),
each also timing a batch-1 decode step on an 8K prompt (the same prompt with 16 and 144 new
tokens, the cache flushed before each: the difference is 128 decode steps).

Run on the GPU host: ``pytest -m gpu test/test_sparse_server_gpu.py``; timings and outputs go to
``$SPARSE_SGLANG_RESULTS_DIR/gpu-sparse-server-8b-<eager, cuda-graph>.json`` when that is set.
"""

from __future__ import annotations

import datetime
import json
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from sparse_sglang.testing.models import LLAMA3_8B_CONFIG, write_llama3_8b_dummy
from sparse_sglang.testing.provenance import git_commit
from sparse_sglang.testing.server import SPARSE_MODULE, ServerProcess, flush_cache

pytestmark = pytest.mark.gpu

ARGS = ["--load-format", "dummy", "--skip-tokenizer-init", "--mem-fraction-static", "0.8",
        "--chunked-prefill-size", "4096", "--sparse-host-cache-gb", "16", "--max-running-requests", "8",
        "--cuda-graph-max-bs-decode", "8"]  # fmt: skip
PROMPT_TOKENS = (1500, 3000, 6000, 9000)  # one under the 2048-token budget; the 9000 one in 3 chunks
NEW_TOKENS = 48


def generate(url: str, ids: list[int], new_tokens: int = NEW_TOKENS) -> dict:
    started = time.monotonic()
    params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    response = requests.post(url + "/generate", json={"input_ids": ids, "sampling_params": params}, timeout=600)
    assert response.status_code == 200, response.text[:500]
    return {**response.json(), "latency_s": round(time.monotonic() - started, 3)}


def decode_step_ms(url: str, ids: list[int]) -> float:
    """Milliseconds per batch-1 decode step: (144 new tokens - 16 new tokens) / 128, no cached prefix
    (after one untimed request: the first one on a fresh server pays one-time costs)."""
    generate(url, ids, 16)
    latency = {}
    for n in (16, 144):
        assert flush_cache(url)
        latency[n] = generate(url, ids, n)["latency_s"]
    return round((latency[144] - latency[16]) / 128 * 1000, 3)


@pytest.mark.parametrize("decode_graph", [False, True], ids=["eager", "cuda-graph"])
def test_long_prompts_decode_sparsely_with_chunked_prefill_and_a_radix_hit(tmp_path, decode_graph):
    model = write_llama3_8b_dummy(tmp_path / "llama3-8b-dummy")
    rng = random.Random(0)
    vocab = LLAMA3_8B_CONFIG["vocab_size"]
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_TOKENS]
    shared = prompts[2][:4096] + [rng.randrange(3, vocab) for _ in range(700)]  # a cached 4096-token prefix
    started = time.monotonic()
    mode = "cuda-graph" if decode_graph else "eager"
    args = [*ARGS, "--sparse-decode-cuda-graph", str(decode_graph).lower()]
    with ServerProcess(SPARSE_MODULE, model, args, log_path=tmp_path / f"sparse-8b-{mode}.log") as server:
        ready_s = time.monotonic() - started
        with ThreadPoolExecutor(len(prompts)) as pool:
            outs = list(pool.map(lambda ids: generate(server.url, ids), prompts))
        hit = generate(server.url, shared)
        step_ms = decode_step_ms(server.url, prompts[3][:8192])
        assert requests.get(server.url + "/health", timeout=30).status_code == 200
        log = server.log_path.read_text(errors="replace")
    assert server.stopped_cleanly, server.log_tail()
    assert "sparse attention backend: SparseConfig(" in log and "Traceback" not in log
    for out, n in zip(outs + [hit], [*PROMPT_TOKENS, len(shared)]):
        assert out["meta_info"]["prompt_tokens"] == n
        assert len(out["output_ids"]) == NEW_TOKENS and all(0 <= t < vocab for t in out["output_ids"])
    assert hit["meta_info"].get("cached_tokens", 0) >= 4096 - 32, hit["meta_info"]
    if os.environ.get("SPARSE_SGLANG_RESULTS_DIR"):
        import torch

        record = {"device": torch.cuda.get_device_name(0), "date": datetime.date.today().isoformat(),
                  "commit": git_commit(), "command": server.command, "ready_s": round(ready_s, 1),
                  "decode_mode": mode, "decode_step_ms_batch1_8k": step_ms,
                  "requests": [{"prompt_tokens": o["meta_info"]["prompt_tokens"], "cached_tokens": o["meta_info"].get("cached_tokens"),
                                "latency_s": o["latency_s"], "output_ids": o["output_ids"]} for o in outs + [hit]]}  # fmt: skip
        Path(os.environ["SPARSE_SGLANG_RESULTS_DIR"], f"gpu-sparse-server-8b-{mode}.json").write_text(
            json.dumps(record, indent=1)
        )
