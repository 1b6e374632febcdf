"""tools/gpu_host_stages.sh, gpu_host_burst.sh's stage runner: stages in order, jobs of a stage side by
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
export -f run_stages run_job_chain descendants stop_trees sample_host_cpu job_slow job_fast job_named
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


POLL = STAGES.parent / "gpu_host_poll.sh"


def test_a_poll_returns_when_a_result_is_written_and_packs_the_folder(tmp_path):
    """gpu_host_poll.sh waits for the stages' end or a new result file (a host lost later loses
    nothing written), not its whole interval; it packs the out folder into $OUT."""
    import tarfile

    out, packed = tmp_path / "o", tmp_path / "packed"
    out.mkdir(), packed.mkdir()
    (out / "stage.log").write_text("10:00:00 stage: serving_tp1\n")
    env = {**os.environ, "BURST_OUT": str(out), "OUT": str(packed), "POLL_TICK_S": "1"}
    poll = subprocess.Popen(["bash", str(POLL), "60"], env=env, stdout=subprocess.PIPE, text=True)
    time.sleep(2)
    (out / "serving-tp1.json").write_text("{}")
    started = time.monotonic()
    stdout, _ = poll.communicate(timeout=30)
    assert "a result was written" in stdout and time.monotonic() - started < 10
    with tarfile.open(packed / "o.tgz.00") as pack:
        assert {"o/stage.log", "o/serving-tp1.json"} <= set(pack.getnames())
    # all stages done: it returns at once
    (out / "stage.log").write_text("10:00:00 stage: serving_tp1\n10:09:00 done\n")
    started = time.monotonic()
    subprocess.run(["bash", str(POLL), "60"], env=env, check=True, capture_output=True, timeout=30)
    assert time.monotonic() - started < 5


def test_a_poll_on_a_machine_with_no_burst_fails_at_once(tmp_path):
    """A host where no jobs were started (a fresh one) has nothing to poll: the poll says so and
    exits non-zero at once, instead of waiting out its whole interval."""
    packed = tmp_path / "packed"
    packed.mkdir()
    env = {**os.environ, "BURST_OUT": str(tmp_path / "o"), "OUT": str(packed), "POLL_TICK_S": "1"}
    started = time.monotonic()
    poll = subprocess.run(["bash", str(POLL), "60"], env=env, capture_output=True, text=True, timeout=30)
    assert poll.returncode == 3 and "no burst on this machine" in poll.stderr
    assert time.monotonic() - started < 5 and not list(packed.iterdir())
