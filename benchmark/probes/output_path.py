"""Probe: does SGLang's output path deliver what its scheduler decodes, at sparse TP=2's rate?

Sparse TP=2's client received 2-3% less than its server's log counted (docs/results.md,
Parallelism), where vanilla and sparse TP=1 received all of it. The client reads far faster than
that (``stream_client.py``); this measures the server side of the stream on the CPU: SGLang's own
HTTP server, TokenizerManager and request handling (``launch_server``), with a fake scheduler
process in place of the GPU one. The fake scheduler takes the tokenized requests, keeps up to
``--batch`` of them running (prefill is free), and every ``--step-ms`` sends one
``BatchTokenIDOutput`` with a token for each, as SGLang's scheduler streams under
``--skip-tokenizer-init --incremental-streaming-output`` (the serving benchmark's flags). The
serving benchmark's client (:func:`benchmark.serving.drive`) sends the long-generation shape of
request (``--prompt-tokens`` ids at ``--rate`` a second); the probe prints, by quarter of the
window, the tokens a second the fake scheduler sent and the client received. CPU only, from the
repository root (the server half runs as ``python -m benchmark.probes.output_path --serve``)::

    python benchmark/probes/output_path.py --batch 164 --step-ms 26    # ~6,300 tokens/s, 2 minutes
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import time
from array import array
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmark.serving import QUARTERS, Request, drive  # noqa: E402

# SGLang starts the scheduler with fixed arguments: the fake one reads its settings from these
BATCH_ENV, STEP_ENV, SENT_ENV = "OUTPUT_PATH_PROBE_BATCH", "OUTPUT_PATH_PROBE_STEP_MS", "OUTPUT_PATH_PROBE_SENT"
# BatchTokenIDOutput's fields that a greedy request without logprobs leaves empty
UNUSED_OUTPUT_FIELDS = (
    "input_token_logprobs_val", "input_token_logprobs_idx", "output_token_logprobs_val", "output_token_logprobs_idx",
    "input_top_logprobs_val", "input_top_logprobs_idx", "output_top_logprobs_val", "output_top_logprobs_idx",
    "input_token_ids_logprobs_val", "input_token_ids_logprobs_idx", "output_token_ids_logprobs_val",
    "output_token_ids_logprobs_idx", "output_token_entropy_val", "output_token_sampling_mask",
    "output_token_sampling_logprobs", "output_hidden_states", "routed_experts", "indexer_topk",
    "placeholder_tokens_idx", "placeholder_tokens_val",
)  # fmt: skip


def fake_scheduler(server_args, port_args, *ranks_and_pipe) -> None:
    """SGLang's ``run_scheduler_process`` without a model: reports ready, then streams one token a
    step to each running request, appending "<time> <tokens>" per step to ``$OUTPUT_PATH_PROBE_SENT``."""
    import zmq
    from sglang.srt.managers.io_struct import BatchTokenIDOutput, sock_recv, sock_send, wrap_as_pickle
    from sglang.srt.observability.req_time_stats import SchedulerReqTimeStats
    from sglang.srt.utils.network import get_zmq_socket

    writer = ranks_and_pipe[-1]
    context = zmq.Context(2)
    from_tokenizer = get_zmq_socket(context, zmq.PULL, port_args.scheduler_input_ipc_name, False)
    to_tokenizer = get_zmq_socket(context, zmq.PUSH, port_args.tokenizer_ipc_name, False)
    batch, step = int(os.environ[BATCH_ENV]), float(os.environ[STEP_ENV]) / 1000
    writer.send({"status": "ready", "max_total_num_tokens": 10**8, "max_req_input_len": 10**6, "startup_time": {}})
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    waiting, running = [], []  # [rid, prompt tokens, max new tokens, tokens sent, time stats]
    sent = open(os.environ[SENT_ENV], "w")
    next_step = time.time()
    while not stopping:
        while True:
            try:
                message = sock_recv(from_tokenizer, zmq.NOBLOCK)
            except zmq.Again:
                break
            for req in getattr(message, "batch", None) or [message]:
                if hasattr(req, "input_ids") and hasattr(req, "sampling_params"):
                    waiting.append([req.rid, len(req.input_ids), req.sampling_params.max_new_tokens, 0,
                                    SchedulerReqTimeStats()])  # fmt: skip
        now = time.time()
        if now < next_step:
            time.sleep(min(next_step - now, 0.002))
            continue
        next_step += step
        admitted = waiting[: max(0, batch - len(running))]
        running += admitted
        del waiting[: len(admitted)]
        if not running:
            continue
        n = len(running)
        for req in running:
            req[3] += 1
        output = BatchTokenIDOutput(
            rids=[r[0] for r in running],
            finished_reasons=[{"type": "length", "length": r[2]} if r[3] >= r[2] else None for r in running],
            decoded_texts=[""] * n,
            decode_ids=[array("i") for _ in running],
            read_offsets=[0] * n,
            output_ids=[array("i", [1234]) for _ in running],
            skip_special_tokens=[True] * n,
            spaces_between_special_tokens=[True] * n,
            no_stop_trim=[False] * n,
            prompt_tokens=[r[1] for r in running],
            reasoning_tokens=[0] * n,
            completion_tokens=[r[3] for r in running],
            cached_tokens=[0] * n,
            retraction_counts=[0] * n,
            dp_ranks=[0] * n,
            time_stats=wrap_as_pickle([r[4] for r in running]),
            **dict.fromkeys(UNUSED_OUTPUT_FIELDS),
        )
        sock_send(to_tokenizer, output)
        sent.write(f"{now} {n}\n")
        sent.flush()
        running = [r for r in running if r[3] < r[2]]


def serve(argv: list[str]) -> None:
    """``--serve`` + SGLang's server flags: SGLang's own ``launch_server`` with the fake scheduler
    (imported by module name, so SGLang's spawned scheduler process finds it)."""
    from sglang.srt.entrypoints.http_server import launch_server
    from sglang.srt.server_args import prepare_server_args

    from benchmark.probes.output_path import fake_scheduler

    launch_server(prepare_server_args(argv), run_scheduler_process_func=fake_scheduler)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=164, help="requests the fake scheduler runs at once")
    parser.add_argument("--step-ms", type=float, default=26.0, help="one token per running request this often")
    parser.add_argument("--rate", type=float, default=4.0, help="requests sent a second (Poisson)")
    parser.add_argument("--prompt-tokens", type=int, default=16_000, help="token ids in each request")
    parser.add_argument("--new-tokens", type=int, default=6_000, help="max_new_tokens of each request")
    parser.add_argument("--window", type=float, default=120.0, help="seconds of sending, then the cutoff")
    args = parser.parse_args()

    from sparse_sglang.testing.models import write_llama3_8b_dummy
    from sparse_sglang.testing.server import ServerProcess

    work = Path(tempfile.mkdtemp(prefix="output-path-probe-"))
    env = {BATCH_ENV: str(args.batch), STEP_ENV: str(args.step_ms), SENT_ENV: str(work / "sent.txt")}
    flags = ["--serve", "--load-format", "dummy", "--device", "cpu", "--skip-tokenizer-init",
             "--incremental-streaming-output", "--skip-server-warmup", "--log-level", "error"]  # fmt: skip
    rng, arrival, trace = random.Random(0), 0.0, []
    while arrival < args.window:
        arrival += rng.expovariate(args.rate)
        trace.append(
            Request(arrival, [rng.randrange(1000, 100_000) for _ in range(args.prompt_tokens)], args.new_tokens)
        )
    model = write_llama3_8b_dummy(work / "model")
    with ServerProcess("benchmark.probes.output_path", model, flags, log_path=work / "server.log", env=env) as server:
        run = asyncio.run(drive(server.url, trace, args.window, request_timeout=3600))
    steps = [tuple(map(float, line.split())) for line in (work / "sent.txt").read_text().splitlines()]
    quarter = run.duration / QUARTERS
    edges = [run.started_at + q * quarter for q in range(QUARTERS + 1)]
    sent = [sum(n for t, n in steps if a <= t < b) / quarter for a, b in zip(edges, edges[1:])]
    print(json.dumps({
        "batch": args.batch, "step_ms": args.step_ms, "rate": args.rate, "prompt_tokens": args.prompt_tokens,
        "cpus": os.cpu_count(), "max_in_flight": run.max_in_flight,
        "sent_tokens_per_s_by_quarter": [round(x) for x in sent],
        "received_tokens_per_s_by_quarter": [round(n / quarter) for n in run.tokens_by_quarter],
        "received_over_sent_second_half": round(sum(run.tokens_by_quarter[2:]) / quarter / max(1e-9, sum(sent[2:])), 4),
    }))  # fmt: skip


if __name__ == "__main__":
    if "--serve" in sys.argv:
        serve([a for a in sys.argv[1:] if a != "--serve"])
    else:
        main()
