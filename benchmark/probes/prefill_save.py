"""What saving prefill KV into the hierarchy adds to a 32K-token prefill of the Llama-3-8B shape.

The prefill is the 8B shape's 32 layers in bf16 over one 32,768-token prompt: RMSNorm, QKV
projection, causal GQA attention (FlashInfer's ragged prefill, as the ``sparse`` backend runs it),
output projection, RMSNorm and the SwiGLU MLP. One layer's random weights serve every layer (the
same work as 32 distinct layers, 0.4 instead of 14 GiB). Three variants, timed end to end with
CUDA events in one process, median of ``--reps``:

- **base**: the prefill alone (what a GPU-resident KV pool costs, minus its KV write);
- **summaries**: each layer also does what :meth:`SparseKVStore.save` does on the GPU besides the
  host copy, :meth:`SparseKVStore.index` (one fused kernel: key min/max/mean per page and kv head,
  page-table lookup, write of the write-allocated pages); per forward also the host-side
  ``resize_request`` + ``write_allocate`` + :class:`SaveRuns` the backend runs before the layers;
- **full save**: the same with the host copy too (FlashD2H: one D2H copy per layer to pinned
  staging, scattered by CPU threads), waited for at the end, as the server does before it next
  reads the host store.

``summary_overhead_32k = summaries / base - 1`` (issue target: <= 0.05). Writes
``benchmark/results/transfer-<date>-prefill-save.json``::

    PYTHONPATH=python python benchmark/probes/prefill_save.py [--tokens 32768] [--reps 5]
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path

import torch

from sparse_sglang.config import SparseConfig
from sparse_sglang.mem_cache.kernels import SaveRuns
from sparse_sglang.testing.decode_setup import Llama8BShape, make_store
from sparse_sglang.testing.provenance import finish_run

REPO = Path(__file__).resolve().parents[2]
SHAPE = Llama8BShape(num_layers=32)
HIDDEN, INTERMEDIATE = 4096, 14336
TARGET = 0.05


class Llama8BPrefill:
    """32 layers of the 8B shape over one prompt; ``on_kv(layer, k, v)`` sees each layer's new K/V."""

    def __init__(self, tokens: int, workspace: torch.Tensor):
        import flashinfer

        s, dev, bf = SHAPE, "cuda", torch.bfloat16
        self.tokens = tokens
        qkv = (s.num_q_heads + 2 * s.num_kv_heads) * s.head_dim

        def weight(rows, cols):
            return (torch.randn(rows, cols, device=dev) / math.sqrt(cols)).to(bf)

        self.w_qkv, self.w_o = weight(qkv, HIDDEN), weight(HIDDEN, s.num_q_heads * s.head_dim)
        self.w_gate_up, self.w_down = weight(2 * INTERMEDIATE, HIDDEN), weight(HIDDEN, INTERMEDIATE)
        self.norm = torch.ones(HIDDEN, device=dev, dtype=bf)
        self.x = torch.randn(tokens, HIDDEN, device=dev).to(bf)
        self.attn = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend="fa2")
        indptr = torch.tensor([0, tokens], dtype=torch.int32, device=dev)
        self.attn.plan(indptr, indptr, s.num_q_heads, s.num_kv_heads, s.head_dim, causal=True, q_data_type=bf)

    def forward(self, on_kv=None) -> torch.Tensor:
        s, F = SHAPE, torch.nn.functional
        h = self.x
        q_size, kv_size = s.num_q_heads * s.head_dim, s.num_kv_heads * s.head_dim
        for layer in range(s.num_layers):
            y = F.rms_norm(h, (HIDDEN,), self.norm)
            q, k, v = (t.contiguous() for t in (y @ self.w_qkv.T).split([q_size, kv_size, kv_size], dim=-1))
            k = k.view(-1, s.num_kv_heads, s.head_dim)
            v = v.view(-1, s.num_kv_heads, s.head_dim)
            o = self.attn.run(q.view(-1, s.num_q_heads, s.head_dim), k, v)
            if on_kv is not None:
                on_kv(layer, k, v)
            h = h + o.reshape(-1, q_size) @ self.w_o.T
            gate, up = (F.rms_norm(h, (HIDDEN,), self.norm) @ self.w_gate_up.T).chunk(2, dim=-1)
            h = h + (F.silu(gate) * up) @ self.w_down.T
        return h


def time_ms(fn, reps: int) -> list[float]:
    fn()  # warm-up: kernel selection, first-touch of staging buffers
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def run(args) -> dict:
    tokens = args.tokens
    config = SparseConfig(host_cache_gb=1.0)
    store = make_store(SHAPE, config, max_batch=1, max_context=tokens)
    page = store.shape.page_size
    workspace = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    model = Llama8BPrefill(tokens, workspace)
    cache, slot = store.cache, 1
    num_pages = math.ceil(tokens / page)
    loc = torch.arange(page, page + tokens, device="cuda")  # host pages 1.. (page 0 is SGLang's padding)

    def begin_forward():
        # What SparseAttnBackend._begin_extend does for one new request, on the host.
        if cache.is_open(slot):
            cache.close_request(slot)
        cache.open_request(slot)
        cache.resize_request(slot, num_pages)
        cache.write_allocate(slot, 0, num_pages)
        store.bind_runs(SaveRuns.for_extend([slot], [0], [tokens], page, "cuda"))

    def gpu_side(layer, k, v):
        store.index(layer, loc, k.contiguous(), v.contiguous())

    def base():
        model.forward()

    def summaries():
        begin_forward()
        model.forward(gpu_side)

    def full_save():
        begin_forward()
        model.forward(lambda layer, k, v: store.save(layer, loc, k, v, staged=True))
        store.wait_saves()

    variants = {"base": base, "summaries": summaries, "full_save": full_save}
    times = {name: [] for name in variants}
    for _ in range(args.rounds):  # interleaved, so drift hits every variant alike
        for name, fn in variants.items():
            times[name] += time_ms(fn, args.reps)
    med = {name: statistics.median(t) for name, t in times.items()}
    spread = {name: (min(t), max(t)) for name, t in times.items()}
    for name in variants:
        print(
            f"{name:10} median {med[name]:8.1f} ms  (min {spread[name][0]:.1f}, max {spread[name][1]:.1f})", flush=True
        )
    store.close()
    return {
        "tokens": tokens,
        "times_ms": times,
        "median_ms": med,
        "row_width_pages": store.shape.row_width,
        "write_allocated_pages_per_head": min(num_pages, store.shape.row_width),
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out-dir", type=Path, default=REPO / "benchmark" / "results")
    args = parser.parse_args(argv)
    result = run(args)
    med = result["median_ms"]
    summary = {
        "summary_overhead_32k": med["summaries"] / med["base"] - 1,
        "full_save_overhead_32k": med["full_save"] / med["base"] - 1,
        "target": TARGET,
    }
    summary["target_met"] = summary["summary_overhead_32k"] <= TARGET
    shape = {**SHAPE.__dict__, "hidden": HIDDEN, "intermediate": INTERMEDIATE, "dtype": "bfloat16"}
    return finish_run("benchmark/probes/prefill_save.py", argv, {"shape": shape, **result, "summary": summary},
                          args.out_dir, "transfer-{date}-prefill-save.json")  # fmt: skip


if __name__ == "__main__":
    main()
