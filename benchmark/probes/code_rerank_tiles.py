"""The quantized re-rank's two launches (``choose_by_codes``) alone, by tile: keys one program
decodes and dots at once, and its warps, at the decode benchmark's cells (Llama-3-8B shape,
budget 2,048 tokens, 2x candidates, random codes), timed as that benchmark times a step (a CUDA
graph's replays, L2 flushed, the median). Picks the tile the decode step uses
(docs/decisions, the quantized re-rank).

    python -m benchmark.probes.code_rerank_tiles --out code-rerank-tiles.json
"""

from __future__ import annotations

import argparse

import torch

from benchmark.decode import time_graph
from sparse_sglang.attention.rerank import choose_by_codes
from sparse_sglang.mem_cache.key_codes import PageKeyCodes
from sparse_sglang.testing.decode_setup import fill_codes_randomly
from sparse_sglang.testing.provenance import run_header, save_result

KV_HEADS, GROUP, HEAD_DIM, PAGE = 8, 4, 128, 32


def codes_case(context: int, batch: int, candidates: int, bits: int, kv_dtype: torch.dtype, gen: torch.Generator):
    """Random codes for every page of ``batch`` requests of ``context`` tokens, and each (request,
    kv head) row's ``candidates`` distinct pages."""
    pages = context // PAGE
    table = PageKeyCodes(1, KV_HEADS, batch * pages + 1, PAGE, HEAD_DIM, bits, kv_dtype, "cuda").layer(0)
    fill_codes_randomly(table, gen)
    host_pages = (1 + torch.arange(batch * pages, device="cuda", dtype=torch.int32)).view(batch, pages)
    order = torch.rand(batch * KV_HEADS, pages, generator=gen, device="cuda").argsort(dim=-1)
    cands = order[:, :candidates].to(torch.int32).view(batch, KV_HEADS, candidates)
    qg = torch.randn(batch, KV_HEADS, GROUP, HEAD_DIM, generator=gen, device="cuda").to(torch.bfloat16)
    num_pages = torch.full((batch,), pages, dtype=torch.int32, device="cuda")
    return qg, table, host_pages, cands, num_pages


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", default="131072x32,32768x8")
    parser.add_argument("--keys", default="32,64,128,256", help="keys per program")
    parser.add_argument("--warps", default="2,4,8")
    parser.add_argument("--bits", type=int, default=2)
    parser.add_argument("--kv-dtype", choices=("bf16", "fp8_e4m3"), default="bf16")
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    kv_dtype = torch.bfloat16 if args.kv_dtype == "bf16" else torch.float8_e4m3fn
    k = args.budget // PAGE
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for cell in args.cells.split(","):
        context, batch = map(int, cell.split("x"))
        qg, table, host_pages, cands, num_pages = codes_case(context, batch, 2 * k, args.bits, kv_dtype, gen)
        want = None
        for keys in map(int, args.keys.split(",")):
            for warps in map(int, args.warps.split(",")):

                def choose(keys=keys, warps=warps):
                    return choose_by_codes(qg, table, args.bits, host_pages, cands, num_pages, k, (1, 2), 0.088,
                                           keys_per_program=keys, num_warps=warps)  # fmt: skip

                got = choose().sort(dim=-1).values
                want = got if want is None else want
                row = {"context": context, "batch": batch, "keys_per_program": keys, "num_warps": warps,
                       "us": round(1000 * time_graph(choose, args.iters), 1), "same_choice": bool(torch.equal(got, want))}  # fmt: skip
                rows.append(row)
                print(row, flush=True)
    best = {}
    for row in rows:
        cell = f"{row['context']}x{row['batch']}"
        if cell not in best or row["us"] < best[cell]["us"]:
            best[cell] = row
    default = {
        f"{r['context']}x{r['batch']}": r["us"] for r in rows if r["keys_per_program"] == 128 and r["num_warps"] == 4
    }
    summary = {"default_tile_us": default, "best": best, "same_choice_everywhere": all(r["same_choice"] for r in rows)}
    result = {**run_header("benchmark.probes.code_rerank_tiles", argv), "bits": args.bits, "kv_dtype": args.kv_dtype,
              "budget": args.budget, "rows": rows, "summary": summary}  # fmt: skip
    if args.out:
        save_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
