"""The accuracy suite's summary (benchmark/accuracy.py): retention, judged families and the bars, on
synthetic runs (CPU, no server).

Retention is what a user loses: of the items dense answers fully right one request at a time, the
share a sparse configuration answers fully right too. The runs below have known right and wrong
items, so every number the summary gives is counted here by hand.
"""

from __future__ import annotations

import json

import pytest

from benchmark import accuracy


def needle(family: str, length: int, index: int) -> accuracy.Item:
    return accuracy.Item(f"{family}-{length}-{index}", family, length, "p", [str(1_000_000 + index)], "all", 8,
                         detail={"kind": "numbers"})  # fmt: skip


MULTI = ["1111111", "2222222", "3333333", "4444444"]
ITEMS = (
    [needle("niah_single", 2048, i) for i in range(10)]
    + [accuracy.Item(f"qa-2048-{i}", "qa", 2048, "p", ["word"], "part", 8) for i in range(10)]
    + [accuracy.Item(f"vt-2048-{i}", "vt", 2048, "p", ["ABCDE"], "all", 8) for i in range(11)]
    + [accuracy.Item(f"niah_multivalue-2048-{i}", "niah_multivalue", 2048, "p", MULTI, "all", 8) for i in range(2)]
    + [needle("niah_single", 8000, i) for i in range(4)]
)
BY_ID = {i.id: i for i in ITEMS}


def right(item_id: str) -> str:
    return {"qa": " word", "vt": " ABCDE"}.get(item_id.split("-")[0], f" {BY_ID[item_id].answers[0]}.")


WRONG = " 0."


def answers(right_ids, ids, overrides=None) -> dict:
    """An output for each of ``ids``: right for those in ``right_ids``, wrong for the others."""
    out = {i: right(i) if i in right_ids else WRONG for i in ids}
    return {**out, **(overrides or {})}


def ids(family: str, length: int, indices) -> list[str]:
    return [f"{family}-{length}-{i}" for i in indices]


AT_2048 = [i.id for i in ITEMS if i.length == 2048]
AT_8000 = [i.id for i in ITEMS if i.length == 8000]
# dense, one at a time: niah_single 8 of 10 at 2K and 4 of 4 at 8K, qa 1 of 10 (judged: 10%),
# vt 1 of 11 (not judged), multi-value item 0 whole and item 1 with two values of four
DENSE_RIGHT = ids("niah_single", 2048, range(8)) + ["qa-2048-0", "vt-2048-0"] + AT_8000
MULTI_DENSE = {"niah_multivalue-2048-0": " " + ", ".join(MULTI), "niah_multivalue-2048-1": " 1111111, 2222222"}
# the default at 4x (budget 512 at 2K): keeps niah_single 0-5, loses 6 and 7, gains 8; keeps qa 0;
# loses vt 0 (not judged); half of multi-value item 0's values, one of item 1's two (and one dense lacked)
DEFAULT_RIGHT = ids("niah_single", 2048, [0, 1, 2, 3, 4, 5, 8]) + ["qa-2048-0"] + ids("niah_single", 8000, [0, 1])
MULTI_DEFAULT = {"niah_multivalue-2048-0": " 1111111, 2222222", "niah_multivalue-2048-1": " 1111111, 3333333"}


def write_run(tmp_path, name: str, outputs: dict, **fields) -> str:
    rows = []
    for item_id, out in outputs.items():
        row = {"id": item_id, "output": out}
        if out is None:
            row["error"] = "not sent: the server stopped answering"
        else:
            row["score"] = accuracy.score(BY_ID[item_id], out)
        rows.append(row)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"kind": "server", "name": name, "outputs": rows, **fields}))
    return str(path)


def write_items(tmp_path, seed: int) -> str:
    path = tmp_path / f"items-{seed}.json.gz"
    accuracy.save_items(ITEMS, path, {"seed": seed, "digest": "synthetic"})
    return str(path)


