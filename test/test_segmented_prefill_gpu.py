"""Layer-segmented prefill through the real server on the GPU host (``--sparse-segmented-prefill``).

While background requests decode, a long prompt arrives. Its prefill runs a layer segment per
scheduler iteration (``--sparse-max-inject-tokens`` set so each of its chunks runs one layer per
iteration, ``--chunked-prefill-size`` so it is also chunked: the in-layer hybrid), each iteration
also running a decode step of the background requests. Then the same prompt is sent alone, which
SGLang prefills the normal way (nothing decodes next to it). Both give

- the same log-probability of every prompt token (the prefill's output at every position), and
- the same greedy tokens (the KV the segmented prefill left in the host store and the page cache).

The server's counters show the segments ran with decode steps between them. A third long prompt,
aborted while it is being segmented, stops its prefill and frees its pages at once: when the
background requests are done, every pool is back at its idle value.

Both on the Llama-3-8B shape (dummy weights, 32 layers) and on SmolLM2 (real weights, 30 layers).
Results go to ``$SPARSE_SGLANG_RESULTS_DIR/segmented-prefill-<model>.json`` when that is set.
"""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from benchmark.soak import settled, sparse_state
from sparse_sglang.testing.models import LLAMA3_8B_TOKEN_IDS, write_llama3_8b_dummy
from sparse_sglang.testing.provenance import save_gpu_test_record
from sparse_sglang.testing.server import SPARSE_MODULE, ServerProcess, flush_cache, generate_ids, prompt_logprobs

pytestmark = pytest.mark.gpu

PROMPT_TOKENS = 6000  # the segmented prompt: chunks of 4096 + 1904 tokens
CHUNK_TOKENS = 4096
BACKGROUND = 4  # requests decoding while it prefills
BACKGROUND_PROMPT, BACKGROUND_NEW = 300, 1200
NEW_TOKENS = 32
ARGS = ["--mem-fraction-static", "0.7", "--sparse-host-cache-gb", "12", "--cuda-graph-max-bs-decode", "8",
        "--chunked-prefill-size", str(CHUNK_TOKENS),
        "--sparse-segmented-prefill", "true", "--sparse-max-inject-tokens", str(CHUNK_TOKENS)]  # fmt: skip


def model_and_prompts(name: str, tmp_path: Path) -> tuple[str, list[str], list[list[int]]]:
    """(model folder, extra server args, [long prompt, prompt to abort, *background prompts])."""
    rng = random.Random(0)
    if name == "llama3-8b-dummy":
        model = write_llama3_8b_dummy(tmp_path / "llama3-8b-dummy")
        ids = lambda n: [rng.randrange(*LLAMA3_8B_TOKEN_IDS) for _ in range(n)]  # noqa: E731
        return model, ["--load-format", "dummy", "--skip-tokenizer-init"], [
            ids(PROMPT_TOKENS), ids(PROMPT_TOKENS), *(ids(BACKGROUND_PROMPT) for _ in range(BACKGROUND))]  # fmt: skip
    from transformers import AutoTokenizer

    from sparse_sglang.default_model import default_model_path

    model = default_model_path()
    licenses = [p for p in sorted(Path("/usr/share/common-licenses").glob("*")) if p.is_file()]
    text = "\n\n".join(p.read_text(errors="replace") for p in licenses) or "The quick brown fox. " * 5000
    tokens = AutoTokenizer.from_pretrained(model)(text)["input_ids"]
    pieces = [tokens[i * 7000 : i * 7000 + PROMPT_TOKENS] for i in range(2)]
    pieces += [tokens[20000 + i * 500 : 20000 + i * 500 + BACKGROUND_PROMPT] for i in range(BACKGROUND)]
    assert all(len(p) for p in pieces)
    return model, [], pieces


def segmented(url: str) -> dict:
    return dict(sparse_state(url)["segmented_prefill"])


@pytest.mark.parametrize("model_name", ["llama3-8b-dummy", "smollm2"])
def test_segmented_prefill_equals_a_normal_one_and_aborts_free_at_once(model_name, tmp_path):
    model, model_args, (prompt, doomed, *background) = model_and_prompts(model_name, tmp_path)
    with ServerProcess(SPARSE_MODULE, model, [*ARGS, *model_args], log_path=tmp_path / "server.log") as server:
        url = server.url
        generate_ids(url, background[0], 4)  # first-request costs out of the way
        assert flush_cache(url)
        idle = sparse_state(url)
        before = segmented(url)
        with ThreadPoolExecutor(BACKGROUND + 1) as pool:
            decoding = [pool.submit(generate_ids, url, ids, BACKGROUND_NEW) for ids in background]
            time.sleep(2.0)  # they are past their prefill and decoding
            during = generate_ids(url, prompt, NEW_TOKENS, logprobs=True)
            after_one = segmented(url)
            # A long prompt aborted a moment into its prefill, while the others still decode.
            doomed_reply = pool.submit(generate_ids, url, doomed, NEW_TOKENS, "segmented-abort")
            time.sleep(0.15)
            abort_status = requests.post(
                url + "/abort_request", json={"rid": "segmented-abort"}, timeout=30
            ).status_code
            doomed_finish = doomed_reply.result()["meta_info"]["finish_reason"]
            still_decoding = sum(not f.done() for f in decoding)
            background_out = [f.result() for f in decoding]
        after_abort = segmented(url)
        leaked = settled(server, idle)
        alone = generate_ids(url, prompt, NEW_TOKENS, logprobs=True)  # nothing decodes: a normal prefill
        after_alone = segmented(url)
        log = server.log_path.read_text(errors="replace")
    assert server.stopped_cleanly, server.log_tail()

    diffs = [abs(a - b) for a, b in zip(prompt_logprobs(during), prompt_logprobs(alone))]
    summary = {
        "model": model_name,
        "prompt_tokens": len(prompt),
        "segments": after_one["segments"] - before["segments"],
        "decode_steps_between_segments": after_one["decode_steps"] - before["decode_steps"],
        "greedy_equal": during["output_ids"] == alone["output_ids"],
        "prompt_logprob_max_abs_diff": max(diffs),
        "alone_was_segmented": after_alone["prefills"] != after_abort["prefills"],
        "abort_status": abort_status,
        "aborted_finish": doomed_finish,
        "abort_cancelled_mid_prefill": after_abort["cancelled"] - after_one["cancelled"],
        "background_still_decoding_at_abort": still_decoding,
        "background_tokens": [len(o["output_ids"]) for o in background_out],
        **leaked,
        "tracebacks_in_log": log.count("Traceback"),
    }
    save_gpu_test_record(
        f"segmented-prefill-{model_name}.json",
        {
            "args": ARGS,
            "summary": summary,
            "output_ids": {"segmented": during["output_ids"], "alone": alone["output_ids"]},
        },
    )
    print(json.dumps(summary))
    layers = 32 if model_name == "llama3-8b-dummy" else 30
    assert summary["segments"] > layers, summary  # the first chunk one layer per iteration, then the rest
    assert summary["decode_steps_between_segments"] == summary["segments"], summary  # a decode step next to each
    assert not summary["alone_was_segmented"], summary
    assert summary["prompt_logprob_max_abs_diff"] <= 1e-3, summary
    assert summary["greedy_equal"], summary
    assert abort_status == 200 and doomed_finish["type"] == "abort", summary
    assert summary["abort_cancelled_mid_prefill"] == 1, summary
    assert all(n == BACKGROUND_NEW for n in summary["background_tokens"]), summary
    assert not any(leaked.values()) and summary["tracebacks_in_log"] == 0, summary
