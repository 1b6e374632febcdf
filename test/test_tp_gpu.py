"""Tensor parallelism on two GPUs (``--tp-size 2``): each rank keeps the hierarchy of its own kv
heads, and the server answers as plain SGLang at TP=2 and as itself at TP=1.

The Llama-3-8B shape cut to a few layers, greedy with log-probabilities:

- dummy weights, the budget covering every prompt and the exact shortcut off (the selection
  machinery runs, every page is attended): the tokens equal vanilla SGLang TP=2's;
- seeded random weights of real spread, prompts three times the budget (real selection), each
  decode step compared on forced contexts (:func:`forced_steps`: the prompt plus the first j
  tokens of one continuation, so a near tie at one step does not part the rest). On one layer,
  where TP's rounding cannot reach the selection, TP=2 gives TP=1's tokens and logprobs as closely
  as plain SGLang's TP=2 gives its TP=1's (:func:`tp_steps_agree`); on four, where rounding summed
  across ranks moves the next layers' queries and swaps pages at the selection's boundary, TP=2
  stays far nearer TP=1 than selection itself moves (:func:`nearer_than_selection`). Under dummy
  weights the first token is already a tie.

Also ``/get_server_info`` at TP=2: every rank's ``"sparse"`` entry and their sum. Needs two CUDA
GPUs.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable
from typing import NamedTuple, TypeVar

import pytest
import torch

from sparse_sglang.testing.greedy import (
    completion,
    forced_steps,
    greedy_agreement,
    nearer_than_selection,
    switched_steps,
    tp_logprob_tolerance,
    tp_steps_agree,
)
from sparse_sglang.testing.models import LLAMA3_8B_CONFIG, write_llama3_8b_dummy, write_llama3_8b_random
from sparse_sglang.testing.provenance import save_gpu_test_record
from sparse_sglang.testing.server import SPARSE_MODULE, VANILLA_MODULE, ServerProcess, generate_ids

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]

# Prefill runs eagerly on every server, as the sparse launcher always runs it, so the two systems'
# prefills run alike (capturing vanilla's prefill graphs was also most of each vanilla start).
BASE = [
    "--skip-tokenizer-init",
    "--mem-fraction-static",
    "0.5",
    "--cuda-graph-max-bs-decode",
    "8",
    "--disable-radix-cache",
    "--disable-prefill-cuda-graph",
]
SPARSE_FLAGS = ["--sparse-host-cache-gb", "16", "--sparse-token-budget", "1024"]
COMMON = ["--load-format", "dummy", *BASE]
SPARSE = [*COMMON, *SPARSE_FLAGS]
# A model folder with its weights; fp32 logits, since bf16 logits of the random model's spread
# (top logits near 28, bf16 steps of 0.125 there) tie exactly every few steps.
REAL_WEIGHTS = [*BASE, "--enable-fp32-lm-head"]
SPARSE_REAL_WEIGHTS = [*REAL_WEIGHTS, *SPARSE_FLAGS]
NEW_TOKENS = 32
T = TypeVar("T")
FORCED_STEPS = 24  # decode steps compared per prompt at TP=2 against TP=1
# The forced contexts' prompts. The selection tests' bars were set after runs on seed 1 (docs/
# decisions/0020), and their servers are deterministic, so seed 1 passing again is no new evidence:
# another seed is a fresh sample of prompts to hold the bars to.
PROMPT_SEED = int(os.environ.get("SPARSE_SGLANG_TP_PROMPT_SEED", "1"))


def prompts(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, LLAMA3_8B_CONFIG["vocab_size"]) for _ in range(n)] for n in lengths]


def greedy(url: str, ids: list[int], new_tokens: int = NEW_TOKENS) -> dict:
    """Greedy output tokens with their logprobs and top two (:func:`completion`)."""
    return completion(generate_ids(url, ids, new_tokens, logprobs=True, logprob_start_len=-1, top_logprobs=2))


def serve(module: str, model, args: list[str], log_path, work: Callable[[str], T], info: list | None = None) -> T:
    """``work(url)`` against one server (its requests one at a time, so batch composition stays
    fixed); ``info`` given, the server's ``/get_server_info`` states afterwards are appended to it."""
    import requests

    with ServerProcess(module, model, args, log_path=log_path) as server:
        out = work(server.url)
        if info is not None:
            info.extend(requests.get(server.url + "/get_server_info", timeout=60).json()["internal_states"])
        tracebacks = server.log_path.read_text(errors="replace").count("Traceback")
    assert server.stopped_cleanly and tracebacks == 0, server.log_tail()
    return out


