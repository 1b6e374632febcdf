"""The int8 bound codec: how a page's key bounds are stored as int8 levels times a power-of-two
scale, in torch (:func:`quantize_bounds`, :func:`dequantize_bounds`) and in Triton
(:func:`pow2`, :func:`quantize_outward`, for the kernels that save and score), bit for bit the same.

Contract
--------
- A bound vector ``[D]`` (float32) is stored as int8 levels ``l`` and one exponent ``e`` (int8):
  its value is ``l * 2**e``, exact in float32.
- Rounding is outward for min/max bounds: ``levels_min * 2**e <= kmin`` and ``levels_max * 2**e >=
  kmax``, so every key of a page stays inside its stored box (Quest's score stays an upper bound of
  ``q . k``). Mean/std corners (``--sparse-page-bounds meanstd``) bound nothing and are decoded back
  into moments when a token joins their page, so they round to the nearest level instead
  (:func:`quantize_corners`, :func:`quantize_nearest`): outward rounding would widen the spread by
  a level at every merge.
- ``e`` is the smallest with ``max |bound| <= 127 * 2**e``, computed from the float's bits alike in
  torch and Triton; an empty page holds levels ``+-127`` at :data:`EMPTY_EXP`, which read back as
  ``+-inf``.

Why int8 bounds at all: ``docs/decisions/0003-int8-page-bounds.md``.
"""

from __future__ import annotations

import torch

from sparse_sglang.config import BOUND_FORMATS, PAGE_BOUNDS

try:  # Triton comes with CUDA builds of torch (and runs on the CPU in its interpreter).
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

INT8_LEVELS = 127  # largest |level| of an int8 bound
EMPTY_EXP = 127  # scale exponent of an empty page: levels +-127 read back as +-inf in float32
MIN_BOUND_ABS = 2.0**-100  # a page's scale covers at least this (an all-zero page gets a finite scale)
# Float32 mantissa bits of 127 / 64 = 1.984375: a magnitude whose mantissa is larger needs the next
# scale up (see bound_exponent).
_LEVELS_MANTISSA = (INT8_LEVELS - 64) << 17


def resolve_bound_format(bound_format: str, kv_dtype: torch.dtype, page_bounds: str = "minmax") -> str:
    """``"exact"`` or ``"int8"``: ``"auto"`` is int8 for 16-bit keys and exact otherwise (fp8 bounds
    are one byte already; float32 ones are reference runs). Mean/std corners are no stored key, so
    fp8 would round them to 3 mantissa bits: ``"auto"`` takes int8 for them with fp8 keys too."""
    if bound_format not in BOUND_FORMATS:
        raise ValueError(f"bound format must be one of {', '.join(BOUND_FORMATS)}, got {bound_format!r}")
    if page_bounds not in PAGE_BOUNDS:
        raise ValueError(f"page bounds must be one of {', '.join(PAGE_BOUNDS)}, got {page_bounds!r}")
    if bound_format == "auto":
        moments_in_fp8 = page_bounds == "meanstd" and kv_dtype.itemsize == 1
        return "int8" if kv_dtype.itemsize == 2 or moments_in_fp8 else "exact"
    return bound_format


def bound_dtype(kv_dtype: torch.dtype, bound_format: str = "exact", page_bounds: str = "minmax") -> torch.dtype:
    """Storage type of ``kmin``/``kmax`` for keys of ``kv_dtype``: the keys' own (exact; see module
    doc), or int8 levels."""
    return torch.int8 if resolve_bound_format(bound_format, kv_dtype, page_bounds) == "int8" else kv_dtype


def bound_exponent(amax: torch.Tensor) -> torch.Tensor:
    """The smallest ``e`` with ``amax <= 127 * 2**e`` (int32, elementwise, ``amax >= 0`` float32),
    for ``amax`` at least :data:`MIN_BOUND_ABS`. Integer arithmetic on the float's bits, as the
    index kernel does, so both give the same scales: with ``amax = m * 2**E`` (``1 <= m < 2``),
    ``e = E - 6`` while ``m <= 127 / 64``, else ``E - 5``."""
    bits = amax.float().clamp_min(MIN_BOUND_ABS).contiguous().view(torch.int32)
    return ((bits >> 23) & 0xFF) - 133 + ((bits & 0x7FFFFF) > _LEVELS_MANTISSA).int()


