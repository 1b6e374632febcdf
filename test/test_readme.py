"""README.md stays true: every sparse flag is in its table, and CI runs its test command."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from sparse_sglang.config import SparseConfig, flag_name

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_flags_table_lists_every_knob():
    rows = {line.split("|")[1].strip().strip("`") for line in README.splitlines() if line.startswith("| `--sparse-")}
    assert rows == {flag_name(f.name) for f in dataclasses.fields(SparseConfig)}


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    test_command = [line for line in ci if "pytest" in line]
    assert test_command == ["python3 -m pytest -q"]
    assert "&& python3 -m pytest -q\n" in README


def test_flags_table_says_what_help_says():
    """Each row's meaning is its flag's --help text (backticks and table escapes aside)."""
    import re

    norm = lambda text: " ".join(text.replace("`", "").replace("\\|", "|").split())  # noqa: E731
    meanings = {}
    for line in README.splitlines():
        if line.startswith("| `--sparse-"):
            cells = re.split(r"(?<!\\)\|", line)
            meanings[cells[1].strip().strip("`")] = cells[3]
    for f in dataclasses.fields(SparseConfig):
        assert norm(meanings[flag_name(f.name)]) == norm(f.metadata["help"]), flag_name(f.name)