def dense_runs(tmp_path) -> list[str]:
    dense = dict(config="dense", alone=True, vanilla=True, budget=None)
    return [
        write_run(tmp_path, "dense-alone-2048", answers(DENSE_RIGHT, AT_2048, MULTI_DENSE), **dense),
        write_run(tmp_path, "dense-alone-8000", answers(DENSE_RIGHT, AT_8000), **dense),
    ]


def reference_run(tmp_path) -> str:
    """A CPU reference at budget 512 (4x at 2K) with an oracle policy: the oracle keeps niah_single
    0-2 of the four dense gets right, and qa 0; vt 0 is not judged; niah_single 8 dense gets wrong."""
    rows = []
    for item_id in ids("niah_single", 2048, [0, 1, 2, 3, 8]) + ["qa-2048-0", "vt-2048-0"]:
        oracle = right(item_id) if item_id in ids("niah_single", 2048, [0, 1, 2]) + ["qa-2048-0"] else WRONG
        policies = {"dense": right(item_id), "sparse-512": WRONG, "oracle": oracle}
        rows.append({"id": item_id, **{k: {"output": v, "score": accuracy.score(BY_ID[item_id], v)}
                                       for k, v in policies.items()}})  # fmt: skip
    path = tmp_path / "oracle-512.json"
    run = {"kind": "reference", "name": "oracle-512", "budget": 512, "compressions": [4, 8, 16, 32],
           "policies": ["dense", "sparse-512", "oracle"], "outputs": rows}  # fmt: skip
    path.write_text(json.dumps(run))
    return str(path)


@pytest.fixture
def result(tmp_path):
    sparse = dict(alone=True, vanilla=False)
    default = answers(DEFAULT_RIGHT, AT_2048 + AT_8000, MULTI_DEFAULT)
    # the headline's flags at 4x: loses niah_single 7 only, keeps multi-value item 0 whole
    headline = answers(ids("niah_single", 2048, range(7)) + ["qa-2048-0"], AT_2048,
                       {"niah_multivalue-2048-0": MULTI_DENSE["niah_multivalue-2048-0"]})  # fmt: skip
    # a candidate answering as dense, but two items never came back
    quest = answers(DENSE_RIGHT, AT_2048, {**MULTI_DENSE, "qa-2048-8": None, "qa-2048-9": None})
    # plain SGLang under other flags (fp8 KV): dense's answers but for niah_single 7 at 2K
    fp8 = dict(config="densefp8", alone=True, vanilla=True, budget=None)
    runs = dense_runs(tmp_path) + [
        write_run(
            tmp_path,
            "densefp8-alone-2048",
            answers(DENSE_RIGHT, AT_2048, {**MULTI_DENSE, "niah_single-2048-7": WRONG}),
            **fp8,
        ),
        write_run(tmp_path, "densefp8-alone-8000", answers(DENSE_RIGHT, AT_8000), **fp8),
        write_run(tmp_path, "default-alone-512", default, config="default", budget=512, **sparse),
        write_run(tmp_path, "headline-alone-512", headline, config="headline", budget=512, **sparse),
        write_run(tmp_path, "quest-alone-512", quest, config="quest", budget=512, **sparse),
        # batched, all wrong: never paired with the one-at-a-time runs
        write_run(
            tmp_path, "default-512", answers([], AT_2048), config="default", budget=512, alone=False, vanilla=False
        ),  # fmt: skip
        reference_run(tmp_path),
    ]
    return accuracy.summarize(runs, write_items(tmp_path, accuracy.HELD_OUT_SEED))


