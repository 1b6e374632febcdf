"""The tree stays formatted and lint-clean (ruff, configured in pyproject.toml), and code and help
texts carry no commit ids or result file names (those belong in docs/)."""

from __future__ import annotations

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
