"""A prefix-hit request decodes exactly as the same request on a cold server (GPU host).

The sparse server on the Llama-3-8B shape (dummy weights, 32 layers). A 6,000-token prefix (not a
whole number of pages: the hit shares its 187 full pages and recomputes the partial one) is
followed by each of three 500-token questions. Cold: each request alone on an empty radix cache
(``/flush_cache`` first), its prompt prefilled in chunks of 4,096 tokens. Hit: one other request
with the same prefix fills the cache, then each request alone reuses the prefix's host pages and
summaries and prefills only its question, which attends to the prefix staged from the host (in
pieces of 1,024 tokens, merged by their log-sum-exp, as the cold runs' second chunks do). The
contexts are longer than the 2,048-token budget, so both decode sparsely, selecting from the
summaries each path built. Each hit request gives the same 32 greedy tokens as its cold run, with
the same output log-probabilities; afterwards nothing leaked.

Results go to ``$SPARSE_SGLANG_RESULTS_DIR/radix-gpu-test.json`` when that is set.
"""

from __future__ import annotations

import json
import random

import pytest

from benchmark.soak import PAGE_SIZE, settled, sparse_state
from sparse_sglang.testing.models import LLAMA3_8B_TOKEN_IDS, write_llama3_8b_dummy
from sparse_sglang.testing.provenance import save_gpu_test_record
from sparse_sglang.testing.server import SPARSE_MODULE, ServerProcess, flush_cache, generate_ids, greedy_comparison

pytestmark = pytest.mark.gpu

PREFIX_TOKENS, QUESTION_TOKENS, QUESTIONS, NEW_TOKENS = 6000, 500, 3, 32
# 1,536 staging tokens (two buffers of 768): the cold runs' second chunks attend their 4,096-token
# prefix in 6 pieces, the hits their 5,984-token prefix in 8 (more than the planned wrappers:
# re-planned per layer).
ARGS = ["--load-format", "dummy", "--skip-tokenizer-init", "--mem-fraction-static", "0.7",
        "--sparse-host-cache-gb", "12", "--cuda-graph-max-bs-decode", "8", "--chunked-prefill-size", "4096",
        "--sparse-prefix-staging-tokens", "1536"]  # fmt: skip


def test_prefix_hit_decodes_like_a_cold_request(tmp_path):
    model = write_llama3_8b_dummy(tmp_path / "llama3-8b-dummy")
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(*LLAMA3_8B_TOKEN_IDS) for _ in range(n)]  # noqa: E731
    prefix = ids(PREFIX_TOKENS)
    primer, *prompts = [prefix + ids(QUESTION_TOKENS) for _ in range(QUESTIONS + 1)]
    with ServerProcess(SPARSE_MODULE, model, ARGS, log_path=tmp_path / "server.log") as server:
        url = server.url
        generate_ids(url, ids(300), 4)  # first-request costs out of the way
        assert flush_cache(url)
        idle = sparse_state(url)
        cold = []
        for prompt in prompts:
            assert flush_cache(url)
            cold.append(generate_ids(url, prompt, NEW_TOKENS, logprobs=True, logprob_start_len=-1))
        assert flush_cache(url)
        generate_ids(url, primer, 1)  # caches the prefix's full pages
        hit = [generate_ids(url, prompt, NEW_TOKENS, logprobs=True, logprob_start_len=-1) for prompt in prompts]
        shared = sparse_state(url)
        leaked = settled(server, idle)
    assert server.stopped_cleanly, server.log_tail()

    summary = {
        "cached_tokens_cold": [c["meta_info"].get("cached_tokens", 0) for c in cold],
        "cached_tokens_hit": [h["meta_info"].get("cached_tokens", 0) for h in hit],
        **greedy_comparison(cold, hit),
        "host_tokens_in_radix_cache": shared.get("host_tokens_in_radix_cache"),
        **leaked,
    }
    save_gpu_test_record(
        "radix-gpu-test.json",
        {
            "args": ARGS,
            "summary": summary,
            "output_ids": {"cold": [c["output_ids"] for c in cold], "hit": [h["output_ids"] for h in hit]},
        },
    )
    print(json.dumps(summary))
    full_prefix = PREFIX_TOKENS // PAGE_SIZE * PAGE_SIZE
    assert summary["cached_tokens_cold"] == [0] * QUESTIONS, summary
    assert summary["cached_tokens_hit"] == [full_prefix] * QUESTIONS, (
        summary
    )  # full pages only: the partial one is recomputed
    assert all(summary["greedy_equal"]), summary
    assert summary["output_logprob_max_abs_diff"] <= 0.05, summary
    assert not any(leaked.values()), summary  # nothing leaked, no traceback
