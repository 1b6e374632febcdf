"""Key codes: every key rounded to a few bits per channel between its page's channel min and max,
kept on the GPU (KIVI's per-channel key quantization, with the page as the group).

The quantized re-rank (``--sparse-rerank-by quantized``) estimates each candidate page's attention
mass from these codes instead of loading the page's keys from host memory: a key ``k_t`` is read
back as ``lo + code_t * (hi - lo) / (2**bits - 1)``, per channel, with ``lo``/``hi`` the page's
channel min and max. At 2 bits a page's codes are an eighth of its bf16 keys, and unlike a bound
or a mean they keep each token: the one token a query wants stands out of its page.

Contracts
---------
- :class:`PageKeyCodes` holds, per (layer, kv head, host page), ``codes``
  ``[num_layers, num_kv_heads, num_pages + 1, page_size * head_dim * bits / 8]`` uint8: with
  ``W = head_dim * bits / 8`` bytes per token, token ``o``'s channel ``c`` in byte ``o * W + c % W``
  at bit ``(c // W) * bits`` (a shift reads a block of ``W`` consecutive channels whole), and the frame ``lo``/``hi`` ``[..., num_pages + 1, head_dim]`` in
  the keys' own type (a min or max *is* a key, so the frame is exact for bf16, fp16 and fp8 alike;
  fp8 keys are coded as stored, without their per-tensor scale).
- A page's codes are those of its keys against its frame once the page is whole. While it fills,
  each token that widens the frame re-codes the page's earlier tokens from their decoded values
  (the save path never reads keys back): a page saved in one run (a prefill's whole pages) is coded
  exactly, one filled across runs carries up to half a level more error per widening. Tokens past
  a page's fill hold stale codes: only a request's newest page is partial, and the re-rank never
  compares it (it is a forced page).
- A run starting at page offset 0 starts its page anew (a previous owner's codes are ignored).

The save kernel is :func:`~sparse_sglang.mem_cache.kernels.encode_runs`; its torch reference is
:func:`~sparse_sglang.mem_cache.reference.encode_codes_reference`.
"""

from __future__ import annotations

import torch

from sparse_sglang.config import KEY_CODE_BITS

try:  # Triton comes with CUDA builds of torch (and runs on the CPU in its interpreter).
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

# A flat channel's frame (hi == lo) still gets a positive step: its codes are all 0 and decode to lo.
FLAT_FRAME_WIDTH = 1e-30


def code_row_bytes(page_size: int, head_dim: int, bits: int, kv_dtype: torch.dtype) -> int:
    """GPU bytes of one (layer, kv head, page): the codes and the frame."""
    return page_size * head_dim * bits // 8 + 2 * head_dim * kv_dtype.itemsize


def code_levels(bits: int) -> int:
    """The largest code, ``2**bits - 1``: a frame spans that many steps."""
    return (1 << bits) - 1


class PageKeyCodes:
    """Codes and frames of every (layer, kv head, host page), page ``num_pages`` a spare for padding.

    Example
    -------
    >>> codes = PageKeyCodes(num_layers=1, num_kv_heads=1, num_pages=4, page_size=2, head_dim=4,
    ...                      bits=2, kv_dtype=torch.bfloat16)
    >>> codes.layer(0)["codes"].shape, codes.layer(0)["lo"].shape
    (torch.Size([1, 5, 2]), torch.Size([1, 5, 4]))
    """

    def __init__(self, num_layers: int, num_kv_heads: int, num_pages: int, page_size: int, head_dim: int,
                 bits: int, kv_dtype: torch.dtype, device: torch.device | str = "cpu"):  # fmt: skip
        if bits not in KEY_CODE_BITS:
            raise ValueError(f"key codes take {KEY_CODE_BITS} bits, got {bits}")
        if head_dim * bits % 8:
            raise ValueError(f"head_dim {head_dim} does not pack into bytes of {8 // bits} codes")
        self.bits, self.page_size, self.head_dim, self.num_pages = bits, page_size, head_dim, num_pages
        frame = (num_layers, num_kv_heads, num_pages + 1, head_dim)
        self._codes = torch.zeros(*frame[:-1], page_size * head_dim * bits // 8, dtype=torch.uint8, device=device)
        self._lo = torch.zeros(frame, dtype=kv_dtype, device=device)
        self._hi = torch.zeros(frame, dtype=kv_dtype, device=device)

    def layer(self, layer: int) -> dict[str, torch.Tensor]:
        """One layer's ``codes``, ``lo`` and ``hi``, ``[num_kv_heads, num_pages + 1, ...]`` each."""
        return {"codes": self._codes[layer], "lo": self._lo[layer], "hi": self._hi[layer]}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self._codes, self._lo, self._hi))

    def decode(self, layer: int, pages: torch.Tensor) -> torch.Tensor:
        """The keys ``pages`` (``[...]`` host pages) read back from their codes: ``[Hkv, ..., page_size,
        head_dim]`` float32 (:func:`decode_codes`)."""
        t = self.layer(layer)
        return decode_codes(t["codes"][:, pages], t["lo"][:, pages], t["hi"][:, pages], self.bits)


