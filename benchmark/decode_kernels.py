"""Launch choices of the sparse decode step's kernels, each timed on the GPU: the measurements
behind the launch rules in ``attention/scoring.py`` and ``attention/sparse_decode.py``.

For each context (8K/32K/128K) and batch (1/8/32), one layer of the Llama-3-8B shape, budget 2048,
graph replays with L2 flushed as in ``benchmark/decode.py`` (``--layers-per-graph`` layers a graph):

- **score**: the score kernel (quest, forced pages, rows left unwritten past each request's pages
  as the decoder runs it) at every ``--block-n`` x ``--warps`` x ``--programs`` choice;
- **attention**: FlashInfer's paged decode over the selected pages, and the whole all-hit step,
  with its tensor-core kernel and with its CUDA-core one, and with ``--xqa`` (fp8 KV, Hopper
  and newer) XQA's (``--sparse-decode-kernel xqa``); with the bandwidth the attention reaches
  (the selected pages' K and V bytes over its time), which says how far a faster kernel could
  take the step.

Writes ``benchmark/results/decode-kernels-<date>.json`` (``--kv-dtype fp8_e4m3``: the serving
flags' KV; a serving server's batch, e.g. ``--contexts 32768 --batches 80``, and one score
launch, ``--block-n 32 --warps 4 --programs 2048``, time what a loaded server's step runs)::

    python -m benchmark.decode_kernels
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import json

import torch

from benchmark.decode import KV_DTYPE_CHOICES, SHAPE, add_grid_args, layers_for, time_graph
from benchmark.transfer import gbps
from sparse_sglang.attention import scoring
from sparse_sglang.attention.scoring import score_pages
from sparse_sglang.config import SparseConfig
from sparse_sglang.testing.decode_setup import DecodeBench, Llama8BShape, make_store
from sparse_sglang.testing.provenance import finish_run


def score_times(b: DecodeBench, plan, q: torch.Tensor, layers: int, args) -> dict[str, float]:
    d = b.decoder
    qg = q.view(b.batch, d.num_kv_heads, d.group, d.head_dim)
    out = {}
    default_programs = scoring.SCORE_PROGRAMS
    try:
        for block_n, warps, programs in itertools.product(args.block_n, args.warps, args.programs):
            scoring.SCORE_PROGRAMS = programs

            def score(block_n=block_n, warps=warps):
                for layer in range(layers):
                    score_pages(d.selector, qg, b.store.summaries.layer(layer), b.host_pages, plan.num_pages,
                                forced=d.forced, fill_tail=False, block_n=block_n, num_warps=warps)  # fmt: skip

            out[f"block{block_n}_warps{warps}_programs{programs}"] = time_graph(score, args.iters, per=layers) * 1e3
    finally:
        scoring.SCORE_PROGRAMS = default_programs
    return out


def attended_bytes(store, batch: int, budget: int) -> int:
    """K and V bytes one layer's attention reads over the selected pages: ``budget`` tokens of
    every request and kv head."""
    shape = store.shape
    return batch * shape.num_kv_heads * budget * shape.head_dim * 2 * shape.dtype.itemsize


def attention_kernels(with_xqa: bool) -> list[tuple[str, str, bool]]:
    """(name, ``--sparse-decode-kernel``, FlashInfer tensor cores) of each attention kernel timed:
    FlashInfer's two, and with ``--xqa`` XQA's."""
    kernels = [("tensor_cores", "flashinfer", True), ("cuda_cores", "flashinfer", False)]
    return kernels + [("xqa", "xqa", True)] if with_xqa else kernels


def attention_times(store, config, batch: int, context: int, workspace, q, layers: int, args) -> dict[str, float]:
    out = {}
    for name, kernel, tensor_cores in attention_kernels(args.xqa):
        b = DecodeBench(store, dataclasses.replace(config, decode_kernel=kernel), SHAPE.num_q_heads, batch, context,
                        workspace, use_tensor_cores=tensor_cores)  # fmt: skip
        plan = b.plan()
        d = b.decoder

        def step():
            for layer in range(layers):
                d.run(layer, q, plan)

        step()  # the cache is warm from here on, and the indices hold the selection
        qs = q.reshape(batch * d.num_kv_heads, d.group, d.head_dim)

        def attend():
            for _ in range(layers):
                plan.wrapper.run(qs, d.kv)  # planned with the decoder's scale

        out[f"attention_{name}_us"] = time_graph(attend, args.iters, per=layers) * 1e3
        out[f"attention_{name}_gbps"] = gbps(
            attended_bytes(store, batch, args.budget), out[f"attention_{name}_us"] / 1e6
        )
        out[f"step_{name}_us"] = time_graph(step, args.iters, per=layers) * 1e3
    return out


def run(args) -> list[dict]:
    config = SparseConfig(token_budget=args.budget, host_cache_gb=1.0)
    workspace = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for context in args.contexts:
        for batch in args.batches:
            layers = layers_for(batch, context, max(args.batches), args.layers_per_graph)
            store = make_store(
                Llama8BShape(num_layers=layers), config, batch, context, dtype=KV_DTYPE_CHOICES[args.kv_dtype]
            )
            b = DecodeBench(store, config, SHAPE.num_q_heads, batch, context, workspace)
            b.fill_summaries_randomly(gen)
            plan = b.plan()
            q = torch.randn(batch, SHAPE.num_q_heads, SHAPE.head_dim, device="cuda", dtype=torch.bfloat16)
            row = {
                "context": context,
                "batch": batch,
                "layers": layers,
                "score_us": score_times(b, plan, q, layers, args),
            }
            row.update(attention_times(store, config, batch, context, workspace, q, layers, args))
            best = min(row["score_us"], key=row["score_us"].get)
            row["score_best"] = best
            print(
                json.dumps(
                    {k: v for k, v in row.items() if k != "score_us"} | {"score_best_us": row["score_us"][best]}
                ),
                flush=True,
            )
            rows.append(row)
            store.close()
            b = store = None
            gc.collect()
            torch.cuda.empty_cache()
    return rows


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_grid_args(parser)
    parser.add_argument("--kv-dtype", choices=sorted(KV_DTYPE_CHOICES), default="bf16")
    parser.add_argument("--block-n", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--warps", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--programs", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--xqa", action="store_true", help="time XQA's attention too (fp8_e4m3 KV; Hopper and newer)")
    args = parser.parse_args(argv)
    if args.xqa and args.kv_dtype != "fp8_e4m3":
        parser.error("--xqa attends fp8 KV only: add --kv-dtype fp8_e4m3")
    rows = run(args)
    summary = {f"{r['context'] // 1024}k_b{r['batch']}": {
        "score_best": r["score_best"], "score_best_us": r["score_us"][r["score_best"]],
        "score_default_us": r["score_us"].get("block{}_warps{}_programs{}".format(*scoring.score_launch(), scoring.SCORE_PROGRAMS)),
        "attention_tensor_cores_us": r["attention_tensor_cores_us"], "attention_cuda_cores_us": r["attention_cuda_cores_us"],
        "attention_tensor_cores_gbps": r["attention_tensor_cores_gbps"], "attention_cuda_cores_gbps": r["attention_cuda_cores_gbps"],
        "step_tensor_cores_us": r["step_tensor_cores_us"], "step_cuda_cores_us": r["step_cuda_cores_us"],
        **{k: r[k] for k in ("attention_xqa_us", "attention_xqa_gbps", "step_xqa_us") if k in r},
    } for r in rows}  # fmt: skip
    config = {"shape": SHAPE.__dict__, "page_size": 32, "budget": args.budget, "selector": "quest", "kv_dtype": args.kv_dtype,
              "layers_per_graph": args.layers_per_graph, "l2_flushed": True}  # fmt: skip
    return finish_run("benchmark.decode_kernels", argv, {"config": config, "rows": rows, "summary": summary},
                      args.out_dir, "decode-kernels-{date}.json")  # fmt: skip


if __name__ == "__main__":
    main()
