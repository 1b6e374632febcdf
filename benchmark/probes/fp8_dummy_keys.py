"""Keys of a dummy-weight model in FP8 KV (CPU): why the fp8 serving runs' selections churned.

The serving benchmark runs the Llama-3-8B shape with ``--load-format dummy``: SGLang's
``initialize_dummy_weights`` fills every weight, RMSNorm weights included, uniformly in
[-1e-3, 1e-3]. A layer's key is ``k_proj(RMSNorm(x))``, and RMSNorm gives ``x`` unit RMS whatever its
scale, so every layer's keys are ~(1e-3 x 1e-3 x sqrt(4096)), far below e4m3's smallest subnormal
(2^-9). With ``--kv-cache-dtype fp8_e4m3`` and no calibrated scale (1.0, as for dummy weights) every
key is stored as 0: every page has the same (zero) min/max summary, every page scores the same, and
the top-k picks among ties, differently from step to step. This builds the key path of one layer
with the 8B shape's sizes, initializes it with SGLang's own ``initialize_dummy_weights``, and
counts the keys that survive the cast.

A fair fp8 run needs what an fp8 checkpoint ships: calibrated per-tensor KV scales (stored =
value / scale). This also writes them, in the JSON SGLang's ``--quantization-param-path`` reads:
``scale = HEADROOM * sqrt(2) * amax / 448`` (e4m3's largest value), ``amax`` the largest |key| seen
here, ``sqrt(2)`` the most RoPE's rotation of a pair can raise one coordinate. The values of a
dummy layer are the same in distribution (SGLang draws V's weights like K's), so one scale serves
K, V and every layer; anything beyond the range saturates (``SparseKVStore.to_store_dtype``).

    python benchmark/probes/fp8_dummy_keys.py        # a few seconds

Writes ``benchmark/results/fp8-dummy-keys-<date>.json`` and ``benchmark/kv-scales-llama3-8b-dummy.json``
(the serving benchmark's fp8 runs pass it: ``--kv-cache-dtype fp8_e4m3 --quantization-param-path ...``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from sparse_sglang.testing.models import LLAMA3_8B_CONFIG  # noqa: E402
from sparse_sglang.testing.provenance import finish_run  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SCALES_PATH = REPO / "benchmark" / "kv-scales-llama3-8b-dummy.json"
HEADROOM = 2.0  # over the largest key seen, beyond RoPE's sqrt(2)
E4M3_MAX = 448.0


class KeyPath(torch.nn.Module):
    """Embedding -> RMSNorm -> k_proj of the 8B shape (a small vocabulary: the values SGLang's
    dummy init draws depend only on each parameter's size and dtype, not on the model)."""

    def __init__(self, vocab: int):
        super().__init__()
        c = LLAMA3_8B_CONFIG
        hidden, kv = c["hidden_size"], c["num_key_value_heads"] * c["head_dim"]
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.norm = torch.nn.RMSNorm(hidden, eps=c["rms_norm_eps"])
        self.k_proj = torch.nn.Linear(hidden, kv, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.k_proj(self.norm(self.embed(ids)))


def main(argv: list[str] | None = None) -> dict:
    from sglang.srt.model_loader.weight_utils import initialize_dummy_weights

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--out-dir", type=Path, default=REPO / "benchmark" / "results")
    parser.add_argument(
        "--scales-out",
        type=Path,
        default=SCALES_PATH,
        help="where to write the calibrated KV scales (SGLang's --quantization-param-path JSON)",
    )
    args = parser.parse_args(argv)
    model = KeyPath(vocab=args.tokens).to(torch.bfloat16)
    initialize_dummy_weights(model)
    with torch.no_grad():
        keys = model(torch.arange(args.tokens)).float()
    stored = keys.to(torch.float8_e4m3fn).float()
    smallest = torch.tensor(1, dtype=torch.uint8).view(torch.float8_e4m3fn).float().item()  # 2^-9
    amax = keys.abs().max().item()
    scale = HEADROOM * math.sqrt(2) * amax / E4M3_MAX
    scaled = (keys / scale).to(torch.float8_e4m3fn).float() * scale
    write_scales(args.scales_out, scale, LLAMA3_8B_CONFIG["num_hidden_layers"])
    summary = {
        "key_abs_mean": keys.abs().mean().item(),
        "key_abs_max": amax,
        "e4m3_smallest_subnormal": smallest,
        "fp8_e4m3_nonzero_key_fraction": (stored != 0).float().mean().item(),
        "norm_weight_abs_mean": model.norm.weight.float().abs().mean().item(),
        "calibrated_scale": scale,
        "calibrated_nonzero_key_fraction": (scaled != 0).float().mean().item(),
        "calibrated_key_rel_err": ((scaled - keys).norm() / keys.norm()).item(),
        "scales_file": str(args.scales_out.relative_to(REPO))
        if args.scales_out.is_relative_to(REPO)
        else str(args.scales_out),
    }
    return finish_run("benchmark/probes/fp8_dummy_keys.py", argv, {"summary": summary}, args.out_dir,
                      "fp8-dummy-keys-{date}.json", device="cpu")  # fmt: skip


def write_scales(path: Path, scale: float, num_layers: int) -> None:
    """One scale for K and V of every layer, in the schema SGLang's ``kv_cache_scales_loader`` validates
    (TP rank -> layer -> scale; SGLang sets a layer's K and V scale from the one number)."""
    body = {"model_type": LLAMA3_8B_CONFIG["model_type"],
            "kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {0: {layer: scale for layer in range(num_layers)}}}}  # fmt: skip
    path.write_text(json.dumps(body, indent=1) + "\n")


if __name__ == "__main__":
    main()