def each_greedy(batch: list[list[int]]) -> Callable[[str], list[dict]]:
    return lambda url: [greedy(url, ids) for ids in batch]


def each_forced(contexts: list[list[int]]) -> Callable[[str], list[dict]]:
    """Two new tokens on each context: the first from the dense prefill, the second from a decode step."""
    return lambda url: [greedy(url, ids, new_tokens=2) for ids in contexts]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_llama3_8b_dummy(tmp_path_factory.mktemp("tp") / "llama3-8b-dummy-4l", num_layers=4)


def test_tp2_with_every_page_attended_gives_vanilla_tp2s_tokens(model, tmp_path):
    batch = prompts((700, 1000), seed=0)  # within the 1024-token budget
    vanilla = serve(VANILLA_MODULE, model, [*COMMON, "--tp-size", "2", "--attention-backend", "flashinfer"],
                    tmp_path / "vanilla-tp2.log", each_greedy(batch))  # fmt: skip
    sparse = serve(SPARSE_MODULE, model, [*SPARSE, "--tp-size", "2", "--sparse-exact-shortcut", "false"],
                   tmp_path / "sparse-tp2.log", each_greedy(batch))  # fmt: skip
    agreement = [greedy_agreement(v, s).as_dict() for v, s in zip(vanilla, sparse)]
    save_gpu_test_record("tp2-exact-gpu-test.json", {"agreement": agreement})
    print(json.dumps(agreement))
    assert all(a["equal"] for a in agreement), agreement


@pytest.fixture(scope="module")
def random_model(tmp_path_factory):
    return write_llama3_8b_random(tmp_path_factory.mktemp("tp") / "llama3-8b-random-4l", num_layers=4)


def continue_then_force(batch: list[list[int]]) -> Callable[[str], tuple[list[list[int]], list[dict]]]:
    """Vanilla TP=1's work that makes the forced contexts, each prompt plus the first j tokens of
    its greedy continuation (j < :data:`FORCED_STEPS`), and answers them (:func:`each_forced`)."""

    def work(url: str) -> tuple[list[list[int]], list[dict]]:
        continuations = each_greedy(batch)(url)
        contexts = [ids + c["output_ids"][:j] for ids, c in zip(batch, continuations) for j in range(FORCED_STEPS)]
        return contexts, each_forced(contexts)(url)

    return work


class ForcedRuns(NamedTuple):
    """The forced contexts of three prompts of about three budgets and more (real selection), and
    each server's two-token answers to them."""

    batch: list[list[int]]
    contexts: list[list[int]]
    vanilla1: list[dict]
    vanilla2: list[dict]  # plain SGLang's own TP=2: what rounding alone moves
    sparse1: list[dict]
    sparse2: list[dict]


def forced_on_four_servers(model, tmp_path, states: list | None = None) -> ForcedRuns:
    """Vanilla and sparse at TP=1 and TP=2 on ``model``, one server at a time; ``states`` given,
    sparse TP=2's ``/get_server_info`` states are appended to it."""
    batch = prompts((3000, 3500, 4000), seed=PROMPT_SEED)
    vanilla_args = [*REAL_WEIGHTS, "--attention-backend", "flashinfer"]
    contexts, vanilla1 = serve(VANILLA_MODULE, model, vanilla_args, tmp_path / "vanilla-tp1.log",
                               continue_then_force(batch))  # fmt: skip
    vanilla2 = serve(VANILLA_MODULE, model, [*vanilla_args, "--tp-size", "2"], tmp_path / "vanilla-tp2.log",
                     each_forced(contexts))  # fmt: skip
    sparse1 = serve(SPARSE_MODULE, model, SPARSE_REAL_WEIGHTS, tmp_path / "sparse-tp1.log", each_forced(contexts))
    sparse2 = serve(SPARSE_MODULE, model, [*SPARSE_REAL_WEIGHTS, "--tp-size", "2"], tmp_path / "sparse-tp2.log",
                    each_forced(contexts), states)  # fmt: skip
    return ForcedRuns(batch, contexts, vanilla1, vanilla2, sparse1, sparse2)


