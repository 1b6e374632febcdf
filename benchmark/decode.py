"""Sparse decode step vs dense FlashInfer decode, one layer of the Llama-3-8B shape, on the GPU.

For each context (8K/32K/128K) and batch (1/8/32), in the same process:

- **dense**: FlashInfer paged decode over every page (HND, page 32), the step SGLang runs;
- **sparse, all hits**: score + select (budget 2048) + page-cache lookup + FlashInfer over the
  selected pages, with every selected page already cached (a warm cache);
- **sparse, 10% / 50% misses**: the same step after unmapping that share of the selected pages,
  so FlashH2D loads them from pinned host memory;
- **select**: scoring + top-k alone (its share of the all-hit step).

With ``--reselect-interval N`` (``--sparse-reselect-interval``, both sides) the timed steps are the
steady state a server reaches: after one step that fills every request's cache row, one request in
N selects from all its pages and the others choose among the pages their rows hold.

Every timed step is a CUDA graph replay (the sparse step is built to be captured: no host
synchronization, fixed shapes), timed with CUDA events, median of ``--iters``, with L2 flushed
before each replay (in a server the layer's weights pass through L2 between two attentions). As
in a server, where one graph holds every layer of a decode step, a graph holds
``--layers-per-graph`` layers (distinct KV and summaries, fewer where memory is short: the
``layers`` field) and times are per layer, so the graph's launch is paid once per graph rather
than once per layer. Summaries are random (the selected pages then look random, as misses would). Writes
``benchmark/results/decode-<date>.json`` (``decode-<date>-fp8.json`` with ``--kv-dtype fp8_e4m3``,
``decode-<date>-exact-bounds.json`` with ``--bound-format exact``: bf16 bounds for bf16 KV)::

    python -m benchmark.decode                 # the full grid
    python -m benchmark.decode --quick         # 8K and 32K, batch 1 and 8
"""

from __future__ import annotations

import argparse
import functools
import gc
import glob
import json
import re
import statistics
from pathlib import Path

import torch

from sparse_sglang.attention.sparse_decode import TOPK_IMPLS, topk_pages
from sparse_sglang.config import BOUND_FORMATS, PAGE_BOUNDS, RERANK_BY, SparseConfig
from sparse_sglang.mem_cache.bounds import resolve_bound_format
from sparse_sglang.testing.decode_setup import DecodeBench, Llama8BShape, make_store
from sparse_sglang.testing.provenance import finish_run

REPO = Path(__file__).resolve().parents[1]
SHAPE = Llama8BShape(num_layers=1)
KV_DTYPE_CHOICES = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}  # fp8: summaries' bounds in fp8 too
DEFAULTS = SparseConfig(host_cache_gb=1.0)
HOST_GIB_PER_STORE = 24  # pinned host KV of one (context, batch) store: bounds its layers


@functools.cache
def l2_sized_buffer() -> torch.Tensor:
    return torch.empty(256 << 20, dtype=torch.uint8, device="cuda")


def flush_l2() -> None:
    """Evict the GPU's L2 (50 MiB on an H100) by reading a buffer five times its size."""
    l2_sized_buffer().view(torch.int64).sum()


def capture(fn) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up outside the graph (lazy init, JIT)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def time_graph(fn, iters: int, before=None, per: int = 1) -> float:
    """Median milliseconds of a CUDA-graph replay of ``fn``, divided by ``per`` (the layers ``fn``
    runs); ``before()`` and an L2 flush run untimed before each replay."""
    graph = capture(fn)
    times = []
    for _ in range(iters):
        if before is not None:
            before()
        flush_l2()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times) / per


def kernel_times(fn, iters: int, per: int = 1) -> dict[str, float]:
    """Microseconds per layer of each kernel of a CUDA-graph replay of ``fn`` (torch's profiler,
    which sees the kernels inside a graph), L2 flushed before each replay as in :func:`time_graph`;
    names cut to 80 characters, largest first."""
    from torch.profiler import ProfilerActivity, profile

    graph = capture(fn)
    flush_l2()
    with profile(activities=[ProfilerActivity.CUDA]) as flush_only:
        flush_l2()
        torch.cuda.synchronize()
    flush_names = {e.key for e in flush_only.key_averages() if e.device_time_total > 0}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            flush_l2()
            graph.replay()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for e in prof.key_averages():
        if e.key not in flush_names and e.device_time_total > 0 and not e.key.startswith("cuda"):
            name = e.key[:80]
            times[name] = times.get(name, 0.0) + e.device_time_total / iters / per
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))


