"""Saving the K/V a forward produced into the host store.

:class:`FlashD2H` (SparseServe §3.2.2, the default): one device-to-host copy of the layer's
contiguous ``[num_tokens, num_kv_heads, head_dim]`` K and V into a pinned staging buffer on a side
stream (the copy engine: no SMs taken from the model), then native C++ threads wait on that copy's
CUDA event and scatter each (token, head) row into ``host[layer, head, page, offset]``.

:class:`DirectD2H`: the alternative, a kernel of a fixed number of CTAs writing the rows straight
into pinned host memory through UVA (it takes that many SMs while it runs).
"""

from __future__ import annotations

import atexit
import functools
import os
import weakref
from dataclasses import dataclass

import torch
from torch.profiler import record_function

from sparse_sglang.transfer.h2d import cuda_view, device_index
from sparse_sglang.transfer.layout import alloc_host_tensor, check_host_store, check_tokens
from sparse_sglang.transfer.native import cuda_ext, host_ext


def default_num_threads(share: int = 1) -> int:
    """Scatter threads by default: all CPUs but 4 (left to the server's own processes), split
    between the ``share`` schedulers of one host (data-parallel replicas, tensor-parallel ranks), at
    most 12 each.

    The measurement behind it: ``docs/decisions/0009-staged-flashd2h-for-saving-kv.md``.
    """
    return max(1, min(12, ((os.cpu_count() or 2) - 4) // max(1, share)))


def _check_layer(layer: int, host_k: torch.Tensor) -> None:
    if not 0 <= layer < host_k.shape[0]:
        raise ValueError(f"layer {layer} out of range [0, {host_k.shape[0]})")


@functools.cache
def _shared_pool(num_threads: int, nontemporal: bool):
    pool = host_ext().ScatterPool(num_threads, nontemporal)
    atexit.register(pool.shutdown)
    return pool


def scatter_rows_cpu(
    k_rows: torch.Tensor,
    v_rows: torch.Tensor,
    host_k: torch.Tensor,
    host_v: torch.Tensor,
    layer: int,
    token_slots: torch.Tensor,
    *,
    num_threads: int | None = None,
    nontemporal: bool = True,
) -> None:
    """FlashD2H's scatter step on CPU tensors, in native threads (GIL released); blocks until done.

    Parameters
    ----------
    k_rows, v_rows : torch.Tensor
        CPU ``[num_tokens, num_kv_heads, head_dim]`` (e.g. a staging buffer).
    host_k, host_v : torch.Tensor
        CPU ``[num_layers, num_kv_heads, num_host_pages, page_size, head_dim]``, same dtype; written.
    layer : int
    token_slots : torch.Tensor
        ``[num_tokens]`` int32/int64: ``page * page_size + offset``; ``< 0`` skips the token.
    num_threads : int, optional
        Worker threads (default :func:`default_num_threads`). A pool per setting is kept for reuse.
    nontemporal : bool
        Write with streaming (cache-bypassing) stores when rows are 16-byte multiples.

    Raises
    ------
    ValueError
        On a layout mismatch, a layer or a slot out of range (same as ``scatter_tokens_reference``).
    """
    check_host_store(host_k, host_v)
    check_tokens(k_rows, v_rows, host_k, token_slots)
    if k_rows.device.type != "cpu" or host_k.device.type != "cpu":
        raise ValueError("scatter_rows_cpu works on CPU tensors")
    _check_layer(layer, host_k)
    pool = _shared_pool(num_threads or default_num_threads(), nontemporal)
    slots = token_slots.to(torch.int64).contiguous()
    pool.wait(pool.submit([0, 0], -1, [k_rows, v_rows], [host_k, host_v], layer, slots, k_rows.shape[0]))


@dataclass
class _Staging:
    k: torch.Tensor
    v: torch.Tensor
    slots: torch.Tensor
    k_copied: torch.cuda.Event  # recorded after the slots and K copies
    v_copied: torch.cuda.Event  # recorded after the V copy
    ticket: int = 0


class FlashD2H:
    """Staged save engine: one D2H copy per call, then a native CPU scatter.

    Parameters
    ----------
    host_k, host_v : torch.Tensor
        Pinned CPU host store ``[num_layers, num_kv_heads, num_host_pages, page_size, head_dim]``.
    max_tokens : int
        Largest ``num_tokens`` one :meth:`submit` takes (sizes the staging buffers).
    num_buffers : int
        Staging buffers in the ring; :meth:`submit` blocks while all hold unscattered rows.
    num_threads : int, optional
        Scatter threads (default :func:`default_num_threads`).
    nontemporal : bool
        Streaming stores for the scatter.
    device : optional
        The CUDA device whose tensors are saved (default: current).

    Saves in flight together must write distinct slots: wait for a ticket before rewriting its
    slots. Not thread-safe: submit from one thread. Not for use inside CUDA-graph capture.
    """

    sms_used = 0  # the copy engine moves the bytes, CPU threads place them

    def __init__(
        self,
        host_k: torch.Tensor,
        host_v: torch.Tensor,
        max_tokens: int,
        *,
        num_buffers: int = 4,
        num_threads: int | None = None,
        nontemporal: bool = True,
        device=None,
    ):
        check_host_store(host_k, host_v)
        if host_k.device.type != "cpu" or not host_k.is_pinned():
            raise ValueError("FlashD2H needs a pinned CPU host store (see alloc_host_store)")
        if max_tokens < 1 or num_buffers < 1:
            raise ValueError(f"max_tokens and num_buffers must be >= 1, got {max_tokens}, {num_buffers}")
        self.host_k, self.host_v, self.max_tokens = host_k, host_v, max_tokens
        self.device = torch.device("cuda", device_index(device))
        _, heads, pages, page_size, head_dim = host_k.shape
        self.num_slots = pages * page_size
        self._stream = torch.cuda.Stream(self.device)
        self._ring = [
            _Staging(
                k=alloc_host_tensor((max_tokens, heads, head_dim), host_k.dtype),
                v=alloc_host_tensor((max_tokens, heads, head_dim), host_k.dtype),
                slots=alloc_host_tensor((max_tokens,), torch.int64),
                k_copied=torch.cuda.Event(blocking=True),  # waiting workers sleep instead of spinning
                v_copied=torch.cuda.Event(blocking=True),
            )
            for _ in range(num_buffers)
        ]
        self._next = 0
        self._pool = host_ext().ScatterPool(num_threads or default_num_threads(), nontemporal)
        self._finalizer = weakref.finalize(self, self._pool.shutdown)

    @property
    def num_threads(self) -> int:
        return self._pool.num_threads

    @property
    def num_buffers(self) -> int:
        return len(self._ring)

    @property
    def staging_bytes(self) -> int:
        """Pinned bytes of the ring (its K, V and slot buffers)."""
        return sum(b.k.nbytes + b.v.nbytes + b.slots.nbytes for b in self._ring)

    def submit(self, layer: int, k: torch.Tensor, v: torch.Tensor, token_slots: torch.Tensor) -> int:
        """Start saving one layer's new K/V; returns a ticket for :meth:`wait`.

        Parameters
        ----------
        layer : int
        k, v : torch.Tensor
            Contiguous CUDA ``[num_tokens, num_kv_heads, head_dim]`` of the store's dtype, produced
            on the current stream (the copy waits for it; the caller may free them afterwards).
        token_slots : torch.Tensor
            ``[num_tokens]`` int32/int64, CPU or CUDA: ``page * page_size + offset``; ``< 0`` skips.

        Raises
        ------
        ValueError
            On a layout mismatch, ``num_tokens > max_tokens``, or (CPU slots) a slot out of range;
            a CUDA slot out of range is reported by the next :meth:`wait` covering this ticket (or by
            a later submit that waits for this ticket's staging buffer).
        """
        if not self._finalizer.alive:
            raise RuntimeError("this FlashD2H is shut down (closed)")
        check_tokens(k, v, self.host_k, token_slots)
        _check_layer(layer, self.host_k)
        if k.device != self.device:
            raise ValueError(f"k/v must be on {self.device}, got {k.device}")
        n = k.shape[0]
        if n > self.max_tokens:
            raise ValueError(
                f"{n} tokens exceed this FlashD2H's max_tokens={self.max_tokens}: construct it "
                "with a larger max_tokens or submit the batch in parts"
            )
        if not token_slots.is_cuda and n and int(token_slots.max()) >= self.num_slots:
            raise ValueError(f"token slot {int(token_slots.max())} is past the host store ({self.num_slots} slots)")
        if n == 0:
            return self._pool.submit([0], -1, [self._ring[0].k], [self.host_k], layer, self._ring[0].slots, 0)
        buf = self._ring[self._next]
        self._next = (self._next + 1) % len(self._ring)
        with record_function("sparse.d2h_ring_wait"):  # named in profiles: the forward waits for the host here
            self._pool.wait(buf.ticket)  # the buffer is free once its last scatter is done (blocks if the ring is full)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):  # K's scatter starts while V is still copying
            if token_slots.is_cuda:
                buf.slots[:n].copy_(token_slots, non_blocking=True)
            buf.k[:n].copy_(k, non_blocking=True)
            buf.k_copied.record(self._stream)
            buf.v[:n].copy_(v, non_blocking=True)
            buf.v_copied.record(self._stream)
        for t in (k, v, token_slots):
            if t.is_cuda:
                t.record_stream(self._stream)  # the caller may free them before the copy has run
        if not token_slots.is_cuda:
            buf.slots[:n].copy_(token_slots)
        events = [buf.k_copied.cuda_event, buf.v_copied.cuda_event]
        buf.ticket = self._pool.submit(
            events, self.device.index, [buf.k, buf.v], [self.host_k, self.host_v], layer, buf.slots, n
        )
        return buf.ticket

    def wait(self, ticket: int) -> None:
        """Block (GIL released) until ``ticket`` and every earlier save are in the host store.

        Raises the first error of those saves (each error is raised once)."""
        self._pool.wait(ticket)

    def synchronize(self) -> None:
        """Block until every submitted save is in the host store."""
        self._pool.synchronize()

    def close(self) -> None:
        """Finish queued saves and join the threads (also at garbage collection and exit)."""
        self._finalizer()

    def __enter__(self) -> FlashD2H:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class DirectD2H:
    """Direct-write save: a kernel of ``num_ctas`` CTAs writes the rows into pinned host memory (UVA).

    Parameters
    ----------
    host_k, host_v : torch.Tensor
        Pinned CPU host store ``[num_layers, num_kv_heads, num_host_pages, page_size, head_dim]``;
        ``head_dim * itemsize`` must be a multiple of 16.
    num_ctas : int
        Grid size: at most this many SMs are taken from the model while it runs.
    device : optional
        CUDA device (default: current).
    """

    def __init__(self, host_k: torch.Tensor, host_v: torch.Tensor, *, num_ctas: int = 16, device=None):
        check_host_store(host_k, host_v)
        if host_k.shape[-1] * host_k.element_size() % 16:
            raise ValueError("DirectD2H needs head_dim * itemsize to be a multiple of 16")
        self.device = torch.device("cuda", device_index(device))
        self.host_k, self.host_v = cuda_view(host_k, self.device), cuda_view(host_v, self.device)
        self.num_ctas = num_ctas
        self.sms_used = min(num_ctas, torch.cuda.get_device_properties(self.device).multi_processor_count)
        self._ext = cuda_ext()

    def __call__(self, layer: int, k: torch.Tensor, v: torch.Tensor, token_slots: torch.Tensor) -> int:
        """Save one layer's K/V on the current stream (same semantics as ``scatter_tokens_reference``;
        out-of-range slots are skipped). ``token_slots`` should be on the GPU. Returns the grid size used."""
        check_tokens(k, v, self.host_k, token_slots)
        slots = token_slots if token_slots.is_cuda else token_slots.to(k.device)
        return self._ext.direct_d2h(k, v, self.host_k, self.host_v, layer, slots, self.num_ctas)
