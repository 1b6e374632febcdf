"""FlashInfer's paged decode (tensor cores: the kernel the sparse decoder runs) against its XQA
kernel, alone, over the selected pages of a serving batch: 80 requests x 8 kv heads = 640 rows of
4 query heads (the Llama-3-8B shape), 64 random pages of 32 tokens per row (the 2,048-token
budget), head_dim 128, bf16 queries, fp8 and bf16 KV. Each kernel's time (ten launches a CUDA
graph, timed as the decode benchmark times a step: ``benchmark.decode.time_graph``) and its
largest difference from float32 attention over the same stored values: XQA's fp8 kernel rounds
the queries and probabilities to fp8 too. What ``--sparse-decode-kernel xqa`` stands on
(docs/decisions, the XQA decision).

    python -m benchmark.probes.xqa_attention --out xqa-attention.json
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmark.decode import time_graph
from sparse_sglang.testing.provenance import run_header, save_result

GROUP, HEAD_DIM, PAGE = 4, 128, 32


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=640, help="(request, kv head) rows")
    parser.add_argument("--pages", type=int, default=64, help="pages per row")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    import flashinfer
    from flashinfer.decode import xqa_batch_decode_with_kv_cache

    torch.manual_seed(0)
    rows, pages, dev = args.rows, args.pages, "cuda"
    pool = rows * pages + 256
    scale = HEAD_DIM**-0.5
    kv8 = (torch.randn(pool, 2, PAGE, 1, HEAD_DIM, device=dev) * 0.7).to(torch.float8_e4m3fn)
    kv16 = kv8.to(torch.bfloat16)  # the same values in bf16
    table = torch.randperm(pool, device=dev)[: rows * pages].view(rows, pages).int().contiguous()
    q = torch.randn(rows, GROUP, HEAD_DIM, device=dev).to(torch.bfloat16)
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)

    sample = list(range(0, rows, 37))  # float32 attention over these rows' pages
    want = []
    for r in sample:
        k, v = (kv16[table[r].long(), i].float().reshape(-1, HEAD_DIM) for i in (0, 1))
        want.append(torch.softmax((q[r].float() @ k.T) * scale, -1) @ v)
    want = torch.stack(want)

    indptr = torch.arange(rows + 1, device=dev, dtype=torch.int32) * pages
    last = torch.full((rows,), PAGE, device=dev, dtype=torch.int32)
    tokens = torch.full((rows,), pages * PAGE, device=dev, dtype=torch.int32).view(torch.uint32)

    def flashinfer_decode(kv):
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
        wrapper.plan(indptr, table.flatten(), last, GROUP, 1, HEAD_DIM, PAGE, q_data_type=torch.bfloat16,
                     kv_data_type=kv.dtype, sm_scale=scale)  # fmt: skip
        return lambda: wrapper.run(q, kv)

    def xqa(kv):
        scratch = torch.zeros(16 << 20, dtype=torch.uint8, device=dev)
        return lambda: xqa_batch_decode_with_kv_cache(q, kv, scratch, table, tokens, pages * PAGE, bmm1_scale=scale)

    result_rows = []
    for name, make, kv in (("flashinfer", flashinfer_decode, kv8), ("xqa", xqa, kv8),
                           ("flashinfer", flashinfer_decode, kv16), ("xqa", xqa, kv16)):  # fmt: skip
        started = time.time()
        fn = make(kv)
        out = fn()
        torch.cuda.synchronize()
        row = {"kernel": name, "kv_dtype": "fp8_e4m3" if kv is kv8 else "bf16",
               "first_call_s": round(time.time() - started, 1),
               "us": round(time_graph(lambda: [fn() for _ in range(10)], args.iters, per=10) * 1e3, 1),
               "max_abs_error": (out[sample].float() - want).abs().max().item()}  # fmt: skip
        row["gbps"] = round(rows * pages * PAGE * HEAD_DIM * 2 * kv.element_size() / row["us"] / 1e3, 1)
        result_rows.append(row)
        print(row, flush=True)
    us = {(r["kernel"], r["kv_dtype"]): r["us"] for r in result_rows}
    summary = {"xqa_fp8_speedup": round(us["flashinfer", "fp8_e4m3"] / us["xqa", "fp8_e4m3"], 2),
               "xqa_bf16_speedup": round(us["flashinfer", "bf16"] / us["xqa", "bf16"], 2),
               "output_abs_max": want.abs().max().item()}  # fmt: skip
    result = {**run_header("benchmark.probes.xqa_attention", argv), "rows": rows, "pages": pages,
              "group": GROUP, "head_dim": HEAD_DIM, "page_size": PAGE, "runs": result_rows, "summary": summary}  # fmt: skip
    if args.out:
        save_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
