"""README.md and the docs stay true: every sparse flag is in docs/flags.md with its --help text, the
README's flags exist, CI runs the README's test command, every command the README shows parses
(its `--help` runs, no GPU needed), and every relative link and anchor in the docs resolves."""

from __future__ import annotations

import dataclasses
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from sparse_sglang.config import SparseConfig, flag_name

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
FLAGS = (ROOT / "docs" / "flags.md").read_text()
KNOBS = {flag_name(f.name) for f in dataclasses.fields(SparseConfig)}


def table_flags(text: str) -> dict[str, list[str]]:
    """The rows of ``text``'s tables that start with a sparse flag, by flag: their cells."""
    rows = {}
    for line in text.splitlines():
        if line.startswith("| `--sparse-"):
            cells = re.split(r"(?<!\\)\|", line)
            rows[cells[1].strip().strip("`")] = cells
    return rows


def test_flags_page_lists_every_knob():
    assert set(table_flags(FLAGS)) == KNOBS


def test_flags_page_says_what_help_says():
    """Each row's meaning is its flag's --help text (backticks and table escapes aside)."""
    norm = lambda text: " ".join(text.replace("`", "").replace("\\|", "|").split())  # noqa: E731
    meanings = {flag: cells[3] for flag, cells in table_flags(FLAGS).items()}
    for f in dataclasses.fields(SparseConfig):
        assert norm(meanings[flag_name(f.name)]) == norm(f.metadata["help"]), flag_name(f.name)


def test_readme_flags_exist():
    shown = set(table_flags(README)) | set(re.findall(r"--sparse-[a-z-]+[a-z]", README))
    assert shown and shown <= KNOBS, shown - KNOBS


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    test_command = [line for line in ci if "pytest" in line]
    assert test_command == ["python3 -m pytest -q"]
    assert "&& python3 -m pytest -q\n" in README


def test_the_console_script_the_readme_names_is_the_launcher():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["sparse-sglang"] == "sparse_sglang.launch_server:main" and "`sparse-sglang`" in README


def readme_commands() -> list[list[str]]:
    """The commands of the README's code blocks (indented four spaces) that run a Python program
    or the console script, split at ``&&``, as argument lists (continuation lines joined)."""
    block = re.sub(r"\\\n\s*", " ", README)
    commands = []
    for line in block.splitlines():
        if not line.startswith("    "):
            continue
        for part in line.split("&&"):
            if part.split()[:1] in (["python"], ["python3"], ["sparse-sglang"]):
                commands.append(shlex.split(part, comments=True))
    return commands


def test_the_readme_shows_its_server_and_test_commands():
    shown = [" ".join(words[:3]) for words in readme_commands()]
    assert "python -m sparse_sglang.launch_server" in shown and "python3 -m pytest" in shown
    assert any(words[0] == "sparse-sglang" for words in readme_commands())


@pytest.mark.parametrize("words", readme_commands(), ids=lambda words: " ".join(words[:3]))
def test_a_readme_command_parses(words):
    """The command with ``--help`` appended exits 0 on a CPU machine: the program is there and
    takes the flags shown before ``--help`` (argparse checks their values as it reads them)."""
    if words[0] == "sparse-sglang":
        if shutil.which("sparse-sglang") is None:
            pytest.skip("the console script is not installed (pip install -e .)")
        argv = words
    else:
        argv = [sys.executable, *words[1:]]
    done = subprocess.run([*argv, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors of ``text``'s headings: lower case, punctuation dropped, spaces as dashes."""
    anchors = set()
    for heading in re.findall(r"^#+ (.+)$", text, flags=re.M):
        anchors.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return anchors


DOCS = [ROOT / "README.md", ROOT / "tools" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(doc):
    text = doc.read_text()
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # a URL
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in heading_anchors(file.read_text()):
            broken.append(target)
    assert not broken, broken
