"""Every ``--sparse-*`` flag, given a bad value generated from its type, stops the launcher with exit
status 2 and exactly one line on stderr naming that flag (property-based, hypothesis).

Bad values by type: for numbers, text that is no number, NaN and infinities in every spelling
Python's ``float()`` reads, numbers below every knob's smallest valid value (all integer knobs need
>= 0, all float knobs > 0) and integers past int32; for integers also fractions; for booleans and
choices, words they do not take; for paths, names of no file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import warnings

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from sparse_sglang import launch_server
from sparse_sglang.config import (
    BOUND_FORMATS,
    DECODE_KERNELS,
    GROUP_REDUCES,
    INT32_MAX,
    PAGE_BOUNDS,
    RERANK_BY,
    SELECTORS,
    SparseConfig,
    field_type,
    flag_name,
)

FIELDS = {f.name: field_type(f) for f in dataclasses.fields(SparseConfig)}
BOOL_WORDS = {"1", "true", "yes", "on", "0", "false", "no", "off"}
CHOICES = {"selector": set(SELECTORS), "bound_format": set(BOUND_FORMATS), "group_reduce": set(GROUP_REDUCES),
           "page_bounds": set(PAGE_BOUNDS), "rerank_by": set(RERANK_BY), "decode_kernel": set(DECODE_KERNELS)}  # fmt: skip

non_numeric = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12).filter(
    lambda text: not _is_number(text) and text.strip() != "" and "\x00" not in text
)
non_finite = st.sampled_from(["nan", "NaN", "-nan", "inf", "-inf", "+inf", "Infinity", "-Infinity", "1e999", "-1e999"])
negative_int = st.integers(max_value=-1).map(str)
past_int32 = st.integers(min_value=INT32_MAX + 1, max_value=10**30).map(str)
fraction = st.floats(allow_nan=False, allow_infinity=False).filter(lambda x: not x.is_integer()).map(repr)
not_positive = st.one_of(st.floats(max_value=0.0, allow_nan=False, allow_infinity=False), st.integers(max_value=0)).map(
    str
)


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def bad_values(name: str) -> st.SearchStrategy[str]:
    """Command-line texts the knob ``name`` must refuse, from its type."""
    base = FIELDS[name]
    if base is int:
        return st.one_of(non_numeric, non_finite, negative_int, past_int32, fraction)
    if base is float:
        return st.one_of(non_numeric, non_finite, not_positive)
    if base is bool:
        return st.text(min_size=1, max_size=8).filter(lambda t: t.strip().lower() not in BOOL_WORDS and "\x00" not in t)
    if name == "key_basis":  # a path: bad when no file is there
        return st.text(min_size=1, max_size=12).filter(lambda t: "\x00" not in t and not os.path.isfile(t))
    return st.text(min_size=1, max_size=12).filter(lambda t: t not in CHOICES[name] and "\x00" not in t)


def run_launcher(argv: list[str]) -> tuple[int, str]:
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            launch_server.main(argv)
        except SystemExit as exit_info:
            return exit_info.code, stderr.getvalue()
    return 0, stderr.getvalue()


@st.composite
def flag_and_bad_value(draw) -> tuple[str, str]:
    name = draw(st.sampled_from(sorted(FIELDS)))
    return flag_name(name), draw(bad_values(name))


@settings(max_examples=400, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])  # fmt: skip
@given(flag_and_bad_value())
def test_every_sparse_flag_refuses_bad_values_in_one_line_naming_it(case):
    flag, value = case
    # --device cpu: no GPU check, so a value the knob wrongly took would end at the model path instead
    code, err = run_launcher(["--device", "cpu", f"{flag}={value}"])
    assert code == 2, (flag, value, err)
    lines = err.splitlines()
    assert len(lines) == 1 and err.endswith("\n"), (flag, value, err)
    assert lines[0].startswith("python -m sparse_sglang.launch_server: error: ")
    assert flag in lines[0], (flag, value, err)


def test_the_generators_cover_every_flag_and_bad_class():
    # Each class of each knob's type yields a value the knob must refuse.
    assert set(FIELDS) == {f.name for f in dataclasses.fields(SparseConfig)}
    for name, base in FIELDS.items():
        if base in (int, float):
            for text in ("nan", "inf", "-1", "abc"):
                code, err = run_launcher(["--device", "cpu", f"{flag_name(name)}={text}"])
                assert code == 2 and flag_name(name) in err and err.count("\n") == 1, (name, text, err)


def test_the_issues_cases():
    for argv, start in (
        (["--sparse-cache-row-ratio", "inf"], "--sparse-cache-row-ratio: must be a finite number, got inf"),
        (["--sparse-cache-row-ratio", "1e308"], "--sparse-cache-row-ratio: 1e+308 x the budget's 64 pages exceeds"),
        (["--sparse-cache-row-ratio", "nan"], "--sparse-cache-row-ratio: must be a finite number, got nan"),
        (["--sparse-host-cache-gb", "nan"], "--sparse-host-cache-gb: must be a finite number"),
        (["--sparse-gpu-cache-gb", "nan"], "--sparse-gpu-cache-gb: must be a finite number"),
        (["--sparse-coarse-candidates", "nan"], "--sparse-coarse-candidates: must be a finite number"),
        (["--sparse-sink-pages", "100"], "--sparse-sink-pages: 100 pages leave no room for the newest page"),
    ):
        code, err = run_launcher(["--device", "cpu", *argv])
        assert code == 2 and err.count("\n") == 1, (argv, err)
        assert err.startswith("python -m sparse_sglang.launch_server: error: " + start), (argv, err)
