"""SGLang's overlap scheduler with sparse decode: requests that finish while the next step is
already running give the tokens they give alone (GPU host).

Under overlap SGLang plans and launches step N+1 before it has processed step N's results, so a
request that finished in step N is still decoded by step N+1 while the scheduler frees its slot and
the backend returns its page-cache row, and a new request may take that slot and row at N+2. The
sparse server on the Llama-3-8B shape cut to 4 layers (dummy weights, overlap on, as by default)
runs ten requests (prompts of 1,000-7,000 tokens, most longer than the 2,048-token budget, so they
decode sparsely; 8-80 new tokens, so they finish at different steps) at most four at a time: every
request gives the same tokens and output log-probabilities as alone, and nothing leaks.

Results go to ``$SPARSE_SGLANG_RESULTS_DIR/overlap-gpu-test.json`` when that is set.
"""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from benchmark.soak import settled, sparse_state
from sparse_sglang.testing.models import LLAMA3_8B_TOKEN_IDS, write_llama3_8b_dummy
from sparse_sglang.testing.provenance import save_gpu_test_record
from sparse_sglang.testing.server import (
    SPARSE_MODULE,
    ServerProcess,
    generate_ids,
    greedy_comparison,
    warm_then_each_alone,
)

pytestmark = pytest.mark.gpu

LAYERS = 4
ARGS = ["--load-format", "dummy", "--skip-tokenizer-init", "--mem-fraction-static", "0.7", "--sparse-host-cache-gb", "8",
        "--max-running-requests", "4", "--cuda-graph-max-bs-decode", "8"]  # fmt: skip


def test_requests_finishing_under_overlap_give_their_tokens_alone(tmp_path):
    model = write_llama3_8b_dummy(tmp_path / "llama3-8b-dummy-4l", num_layers=LAYERS)
    rng = random.Random(0)
    lengths = [rng.randrange(1000, 7000) for _ in range(10)]
    new_tokens = [rng.randrange(8, 80) for _ in range(10)]
    prompts = [[rng.randrange(*LLAMA3_8B_TOKEN_IDS) for _ in range(n)] for n in lengths]
    tokens_of = {id(ids): n for ids, n in zip(prompts, new_tokens)}
    run = lambda url, ids: generate_ids(url, ids, tokens_of[id(ids)], logprobs=True, logprob_start_len=-1)  # noqa: E731
    with ServerProcess(SPARSE_MODULE, model, ARGS, log_path=tmp_path / "server.log") as server:
        url = server.url
        info = requests.get(url + "/get_server_info", timeout=60).json()
        alone = warm_then_each_alone(url, prompts, run)
        idle = sparse_state(url)
        with ThreadPoolExecutor(len(prompts)) as pool:
            together = list(pool.map(lambda ids: run(url, ids), prompts))
        leaked = settled(server, idle)
    assert server.stopped_cleanly, server.log_tail()
    summary = {"disable_overlap_schedule": info["disable_overlap_schedule"], "prompt_tokens": lengths,
               "new_tokens": new_tokens, **greedy_comparison(alone, together), **leaked}  # fmt: skip
    save_gpu_test_record("overlap-gpu-test.json", {"args": ARGS, "layers": LAYERS, "summary": summary})
    print(json.dumps(summary))
    assert summary["disable_overlap_schedule"] is False, summary
    assert [len(t["output_ids"]) for t in together] == new_tokens, summary
    assert all(summary["greedy_equal"]), summary
    assert summary["output_logprob_max_abs_diff"] <= 0.05, summary
    assert not any(leaked.values()), summary  # nothing leaked, no traceback
