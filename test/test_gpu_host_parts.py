"""tools/gpu_host_parts.py: every part fits its room, and the parts hold each wheel once and
the GGUF whole, in order."""

from __future__ import annotations

import importlib.util
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
    with pytest.raises(ValueError, match="larger than what a call carries"):
        gpu_host_parts.pack([(Path("big.whl"), 50)], 10, 40)
