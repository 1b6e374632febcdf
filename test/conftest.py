"""Test-wide settings: ``gpu``-marked tests skip where torch sees no CUDA device, and there
Triton kernels run in Triton's interpreter (on CPU tensors), so their CPU tests check the real
kernel code against the torch references."""

from __future__ import annotations

import os

import pytest


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU host: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


if not _cuda_available():
    # Read when a kernel is decorated: before any test module imports one.
    os.environ.setdefault("TRITON_INTERPRET", "1")
