"""Small pieces the memory managers share: the KV dtypes, size checks, host-to-device copies that
do not wait for the device, and a tensor free stack.

On the paths that run on the host between steps, writes into device tensors use ``fill_``,
``index_fill_`` or a device-tensor value, never ``t[i] = scalar``: a Python scalar assigned through
``__setitem__`` becomes a CPU tensor copied from pageable memory, which waits for the device."""

from __future__ import annotations

import torch

from sparse_sglang.config import GIB

# Element types of the KV store and page cache; fp8 takes one byte per element.
KV_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)


def kv_compute_dtype(kv_dtype: torch.dtype) -> torch.dtype:
    """The type KV stored as ``kv_dtype`` is computed in: the type itself for 16-bit KV, bf16 for
    fp8 (every fp8 value is exactly a bf16 value; the decode queries, and FlashInfer's Hopper
    prefill kernels, which take fp8 KV only with fp8 queries)."""
    return torch.bfloat16 if kv_dtype.itemsize == 1 else kv_dtype


def check_kv_shape(page_size: int, head_dim: int, dtype: torch.dtype, **counts: int) -> None:
    """Raise ValueError unless ``page_size`` is a power of two, ``dtype`` a KV dtype and every
    count (``head_dim`` and the keyword arguments, e.g. ``num_layers=32``) is positive."""
    if page_size < 1 or page_size & (page_size - 1):
        raise ValueError(f"page_size must be a power of two, got {page_size}")
    if dtype not in KV_DTYPES:
        raise ValueError(f"KV dtype must be one of {', '.join(map(str, KV_DTYPES))}; got {dtype}")
    for name, value in {"head_dim": head_dim, **counts}.items():
        if value < 1:
            raise ValueError(f"{name} must be positive, got {value}")


def units_for_budget(gb: float, unit_bytes: int, minimum: int, what: str) -> int:
    """How many units of ``unit_bytes`` fit in ``gb`` GiB; ValueError naming ``what`` when fewer
    than ``minimum``."""
    if not gb > 0:
        raise ValueError(f"{what}: budget must be positive, got {gb} GiB")
    units = int(gb * GIB) // unit_bytes
    if units < minimum:
        raise ValueError(
            f"{what}: {gb:g} GiB holds {units} units of {unit_bytes / (1 << 20):.3f} MiB; need at least {minimum}"
        )
    return units


def host_to_device(
    values: list | torch.Tensor, device: torch.device | str, dtype: torch.dtype = torch.int64
) -> torch.Tensor:
    """``values`` (a list, or a tensor on the host or already on ``device``) as a ``dtype`` tensor
    on ``device``, copied from pinned memory without waiting for the device (a copy from pageable
    memory waits for the work queued before it: a blocking one always, a ``non_blocking`` one
    where the driver stages it)."""
    host = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    device = torch.device(device)
    if device.type != "cuda" or host.device.type != "cpu":
        return host.to(device)
    return (host if host.is_pinned() else host.pin_memory()).to(device, non_blocking=True)


class FreeStack:
    """A stack of free integer ids kept in a tensor on any device.

    The count lives on the host, so ``pop``/``push`` of a host-known number of ids need no
    device synchronization. Ids pop in ascending order from a fresh stack.

    Parameters
    ----------
    ids : torch.Tensor
        ``[n]`` the ids initially free; copied into an int64 buffer of the same device.
    capacity : int, optional
        Most ids the stack may ever hold (default ``len(ids)``).
    """

    def __init__(self, ids: torch.Tensor, capacity: int | None = None):
        n = ids.numel()
        self.ids = torch.empty(capacity or n, dtype=torch.int64, device=ids.device)
        self.ids[:n] = ids.flip(0)
        self.size = n

    def __len__(self) -> int:
        return self.size

    def pop(self, n: int) -> torch.Tensor:
        """Take the top ``n`` ids (``[n]`` int64, a copy); the caller checks ``n <= len(self)``."""
        assert 0 <= n <= self.size, (n, self.size)
        self.size -= n
        return self.ids[self.size : self.size + n].flip(0).clone()

    def push(self, ids: torch.Tensor) -> None:
        """Return ``ids`` ``[k]`` (same device) to the stack; the next pop takes them first."""
        k = ids.numel()
        assert self.size + k <= self.ids.numel(), "free stack overflow: an id was freed twice"
        self.ids[self.size : self.size + k] = ids.flip(0)
        self.size += k