def test_retention_counts_what_dense_gets_fully_right_and_sparse_keeps(result):
    cell = result["retention"]["default"]["niah_single"]["2048"]["4"]
    assert cell["n"] == 10 and cell["n_dense_right"] == 8 and cell["retained"] == 6
    assert cell["retention"] == 0.75
    assert cell["new_error_ids"] == ["niah_single-2048-6", "niah_single-2048-7"] and cell["new_errors"] == 2
    assert cell["new_correct_ids"] == ["niah_single-2048-8"] and cell["new_corrects"] == 1
    assert result["retention"]["default"]["niah_single"]["8000"]["16"]["retention"] == 0.5
    summary = result["summary"]
    # judged: niah_single (6 of 8 kept), qa (1 of 1), niah_multivalue (0 of 1); vt's lost item does not count
    assert summary["retention_4x"] == pytest.approx(7 / 10)
    assert summary["retention_by_config"]["default"]["4"] == {"retention": 0.7, "n_dense_right": 10, "new_errors": 3,
                                                              "new_corrects": 1}  # fmt: skip
    assert summary["retention_16x_long"] == 0.5
    assert summary["retention_4x_headline"] == pytest.approx(9 / 10)
    # the candidate answers as dense on every item it answered
    assert summary["retention_by_config"]["quest"]["4"]["retention"] == 1.0


def test_plain_sglang_under_other_flags_is_held_against_dense_over_all_its_items(result):
    """The fp8 run is no dense baseline (the default's numbers above are dense's), and it keeps
    13 of the 14 judged items dense gets fully right: niah_single 0-7 at 2K and 0-3 at 8K, qa 0,
    multi-value item 0."""
    brief = result["summary"]["retention_by_vanilla_config"]["densefp8"]
    assert brief == {"retention": round(13 / 14, 4), "n_dense_right": 14, "new_errors": 1, "new_corrects": 0}
    assert "densefp8" not in result["summary"]["retention_by_config"]


def test_value_retention_pools_the_values_dense_found(result):
    cell = result["retention"]["default"]["niah_multivalue"]["2048"]["4"]
    # item 0: dense holds 4 values, sparse 2 of them; item 1: dense holds 2, sparse 1 of them (its other is new)
    assert (cell["values_dense"], cell["values_kept"], cell["value_retention"]) == (6, 3, 0.5)
    assert result["summary"]["value_retention_4x"] == 0.5


def test_families_are_judged_by_how_often_dense_is_fully_right(result):
    summary = result["summary"]
    assert summary["judged_families"] == ["niah_single", "niah_multivalue", "qa"]  # the suite's family order
    assert summary["dense_right_share"] == {"niah_single": 0.8571, "niah_multivalue": 0.5, "vt": 0.0909, "qa": 0.1}
    assert result["families"]["vt"] == {"items": 11, "dense_right": 1, "dense_right_share": 0.0909, "judged": False}


def test_the_oracle_is_held_against_the_dense_servers_answers(result):
    summary = result["summary"]
    # of niah_single 0-3 and qa 0 (dense server fully right, judged), the oracle keeps 4
    assert summary["oracle_retention_4x"] == pytest.approx(4 / 5)
    assert summary["reference_dense_retention_4x"] == 1.0
    assert result["reference_retention"]["oracle-512"]["sparse-512"]["4"]["retention"] == 0.0
    # every policy's per-item output stays in the file
    row = result["outputs"]["oracle-512"][3]
    assert row["id"] == "niah_single-2048-3" and row["oracle"] == {"output": WRONG, "score": 0.0}
    assert row["dense"]["score"] == 1.0


def test_missing_items_and_the_seed_are_reported(result, tmp_path):
    summary = result["summary"]
    assert summary["held_out"] is True and summary["items"] == len(ITEMS)
    assert summary["items_missing"]["quest-alone-512"] == 2 and summary["items_answered"]["quest-alone-512"] == 31
    assert summary["items_missing"]["default-alone-512"] == 0
    quest = next(r for r in result["runs"] if r["name"] == "quest-alone-512")
    assert quest["items_sent"] == 33 and quest["missing_ids"] == ["qa-2048-8", "qa-2048-9"]
    dev = accuracy.summarize(dense_runs(tmp_path), write_items(tmp_path, accuracy.DEV_SEED))
    assert dev["summary"]["held_out"] is False


