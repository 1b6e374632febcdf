"""Two sparse servers on one host, neither given ``--sparse-host-cache-gb``: each sizes its host
store by what its requests can use (decision 25), both come up, both answer, and each start-up log
says which bound it took. SmolLM2 (the default model, real weights).

With two GPUs the servers start at the same moment, one per GPU, so the two size and pin their
host stores in turn. On one GPU the second starts once the first is up, as SGLang needs on a
shared GPU: each server sizes its KV pool from the GPU memory free before it loads its weights
against what is free after, so a neighbour's pool allocated in between fails the check whatever
``--mem-fraction-static`` both take. The second then sizes its host store with the first's
already pinned.

Run on the GPU host: ``pytest -m gpu test/test_two_servers_gpu.py``.
"""

from __future__ import annotations

import re
import threading

import pytest

from sparse_sglang.testing.server import SPARSE_MODULE, ServerProcess, generate_ids

pytestmark = pytest.mark.gpu

ARGS = ["--mem-fraction-static", "0.25", "--cuda-graph-max-bs-decode", "8"]  # no --sparse-host-cache-gb


def test_two_servers_at_their_defaults_start_on_one_host_and_answer(tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    side_by_side = torch.cuda.device_count() >= 2
    servers = [
        ServerProcess(
            SPARSE_MODULE,
            None,
            ARGS,
            log_path=tmp_path / f"server-{i}.log",
            env={"CUDA_VISIBLE_DEVICES": str(i)} if side_by_side else None,
        )
        for i in range(2)
    ]
    errors: list[BaseException] = []

    def start(server: ServerProcess) -> None:
        try:
            server.start()
        except BaseException as err:  # noqa: BLE001 - reported below with its log
            errors.append(err)

    threads = [threading.Thread(target=start, args=(s,)) for s in servers]
    try:
        for t in threads:
            t.start()
            if not side_by_side:
                t.join()
        for t in threads:
            t.join()
        assert not errors, f"a server did not start: {errors[0]}"
        for server in servers:
            out = generate_ids(server.url, list(range(100, 1100)), 8)
            assert len(out["output_ids"]) == 8
            plan = [
                line for line in server.log_path.read_text().splitlines() if "sparse memory plan: host store" in line
            ]
            assert plan, server.log_tail()
            assert re.search(r"host store \d+ pages \(\d+ tokens; \w", plan[0]), plan[0]  # and the bound it took
    finally:
        for server in servers:
            server.stop()
    assert all(s.stopped_cleanly for s in servers)
