"""Build the FlashInfer modules the GPU runs need on a CPU machine, for the offline GPU host.

FlashInfer compiles its kernels on first use (JIT), a minute or two of a GPU session that starts
cold each time. FlashInfer also loads a module from ``<flashinfer>/data/aot/<name>/<name>.so``
when that file exists, without compiling; this script builds those files here (for sm_90a, the
H100/H200) so a device call only copies them in::

    python tools/flashinfer_aot.py .gpu-carry/aot           # here, about 15 minutes on 2 cores
    python tools/flashinfer_aot.py .gpu-carry/aot --head-dim 64     # SmolLM2's modules, beside them (about 25 minutes)
    # on the GPU host, after installing flashinfer into /tmp/site:
    for d in .gpu-carry/aot/*; do mkdir -p /tmp/site/flashinfer/data/aot/$(basename $d); cp $d/*.so $_; done

Modules: the fa2 batch-prefill module for bf16 and head_dim 128 (FlashInfer's tensor-core decode,
which the sparse decoder runs for the 8B shape, and the prefill benchmark's ragged attention), the
fa3 one (SGLang's ragged prefill and the prefix staging on Hopper), the fa2 one for fp8 KV (the
serving runs' paged attention on fp8 pages), the single-request decode (the
GPU tests' dense reference) and the radix top-k. A module that fails to load there is simply
compiled there as usual. Two gaps of a CPU machine's CUDA toolkit are bridged: the curand headers
come from the ``nvidia-*`` wheels, and ``libcuda`` (the driver) is linked against a stub with its
soname, which the GPU host's driver satisfies at load time.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")


def specs(head_dim: int = 128):
    import torch
    from flashinfer.jit.attention.modules import (
        gen_batch_decode_module,
        gen_batch_prefill_module,
        gen_single_decode_module,
    )
    from flashinfer.jit.topk import gen_topk_module

    bf16, d = torch.bfloat16, head_dim
    if d != 128:  # a small model (SmolLM2: head_dim 64, 3 query heads per kv head: CUDA-core decode)
        return [
            gen_batch_prefill_module("fa2", bf16, bf16, bf16, torch.int32, d, d, 0, False, False, False),
            gen_batch_prefill_module("fa3", bf16, bf16, bf16, torch.int32, d, d, 0, False, False, False),
            gen_batch_decode_module(bf16, bf16, bf16, torch.int32, d, d, 0, False, False),
        ]
    return [
        gen_batch_prefill_module("fa2", bf16, bf16, bf16, torch.int32, d, d, 0, False, False, False),
        gen_batch_prefill_module("fa3", bf16, bf16, bf16, torch.int32, d, d, 0, False, False, False),
        # fp8 KV (the serving runs' --kv-cache-dtype fp8_e4m3): bf16 queries on e4m3 pages, fa2
        gen_batch_prefill_module("fa2", bf16, torch.float8_e4m3fn, bf16, torch.int32, d, d, 0, False, False, False),
        gen_single_decode_module(bf16, bf16, bf16, d, d, 0, False, False),
        gen_topk_module(),
    ]


def curand_include() -> str | None:
    """An include folder with ``curand.h`` when the toolkit lacks it (the nvidia wheels have one)."""
    from flashinfer.jit.cpp_ext import get_cuda_path

    if (Path(get_cuda_path()) / "include" / "curand.h").exists():
        return None
    for root in map(Path, sys.path):
        for hit in root.glob("nvidia/*/include/curand.h"):
            return str(hit.parent)
    return None


def libcuda_stub(folder: Path) -> Path:
    """A ``libcuda.so`` with the driver's soname to link against (no driver on this machine)."""
    folder.mkdir(parents=True, exist_ok=True)
    src = folder / "stub.c"
    src.write_text("void cuGetErrorString(void) {}\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(folder / "libcuda.so"), "-Wl,-soname,libcuda.so.1", str(src)],
                   check=True)  # fmt: skip
    return folder


def build(spec, out: Path, include: str | None, stub: Path, jobs: int) -> Path:
    spec.write_ninja()
    ninja = spec.ninja_path
    if include:
        text = ninja.read_text()
        extra = f"    -isystem {include} $\n"
        if extra not in text:
            ninja.write_text(
                text.replace("    -isystem $cuda_home/include $\n", "    -isystem $cuda_home/include $\n" + extra)
            )
    # Compile with ninja, link here: ninja's own link step wants the real libcuda.
    listed = subprocess.run(["ninja", "-C", str(spec.build_dir), "-t", "targets", "all"], check=True,
                            capture_output=True, text=True).stdout  # fmt: skip
    objects = [line.split(":")[0] for line in listed.splitlines() if line.split(":")[0].endswith(".o")]
    subprocess.run(["ninja", "-C", str(spec.build_dir), f"-j{jobs}", *objects], check=True)
    objects = [str(spec.build_dir / o) if not o.startswith("/") else o for o in objects]
    target = out / spec.name / f"{spec.name}.so"
    target.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["c++", *objects, "-shared", "-Wl,--no-as-needed", f"-L{cudart_folder()}", f"-L{stub}", "-lcudart",
                    "-lcuda", "-o", str(target)], check=True)  # fmt: skip
    return target


def cudart_folder() -> Path:
    """The toolkit folder holding ``libcudart.so``."""
    from flashinfer.jit.cpp_ext import get_cuda_path

    for home in (get_cuda_path(), os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home and (Path(home) / "lib64" / "libcudart.so").exists():
            return Path(home) / "lib64"
    raise RuntimeError("libcudart.so not found: set CUDA_HOME to the CUDA toolkit")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder that receives <name>/<name>.so per module")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--head-dim",
        type=int,
        default=128,
        help="128: the 8B shape's modules (default); 64: SmolLM2's (prefill fa2/fa3, CUDA-core decode)",
    )
    args = parser.parse_args(argv)
    include = curand_include()
    with tempfile.TemporaryDirectory() as tmp:
        stub = libcuda_stub(Path(tmp))
        for spec in specs(args.head_dim):
            print(f"building {spec.name}", flush=True)
            target = build(spec, args.out, include, stub, args.jobs)
            print(f"  {target} ({target.stat().st_size / 2**20:.1f} MiB)", flush=True)
    shutil.rmtree(args.out / "tmp", ignore_errors=True)


if __name__ == "__main__":
    main()
