"""Access to the native extensions in ``sgl_kernels_ext`` (compiled on first use)."""

from __future__ import annotations

import sys
from pathlib import Path


def _build_module():
    try:
        from sgl_kernels_ext import build
    except ModuleNotFoundError:  # PYTHONPATH=python only: sgl_kernels_ext sits at the repo root
        root = Path(__file__).resolve().parents[3]
        if not (root / "sgl_kernels_ext" / "build.py").is_file():
            raise
        sys.path.append(str(root))
        from sgl_kernels_ext import build
    return build


def host_ext():
    """The host extension (``ScatterPool``, ``alloc_pinned``, ``cuda_view_of_host``)."""
    return _build_module().load_host_ext()


def cuda_ext():
    """The CUDA extension (``flash_h2d``, ``direct_d2h``, ``copy_blocks_memcpy``)."""
    return _build_module().load_cuda_ext()