def quantize_bounds(kmin: torch.Tensor, kmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Finite bounds ``[..., D]`` (float32) as int8 levels and one scale exponent per ``[D]``
    vector, rounded outward: ``levels_min * 2**e <= kmin`` and ``levels_max * 2**e >= kmax``.

    Returns ``(levels_min, levels_max, e)``: int8 ``[..., D]`` twice and int8 ``[...]``."""
    amax = torch.maximum(kmin.abs(), kmax.abs()).amax(dim=-1)
    e = bound_exponent(amax)
    inv = torch.ldexp(torch.ones_like(amax), -e).unsqueeze(-1)  # 2**-e: exact scaling
    return (kmin * inv).floor().to(torch.int8), (kmax * inv).ceil().to(torch.int8), e.to(torch.int8)


def quantize_corners(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean/std corners ``[..., D]`` (float32) as int8 levels at :func:`quantize_bounds`' scale,
    each rounded to the nearest level (halves up, as :func:`quantize_nearest` does)."""
    amax = torch.maximum(lo.abs(), hi.abs()).amax(dim=-1)
    e = bound_exponent(amax)
    inv = torch.ldexp(torch.ones_like(amax), -e).unsqueeze(-1)
    return (lo * inv + 0.5).floor().to(torch.int8), (hi * inv + 0.5).floor().to(torch.int8), e.to(torch.int8)


def dequantize_bounds(levels: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """``levels * 2**e`` in float32 (``levels`` ``[..., D]``, ``e`` ``[...]``); exact, and
    ``+-inf`` for an empty page's ``+-127`` at :data:`EMPTY_EXP`."""
    return levels.float() * torch.ldexp(torch.ones_like(e, dtype=torch.float32), e.int()).unsqueeze(-1)


def empty_bounds(dtype: torch.dtype) -> tuple[float, float]:
    """``(kmin, kmax)`` of a page without keys, bounds stored as ``dtype``: the identities of min
    and max, ``(+inf, -inf)``, or, for a type without infinity (fp8 e4m3: inf casts to NaN),
    ``(+top, -top)`` of its largest finite value ``top``, which bounds every stored key (the store
    saturates keys cast into fp8; ``KVStore.to_store_dtype``). int8 levels: ``(+127, -127)``,
    which read back as ``(+inf, -inf)`` at the empty scale :data:`EMPTY_EXP`."""
    if dtype == torch.int8:
        return float(INT8_LEVELS), float(-INT8_LEVELS)
    if torch.tensor(float("inf")).to(dtype).float().isinf():
        return float("inf"), float("-inf")
    top = torch.finfo(dtype).max
    return top, -top


if triton is not None:
    MIN_BOUND_ABS_TL = tl.constexpr(MIN_BOUND_ABS)
    LEVELS_MANTISSA = tl.constexpr(_LEVELS_MANTISSA)

    @triton.jit
    def pow2(e):
        """``2.0**e`` in float32 for an int32 ``e`` in [-126, 127], built from its exponent bits:
        exact (int8 bounds' scales; :func:`dequantize_bounds`)."""
        return ((e + 127) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def quantize_outward(lo, hi):
        """``lo``/``hi`` ``[D]`` float32 bounds as int8 levels (floats) and their scale exponent,
        rounded outward (:func:`quantize_bounds`, bit for bit)."""
        amax = tl.maximum(tl.max(tl.maximum(tl.abs(lo), tl.abs(hi)), axis=0), MIN_BOUND_ABS_TL)
        bits = amax.to(tl.int32, bitcast=True)
        e = ((bits >> 23) & 0xFF) - 133 + ((bits & 0x7FFFFF) > LEVELS_MANTISSA).to(tl.int32)
        return tl.floor(lo * pow2(-e)), tl.ceil(hi * pow2(-e)), e

    @triton.jit
    def quantize_nearest(lo, hi):
        """Mean/std corners ``[D]`` float32 as int8 levels (floats) at :func:`quantize_outward`'s
        scale, each rounded to the nearest level (:func:`quantize_corners`, bit for bit)."""
        amax = tl.maximum(tl.max(tl.maximum(tl.abs(lo), tl.abs(hi)), axis=0), MIN_BOUND_ABS_TL)
        bits = amax.to(tl.int32, bitcast=True)
        e = ((bits >> 23) & 0xFF) - 133 + ((bits & 0x7FFFFF) > LEVELS_MANTISSA).to(tl.int32)
        return tl.floor(lo * pow2(-e) + 0.5), tl.floor(hi * pow2(-e) + 0.5), e
