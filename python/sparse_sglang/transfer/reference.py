"""Pure-torch references of the transfer engines: the semantics the kernels must match bit for bit.

Both copy raw bytes (``uint8`` views), so fp8 and NaN payloads round-trip exactly. Also the small
helpers the tests and the benchmark build their data with.
"""

from __future__ import annotations

import torch

from sparse_sglang.transfer.layout import check_block_lists, check_host_store, check_page_cache, check_tokens


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as ``uint8`` (last dim times ``itemsize``); shares storage."""
    return t.view(torch.uint8)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of two tensors (any devices)."""
    return torch.equal(as_bytes(a.cpu()), as_bytes(b.cpu()))


def random_bits(shape, dtype: torch.dtype, generator: torch.Generator | None = None, device="cpu") -> torch.Tensor:
    """A tensor of ``dtype`` holding random bytes: every bit pattern, NaNs included."""
    size = dtype.itemsize
    bits = torch.randint(0, 256, (*shape[:-1], shape[-1] * size), dtype=torch.uint8, generator=generator)
    return bits.to(device).view(dtype)


def token_slots(num_tokens: int, pages: torch.Tensor, page_size: int, pad=()) -> torch.Tensor:
    """Slots of ``num_tokens`` tokens filling ``pages`` in order (the last one partly when
    ``num_tokens`` is not a multiple of ``page_size``), with a -1 padding entry inserted at each
    position in ``pad``; int64 ``[num_tokens + len(pad)]``."""
    used = pages[: -(-num_tokens // page_size)].long()
    slots = (used[:, None] * page_size + torch.arange(page_size)).reshape(-1)[:num_tokens]
    for i in sorted(pad):
        slots = torch.cat([slots[:i], torch.tensor([-1]), slots[i:]])
    return slots


def gather_blocks_reference(
    host_k: torch.Tensor,
    host_v: torch.Tensor,
    gpu_k: torch.Tensor,
    gpu_v: torch.Tensor,
    src_blocks: torch.Tensor,
    dst_slots: torch.Tensor,
) -> None:
    """FlashH2D semantics: copy host blocks into page-cache slots.

    Parameters
    ----------
    host_k, host_v : torch.Tensor
        ``[num_layers, num_kv_heads, num_host_pages, page_size, head_dim]`` CPU tensors.
    gpu_k, gpu_v : torch.Tensor
        ``[num_slots, page_size, head_dim]``, same dtype, any device; written in place.
    src_blocks, dst_slots : torch.Tensor
        ``[n]`` int32/int64: ``gpu[dst_slots[i]] = host.view(-1, page_size, head_dim)[src_blocks[i]]``.
        Entries with ``dst_slots[i] < 0`` are padding and skipped. Destinations must be distinct.

    Raises
    ------
    ValueError
        On a layout mismatch or an index out of range (the kernel instead skips such entries).
    """
    check_host_store(host_k, host_v)
    check_page_cache(gpu_k, gpu_v, host_k)
    check_block_lists(src_blocks, dst_slots)
    src, dst = src_blocks.cpu().long(), dst_slots.cpu().long()
    keep = dst >= 0
    src, dst = src[keep], dst[keep]
    num_blocks = host_k.shape[0] * host_k.shape[1] * host_k.shape[2]
    if src.numel() and (src.min() < 0 or src.max() >= num_blocks or dst.max() >= gpu_k.shape[0]):
        raise ValueError(f"block index out of range: host blocks [0, {num_blocks}), slots [0, {gpu_k.shape[0]})")
    for host, gpu in ((host_k, gpu_k), (host_v, gpu_v)):
        blocks = as_bytes(host).reshape(num_blocks, *as_bytes(gpu).shape[1:])[src]
        as_bytes(gpu)[dst.to(gpu.device)] = blocks.to(gpu.device)


def scatter_tokens_reference(
    host_k: torch.Tensor,
    host_v: torch.Tensor,
    layer: int,
    k: torch.Tensor,
    v: torch.Tensor,
    token_slots: torch.Tensor,
) -> None:
    """FlashD2H semantics: save one layer's new K/V rows into the host store.

    Parameters
    ----------
    host_k, host_v : torch.Tensor
        ``[num_layers, num_kv_heads, num_host_pages, page_size, head_dim]`` CPU tensors; written in place.
    layer : int
        Layer index.
    k, v : torch.Tensor
        ``[num_tokens, num_kv_heads, head_dim]``, same dtype as the store, any device.
    token_slots : torch.Tensor
        ``[num_tokens]`` int32/int64, any device: token ``t`` goes to
        ``host[layer, :, token_slots[t] // page_size, token_slots[t] % page_size]``; ``< 0`` skips the
        token. Slots must be distinct; a page may be filled only partly (the rest is left as it was).

    Raises
    ------
    ValueError
        On a layout mismatch, a layer out of range or a slot past ``num_host_pages * page_size``.
    """
    check_host_store(host_k, host_v)
    check_tokens(k, v, host_k, token_slots)
    num_layers, _, num_pages, page_size, _ = host_k.shape
    if not 0 <= layer < num_layers:
        raise ValueError(f"layer {layer} out of range [0, {num_layers})")
    slots = token_slots.cpu().long()
    keep = slots >= 0
    slots = slots[keep]
    if slots.numel() and slots.max() >= num_pages * page_size:
        raise ValueError(f"token slot {int(slots.max())} is past the host store ({num_pages} pages x {page_size})")
    page, offset = slots // page_size, slots % page_size
    for host, x in ((host_k, k), (host_v, v)):
        rows = as_bytes(x).cpu()[keep]  # [n, heads, head_dim * itemsize]
        as_bytes(host)[layer][:, page, offset] = rows.transpose(0, 1)


class FlashD2HReference:
    """FlashD2H's contract (``submit`` / ``synchronize`` / ``close``) on the CPU: each submit
    scatters at once with :func:`scatter_tokens_reference`, so there is nothing to wait for. Also
    serves as the direct-write kernel's reference (``submit`` has its call signature)."""

    def __init__(self, host_k: torch.Tensor, host_v: torch.Tensor):
        self.host_k, self.host_v = host_k, host_v
        self.tickets = 0

    def submit(self, layer: int, k: torch.Tensor, v: torch.Tensor, token_slots: torch.Tensor) -> int:
        scatter_tokens_reference(self.host_k, self.host_v, layer, k.cpu(), v.cpu(), token_slots.cpu())
        self.tickets += 1
        return self.tickets

    __call__ = submit

    def synchronize(self) -> None:
        """Nothing is in flight: every submit has finished."""

    def close(self) -> None:
        """Nothing to release."""