def selection_effect(steps: list, tol: float | None = None) -> dict:
    """What selection itself moves (sparse TP=1 against dense TP=1 on the same contexts): the
    scale a wrong selection would show, and (``tol`` given) whether the TP bar would pass it (it
    must not: the bar tells selection from rounding)."""
    compared = [a for a in steps if a is not None]
    effect = {"max_logprob_gap": max((a.max_logprob_gap for a in compared), default=None),
              "switched_steps": switched_steps(compared), "compared_steps": len(compared),
              "steps": [a and a.as_dict() for a in steps]}  # fmt: skip
    if tol is not None:
        effect["within_the_bar"] = tp_steps_agree(steps, tol)
    return effect


@pytest.fixture(scope="module")
def one_layer_model(tmp_path_factory):
    return write_llama3_8b_random(tmp_path_factory.mktemp("tp") / "llama3-8b-random-1l", num_layers=1)


def test_tp2_selects_as_tp1_where_rounding_cannot_reach_the_selection(one_layer_model, tmp_path):
    """One layer: its decode queries and the prompt's keys come from the embeddings through the
    QKV projection, which TP splits by output column (nothing summed across ranks), so both sizes
    score pages from the same inputs, up to that projection's own rounding, and select the same
    pages; TP rounds otherwise only after attention (o_proj, the MLP). So sparse TP=2 must match
    sparse TP=1 as closely as plain SGLang's TP=2 matches its TP=1, with no rounding-swapped
    pages to account for a larger gap: a rank scoring the wrong heads, summaries or budget shows."""
    runs = forced_on_four_servers(one_layer_model, tmp_path)
    floor = forced_steps(runs.vanilla1, runs.vanilla2)
    steps = forced_steps(runs.sparse1, runs.sparse2)
    tol = tp_logprob_tolerance(floor)
    selection = selection_effect(forced_steps(runs.vanilla1, runs.sparse1), tol)
    record = {"forced_steps": [a and a.as_dict() for a in steps],
              "vanilla_forced_steps": [a and a.as_dict() for a in floor], "max_switched": None,
              "prompt_lengths": [len(ids) for ids in runs.batch], "prompt_seed": PROMPT_SEED,
              "steps_per_prompt": FORCED_STEPS, "num_layers": 1, "logprob_tol": tol,
              "sparse_vs_dense_tp1": selection}  # fmt: skip
    save_gpu_test_record("tp2-vs-tp1-one-layer-gpu-test.json", record)
    print(json.dumps(record))
    # the bar tells a wrong selection from rounding, and every decode step is within it; switches
    # are not counted: each must be a near tie of the reference, and how many near ties rounding
    # flips in 72 steps is chance (plain SGLang's own TP flipped none where sparse flipped two)
    assert not selection["within_the_bar"], record
    assert tp_steps_agree(steps, tol), record


def test_tp2_at_depth_stays_far_nearer_tp1_than_selection_moves(random_model, tmp_path):
    states = []
    runs = forced_on_four_servers(random_model, tmp_path, states)
    steps = forced_steps(runs.sparse1, runs.sparse2)
    selection_steps = forced_steps(runs.vanilla1, runs.sparse1)
    ranks = states[0]["sparse"]["tp_ranks"]
    info = {"d2h_tokens_per_rank": [r["d2h_tokens"] for r in ranks],
            "d2h_tokens_total": states[0]["sparse"]["tp_total"]["d2h_tokens"]}  # fmt: skip
    record = {"forced_steps": [a and a.as_dict() for a in steps],
              "vanilla_forced_steps": [a and a.as_dict() for a in forced_steps(runs.vanilla1, runs.vanilla2)],
              "prompt_lengths": [len(ids) for ids in runs.batch], "prompt_seed": PROMPT_SEED,
              "steps_per_prompt": FORCED_STEPS, "num_layers": 4,
              "sparse_vs_dense_tp1": selection_effect(selection_steps), "info": info}  # fmt: skip
    save_gpu_test_record("tp2-vs-tp1-gpu-test.json", record)
    print(json.dumps(record))
    assert nearer_than_selection(steps, selection_steps), record
    # /get_server_info: each rank saved every prompt token (its own heads), and the sum is theirs
    assert all(t >= sum(map(len, runs.contexts)) for t in info["d2h_tokens_per_rank"]), info
    assert info["d2h_tokens_total"] == sum(info["d2h_tokens_per_rank"]), info
