"""Cold start: vanilla SGLang and the sparse server, same model, same machine, one after the other.

Each start is timed from launching ``python -m <launcher>`` to the first ``/health`` that answers
200 (``sparse_sglang.testing.server.ServerProcess``, polling once a second), with dummy weights of
the Llama-3-8B shape by default (``--model-path`` for another folder). The sparse server's extra
time is mostly pinning its host KV store (``--sparse-host-cache-gb``, default half the available
RAM, as the launcher's); its log's own lines say where the rest went. Writes
``benchmark/results/startup-<date>.json`` with ``summary.start_overhead_s`` (sparse minus vanilla,
medians over ``--repeats``)::

    python -m benchmark.startup                                   # the 8B shape, the default host store
    python -m benchmark.startup --sparse-host-cache-gb 92 --warmup   # FlashInfer's JIT done before timing
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import time
from pathlib import Path

SYSTEMS = ("vanilla", "sparse")


def launcher_args(system: str, args, warmup: bool = False) -> list[str]:
    """The flags each system starts with: the same SGLang ones, plus the host store for sparse
    (and, for an untimed warm-up start, ``--warmup-args``)."""
    extra = [*shlex.split(args.extra_server_args), *(shlex.split(args.warmup_args) if warmup else [])]
    shared = ["--load-format", "dummy", "--skip-tokenizer-init", *extra]
    if system == "vanilla":
        return [*shared, *shlex.split(args.vanilla_args)]
    if args.sparse_host_cache_gb is not None:
        return [*shared, "--sparse-host-cache-gb", str(args.sparse_host_cache_gb)]
    return shared


def time_start(system: str, model: str, args, attempt: int | str) -> dict:
    """One cold start of ``system``: seconds to healthy, or the error (``attempt`` "warmup": an
    untimed start with ``--warmup-args``)."""
    from sparse_sglang.testing.server import SPARSE_MODULE, VANILLA_MODULE, ServerProcess

    module = {"vanilla": VANILLA_MODULE, "sparse": SPARSE_MODULE}[system]
    log_path = Path(args.log_dir) / f"startup-{system}-{attempt}.log"
    flags = launcher_args(system, args, warmup=attempt == "warmup")
    server = ServerProcess(module, model, flags, log_path=log_path,
                           start_timeout=args.start_timeout, stop_timeout=60)  # fmt: skip
    record = {"system": system, "command": shlex.join(server.command), "log": str(log_path)}
    started = time.perf_counter()
    try:
        server.start()
        record["start_s"] = round(time.perf_counter() - started, 2)
    except (RuntimeError, TimeoutError) as err:
        record["error"] = f"{type(err).__name__}: {err}"[-2000:]
    finally:
        server.stop()
    record.update(exit_code=server.exit_code, stopped_cleanly=server.stopped_cleanly)
    return record


def summarize(starts: list[dict]) -> dict:
    """Median seconds to healthy per system and the sparse server's extra (``None`` when a system
    never started)."""
    median = {}
    for system in SYSTEMS:
        times = [s["start_s"] for s in starts if s["system"] == system and "start_s" in s]
        median[system] = round(statistics.median(times), 2) if times else None
    overhead = None if None in median.values() else round(median["sparse"] - median["vanilla"], 2)
    return {"vanilla_start_s": median["vanilla"], "sparse_start_s": median["sparse"], "start_overhead_s": overhead,
            "starts": {s: sum(1 for r in starts if r["system"] == s and "start_s" in r) for s in SYSTEMS}}  # fmt: skip


def run(args) -> dict:
    from sparse_sglang.testing.models import write_llama3_8b_dummy

    model = args.model_path or write_llama3_8b_dummy(Path(args.log_dir) / "llama3-8b-dummy")
    warmups = [time_start(system, model, args, "warmup") for system in SYSTEMS] if args.warmup else []
    starts = []
    for attempt in range(args.repeats):
        for system in SYSTEMS:  # alternated, so a warm page cache or file cache favours neither
            starts.append(time_start(system, model, args, attempt))
            print(starts[-1])
    return {"model": model, "warmups": warmups, "starts": starts, "summary": summarize(starts)}


def main(argv: list[str] | None = None) -> dict:
    from sparse_sglang.testing.provenance import add_server_run_args, finish_run

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default=None, help="default: the Llama-3-8B shape with dummy weights")
    parser.add_argument(
        "--sparse-host-cache-gb", type=float, default=None, help="default: the launcher's (half the available RAM)"
    )
    parser.add_argument("--extra-server-args", default="", help="flags both servers get")
    parser.add_argument(
        "--vanilla-args",
        default="",
        help="flags vanilla alone gets (e.g. its attention backend, which the sparse launcher sets itself)",
    )
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--warmup",
        action="store_true",
        help="one untimed start of each system first: FlashInfer's JIT compiles on a fresh machine's first "
        "start of a module, which would fall on whichever system starts first",
    )
    parser.add_argument("--warmup-args", default="", help="flags only the warm-up starts get (e.g. less GPU memory)")
    parser.add_argument("--start-timeout", type=float, default=900.0)
    add_server_run_args(parser, "startup")
    args = parser.parse_args(argv)
    return finish_run("benchmark.startup", argv, run(args), args.out_dir, "startup-{date}.json")


if __name__ == "__main__":
    main()
