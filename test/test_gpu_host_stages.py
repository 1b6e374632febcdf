"""tools/gpu_host_stages.sh, the burst's stage runner: stages in order, jobs of a stage side by
side, and a stage past its limit (``$STAGE_LIMITS``) stopped whole, the servers its jobs started
in sessions of their own included, before the next stage starts."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

STAGES = Path(__file__).resolve().parents[1] / "tools" / "gpu_host_stages.sh"


def run(tmp_path: Path, jobs: str, limits: str) -> float:
    script = f"""
source {STAGES}
job_slow() {{ setsid sleep 300 & echo "server $!"; sleep 300; }}
job_fast() {{ echo fast; }}
job_named() {{ echo "variant=$JOB_VARIANT"; }}
export -f run_stages run_job_chain descendants stop_trees job_slow job_fast job_named
JOBS="{jobs}" STAGE_LIMITS="{limits}" bash -c run_stages
"""
    env = {**os.environ, "BURST_OUT": str(tmp_path), "STOP_GRACE_S": "1"}
    started = time.monotonic()
    subprocess.run(["bash", "-c", script], env=env, check=True, timeout=60)
    return time.monotonic() - started


def test_a_stage_past_its_limit_is_stopped_with_its_servers(tmp_path):
    took = run(tmp_path, "slow fast,fast", "2,")
    log = (tmp_path / "stage.log").read_text().splitlines()
    assert took < 20
    assert [line.split(" ", 1)[1] for line in log if "stage" in line or line.endswith("done")] == [
        "stage: slow fast (at most 2 s)",
        "stage limit: stopped",
        "stage: fast",
        "done",
    ]
    server = int((tmp_path / "slow.log").read_text().split()[1])
    try:
        os.kill(server, 0)
        alive = Path(f"/proc/{server}/stat").read_text().split()[2] != "Z"
    except ProcessLookupError:
        alive = False
    assert not alive, "the slow job's server outlived its stage"


def test_stages_within_their_limits_run_in_order(tmp_path):
    run(tmp_path, "fast,fast", "30,")
    log = (tmp_path / "stage.log").read_text()
    assert "stage limit" not in log and log.count("job: fast") == 2 and log.rstrip().endswith("done")


def test_a_job_variant_reaches_the_job_and_names_its_log(tmp_path):
    run(tmp_path, "named:graphs+named", "")
    assert (tmp_path / "named-graphs.log").read_text() == "variant=graphs\n"
    assert (tmp_path / "named.log").read_text() == "variant=\n"
    assert "job: named:graphs" in (tmp_path / "stage.log").read_text()
