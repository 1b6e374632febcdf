"""A decode step between prefill chunks through the real server (``--sparse-interleave-prefill``).

While background requests decode, a long prompt arrives and is prefilled in three chunks; with the
knob, a decode step of the background requests runs after each chunk instead of the next chunk
(the server's ``prefills_held`` counter counts the rounds a pending prefill waited). The chunked request waits stashed
between its chunks, a path SGLang's own rounds take only briefly, so the test holds its result to
the same prompt sent alone (nothing decodes: no round held):

- the same log-probability of every prompt token and the same greedy tokens;
- the background requests get every token they asked for, and nothing is left held afterwards.

The Llama-3-8B shape with dummy weights. Results go to
``$SPARSE_SGLANG_RESULTS_DIR/prefill-interleave-gpu-test.json`` when that is set.
"""

from __future__ import annotations

import json
import random
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from benchmark.soak import settled, sparse_state
from sparse_sglang.testing.models import LLAMA3_8B_TOKEN_IDS, write_llama3_8b_dummy
from sparse_sglang.testing.provenance import save_gpu_test_record
from sparse_sglang.testing.server import SPARSE_MODULE, ServerProcess, flush_cache, generate_ids, prompt_logprobs

pytestmark = pytest.mark.gpu

CHUNK_TOKENS = 2048
PROMPT_TOKENS = 6000  # chunks of 2048 + 2048 + 1904 tokens
BACKGROUND = 4  # requests decoding while it prefills
BACKGROUND_PROMPT, BACKGROUND_NEW = 300, 1200
NEW_TOKENS = 32
ARGS = ["--load-format", "dummy", "--skip-tokenizer-init", "--mem-fraction-static", "0.7",
        "--sparse-host-cache-gb", "12", "--cuda-graph-max-bs-decode", "8",
        "--chunked-prefill-size", str(CHUNK_TOKENS), "--sparse-interleave-prefill", "true"]  # fmt: skip


# Paced (--sparse-tbt-target-ms): a prompt long enough for the pacer to time its first chunks and
# then size the rest, a target below what a full chunk deep in it costs beside a decode step.
PACED_PROMPT_TOKENS, PACED_TARGET_MS = 24000, 40
PREFILL_LINE = re.compile(r"Prefill batch, #new-seq: 1, #new-token: (\d+)")
# The pacer's fitted decode step (it logs its model): four requests decode in well under half the
# target, so a fit near the target has put chunks' time under the decode step's name
PACER_DECODE_LINE = re.compile(r"chunk pacing: decode step ([\d.]+) ms")
PACER_LINE = re.compile(r"chunk pacing: (.*)")  # the fits and the times by chunk size they rest on


# Resident (--sparse-resident-prefix-tokens): the prompt's chunks after the first attend their
# prefix from GPU memory, up to 4,096 tokens of it, instead of staging it from the host.
RESIDENT_TOKENS = 4096


