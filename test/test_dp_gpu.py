"""Data parallelism on two GPUs (``--dp-size 2``, SGLang's data-parallel controller): each replica
builds its own KV hierarchy on its GPU with half of ``--sparse-host-cache-gb``, a burst of requests
is answered across both, ``/get_server_info`` reports each replica and their total, and afterwards
neither replica holds anything it did not hold idle.
Needs two CUDA GPUs (skipped otherwise)."""

from __future__ import annotations

import asyncio
import json

import pytest
import requests
import torch

from benchmark.soak import run_burst
from sparse_sglang.testing.models import write_llama3_8b_dummy
from sparse_sglang.testing.provenance import save_gpu_test_record
from sparse_sglang.testing.server import SPARSE_MODULE, ServerProcess, flush_cache, leaks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]

HOST_GB = 16
ARGS = ["--load-format", "dummy", "--skip-tokenizer-init", "--dp-size", "2", "--mem-fraction-static", "0.5",
        "--sparse-host-cache-gb", str(HOST_GB), "--max-running-requests", "16", "--cuda-graph-max-bs-decode", "16"]  # fmt: skip
BURST, PROMPT_TOKENS = 24, 3000


def replica_states(url: str) -> list[dict]:
    """Each replica's ``"sparse"`` entry of ``/get_server_info`` (one scheduler per replica)."""
    return [s["sparse"] for s in server_states(url)]


def server_states(url: str) -> list[dict]:
    return requests.get(url + "/get_server_info", timeout=60).json()["internal_states"]


def test_two_replicas_answer_a_burst_and_leak_nothing(tmp_path):
    model = write_llama3_8b_dummy(tmp_path / "llama3-8b-dummy-4l", num_layers=4)
    with ServerProcess(SPARSE_MODULE, model, ARGS, log_path=tmp_path / "server.log") as server:
        idle = replica_states(server.url)
        burst = asyncio.run(run_burst(server.url, BURST, PROMPT_TOKENS, timeout=600))
        states = server_states(server.url)
        busy = [s["sparse"] for s in states]
        assert flush_cache(server.url, 60)
        after = replica_states(server.url)
        tracebacks = server.log_path.read_text(errors="replace").count("Traceback")
    assert server.stopped_cleanly, server.log_tail()
    summary = {
        "replicas": len(idle),
        "statuses": sorted({r["status"] for r in burst}),
        "saved_tokens_per_replica": [s["d2h_tokens"] for s in busy],
        "saved_tokens_total": states[0].get("sparse_total", {}).get("d2h_tokens"),
        "host_tokens_per_replica": [s["host_tokens"] for s in idle],
        "leaks_per_replica": [leaks(i, a) for i, a in zip(idle, after)],
        "tracebacks_in_log": tracebacks,
    }
    save_gpu_test_record("dp-gpu-test.json", {"args": ARGS, "summary": summary})
    print(json.dumps(summary))
    assert summary["replicas"] == 2 and summary["statuses"] == [200], summary
    assert all(t >= PROMPT_TOKENS for t in summary["saved_tokens_per_replica"]), summary  # both served
    assert summary["saved_tokens_total"] == sum(summary["saved_tokens_per_replica"]), summary  # and the sum
    # each replica's host store is half the server's: the same size, together within the total
    assert summary["host_tokens_per_replica"][0] == summary["host_tokens_per_replica"][1], summary
    assert not any(v for leak in summary["leaks_per_replica"] for v in leak.values()), summary
    assert tracebacks == 0, summary
