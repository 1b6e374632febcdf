"""FlashInfer's decode plan, without a Python loop over its rows.

``BatchDecodeWithPagedKVCacheWrapper.plan`` (in its ``_plan_impl``, on the tensor-core path the
sparse decoder plans every step) takes the longest KV with Python's builtin ``max`` over a host
tensor of one length per row: an iteration of the tensor, two torch ops per row. The sparse
decoder plans a row per (request, KV head), so a batch of 150 requests with 4 heads per rank is
600 rows, and that loop runs on the host thread that prepares the next step while the GPU runs
this one (SGLang's overlap scheduler): long enough to leave the GPU idle between decode steps.

The decode module's ``max`` becomes :func:`tensor_aware_max`: the same value, taken with one
reduction for a 1-D tensor, Python's ``max`` for everything else. FlashInfer itself is unchanged.
"""

from __future__ import annotations

import builtins

import torch

from sparse_sglang.integration.registry import relies_on


def tensor_aware_max(*args, **kwargs):
    """Python's ``max``, except that ``max(t)`` for one non-empty 1-D tensor is ``t.max()`` (the
    same value as a 0-d tensor, which ``.item()`` and comparisons read as the builtin's)."""
    if len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor) and args[0].dim() == 1:
        if args[0].numel():
            return args[0].max()
    return builtins.max(*args, **kwargs)


@relies_on("flashinfer.decode:BatchDecodeWithPagedKVCacheWrapper._plan_impl", at="flashinfer/decode.py:1349")
def patch_flashinfer_decode_max() -> None:
    """Shadow the builtin ``max`` in ``flashinfer.decode`` with :func:`tensor_aware_max` (idempotent)."""
    import flashinfer.decode

    flashinfer.decode.max = tensor_aware_max