def test_a_batched_run_is_never_paired_with_a_one_at_a_time_run(tmp_path):
    """Old files record no identity: ``sparse-512`` (batched) and ``sparse-alone-512`` both start
    with ``sparse-``; their concurrency tells them apart."""
    two_k = [i for i in AT_2048 if i.startswith("niah_single")]
    runs = [
        write_run(tmp_path, "dense", answers(DENSE_RIGHT, two_k), vanilla=True, budget=None, concurrency=64),
        write_run(tmp_path, "dense-alone-2048", answers(DENSE_RIGHT, two_k), vanilla=True, budget=None, concurrency=1),
        write_run(tmp_path, "sparse-512", answers([], two_k), vanilla=False, budget=512, concurrency=64),
        write_run(tmp_path, "sparse-alone-512", answers(DEFAULT_RIGHT, two_k), vanilla=False, budget=512,
                  concurrency=1),
        # recorded identity wins over the name: batched whatever it is called
        write_run(tmp_path, "headline-alone-1024", answers([], two_k), config="headline", alone=False, vanilla=False,
                  budget=512),
    ]  # fmt: skip
    result = accuracy.summarize(runs, write_items(tmp_path, accuracy.HELD_OUT_SEED))
    batched = result["legacy"]["by_family_batched"]["niah_single"]["4"]
    assert batched["n"] == 10 and batched["sparse"] == 0.0  # the batched run's items alone, once each
    assert result["summary"]["retention_4x"] == 0.75  # the alone run's
    assert result["summary"]["retention_4x_headline"] is None  # the headline run is batched
    identity = {r["name"]: (r["config"], r["alone"]) for r in result["runs"]}
    assert identity == {"dense": ("dense", False), "dense-alone-2048": ("dense", True),
                        "sparse-512": ("default", False), "sparse-alone-512": ("default", True),
                        "headline-alone-1024": ("headline", False)}  # fmt: skip


PASSING = {"retention_4x": 0.93, "retention_4x_headline": 0.9, "retention_16x_long": 0.6, "value_retention_4x": 0.85,
           "held_out": True, "items_seed": 1, "oracle_retention_4x": 0.97, "items_missing": {"a": 0, "b": 0},
           "items_answered": {"a": 400, "b": 400}}  # fmt: skip


def check(tmp_path, capsys, summary: dict) -> tuple[int, str]:
    path = tmp_path / "result.json"
    path.write_text(json.dumps({"summary": summary}))
    with pytest.raises(SystemExit) as exit_:
        accuracy.main(["check", str(path)])
    return exit_.value.code, capsys.readouterr().out


def test_check_names_the_first_bar_short(result, tmp_path, capsys):
    assert check(tmp_path, capsys, result["summary"]) == (1, "retention_4x 0.7 < 0.90\n")
    code, out = check(tmp_path, capsys, PASSING)
    assert code == 0 and out.splitlines() == [
        "retention_4x 0.93 >= 0.90", "retention_4x_headline 0.9 >= 0.87", "retention_16x_long 0.6 >= 0.50",
        "value_retention_4x 0.85 >= 0.80", "held_out true", "oracle_retention_4x 0.97 (present)",
        "items_missing 0 in every run"]  # fmt: skip
    assert len(out.splitlines()) == len(accuracy.BARS)
    short = {**PASSING, "retention_16x_long": 0.49, "held_out": False, "items_seed": 0}
    assert check(tmp_path, capsys, short) == (1, "retention_16x_long 0.49 < 0.50\n")
    not_held_out = {**PASSING, "held_out": False, "items_seed": 0}
    assert check(tmp_path, capsys, not_held_out) == (1, "held_out false (items of seed 0; held out: --seed 1)\n")
    no_oracle = {**PASSING, "oracle_retention_4x": None}
    assert check(tmp_path, capsys, no_oracle) == (1, "oracle_retention_4x missing\n")
    missed = {**PASSING, "items_missing": {"a": 0, "b": 2}, "items_answered": {"a": 400, "b": 398}}
    assert check(tmp_path, capsys, missed) == (1, "items_missing: b 2 of 400\n")
    no_headline = {k: v for k, v in PASSING.items() if k != "retention_4x_headline"}
    assert check(tmp_path, capsys, no_headline) == (1, "retention_4x_headline missing\n")