@pytest.mark.parametrize("variant", ["chunks", "paced-chunks", "resident"])
def test_chunks_interleaved_with_decode_steps_give_the_prompts_normal_result(tmp_path, variant):
    paced = variant == "paced-chunks"
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(*LLAMA3_8B_TOKEN_IDS) for _ in range(n)]  # noqa: E731
    prompt_tokens = PACED_PROMPT_TOKENS if paced else PROMPT_TOKENS
    prompt, background = ids(prompt_tokens), [ids(BACKGROUND_PROMPT) for _ in range(BACKGROUND)]
    model = write_llama3_8b_dummy(tmp_path / "llama3-8b-dummy")
    args = {"chunks": ARGS, "paced-chunks": [*ARGS, "--sparse-tbt-target-ms", str(PACED_TARGET_MS)],
            "resident": [*ARGS, "--sparse-resident-prefix-tokens", str(RESIDENT_TOKENS)]}[variant]  # fmt: skip
    log = tmp_path / "server.log"
    with ServerProcess(SPARSE_MODULE, model, args, log_path=log) as server:
        url = server.url
        generate_ids(url, background[0], 4)  # first-request costs out of the way
        assert flush_cache(url)
        idle = sparse_state(url)
        with ThreadPoolExecutor(BACKGROUND) as pool:
            decoding = [pool.submit(generate_ids, url, b, BACKGROUND_NEW) for b in background]
            time.sleep(2.0)  # they are past their prefill and decoding
            held_before = sparse_state(url)["prefills_held"]
            during = generate_ids(url, prompt, NEW_TOKENS, logprobs=True)
            held = sparse_state(url)["prefills_held"] - held_before
            still_decoding = sum(not f.done() for f in decoding)
            background_out = [f.result() for f in decoding]
        leaked = settled(server, idle)
        chunks = [int(n) for n in PREFILL_LINE.findall(log.read_text())]  # the background's, then the prompt's
        fitted_decode_ms = [float(ms) for ms in PACER_DECODE_LINE.findall(log.read_text())]
        pacer_fits = PACER_LINE.findall(log.read_text())
        held_before_alone = sparse_state(url)["prefills_held"]
        alone = generate_ids(url, prompt, NEW_TOKENS, logprobs=True)  # nothing decodes: SGLang's rounds
        held_alone = sparse_state(url)["prefills_held"] - held_before_alone
        resident_pages = sparse_state(url)["resident_prefix_pages"]
    assert server.stopped_cleanly, server.log_tail()

    diffs = [abs(a - b) for a, b in zip(prompt_logprobs(during), prompt_logprobs(alone))]
    summary = {
        "prompt_tokens": len(prompt),
        "chunk_tokens": CHUNK_TOKENS,
        "tbt_target_ms": PACED_TARGET_MS if paced else None,
        "prefill_batches_logged": chunks,
        "rounds_held_while_background_decoded": held,
        "rounds_held_alone": held_alone,
        "background_still_decoding_after_the_prompt": still_decoding,
        "greedy_equal": during["output_ids"] == alone["output_ids"],
        "prompt_logprob_max_abs_diff": max(diffs),
        "background_tokens": [len(o["output_ids"]) for o in background_out],
        "resident_prefix_pages": resident_pages,
        "pacer_fitted_decode_step_ms": fitted_decode_ms,
        "pacer_fits": pacer_fits,
        **leaked,
    }
    name = {"chunks": "prefill-interleave-gpu-test.json", "paced-chunks": "prefill-interleave-paced-gpu-test.json",
            "resident": "prefill-interleave-resident-gpu-test.json"}[variant]  # fmt: skip
    save_gpu_test_record(name, {"args": args, "summary": summary})
    print(json.dumps(summary))
    # the second and third chunks each waited for a decode step while the background decoded
    assert still_decoding == BACKGROUND and held >= 2, summary
    assert held_alone == 0, summary
    assert summary["prompt_logprob_max_abs_diff"] <= 1e-3 and summary["greedy_equal"], summary
    assert all(n == BACKGROUND_NEW for n in summary["background_tokens"]), summary
    assert not any(leaked.values()), summary
    if paced:
        assert fitted_decode_ms and max(fitted_decode_ms) < PACED_TARGET_MS / 2, summary
    if paced:  # after the chunks it timed, the pacer cut the prompt into chunks smaller than SGLang's
        assert all(n <= CHUNK_TOKENS for n in chunks), summary
        assert any(n % 64 == 0 and n not in (CHUNK_TOKENS, CHUNK_TOKENS // 2) for n in chunks[:-1]), summary
    # the prompt, sent twice (while others decode, then alone), in chunks of 2,048 + 2,048 + 1,904
    # tokens: each time its second and third chunks attend 64 and 128 resident pages (the first
    # chunk's pages reach the buffer from the host at the second)
    assert resident_pages == (2 * (64 + 128) if variant == "resident" else None), summary
