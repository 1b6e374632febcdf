"""The tree stays formatted and lint-clean (ruff, configured in pyproject.toml), and code and help
texts carry no commit ids or result file names (those belong in docs/)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("command", [["check", "."], ["format", "--check", "."]], ids=["check", "format"])
def test_ruff(command):
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]')")
    done = subprocess.run([ruff, *command], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


def test_package_names_no_commits_or_result_files():
    hex_id = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b")
    result_file = re.compile(r"\b[a-z0-9-]+-20\d\d-\d\d-\d\d[\w.-]*\.(json|png|log)\b")
    found = []
    for path in (ROOT / "python").rglob("*.py"):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if hex_id.search(line) or result_file.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}")
    assert not found, "\n".join(found)


def test_results_keep_the_newest_files_and_no_logs():
    """benchmark/results/ holds the newest file of each kind and those the docs cite (at most 60;
    older ones live in git history), JSON and plots only; benchmark/ has the harness at its top."""
    results = [p for p in (ROOT / "benchmark" / "results").iterdir() if p.is_file()]
    assert len(results) <= 60, f"{len(results)} files: move superseded ones to git history (docs/results.md)"
    assert all(p.suffix in (".json", ".png") for p in results), [
        p.name for p in results if p.suffix not in (".json", ".png")
    ]
    scripts = [p for p in (ROOT / "benchmark").glob("*.py") if p.name != "__init__.py"]
    assert len(scripts) <= 12, sorted(p.name for p in scripts)


def test_every_result_file_says_where_it_came_from():
    """Each result document names its device, commit, date and command (non-empty text: where a
    value was not recorded, the file says so in words) and holds its numbers' summary (a mapping)."""
    lacking = {}
    for path in sorted((ROOT / "benchmark" / "results").glob("*.json")):
        doc = json.loads(path.read_text())
        bad = [
            key for key in ("device", "commit", "date", "command") if not (isinstance(doc.get(key), str) and doc[key])
        ]
        bad += [] if isinstance(doc.get("summary"), dict) else ["summary"]
        if bad:
            lacking[path.name] = bad
    assert not lacking, lacking


def test_every_counter_has_one_writer():
    """A counter (an attribute some code adds to) is written by one module: its owner's. Others
    report through the owner's methods, so a metric never counts a thing twice or from two places.
    (The torch references, ``reference.py``, re-enact their kernels' writes and are left out.)"""
    import ast

    writers: dict[str, set[str]] = {}
    for path in (ROOT / "python" / "sparse_sglang").rglob("*.py"):
        if path.name == "reference.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Attribute):
                writers.setdefault(node.target.attr, set()).add(str(path.relative_to(ROOT)))
    shared = {name: sorted(files) for name, files in writers.items() if len(files) > 1}
    assert not shared, f"counters written from more than one module: {shared}"