def dense_step(batch: int, context: int, workspace: torch.Tensor, kv: torch.Tensor, q: torch.Tensor, layers: int):
    """``layers`` dense decode attentions, each over its own slice of ``kv`` (distinct layers)."""
    import flashinfer

    page = 32
    pages = -(-(context + 1) // page)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "HND", use_tensor_cores=True)
    indptr = torch.arange(batch + 1, dtype=torch.int32) * pages
    indices = torch.arange(batch * pages, dtype=torch.int32, device="cuda")
    last = torch.full((batch,), (context + 1) - (pages - 1) * page, dtype=torch.int32)
    wrapper.plan(indptr, indices, last, SHAPE.num_q_heads, SHAPE.num_kv_heads, SHAPE.head_dim, page,
                 q_data_type=q.dtype, kv_data_type=kv.dtype)  # fmt: skip
    n = batch * pages
    slices = [(kv[0][i * n : (i + 1) * n], kv[1][i * n : (i + 1) * n]) for i in range(layers)]

    def step():
        for k, v in slices:
            wrapper.run(q, (k, v))

    return step


def layers_for(batch: int, context: int, max_batch: int, wanted: int) -> int:
    """Layers one timed graph holds: ``wanted``, fewer where the dense KV buffer (sized for
    ``max_batch`` requests) or the pinned host store of the sparse one would not hold them."""
    pages = -(-(context + 1) // 32)
    host_layer_bytes = 2 * batch * pages * SHAPE.num_kv_heads * 32 * SHAPE.head_dim * 2
    return max(1, min(wanted, max_batch // batch, int(HOST_GIB_PER_STORE * 2**30 // host_layer_bytes)))


def run(args) -> dict:
    # the page bounds timed, each cell's side by side: the default's, then quest's min/max with
    # --versus-minmax (the step ratio between them is the summary's step_ratio_vs_quest_max)
    page_bounds = [args.page_bounds] + (["minmax"] if args.versus_minmax and args.page_bounds != "minmax" else [])
    configs = {pb: SparseConfig(token_budget=args.budget, host_cache_gb=1.0, bound_format=args.bound_format,
                                coarse_pages=args.coarse_pages, coarse_candidates=args.coarse_candidates,
                                selector=args.selector, page_bounds=pb, bound_spread=args.bound_spread,
                                # quest's side of --versus-minmax is quest's own step: no re-rank
                                rerank_factor=args.rerank_factor if pb == args.page_bounds else 1,
                                rerank_by=args.rerank_by, reselect_interval=args.reselect_interval,
                                page_size=args.page_size if pb == args.page_bounds else DEFAULTS.page_size,
                                budget_share=args.budget_share and pb == args.page_bounds) for pb in page_bounds}  # fmt: skip
    cells = [(c, b) for c in args.contexts for b in args.batches]
    if args.cells:
        cells = [tuple(int(x) for x in cell.split("x")) for cell in args.cells.split(",")]
    max_batch, max_context = max(b for _, b in cells), max(c for c, _ in cells)
    workspace = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    max_pages = max_batch * -(-(max_context + 1) // 32)
    kv_dtype = KV_DTYPE_CHOICES[args.kv_dtype]
    dense_kv = torch.randn(2, max_pages, SHAPE.num_kv_heads, 32, SHAPE.head_dim, device="cuda").to(kv_dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for (context, batch), (pb, config) in ((cell, pc) for cell in cells for pc in configs.items()):
        # one (context, batch) cell under one page bounds
        layers = layers_for(batch, context, max_batch, args.layers_per_graph)
        store = make_store(Llama8BShape(num_layers=layers), config, batch, context, dtype=kv_dtype)
        b = DecodeBench(store, config, SHAPE.num_q_heads, batch, context, workspace)
        b.fill_summaries_randomly(gen)
        plan = b.plan()
        q = torch.randn(batch, SHAPE.num_q_heads, SHAPE.head_dim, device="cuda", dtype=torch.bfloat16)
        row = {"context": context, "batch": batch, "budget": args.budget, "layers": layers, "page_bounds": pb, "page_size": config.page_size,
               "reselect_interval": args.reselect_interval}  # fmt: skip
        row["dense_ms"] = time_graph(dense_step(batch, context, workspace, dense_kv, q, layers), args.iters, per=layers)

        def step():
            for layer in range(layers):
                b.decoder.run(layer, q, plan)

        log = b.decoder.log_selections(batch) if b.decoder.share else None  # a shared budget's pages
        step()  # loads every selected page: the cache is warm from here on
        if args.reselect_interval > 1:  # from here one request in N selects, the others reuse their rows
            plan = b.plan(staggered=True)
        if log is not None:
            pages = [log[:, layer].clone() for layer in range(layers)]
            b.decoder.selection_log = None
        else:
            pages = [b.decoder.select(layer, q, plan) for layer in range(layers)]
        row["sparse_hit_ms"] = time_graph(step, args.iters, per=layers)
        if args.kernels:
            row["sparse_hit_kernels_us"] = kernel_times(step, args.iters, per=layers)

        def select():
            for layer in range(layers):
                b.decoder.select_raw(layer, q, plan)

        row["select_ms"] = time_graph(select, args.iters, per=layers)
        for impl in TOPK_IMPLS:  # the top-k alone, each implementation (the default by measurement)
            prios = [torch.randn(batch, SHAPE.num_kv_heads, b.num_pages, device="cuda") for _ in range(layers)]

            def topk(impl=impl, prios=prios):
                for prio in prios:
                    topk_pages(prio, b.decoder.width, impl, plan.row_pages, b.decoder.topk_offsets)

            row[f"topk_{impl}_ms"] = time_graph(topk, args.iters, per=layers)
        for frac in args.miss_fracs:
            counts = []

            def evict(frac=frac, counts=counts):
                counts.append(sum(b.evict(layer, pages[layer], frac, gen) for layer in range(layers)) / layers)

            row[f"sparse_miss{int(frac * 100)}_ms"] = time_graph(step, args.iters, before=evict, per=layers)
            row[f"miss{int(frac * 100)}_pages"] = statistics.median(counts)
        store.close()
        b = store = None  # the next (context, batch) allocates its own: free this one first
        gc.collect()
        torch.cuda.empty_cache()
        row["speedup"] = row["dense_ms"] / row["sparse_hit_ms"]
        row["select_frac"] = row["select_ms"] / row["sparse_hit_ms"]
        print(json.dumps(row), flush=True)
        rows.append(row)
    return {"rows": rows}


def summarize(rows: list[dict]) -> dict:
    def at(context, key, agg):
        vals = [r[key] for r in rows if r["context"] == context]
        return agg(vals) if vals else None

    compared = [r for r in rows if r.get("page_bounds", "minmax") == "minmax"]
    default = [r for r in rows if r not in compared]
    rows = default or compared  # the headline numbers are the timed default's

    summary = {
        "speedup_128k": at(131072, "speedup", min),
        "speedup_32k": at(32768, "speedup", min),
        "select_frac_128k": at(131072, "select_frac", max),
    }
    if default and compared:  # the default's all-hit step over quest's min/max one, cell by cell
        quest = {(r["context"], r["batch"]): r["sparse_hit_ms"] for r in compared}
        ratios = [
            r["sparse_hit_ms"] / quest[(r["context"], r["batch"])]
            for r in default
            if (r["context"], r["batch"]) in quest
        ]
        summary["step_ratio_vs_quest_max"] = round(max(ratios), 3)
        summary["page_bounds"] = default[0]["page_bounds"]
    return summary


def quality_summary() -> dict:
    """Q1 error (this run's GPU test output, if given) and the committed quality results."""
    out = {}
    # quality-<date>.json only (not the probes beside them)
    files = sorted(
        f
        for f in glob.glob(str(REPO / "benchmark/results/quality-*.json"))
        if re.fullmatch(r"quality-\d{4}-\d{2}-\d{2}\.json", Path(f).name)
    )
    if files:
        q = json.loads(Path(files[-1]).read_text())["summary"]
        out["recall_512_8k"] = q.get("recall_512_7k", q.get("recall_512"))
        out["passkey_cpu_equal"] = q.get("passkey_cpu_equal")
        out["quality_file"] = Path(files[-1]).name
    return out


def add_grid_args(parser: argparse.ArgumentParser) -> None:
    """The (context, batch) grid and its timing options, shared with ``decode_kernels.py``."""
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument(
        "--layers-per-graph",
        type=int,
        default=4,
        help="layers (distinct KV and summaries) in one timed graph; times are per layer",
    )
    parser.add_argument("--out-dir", type=Path, default=REPO / "benchmark" / "results")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_grid_args(parser)
    parser.add_argument(
        "--kv-dtype",
        choices=sorted(KV_DTYPE_CHOICES),
        default="bf16",
        help="KV dtype of both sides (fp8: dense reads half the bytes, and so does scoring)",
    )
    parser.add_argument(
        "--bound-format",
        choices=BOUND_FORMATS,
        default="auto",
        help="the sparse side's page bounds (--sparse-bound-format; auto: int8 for bf16 KV)",
    )
    parser.add_argument(
        "--coarse-pages",
        type=int,
        default=0,
        help="--sparse-coarse-pages: score super-pages of this many pages first (0 = page by page)",
    )
    parser.add_argument("--coarse-candidates", type=float, default=4.0, help="--sparse-coarse-candidates")
    parser.add_argument("--selector", choices=("quest", "sketch"), default="quest", help="--sparse-selector")
    parser.add_argument("--rerank-factor", type=int, default=1, help="--sparse-rerank-factor")
    parser.add_argument("--rerank-by", choices=RERANK_BY, default=DEFAULTS.rerank_by, help="--sparse-rerank-by")
    parser.add_argument("--page-bounds", choices=PAGE_BOUNDS, default=DEFAULTS.page_bounds, help="--sparse-page-bounds")
    parser.add_argument("--bound-spread", type=float, default=DEFAULTS.bound_spread, help="--sparse-bound-spread")
    parser.add_argument("--page-size", type=int, default=DEFAULTS.page_size,
                        help="--sparse-page-size of the timed default's side (quest's side of --versus-minmax keeps the default's)")  # fmt: skip
    parser.add_argument("--budget-share", action="store_true", help="--sparse-budget-share (the timed default's side)")
    parser.add_argument("--reselect-interval", type=int, default=1,
                        help="--sparse-reselect-interval, both sides: the steady state's step, one request in N "
                             "selecting from all its pages and the others reusing their rows")  # fmt: skip
    parser.add_argument("--versus-minmax", action="store_true",
                        help="also time quest's min/max bounds in each cell: the summary's step_ratio_vs_quest_max")  # fmt: skip
    parser.add_argument("--cells", default="", help="CONTEXTxBATCH,... instead of --contexts x --batches")
    parser.add_argument("--miss-fracs", type=float, nargs="+", default=[0.1, 0.5])
    parser.add_argument(
        "--kernels", action="store_true", help="also record each kernel's time in the all-hit step (torch's profiler)"
    )
    parser.add_argument("--q1", type=Path, help="q1.json written by test/test_sparse_decode_gpu.py")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.contexts, args.batches = [8192, 32768], [1, 8]
    result = run(args)
    summary = summarize(result["rows"])
    if args.q1 and args.q1.exists():
        summary.update(json.loads(args.q1.read_text()))
    summary.update(quality_summary())
    bounds = resolve_bound_format(args.bound_format, KV_DTYPE_CHOICES[args.kv_dtype], args.page_bounds)
    config = {"shape": SHAPE.__dict__, "page_size": args.page_size, "budget": args.budget, "selector": args.selector, "kv_dtype": args.kv_dtype,
              "bound_format": bounds, "coarse_pages": args.coarse_pages, "coarse_candidates": args.coarse_candidates,
              "rerank_factor": args.rerank_factor, "rerank_by": args.rerank_by, "layers_per_graph": args.layers_per_graph,
              "page_bounds": args.page_bounds, "bound_spread": args.bound_spread, "versus_minmax": args.versus_minmax,
              "budget_share": args.budget_share, "reselect_interval": args.reselect_interval, "l2_flushed": True}  # fmt: skip
    name = (
        "decode-{date}"
        + ("" if args.kv_dtype == "bf16" else "-fp8")
        + ("" if args.bound_format == "auto" else f"-{bounds}-bounds")
        + ("" if args.selector == "quest" else f"-{args.selector}")
        + ("-vs-minmax" if args.versus_minmax else "")
    )
    name += f"-coarse{args.coarse_pages}" if args.coarse_pages else ""
    name += "-share" if args.budget_share else ""
    name += f"-rerank{args.rerank_factor}" if args.rerank_factor > 1 else ""
    name += f"-by-{args.rerank_by}" if args.rerank_factor > 1 and args.rerank_by != "keys" else ""
    name += f"-reselect{args.reselect_interval}" if args.reselect_interval > 1 else ""
    return finish_run(
        "benchmark.decode", argv, {"config": config, **result, "summary": summary}, args.out_dir, name + ".json"
    )


if __name__ == "__main__":
    main()
