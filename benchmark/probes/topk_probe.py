"""Probe: how fast is a radix top-k in one Triton program per row, against the top-k the decoder uses?

The batch-1 sparse step spends ~8 us (32K) to ~11 us (128K) in FlashInfer's top-k over 8 rows of
1,024 or 4,096 page priorities. A top-k that one program per row can run would fit at the tail of
the score launch (the last of a row's programs to finish scoring selects), removing a launch. A
bitonic `tl.topk` per row measured 15.5 and 74 us at best (docs/decisions/0001, which this probe's
answer settled); this probes a radix select instead: four passes of a 256-bin histogram over the
priorities' order-preserving 32-bit codes find the K-th largest exactly, then one prefix sum places
the picks (ties at the threshold to the lower pages).

Each timing is a CUDA-graph replay of ``--reps`` top-ks over distinct priority buffers, L2 flushed
before each replay (as ``benchmark/decode.py`` times); the picks are checked against ``torch.topk``
first (the same priority multiset per row). Writes ``benchmark/results/topk-probe-<date>.json``::

    python benchmark/probes/topk_probe.py          # GPU; needs torch and triton only (FlashInfer if present)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "python")]
from benchmark.decode import time_graph  # noqa: E402 (imports neither SGLang nor FlashInfer)


@triton.jit
def _radix_topk_kernel(prio_ptr, lengths_ptr, out_ptr, stride, K: tl.constexpr, NP: tl.constexpr):
    # One program: the K largest of a row's first lengths[row] priorities, ascending page order, -1 padded.
    row = tl.program_id(0)
    n = tl.load(lengths_ptr + row)
    j = tl.arange(0, NP)
    held = j < n
    bits = tl.load(prio_ptr + row.to(tl.int64) * stride + j, mask=held, other=0.0).to(tl.int32, bitcast=True)
    # Float order as unsigned order: flip every bit of a negative, the sign bit of the rest.
    code = tl.where(bits >= 0, bits ^ (-2147483648), ~bits).to(tl.uint32, bitcast=True)
    want = tl.minimum(n, K)
    prefix = tl.zeros([], dtype=tl.uint32)  # the K-th largest code, 8 bits a pass
    remaining = want  # picks still to make among codes matching prefix
    for p in tl.static_range(4):
        shift = 24 - 8 * p
        if p == 0:
            match = held
        else:
            match = held & ((code >> (shift + 8)) == (prefix >> (shift + 8)))
        digit = ((code >> shift) & 255).to(tl.int32)
        hist = tl.histogram(digit, 256, mask=match)
        # at_least[d]: matching codes whose digit is >= d
        at_least = tl.sum(hist) - tl.cumsum(hist, axis=0) + hist
        d = tl.arange(0, 256)
        top = tl.max(tl.where(at_least >= remaining, d, -1), axis=0)
        above = tl.sum(tl.where(d > top, hist, 0), axis=0)
        remaining -= above
        prefix = prefix | (top.to(tl.uint32) << shift)
    take = held & (
        (code > prefix) | ((code == prefix) & (tl.cumsum((held & (code == prefix)).to(tl.int32), axis=0) <= remaining))
    )
    take = take & (want > 0)
    pos = tl.cumsum(take.to(tl.int32), axis=0) - 1
    tl.store(out_ptr + row * K + pos, j, mask=take)
    k = tl.arange(0, NP)
    tl.store(out_ptr + row * K + k, tl.full([NP], -1, tl.int32), mask=(k >= want) & (k < K))


def radix_topk(priority: torch.Tensor, lengths: torch.Tensor, k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``[rows, k]`` int32: each row's ``k`` highest priorities among its first ``lengths[row]``,
    ascending, ``-1`` padded (``priority`` ``[rows, N]`` float32, contiguous rows)."""
    rows, length = priority.shape
    if out is None:
        out = torch.empty(rows, k, dtype=torch.int32, device=priority.device)
    np_ = max(triton.next_power_of_2(length), 256)
    assert k <= np_, "k above the row's register tile"
    _radix_topk_kernel[(rows,)](
        priority, lengths, out, priority.stride(0), K=k, NP=np_, num_warps=8 if np_ >= 2048 else 4
    )
    return out


def check(gen: torch.Generator, device: str) -> None:
    """The picks hold each row's top-k multiset (torch.topk's values), forced +inf pages and ties included."""
    rows, length, k = 12, 1500, 64
    prio = torch.randn(rows, length, device=device, generator=gen)
    prio[:, 0] = prio[:, -2:] = float("inf")
    prio[1, 100:300] = 0.25  # a tie across the threshold
    prio[2] = 1.0  # all tied
    prio[3, :] = -torch.rand(length, device=device, generator=gen)  # all negative
    lengths = torch.full((rows,), length, dtype=torch.int32, device=device)
    lengths[4], lengths[5] = 40, 64  # fewer pages than k, exactly k
    got = radix_topk(prio, lengths, k)
    for r in range(rows):
        n = int(lengths[r])
        ids = got[r][got[r] >= 0].long()
        assert len(ids) == min(n, k) and (ids < n).all() and len(set(ids.tolist())) == len(ids), r
        assert torch.equal(ids, ids.sort().values), r
        want = prio[r, :n].topk(min(n, k)).values.sort().values
        assert torch.equal(prio[r, ids].sort().values, want), r


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--rows", type=int, nargs="+", default=[8, 64, 256], help="(request, kv head) rows: batch 1, 8, 32"
    )
    parser.add_argument("--pages", type=int, nargs="+", default=[1025, 4097], help="pages a row: 32K and 128K contexts")
    parser.add_argument("--k", type=int, default=64)
    parser.add_argument("--reps", type=int, default=4, help="top-ks in one timed graph (distinct buffers)")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--out-dir", type=Path, default=REPO / "benchmark" / "results")
    args = parser.parse_args(argv)
    gen = torch.Generator(device="cuda").manual_seed(0)
    check(gen, "cuda")
    try:
        import flashinfer
    except ImportError:
        flashinfer = None
    results = []
    for pages in args.pages:
        for rows in args.rows:
            prios = [torch.randn(rows, pages, device="cuda", generator=gen) for _ in range(args.reps)]
            lengths = torch.full((rows,), pages, dtype=torch.int32, device="cuda")
            offsets = torch.zeros(rows, dtype=torch.int32, device="cuda")
            outs = [torch.empty(rows, args.k, dtype=torch.int32, device="cuda") for _ in prios]
            impls = {
                "radix_triton": lambda: [radix_topk(p, lengths, args.k, o) for p, o in zip(prios, outs)],
                "torch": lambda: [torch.topk(p, args.k, dim=-1, sorted=False) for p in prios],
            }
            if flashinfer is not None:
                impls["flashinfer"] = lambda: [
                    flashinfer.top_k_ragged_transform(p, offsets, lengths, args.k) for p in prios
                ]
            row = {"rows": rows, "pages": pages, "k": args.k}
            for name, fn in impls.items():
                row[f"{name}_us"] = time_graph(fn, args.iters, per=args.reps) * 1e3
            print(json.dumps(row), flush=True)
            results.append(row)
    from sparse_sglang.testing.provenance import finish_run

    summary = {
        f"{r['pages']}p_x{r['rows']}": {k: round(v, 1) for k, v in r.items() if k.endswith("_us")} for r in results
    }
    return finish_run("benchmark/probes/topk_probe.py", argv, {"rows": results, "summary": summary}, args.out_dir,
                      "topk-probe-{date}.json")  # fmt: skip


if __name__ == "__main__":
    main()
