"""Cut an offline bundle (tools/offline_bundle.sh: its wheels and the default model's GGUF) into
parts of at most N MiB each, for transfer limits.

The parts' wheels lose what the sparse server never loads, which is what lets sglang-kernel fit a
part: its FlashAttention-3, Blackwell and FlashMLA kernels, and xgrammar's static library for C++
builds (a plain SGLang server from such an install runs with ``--attention-backend flashinfer``). Each part gets
``install_part.sh``: on the target it copies the part's wheels to ``$BUNDLE_DEST/wh`` and its GGUF
pieces to ``$BUNDLE_DEST/gguf`` (default ``/root``); the part that completes the set installs the
wheels into ``$BUNDLE_SITE`` (default ``/tmp/site``) and joins the GGUF. ``--beside-tree`` leaves
room in each part for a copy of this repository (its tracked files) sent with it.

    python tools/gpu_host_parts.py .gpu-bundle --part-mib 64 --beside-tree
"""

from __future__ import annotations

import argparse
import fnmatch
import shutil
import subprocess
import zipfile
from pathlib import Path

MiB = 1 << 20
MARGIN = 2 * MiB  # the part's own script, and files written beside the tree after this runs
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Members the parts' wheels drop: nothing the sparse server or its tests load.
STRIP = {
    "sglang_kernel-*.whl": ["sgl_kernel/flash_ops*.so", "sgl_kernel/sm100/*", "sgl_kernel/flashmla_ops*.so", "sgl_kernel/infllm_ops*.so"],
    "xgrammar-*.whl": ["xgrammar/lib/libxgrammar.a"],
}  # fmt: skip

INSTALL_PART = """#!/usr/bin/env bash
# One part of an offline bundle: copy it to $BUNDLE_DEST; the part that completes the set installs
# the wheels into $BUNDLE_SITE and joins the GGUF.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dest=${{BUNDLE_DEST:-/root}} site=${{BUNDLE_SITE:-/tmp/site}}
mkdir -p "$dest/wh" "$dest/gguf"
cp "$here"/*.whl "$dest/wh/" 2>/dev/null || true
cp "$here"/gguf.* "$dest/gguf/" 2>/dev/null || true
wheels=$(ls "$dest"/wh/*.whl | wc -l); pieces=$(ls "$dest"/gguf/gguf.* 2>/dev/null | wc -l)
if [ "$wheels" -lt {wheels} ] || [ "$pieces" -lt {pieces} ]; then
  echo "part copied: $wheels/{wheels} wheels, $pieces/{pieces} GGUF pieces"; exit 0
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$dest"/wh/*.whl
cat "$dest"/gguf/gguf.* > "$dest/gguf/{gguf}" && rm "$dest"/gguf/gguf.*
test "$(stat -c %s "$dest/gguf/{gguf}")" = {gguf_bytes}
echo "SGLang installed in $site (export PYTHONPATH=$site:<repository>/python);"
echo "export SPARSE_SGLANG_DEFAULT_GGUF=$dest/gguf/{gguf}"
"""


def strip_wheel(src: Path, dst: Path, patterns: list[str]) -> None:
    """``src`` rewritten to ``dst`` without the members matching ``patterns`` (fnmatch), its
    RECORD rewritten to match, so pip installs it as it would the original."""
    drop = lambda name: any(fnmatch.fnmatch(name, p) for p in patterns)  # noqa: E731
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        for info in zin.infolist():
            if drop(info.filename):
                continue
            data = zin.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                data = "".join(
                    f"{line}\n" for line in data.decode().splitlines() if line and not drop(line.split(",")[0])
                ).encode()
            member = zipfile.ZipInfo(info.filename, info.date_time)
            member.external_attr = info.external_attr
            member.compress_type = zipfile.ZIP_DEFLATED
            zout.writestr(member, data, compresslevel=9)


def tree_bytes(root: Path) -> int:
    """Bytes of the repository as a copy of it travels: tracked files and untracked ones git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         capture_output=True, check=True).stdout  # fmt: skip
    return sum((root / p).stat().st_size for p in out.decode().split("\0") if p and (root / p).is_file())


def pack(files: list[tuple[Path, int]], gguf_bytes: int, room: int) -> list[dict]:
    """First-fit, largest wheel first; then the GGUF cut into pieces filling each part's room."""
    parts: list[dict] = []
    for path, size in sorted(files, key=lambda f: -f[1]):
        if size > room:
            raise ValueError(f"{path.name} ({size / MiB:.1f} MiB) is larger than a part ({room / MiB:.1f} MiB)")
        part = next((p for p in parts if p["size"] + size <= room), None)
        if part is None:
            part = {"wheels": [], "pieces": [], "size": 0}
            parts.append(part)
        part["wheels"].append(path)
        part["size"] += size
    offset = 0
    for part in parts:
        take = min(room - part["size"], gguf_bytes - offset)
        if take > 0:
            part["pieces"].append((offset, take))
            part["size"] += take
            offset += take
    while offset < gguf_bytes:
        take = min(room, gguf_bytes - offset)
        parts.append({"wheels": [], "pieces": [(offset, take)], "size": take})
        offset += take
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "bundle", type=Path, help="offline_bundle.sh's folder (wheels/, gguf/); the parts go to p0, p1, ..."
    )
    parser.add_argument("--part-mib", type=float, default=64, help="most MiB a part holds (default 64)")
    parser.add_argument(
        "--beside-tree", action="store_true", help="leave room in each part for a copy of the repository"
    )
    args = parser.parse_args()
    gguf_path = args.bundle / "gguf" / GGUF_NAME
    room = int(args.part_mib * MiB) - MARGIN
    if args.beside_tree:
        room -= tree_bytes(Path(__file__).resolve().parents[1])
    stripped = args.bundle / "stripped"
    stripped.mkdir(exist_ok=True)
    wheels = []
    for path in sorted((args.bundle / "wheels").glob("*.whl")):
        patterns = next((p for glob, p in STRIP.items() if fnmatch.fnmatch(path.name, glob)), None)
        if patterns:
            small = stripped / path.name
            if not small.exists() or small.stat().st_mtime < path.stat().st_mtime:
                strip_wheel(path, small, patterns)
            path = small
        wheels.append((path, path.stat().st_size))
    gguf_bytes = gguf_path.stat().st_size
    try:
        parts = pack(wheels, gguf_bytes, room)
    except ValueError as err:
        raise SystemExit(f"gpu_host_parts.py: {err}") from None
    for old in args.bundle.glob("p[0-9]*"):
        shutil.rmtree(old)
    num_pieces = sum(len(p["pieces"]) for p in parts)
    piece = 0
    with gguf_path.open("rb") as gguf:
        for i, part in enumerate(parts):
            folder = args.bundle / f"p{i}"
            folder.mkdir(parents=True)
            for wheel in part["wheels"]:
                shutil.copy(wheel, folder)
            for offset, size in part["pieces"]:
                gguf.seek(offset)
                (folder / f"gguf.{piece:02d}").write_bytes(gguf.read(size))
                piece += 1
            script = INSTALL_PART.format(wheels=len(wheels), pieces=num_pieces, gguf=GGUF_NAME, gguf_bytes=gguf_bytes)
            (folder / "install_part.sh").write_text(script)
            print(
                f"{folder} {part['size'] / MiB:.1f} MiB: {len(part['wheels'])} wheels, {len(part['pieces'])} GGUF pieces"
            )


if __name__ == "__main__":
    main()
