"""Build-on-first-use loaders for the native extensions, one cached loader per extension.

Each extension is compiled with ``torch.utils.cpp_extension.load`` into
``$SPARSE_SGLANG_KERNEL_CACHE`` (else ``$TORCH_EXTENSIONS_DIR/sparse-sglang``, else
``~/.cache/sparse-sglang/kernels``) under a directory named by a hash of the sources, flags,
torch/CUDA versions and GPU arch, so a rebuild happens only when one of those changes. The arch
is ``$TORCH_CUDA_ARCH_LIST`` if set, else the visible GPUs' compute capabilities, else ``9.0``
(Hopper), so compiling works on a machine without a GPU.

``python -m sgl_kernels_ext.build`` builds both verbosely (nvcc's ``-Xptxas -v`` register and
spill report included); ``SPARSE_SGLANG_KERNEL_VERBOSE=1`` does the same on first use.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import os
import shutil
import sys
import threading
from pathlib import Path

import torch

CSRC = Path(__file__).resolve().parent / "csrc"
HOST_SOURCES = ("host_ops.cpp", "flash_d2h.cpp")
CUDA_SOURCES = ("cuda_ops.cpp", "flash_h2d.cu", "direct_d2h.cu")
CFLAGS = ["-O3", "-std=c++17", "-pthread"]
CUDA_CFLAGS = ["-O3", "-std=c++17", "-Xptxas=-v"]
_lock = threading.Lock()


def cache_root() -> Path:
    if os.environ.get("SPARSE_SGLANG_KERNEL_CACHE"):
        return Path(os.environ["SPARSE_SGLANG_KERNEL_CACHE"])
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"]) / "sparse-sglang"
    return Path.home() / ".cache" / "sparse-sglang" / "kernels"


def cuda_arch_list() -> str:
    """``TORCH_CUDA_ARCH_LIST`` to build for: the env var, the visible GPUs, or ``9.0``."""
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return os.environ["TORCH_CUDA_ARCH_LIST"]
    if torch.cuda.is_available():
        caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
        return ";".join(f"{major}.{minor}" for major, minor in sorted(caps))
    return "9.0"


@functools.cache
def cuda_home() -> str | None:
    """The CUDA toolkit to build with: ``$CUDA_HOME``/``$CUDA_PATH``, the one ``nvcc`` sits in,
    ``/usr/local/cuda``, or a versioned ``/usr/local/cuda-X.Y`` (torch's own CUDA version first).
    torch's guess from ``which nvcc`` is wrong where ``nvcc`` is a wrapper script."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    if shutil.which("nvcc"):
        candidates.append(str(Path(shutil.which("nvcc")).resolve().parents[1]))
    candidates.append("/usr/local/cuda")
    versioned = sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    candidates += sorted(versioned, key=lambda p: not p.endswith(f"-{torch.version.cuda}"))
    for home in filter(None, candidates):
        if (Path(home) / "include" / "cuda_runtime_api.h").is_file() and (Path(home) / "bin" / "nvcc").exists():
            return home
    return None


def host_has_cuda() -> bool:
    """Whether this torch build and machine can compile against the CUDA runtime."""
    return torch.version.cuda is not None and cuda_home() is not None


def _load(name: str, sources: tuple[str, ...], with_cuda: bool, cflags: list[str], cuda_cflags: list[str]):
    from torch.utils import cpp_extension

    arch = cuda_arch_list() if with_cuda else ""
    key = hashlib.sha256()
    for part in (name, arch, torch.__version__, str(torch.version.cuda), sys.version, *cflags, *cuda_cflags):
        key.update(part.encode() + b"\0")
    for path in sorted({*(CSRC / s for s in sources), *CSRC.glob("*.h")}):
        key.update(path.name.encode() + b"\0" + path.read_bytes())
    digest = key.hexdigest()[:16]
    build_dir = cache_root() / f"{name}-{digest}"
    build_dir.mkdir(parents=True, exist_ok=True)
    verbose = os.environ.get("SPARSE_SGLANG_KERNEL_VERBOSE") == "1"
    saved = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if with_cuda:
        os.environ["TORCH_CUDA_ARCH_LIST"] = arch
        os.environ["CUDA_HOME"] = cpp_extension.CUDA_HOME = cuda_home()
    try:
        return cpp_extension.load(
            name=f"{name}_{digest}",
            sources=[str(CSRC / s) for s in sources],
            extra_cflags=cflags,
            extra_cuda_cflags=cuda_cflags,
            extra_ldflags=["-pthread"],
            build_directory=str(build_dir),
            with_cuda=with_cuda,
            verbose=verbose,
        )
    finally:
        if saved is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = saved


@functools.cache
def load_host_ext():
    """The host extension: ``ScatterPool`` (FlashD2H's CPU scatter), ``alloc_pinned``, ``cuda_view_of_host``.

    Plain C++ (no nvcc); it links the CUDA runtime when torch has CUDA, and otherwise builds
    without it (``with_cuda`` False: no events, no pinned memory, the scatter still works).
    """
    with_cuda = host_has_cuda()
    flags = CFLAGS + (["-DSPARSE_WITH_CUDA"] if with_cuda else [])
    with _lock:
        return _load("sparse_transfer_host", HOST_SOURCES, with_cuda, flags, [])


@functools.cache
def load_cuda_ext():
    """The CUDA extension: ``flash_h2d``, ``direct_d2h`` and the ``copy_blocks_memcpy`` baseline."""
    if not host_has_cuda():
        raise RuntimeError("sparse-sglang CUDA kernels need a CUDA build of torch and nvcc (CUDA_HOME)")
    with _lock:
        return _load("sparse_transfer_cuda", CUDA_SOURCES, True, CFLAGS, CUDA_CFLAGS)


if __name__ == "__main__":
    os.environ["SPARSE_SGLANG_KERNEL_VERBOSE"] = "1"
    print(load_host_ext(), load_cuda_ext(), sep="\n")
