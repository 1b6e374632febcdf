"""Where a benchmark result came from, and writing it down."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

# The checkout this package runs from (editable install or PYTHONPATH=python).
REPO = Path(__file__).resolve().parents[3]
COMMIT_ENV = "SPARSE_SGLANG_COMMIT"  # the GPU host's copy of the tree has no .git: pass the commit in


def git_commit() -> str:
    """``$SPARSE_SGLANG_COMMIT``, else HEAD with ``-dirty`` when tracked or untracked (not ignored)
    files differ from it (new code is code that ran), else ``unknown``."""
    if os.environ.get(COMMIT_ENV):
        return os.environ[COMMIT_ENV]

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)

    try:
        head = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain").stdout.strip()
    except OSError:
        return "unknown"
    if head.returncode != 0:
        return "unknown"
    return head.stdout.strip() + ("-dirty" if dirty else "")


def module_command(module: str, argv: list[str] | None = None) -> str:
    """``python -m <module> <argv>`` (default: this process's arguments), the way a benchmark in
    ``benchmark/`` runs from the repository root."""
    import shlex
    import sys

    return shlex.join(["python", "-m", module, *(sys.argv[1:] if argv is None else argv)])


def run_header(module: str, argv: list[str] | None, device: str | None = None, commit: str | None = None) -> dict:
    """``device``, ``commit``, ``date`` and ``command`` of a run of the benchmark ``module`` (like
    ``benchmark.decode``: run as ``python -m benchmark.decode`` from the repository root) with
    ``argv`` (default: this process's arguments); ``device`` defaults to the CUDA device's name (a
    CPU benchmark passes ``"cpu"``), ``commit`` to :func:`git_commit` (a summary of runs made
    elsewhere passes theirs)."""
    import datetime

    if device is None:
        import torch

        device = torch.cuda.get_device_name()
    return {"device": device, "commit": commit or git_commit(), "date": datetime.date.today().isoformat(),
            "command": module_command(module, argv)}  # fmt: skip


def save_result(result: dict, path: str | Path) -> Path:
    """Write a result document as indented JSON (folders created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path


def save_gpu_test_record(name: str, record: dict) -> None:
    """A GPU test's outcome as ``$SPARSE_SGLANG_RESULTS_DIR/name`` (with ``device``, ``date``,
    ``commit`` and ``command`` first: the pytest command of the running test), when that is set
    (on the GPU host); nothing otherwise. ``record`` holds the ``summary``."""
    if not os.environ.get("SPARSE_SGLANG_RESULTS_DIR"):
        return
    import datetime

    import torch

    header = {
        "device": torch.cuda.get_device_name(0),
        "date": datetime.date.today().isoformat(),
        "commit": git_commit(),
        # "test/test_x_gpu.py::test_y (call)": pytest's name of the test running now
        "command": f"python -m pytest -m gpu -s {os.environ.get('PYTEST_CURRENT_TEST', '').split(' ')[0]}",
    }
    save_result({**header, **record}, Path(os.environ["SPARSE_SGLANG_RESULTS_DIR"], name))


def finish_run(module: str, argv: list[str] | None, body: dict, out_dir: str | Path, name: str,
               device: str | None = None, commit: str | None = None) -> dict:  # fmt: skip
    """The end of a benchmark's ``main``: its document (:func:`run_header` + ``body``, which holds
    the ``summary``) saved as ``out_dir/name`` (``{date}`` filled in), the summary printed."""
    doc = {**run_header(module, argv, device, commit), **body}
    save_result(doc, Path(out_dir) / name.format(date=doc["date"]))
    print(json.dumps(doc["summary"], indent=1))
    return doc


def add_server_run_args(parser, name: str) -> None:
    """``--log-dir`` (server logs and model folders, ``/tmp/sparse-sglang-<name>``) and
    ``--out-dir`` (the result document, ``benchmark/results``) of a benchmark that starts servers."""
    parser.add_argument("--log-dir", default=f"/tmp/sparse-sglang-{name}")
    parser.add_argument("--out-dir", type=Path, default=REPO / "benchmark" / "results")
