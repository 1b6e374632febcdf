"""A retracted request comes back as a prefix hit and decodes as if never retracted (GPU host).

SGLang retracts running requests when host KV runs short; ``SGLANG_TEST_RETRACT`` makes it retract
every ``SGLANG_TEST_RETRACT_INTERVAL`` steps whenever two or more requests decode (it always keeps
one). With ``integration/retraction.py`` a retracted request's full pages go into the radix tree,
so it resumes from its host KV. The sparse server on the Llama-3-8B shape (dummy weights): each of
four 5,000-token prompts alone (nothing to retract: the reference), then all four at once, with
retractions. Every request gives the same 64 greedy tokens, with the same output
log-probabilities; afterwards nothing leaked.

Results go to ``$SPARSE_SGLANG_RESULTS_DIR/retraction-gpu-test.json`` when that is set.
"""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import pytest

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

PROMPTS, PROMPT_TOKENS, NEW_TOKENS = 4, 5000, 64
ARGS = ["--load-format", "dummy", "--skip-tokenizer-init", "--mem-fraction-static", "0.7",
        "--sparse-host-cache-gb", "12", "--cuda-graph-max-bs-decode", "8"]  # fmt: skip
ENV = {"SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": "16"}


def test_retracted_requests_resume_from_host_kv_with_the_same_tokens(tmp_path):
    model = write_llama3_8b_dummy(tmp_path / "llama3-8b-dummy")
    rng = random.Random(0)
    prompts = [[rng.randrange(*LLAMA3_8B_TOKEN_IDS) for _ in range(PROMPT_TOKENS)] for _ in range(PROMPTS)]
    run = lambda url, ids: generate_ids(url, ids, NEW_TOKENS, logprobs=True, logprob_start_len=-1)  # noqa: E731
    with ServerProcess(SPARSE_MODULE, model, ARGS, env=ENV, log_path=tmp_path / "server.log") as server:
        url = server.url
        alone = warm_then_each_alone(url, prompts, run)
        idle = sparse_state(url)  # flushed: what an idle server holds
        with ThreadPoolExecutor(PROMPTS) as pool:
            together = list(pool.map(lambda ids: run(url, ids), prompts))
        leaked = settled(server, idle)
        log = server.log_path.read_text(errors="replace")
    assert server.stopped_cleanly, server.log_tail()

    summary = {
        "retractions_alone": [a["meta_info"].get("num_retractions", 0) for a in alone],
        "retractions_together": [t["meta_info"].get("num_retractions", 0) for t in together],
        "retraction_log_lines": log.count("Testing retraction"),
        **greedy_comparison(alone, together),
        **leaked,
    }
    save_gpu_test_record(
        "retraction-gpu-test.json",
        {
            "args": ARGS,
            "env": ENV,
            "summary": summary,
            "output_ids": {"alone": [a["output_ids"] for a in alone], "together": [t["output_ids"] for t in together]},
        },
    )
    print(json.dumps(summary))
    assert summary["retractions_alone"] == [0] * PROMPTS, summary
    assert sum(summary["retractions_together"]) > 0, summary
    assert all(summary["greedy_equal"]), summary
    assert summary["output_logprob_max_abs_diff"] <= 0.05, summary
    assert not any(leaked.values()), summary  # nothing leaked, no traceback