def unpack_codes(codes: torch.Tensor, bits: int, head_dim: int) -> torch.Tensor:
    """``[..., page_size * head_dim * bits / 8]`` uint8 to ``[..., page_size, head_dim]`` int64 codes."""
    width = head_dim * bits // 8
    shifts = torch.arange(8 // bits, device=codes.device).view(-1, 1) * bits
    tokens = codes.long().reshape(*codes.shape[:-1], -1, 1, width)  # [..., P, 1, W]
    return ((tokens >> shifts) & code_levels(bits)).reshape(*codes.shape[:-1], -1, head_dim)


def pack_codes(values: torch.Tensor, bits: int) -> torch.Tensor:
    """``[..., page_size, head_dim]`` integer codes to ``[..., page_size * head_dim * bits / 8]`` uint8."""
    per_byte = 8 // bits
    shifts = torch.arange(per_byte, device=values.device).view(-1, 1) * bits
    blocks = values.long().reshape(*values.shape[:-1], per_byte, -1)  # [..., P, PER_BYTE, W]
    return (blocks << shifts).sum(-2).reshape(*values.shape[:-2], -1).to(torch.uint8)


def frame_step(lo: torch.Tensor, hi: torch.Tensor, bits: int) -> torch.Tensor:
    """The width of one level, float32: a flat channel (``hi == lo``) gets a tiny positive step.
    The width times the float32 reciprocal of the level count, one rounding: what torch computes on
    either device (on a GPU it turns a division by a scalar into this product) and what
    :func:`frame_step_tl` computes, so kernels and references agree on keys at rounding boundaries."""
    return (hi.float() - lo.float()).clamp_min(FLAT_FRAME_WIDTH) * (1.0 / code_levels(bits))


def encode(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes ``[..., T, D]`` int64 of values ``x`` ``[..., T, D]`` in the frame ``lo``/``hi``
    ``[..., D]``: the nearest level (halves up), clamped to the frame."""
    step = frame_step(lo, hi, bits).unsqueeze(-2)
    return torch.floor((x.float() - lo.float().unsqueeze(-2)) / step + 0.5).clamp(0, code_levels(bits)).long()


def decode_codes(codes: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int) -> torch.Tensor:
    """Keys ``[..., page_size, head_dim]`` float32 read back from packed codes ``[..., bytes]`` and
    their frames ``[..., head_dim]``."""
    values = unpack_codes(codes, bits, lo.shape[-1]).float()
    return lo.float().unsqueeze(-2) + values * frame_step(lo, hi, bits).unsqueeze(-2)


if triton is not None:
    FLAT_FRAME_WIDTH_TL = tl.constexpr(FLAT_FRAME_WIDTH)

    @triton.jit
    def frame_step_tl(lo, hi, LEVELS: tl.constexpr):
        """:func:`frame_step` in a kernel, float32 ``lo``/``hi``, ``LEVELS = 2**bits - 1``: the same
        product, so a code the save kernel writes is its reference's (launched unfused)."""
        return tl.maximum(hi - lo, FLAT_FRAME_WIDTH_TL) * (1.0 / LEVELS)
