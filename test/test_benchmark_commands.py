"""The benchmarks run the way their docs say, ``python -m benchmark.<name>`` from the repository
root: every one answers ``--help``, and those recommended for a CPU run (quality's smoke run; the
accuracy suite's generate, reference, summarize and check) run end to end on tiny inputs here and
write documents with the shared header and their summary keys. Each command is a child process of
this tree (``PYTHONPATH``: this checkout's package before any installed one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted(f"benchmark.{p.stem}" for p in (ROOT / "benchmark").glob("*.py") if p.name != "__init__.py") + sorted(
    f"benchmark.probes.{p.stem}" for p in (ROOT / "benchmark" / "probes").glob("*.py") if p.name != "__init__.py"
)
HEADER = ("device", "commit", "date", "command", "summary")


def run(module: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "python"), str(ROOT)])}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def smollm2_or_skip() -> None:
    from sparse_sglang.default_model import DefaultModelUnavailable, default_model_path

    try:
        default_model_path()
    except DefaultModelUnavailable as err:
        pytest.skip(str(err))


@pytest.mark.parametrize("module", MODULES)
def test_every_benchmark_runs_as_a_module(module):
    done = run(module, "--help", timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage: "), done.stdout[:300]


def test_quality_smoke_run_writes_its_document(tmp_path):
    smollm2_or_skip()
    done = run("benchmark.quality", "--quick", "--out-dir", str(tmp_path))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    (path,) = tmp_path.glob("quality-*.json")
    doc = json.loads(path.read_text())
    assert all(doc[key] for key in HEADER)
    assert doc["device"] == "cpu" and doc["command"].startswith("python -m benchmark.quality --quick --out-dir ")
    summary = doc["summary"]
    for key in ("recall_512_7k", "recall_512_oracle", "passkey_cpu_equal", "passkey_cases", "passkey_by_policy"):
        assert key in summary, key
    assert 0 < summary["recall_512_7k"] <= summary["recall_512_oracle"] <= 1
    assert summary["passkey_cases"] == 1  # --quick: one length, one depth
    assert set(doc["recall_setup"]["selectors_left_out"]) == {"sketch"}  # said in the result, not a crash
    assert "selector 'sketch' left out" in done.stdout


def test_accuracy_generate_reference_summarize_check(tmp_path):
    smollm2_or_skip()
    items, reference, out = tmp_path / "items.json.gz", tmp_path / "reference-512.json", tmp_path / "out"
    done = run("benchmark.accuracy", "generate", "--seed", "1", "--per-cell", "1", "--out", str(items))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("24 items, digest ")  # 8 families x 3 lengths

    done = run("benchmark.accuracy", "reference", "--items", str(items), "--budget", "512", "--lengths", "2048",
               "--per-cell", "1", "--families", "niah_single", "--out", str(reference))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    ref = json.loads(reference.read_text())
    assert ref["kind"] == "reference" and [o["id"] for o in ref["outputs"]] == ["niah_single-2048-0"]
    assert set(ref["outputs"][0]) == {"id", "dense", "sparse-512"}

    done = run("benchmark.accuracy", "summarize", str(reference), "--items", str(items), "--out-dir", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    (path,) = out.glob("accuracy-*.json")
    doc = json.loads(path.read_text())
    assert all(doc[key] for key in HEADER) and doc["device"] == "cpu"
    summary = doc["summary"]
    assert summary["items"] == 24 and summary["items_seed"] == 1 and summary["held_out"] is True
    assert summary["items_answered"] == {"reference-512": 1} and summary["items_missing"] == {"reference-512": 0}
    assert summary["retention_4x"] is None  # no server runs: nothing to retain against

    done = run("benchmark.accuracy", "check", str(path))
    assert (done.returncode, done.stdout) == (1, "retention_4x missing\n")  # a reference alone meets no bar


def test_accuracy_check_holds_the_newest_committed_result_to_the_bars():
    """Exit 1 printing the first bar short, or 0 printing every bar (the first is retention_4x)."""
    newest = max((ROOT / "benchmark" / "results").glob("accuracy-*.json"))
    done = run("benchmark.accuracy", "check", str(newest))
    lines = done.stdout.splitlines()
    assert (done.returncode, len(lines)) in ((1, 1), (0, 7)), done.stdout + done.stderr[-2000:]
    assert lines[0].startswith("retention_4x ") or done.returncode == 1