@pytest.fixture
def grid_commands(tmp_path, monkeypatch):
    """Runs ``accuracy.grid`` with its arguments and returns the ``serve`` commands it starts (no
    server starts: the subprocesses are captured)."""
    import argparse
    import subprocess

    started = []

    class Done:
        returncode = 0

        def __init__(self, cmd, **kwargs):
            started.append(cmd)

        def poll(self):
            return 0

    monkeypatch.setattr(subprocess, "Popen", Done)
    monkeypatch.setattr(accuracy.time, "sleep", lambda s: None)

    def run(**args) -> list[list[str]]:
        defaults = dict(out_dir=str(tmp_path), grid="retention", only="", items="items.json.gz", parallel=9,
                        stagger=0, sparse_args="", configs="", vanilla_configs="", shard="0/1")  # fmt: skip
        started.clear()
        accuracy.grid(argparse.Namespace(**{**defaults, **args}))
        return list(started)

    return run


def flag_value(cmd: list[str], flag: str) -> str | None:
    return cmd[cmd.index(flag) + 1] if flag in cmd else None


def test_grid_shards_split_the_runs_between_processes(grid_commands):
    names = [[flag_value(cmd, "--name") for cmd in grid_commands(shard=f"{i}/2")] for i in range(2)]
    assert names[0] and names[1] and not set(names[0]) & set(names[1])
    assert sorted(names[0] + names[1]) == sorted(flag_value(cmd, "--name") for cmd in grid_commands())


def test_the_retention_grid_runs_one_at_a_time_and_covers_4x_and_long_16x(grid_commands):
    runs = {}
    for cmd in grid_commands(configs="quest=--sparse-selector quest"):
        runs[flag_value(cmd, "--name")] = tuple(
            flag_value(cmd, f) for f in ("--config", "--budget", "--lengths", "--server-args")
        )
        assert "--alone" in cmd and flag_value(cmd, "--concurrency") == "1"
        assert "--disable-radix-cache" in flag_value(cmd, "--server-args")
    assert sorted(runs) == sorted(
        ["dense-alone-2048", "dense-alone-4096", "dense-alone-8000"]
        + [
            f"{c}-alone-{b}-{n}"
            for c in ("default", "quest")
            for b, n in ((256, 4096), (512, 2048), (512, 8000), (1024, 4096), (2048, 8000))
        ]  # fmt: skip
        + ["headline-alone-512", "headline-alone-1024", "headline-alone-2048"]
    )
    assert runs["default-alone-512-8000"][:3] == ("default", "512", "8000")
    assert runs["quest-alone-256-4096"][:3] == ("quest", "256", "4096")
    assert "--sparse-selector quest" in runs["quest-alone-1024-4096"][3]
    assert "--sparse-selector" not in runs["default-alone-1024-4096"][3]
    assert runs["headline-alone-512"][:3] == ("headline", "512", "2048")
    assert accuracy.HEADLINE_FLAGS in runs["headline-alone-512"][3]
    assert runs["dense-alone-4096"][0] == "dense" and runs["dense-alone-4096"][1] is None
    # together the cells: 4x at every length, 16x at 4096 and 8000
    cells = set()
    for config, budget, lengths, _ in runs.values():
        for length in map(int, lengths.split(",")):
            if budget:
                cells.add((config, length, accuracy.nominal(length / int(budget))))
    assert {(n, c) for config, n, c in cells if config == "default"} == {(2048, 4), (4096, 4), (8000, 4), (4096, 16),
                                                                         (8000, 16)}  # fmt: skip
    assert {(n, c) for config, n, c in cells if config == "headline"} == {(2048, 4), (4096, 4), (8000, 4)}


