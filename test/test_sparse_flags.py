"""The launcher's first phase: the ``--sparse-*`` flags, refused in one line before SGLang loads."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sparse_sglang.config import SparseConfig
from sparse_sglang.sparse_flags import PROG, CLIError, check_sparse_flags

REPO_PYTHON = str(Path(__file__).resolve().parents[1] / "python")


def test_the_sparse_flags_make_the_config_and_leave_sglangs_alone():
    argv = ["--model-path", "/m", "--sparse-token-budget", "1024", "--tp-size", "2", "--sparse-selector=mean",
            "--max-total-tokens", "-5", "--sparse-host-cache-gb", "1.5"]  # fmt: skip
    assert check_sparse_flags(argv) == SparseConfig(token_budget=1024, selector="mean", host_cache_gb=1.5)
    assert check_sparse_flags(["--help"]) == SparseConfig()  # --help is the full parser's


@pytest.mark.parametrize(
    "argv,line",
    [
        (["--sparse-token-budget", "-5"], "--sparse-token-budget: must be positive, got -5"),
        (
            ["--sparse-token-budget=100"],
            "--sparse-token-budget: must be a multiple of --sparse-page-size (32), got 100",
        ),
        (["--sparse-selector", "nope"], "argument --sparse-selector: invalid choice: 'nope' (choose from "),
        (["--sparse-page-size", "abc"], "argument --sparse-page-size: expected int, got 'abc'"),
        (["--sparse-enabled", "maybe"], "argument --sparse-enabled: expected true or false, got 'maybe'"),
        (["--port", "1", "--sparse-foo", "3"], "unrecognized arguments: --sparse-foo"),
        (["--sparse-foo=3"], "unrecognized arguments: --sparse-foo=3"),
    ],
)
def test_a_bad_sparse_flag_is_one_line_naming_it(argv, line, capsys):
    """``line`` is the error's start (argparse words its list of choices per Python version)."""
    try:
        check_sparse_flags(argv)
    except CLIError as err:  # an invalid config: the launcher prints it
        assert str(err).startswith(line) and "\n" not in str(err)
    except SystemExit as exit_info:  # argparse's own refusal, printed already
        err = capsys.readouterr().err
        assert exit_info.code == 2 and err.startswith(f"{PROG}: error: {line}") and err.count("\n") == 1, err
    else:
        pytest.fail(f"{argv} was accepted")


def test_a_bad_sparse_flag_never_loads_sglang_or_torch():
    """The launcher's error comes before SGLang's (and torch's) modules load: a bad flag answers at
    argparse's speed. Checked in a fresh interpreter, by what it imported."""
    code = textwrap.dedent("""
        import sys
        from sparse_sglang.launch_server import main
        for argv in (["--sparse-token-budget", "-5"], ["--sparse-selector", "nope"], ["--sparse-foo"]):
            try:
                main(["--model-path", "/m", *argv])
            except SystemExit as exit_info:
                print(exit_info.code, "sglang" in sys.modules, "torch" in sys.modules)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": REPO_PYTHON})  # fmt: skip
    assert proc.stdout.splitlines() == ["2 False False"] * 3, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 3 and all(line.startswith(f"{PROG}: error: ") and "--sparse-" in line for line in lines), lines
