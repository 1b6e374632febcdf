"""The startup benchmark's pure parts: the flags each system starts with and its summary."""

import argparse

from benchmark.startup import launcher_args, summarize


def test_both_systems_get_the_same_sglang_flags_and_sparse_its_host_store():
    args = argparse.Namespace(extra_server_args="--mem-fraction-static 0.8", sparse_host_cache_gb=92.0, vanilla_args="",
                              warmup_args="--cuda-graph-max-bs 8")  # fmt: skip
    vanilla, sparse = launcher_args("vanilla", args), launcher_args("sparse", args)
    assert sparse[: len(vanilla)] == vanilla and sparse[len(vanilla) :] == ["--sparse-host-cache-gb", "92.0"]
    assert "--mem-fraction-static" in vanilla and "--load-format" in vanilla
    args.sparse_host_cache_gb = None  # the launcher's own default
    assert launcher_args("sparse", args) == launcher_args("vanilla", args)
    args.vanilla_args = "--attention-backend flashinfer"  # vanilla's alone: the sparse launcher sets its own
    assert launcher_args("vanilla", args)[-2:] == ["--attention-backend", "flashinfer"]
    assert "--attention-backend" not in launcher_args("sparse", args)
    for system in ("vanilla", "sparse"):  # the warm-up starts alone get --warmup-args, after the shared flags
        assert launcher_args(system, args, warmup=True)[:5] == launcher_args(system, args)[:5]
        assert "--cuda-graph-max-bs" in launcher_args(system, args, warmup=True)
        assert "--cuda-graph-max-bs" not in launcher_args(system, args)


def test_overhead_is_the_difference_of_medians_and_none_without_a_start():
    starts = [
        {"system": "vanilla", "start_s": 40.0},
        {"system": "sparse", "start_s": 70.0},
        {"system": "vanilla", "start_s": 44.0},
        {"system": "sparse", "start_s": 66.0},
    ]
    summary = summarize(starts)
    assert (summary["vanilla_start_s"], summary["sparse_start_s"], summary["start_overhead_s"]) == (42.0, 68.0, 26.0)
    failed = summarize([{"system": "vanilla", "start_s": 40.0}, {"system": "sparse", "error": "TimeoutError"}])
    assert failed["start_overhead_s"] is None and failed["starts"] == {"vanilla": 1, "sparse": 0}
