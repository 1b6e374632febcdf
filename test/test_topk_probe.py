"""The radix top-k probe (``benchmark/probes/topk_probe.py``) picks each row's top k, as ``torch.topk``.

Without CUDA the kernel runs in Triton's interpreter (``test/conftest.py``); on the GPU host the
probe checks itself the same way before it times anything.
"""

from __future__ import annotations

import torch

from benchmark.probes.topk_probe import check


def test_radix_topk_picks_each_rows_top_k():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    check(torch.Generator(device=device).manual_seed(1), device)