def test_the_retention_grid_runs_plain_sglang_under_other_flags_at_every_length(grid_commands):
    started = grid_commands(vanilla_configs="densefp8=--kv-cache-dtype fp8_e4m3")
    fp8 = {flag_value(cmd, "--name"): cmd for cmd in started if flag_value(cmd, "--config") == "densefp8"}
    assert sorted(fp8) == ["densefp8-alone-2048", "densefp8-alone-4096", "densefp8-alone-8000"]
    for cmd in fp8.values():
        flags = flag_value(cmd, "--server-args")
        assert "--vanilla" in cmd and "--alone" in cmd and flag_value(cmd, "--budget") is None
        assert "--kv-cache-dtype fp8_e4m3" in flags and accuracy.GRID_VANILLA_ARGS in flags
        assert "--sparse" not in flags
    with pytest.raises(SystemExit, match="--vanilla-configs: 'quest' is not a free configuration name"):
        grid_commands(configs="quest=--sparse-selector quest", vanilla_configs="quest=--kv-cache-dtype fp8_e4m3")
    with pytest.raises(SystemExit, match="--vanilla-configs: 'dense' is not a free"):
        grid_commands(vanilla_configs="dense=--kv-cache-dtype fp8_e4m3")


def test_the_final_grid_runs_agreement_cold_and_accuracy_batched(grid_commands):
    """The first results' grid: its one-at-a-time runs prefill every request cold, its batched runs
    keep SGLang's defaults; each run says what it is."""
    started = grid_commands(grid="final", only="dense,dense-alone-2048,sparse-alone-512",
                            sparse_args="--sparse-selector sketch")  # fmt: skip
    flags = {flag_value(cmd, "--name"): flag_value(cmd, "--server-args") for cmd in started}
    assert set(flags) == {"dense", "dense-alone-2048", "sparse-alone-512"}
    assert "--disable-radix-cache" in flags["dense-alone-2048"] and "--disable-radix-cache" in flags["sparse-alone-512"]
    assert "--disable-radix-cache" not in flags["dense"]
    # a candidate default (--sparse-args) reaches the sparse servers only
    assert "--sparse-selector sketch" in flags["sparse-alone-512"]
    assert "--sparse-selector" not in flags["dense-alone-2048"]
    configs = {flag_value(cmd, "--name"): (flag_value(cmd, "--config"), "--alone" in cmd) for cmd in started}
    assert configs == {"dense": ("dense", False), "dense-alone-2048": ("dense", True),
                       "sparse-alone-512": ("default", True)}  # fmt: skip
    with pytest.raises(SystemExit, match="--configs and --vanilla-configs go with --grid retention"):
        grid_commands(grid="final", configs="quest=--sparse-selector quest")


def test_serve_records_what_the_run_is_and_the_items_it_missed(tmp_path, monkeypatch):
    """--concurrency 1 makes a run one at a time without --alone; a run that gives up on its server
    records the items it never got back. The server is stood in for: no request is sent."""
    import argparse

    sent = []

    def run_server(items, url, concurrency):
        sent.append(concurrency)
        # the server stops answering after the first item (GIVE_UP leaves the rest unsent)
        return [{"id": i.id, "output": right(i.id) if n == 0 else None} for n, i in enumerate(items)]

    monkeypatch.setattr(accuracy, "run_server", run_server)
    args = argparse.Namespace(items=write_items(tmp_path, accuracy.HELD_OUT_SEED), name="quest-alone-512",
                              config="quest", alone=False, concurrency=1, vanilla=False, budget=512, server_args="",
                              families="niah_single", lengths="2048", per_cell=3, url="http://stand-in",
                              model_path=None, repeat=False, log=None)  # fmt: skip
    run = accuracy.serve(args)
    assert sent == [1]
    assert (run["config"], run["alone"], run["budget"], run["vanilla"]) == ("quest", True, 512, False)
    assert "--disable-radix-cache" in run["server_args"] and run["items_seed"] == accuracy.HELD_OUT_SEED
    assert (run["items_sent"], run["items_answered"], run["items_missing"]) == (3, 1, 2)
    assert run["missing_ids"] == ["niah_single-2048-1", "niah_single-2048-2"]
    dense = accuracy.serve(argparse.Namespace(**{**vars(args), "vanilla": True, "config": None, "concurrency": 64}))
    assert (dense["config"], dense["alone"], sent[-1]) == ("dense", False, 64)
