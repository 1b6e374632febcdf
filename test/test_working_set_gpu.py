"""More requests than the GPU page cache holds working sets for: the working-set rule defers and
retracts, and every request still gives the tokens it gives alone (GPU host).

The sparse server on the Llama-3-8B shape cut to 4 layers (dummy weights) with
``--sparse-working-set-admission true`` and a GPU page cache of 0.125 GiB: 8,192 slots, three
narrowest request rows (80 pages x 4 layers x 8 kv heads). Six 6,000-token prompts (188 pages
each, 64 selected per step) decode 96 greedy tokens each, first alone (the reference, nothing to
defer or retract), then all six at once. Together, the rule must hold some back (deferrals) and,
when the running requests' selected pages over the window outgrow the cache, retract some (their
host KV kept as a radix-cached prefix, so they come back as prefix hits). Every request gives the
same tokens and output log-probabilities as alone; afterwards nothing leaked.

Results go to ``$SPARSE_SGLANG_RESULTS_DIR/working-set-gpu-test.json`` when that is set.
"""

from __future__ import annotations

import json
import random
import threading
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

PROMPTS, PROMPT_TOKENS, NEW_TOKENS, LAYERS = 6, 6000, 96, 4
ARGS = ["--load-format", "dummy", "--skip-tokenizer-init", "--mem-fraction-static", "0.7", "--sparse-host-cache-gb", "8",
        "--sparse-working-set-admission", "true", "--sparse-gpu-cache-gb", "0.125", "--cuda-graph-max-bs-decode", "8"]  # fmt: skip


def test_more_requests_than_the_cache_holds_finish_with_their_uncontended_tokens(tmp_path):
    model = write_llama3_8b_dummy(tmp_path / "llama3-8b-dummy-4l", num_layers=LAYERS)
    rng = random.Random(0)
    prompts = [[rng.randrange(*LLAMA3_8B_TOKEN_IDS) for _ in range(PROMPT_TOKENS)] for _ in range(PROMPTS)]
    run = lambda url, ids: generate_ids(url, ids, NEW_TOKENS, logprobs=True, logprob_start_len=-1)  # noqa: E731
    with ServerProcess(SPARSE_MODULE, model, ARGS, log_path=tmp_path / "server.log") as server:
        url = server.url
        fresh = sparse_state(url)
        alone = warm_then_each_alone(url, prompts, run)
        idle = before = sparse_state(url)  # flushed: what an idle server holds
        demand, done = [], threading.Event()

        def watch():  # the running requests' summed working sets while they run together
            while not done.wait(0.5):
                state = sparse_state(url)
                demand.append((state["working_set_demand_pages"], state["gpu_cache_rows_open"]))

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            with ThreadPoolExecutor(PROMPTS) as pool:
                together = list(pool.map(lambda ids: run(url, ids), prompts))
        finally:
            done.set()
            watcher.join()
        after = sparse_state(url)
        leaked = settled(server, idle)
    assert server.stopped_cleanly, server.log_tail()

    summary = {
        "gpu_cache_slots": idle["gpu_cache_slots"],
        "deferrals_alone": before["working_set_deferrals"] - fresh["working_set_deferrals"],
        "retractions_alone": before["working_set_retractions"] - fresh["working_set_retractions"],
        "deferrals_together": after["working_set_deferrals"] - before["working_set_deferrals"],
        "retractions_together": after["working_set_retractions"] - before["working_set_retractions"],
        "num_retractions": [t["meta_info"].get("num_retractions", 0) for t in together],
        "max_demand_pages": max((d for d, _ in demand if d is not None), default=None),
        "max_rows_open": max((rows for _, rows in demand), default=None),
        **greedy_comparison(alone, together),
        **leaked,
    }
    save_gpu_test_record("working-set-gpu-test.json", {"args": ARGS, "layers": LAYERS, "summary": summary,
                                                       "demand_pages_and_rows": demand})  # fmt: skip
    print(json.dumps(summary))
    assert summary["retractions_alone"] == 0, summary
    assert summary["deferrals_together"] > 0 and summary["retractions_together"] > 0, summary
    assert sum(summary["num_retractions"]) == summary["retractions_together"], summary
    assert all(summary["greedy_equal"]), summary
    assert summary["output_logprob_max_abs_diff"] <= 0.05, summary
    assert not any(leaked.values()), summary  # nothing leaked, no traceback
