"""tools/gpu_host_parts.py, the offline bundle's parts: every part fits its room, the parts hold
each wheel once and the GGUF whole, in order, and a stripped wheel drops exactly what it names;
tools/offline_bundle.sh parses and explains itself."""

from __future__ import annotations

import importlib.util
import subprocess
import zipfile
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location(
    "gpu_host_parts", Path(__file__).resolve().parents[1] / "tools" / "gpu_host_parts.py"
)
gpu_host_parts = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_host_parts)


@pytest.mark.parametrize("room", [40, 64, 100])
def test_parts_fit_their_room_and_hold_everything_once(room):
    wheels = [(Path(f"w{i}.whl"), size) for i, size in enumerate([38, 22, 15, 13, 11, 3, 2, 2, 1, 1])]
    gguf_bytes = 94
    parts = gpu_host_parts.pack(wheels, gguf_bytes, room)
    assert all(p["size"] <= room for p in parts)
    assert all(p["size"] == sum(dict(wheels)[w] for w in p["wheels"]) + sum(n for _, n in p["pieces"]) for p in parts)
    assert sorted(w for p in parts for w in p["wheels"]) == sorted(w for w, _ in wheels)
    pieces = [piece for p in parts for piece in p["pieces"]]
    assert pieces[0][0] == 0 and all(a[0] + a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
    assert pieces[-1][0] + pieces[-1][1] == gguf_bytes
    # no part could have been left out: the total needs at least this many
    assert len(parts) <= -(-(sum(s for _, s in wheels) + gguf_bytes) // room) + 1


def test_tree_bytes_counts_tracked_files():
    root = Path(__file__).resolve().parents[1]
    assert gpu_host_parts.tree_bytes(root) >= (root / "README.md").stat().st_size


def test_a_wheel_larger_than_the_room_is_refused():
    with pytest.raises(ValueError, match="larger than a part"):
        gpu_host_parts.pack([(Path("big.whl"), 50)], 10, 40)


def test_a_stripped_wheel_drops_its_members_and_their_record_lines(tmp_path):
    wheel = tmp_path / "w-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("w/keep.py", "x = 1\n")
        zf.writestr("w/big_ops.so", b"\0" * 1000)
        zf.writestr(
            "w-1.0.dist-info/RECORD", "w/keep.py,sha256=a,6\nw/big_ops.so,sha256=b,1000\nw-1.0.dist-info/RECORD,,\n"
        )
    out = tmp_path / "small.whl"
    gpu_host_parts.strip_wheel(wheel, out, ["w/big_*.so"])
    with zipfile.ZipFile(out) as zf:
        assert sorted(zf.namelist()) == ["w-1.0.dist-info/RECORD", "w/keep.py"]
        assert zf.read("w-1.0.dist-info/RECORD").decode() == "w/keep.py,sha256=a,6\nw-1.0.dist-info/RECORD,,\n"


def test_the_bundle_script_parses_and_prints_its_usage():
    script = Path(__file__).resolve().parents[1] / "tools" / "offline_bundle.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    usage = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True, check=True).stdout
    assert "bash tools/offline_bundle.sh [--parts MIB [--beside-tree]] [OUT]" in usage and "set -euo" not in usage
