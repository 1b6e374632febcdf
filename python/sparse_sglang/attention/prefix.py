"""Dense prefill over a cached prefix whose KV lives on the host.

Prefill stays dense: new tokens attend to each other with FlashInfer's ragged kernel, and to
their prefix (an earlier chunk of a chunked prefill, or a prefix the radix cache shares) with
FlashInfer's paged kernel. Here the prefix is on the host, so per layer FlashH2D first stages
prefix pages of every kv head into a fixed GPU buffer laid out ``[pages, Hkv, P, D]`` (HND), then
the paged kernel reads them. ``--sparse-prefix-staging-tokens`` bounds what is staged at once: a
batch whose prefixes are longer is attended in *pieces* (:func:`prefix_pieces`), each merged into
the output by its log-sum-exp, so a prefill's KV in GPU memory is bounded whatever its length.

The staging memory is two buffers of half that size, and the loads run on a side stream: piece
``i`` stages into buffer ``i % 2`` as soon as the attention that last read that buffer is done
(:func:`next_staged_piece`), so the next piece, or the next layer's first pieces, load while
this one is attended and while the layer's projections and MLP run, instead of in series with
them.

With ``--sparse-resident-prefix-tokens`` the prompt being prefilled keeps its prefix in GPU
memory between its chunks (:class:`ResidentPart`): each chunk stages into a resident buffer, every
layer at once, only the pages the chunk before it added, and attends those and the earlier ones
from there; only the prefix past the buffer's capacity, and the last page while it is still
filling, go through the staging buffers. The buffer belongs to the last request of the last
prefill batch (the one SGLang chunks), identified by its request slot and the slot's generation,
so a slot given to another request never reads what an earlier one left.

An fp8 store's prefix is converted to bf16 as it is staged (on the load stream, one pass over the
piece in HBM; the KV scales still go to the kernel, which folds them into the softmax scale and the
output): FlashInfer's Hopper (FA3) kernels take fp8 KV only with fp8 queries, so an fp8 prefix
ran on the FA2 kernel, slower than FA2 over bf16 and than FA3
(``docs/decisions/0012-fp8-prefix-attended-in-bf16.md``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from sparse_sglang.attention.constants import LayerConstants
from sparse_sglang.mem_cache.host_pool import host_block
from sparse_sglang.mem_cache.kv_store import SparseKVStore
from sparse_sglang.mem_cache.plan import STAGING_BUFFERS, staging_buffer_pages
from sparse_sglang.mem_cache.utils import host_to_device, kv_compute_dtype
from sparse_sglang.stats import SparseStats

# FlashInfer prefill wrappers planned once per forward. A forward with more pieces re-plans them
# per layer in turn (each wrapper owns an 8 MiB GPU plan buffer, so their number is bounded). Six
# cover a 48K-token prefix at the default staging (pieces of 8K): a 56K prompt in 8K chunks.
PLANNED_PIECES = 6
# PLANNED_PIECES is a multiple of STAGING_BUFFERS, so a planned wrapper always reads the same buffer.
assert PLANNED_PIECES % STAGING_BUFFERS == 0


@dataclass(frozen=True)
class PrefixPiece:
    """One staging-buffer load: pages ``pages`` of the batch's prefix pages (request by request),
    which belong to requests ``reqs`` (their query rows ``rows``). The lists are FlashInfer's plan
    inputs for those requests: query and page offsets, and tokens in each one's last page (0 for
    a request with no page here)."""

    reqs: range
    rows: slice
    pages: slice
    qo_indptr: list[int]
    kv_indptr: list[int]
    last_page_len: list[int]


def prefix_pieces(
    prefix_lens: list[int],
    extend_lens: list[int],
    page_size: int,
    capacity_pages: int,
    skip_pages: list[int] | None = None,
) -> list[PrefixPiece]:
    """Cut the batch's prefix pages, request by request, into pieces of at most ``capacity_pages``.

    A piece spans the consecutive requests its pages belong to, so their query rows are one
    slice; a request with no prefix between two that have one rides along with no pages.
    ``skip_pages``: each request's first pages not to stage (its resident ones; none by default).
    """
    if capacity_pages < 1:
        raise ValueError(f"capacity_pages must be positive, got {capacity_pages}")
    skip = skip_pages or [0] * len(prefix_lens)
    pages = [math.ceil(n / page_size) - s for n, s in zip(prefix_lens, skip)]
    last_len = [n - (math.ceil(n / page_size) - 1) * page_size for n in prefix_lens]  # tokens in the last page
    first = [sum(pages[:i]) for i in range(len(pages))]
    qo = [sum(extend_lens[:i]) for i in range(len(extend_lens) + 1)]
    total = sum(pages)
    pieces = []
    for start in range(0, total, capacity_pages):
        end = min(total, start + capacity_pages)
        inside = [r for r in range(len(pages)) if pages[r] and first[r] < end and first[r] + pages[r] > start]
        reqs = range(inside[0], inside[-1] + 1)
        kv_indptr, last_page_len = [0], []
        for r in reqs:
            lo, hi = max(start, first[r]), min(end, first[r] + pages[r])
            n = max(0, hi - lo)
            kv_indptr.append(kv_indptr[-1] + n)
            ends_here = n and hi == first[r] + pages[r]  # the request's last prefix page is in this piece
            last_page_len.append(last_len[r] if ends_here else page_size if n else 0)
        qo_indptr = [qo[r] - qo[reqs.start] for r in range(reqs.start, reqs.stop + 1)]
        pieces.append(PrefixPiece(reqs, slice(qo[reqs.start], qo[reqs.stop]), slice(start, end), qo_indptr,
                                  kv_indptr, last_page_len))  # fmt: skip
    return pieces


@dataclass(frozen=True, slots=True)
class ResidentPart:
    """The resident prefix in one forward: request ``request`` (its index in the batch; -1: none)
    attends its first ``pages`` prefix pages from the resident buffer, after its pages ``fill``
    (a sub-range of them) were staged into it; ``rows``: its query rows in the batch."""

    request: int = -1
    pages: int = 0
    fill: range = range(0)
    rows: slice = dataclasses.field(default_factory=lambda: slice(0, 0))


RequestKey = tuple[int, int]  # a request slot and the slot's generation: one request


def resident_part(keys: list[RequestKey], prefix_lens: list[int], owner: RequestKey | None, owner_pages: int,
                  capacity_pages: int, page_size: int) -> tuple[ResidentPart, RequestKey | None, int]:  # fmt: skip
    """The resident prefix's part in a forward of requests ``keys`` with prefixes ``prefix_lens``,
    when the buffer holds ``owner_pages`` pages of ``owner``'s prefix; and what it holds after the
    forward: ``(part, owner, pages)``.

    The owner attends its whole pages up to the capacity from the buffer, staging there first the
    ones it lacks (a prefix shorter than what the buffer holds, which no chunked prompt has, starts
    it again). The buffer then passes to the batch's last request, the one SGLang may have cut
    short, keeping its pages if that is the owner; it holds none of a new owner's yet: they are
    staged at its next chunk, once the host has them.
    """
    part = ResidentPart()
    if owner is not None and owner in keys:
        i = keys.index(owner)
        full = min(prefix_lens[i] // page_size, capacity_pages)
        if full:
            part = ResidentPart(i, full, range(owner_pages if owner_pages <= full else 0, full))
    if not capacity_pages or not keys:
        return part, None, 0
    return part, keys[-1], part.pages if part.request == len(keys) - 1 else 0


def staged_pages(prefix_lens: list[int], skip_pages: list[int], page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefix pages a forward stages, request by request (each request's from its
    ``skip_pages`` on): ``(request, page)``, each request's index in the batch and the page's in
    its prefix (host tensors)."""
    skipped = torch.tensor(skip_pages, dtype=torch.int64)
    pages = (torch.tensor(prefix_lens, dtype=torch.int64) + page_size - 1) // page_size - skipped
    first = torch.cumsum(pages, 0) - pages
    request = torch.repeat_interleave(torch.arange(len(pages)), pages)
    return request, torch.arange(int(pages.sum())) - torch.repeat_interleave(first - skipped, pages)


def resident_fill_blocks(host_pages: torch.Tensor, first_page: int, num_layers: int, num_kv_heads: int,
                         num_host_pages: int, capacity_pages: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """FlashH2D's ``(src_blocks, dst_slots)`` staging a request's prefix pages ``first_page,
    first_page + 1, ...`` (host pages ``host_pages``) into the resident buffer, every layer and kv
    head: the host page's :func:`host_block`, buffer slot ``(layer * capacity_pages + page) * Hkv + head``."""
    device = host_pages.device
    pages = torch.arange(first_page, first_page + len(host_pages), device=device).view(1, -1, 1)
    layer = torch.arange(num_layers, device=device).view(-1, 1, 1)
    head = torch.arange(num_kv_heads, device=device).view(1, 1, -1)
    src = host_block(layer, head, host_pages.long().view(1, -1, 1), num_kv_heads, num_host_pages).reshape(-1)
    dst = ((layer * capacity_pages + pages) * num_kv_heads + head).reshape(-1)
    return src, dst


def next_staged_piece(layer: int, piece: int, num_pieces: int, buffers: int = STAGING_BUFFERS) -> tuple[int, int]:
    """The ``(layer, piece)`` to stage once the attention over ``(layer, piece)`` is done: the next
    one, in the order they are attended, that uses the buffer it frees (``piece % buffers``)."""
    if piece + buffers < num_pieces:
        return layer, piece + buffers
    return layer + 1, piece % buffers


class PrefixAttention:
    """Stage prefixes from the host and attend to them (plan once per forward, run per layer).

    Parameters
    ----------
    store : SparseKVStore
    num_q_heads : int
    workspace : torch.Tensor
        FlashInfer float workspace (GPU, uint8).
    staging_tokens : int
        Prefix tokens staged at once, in two buffers of half as many (``--sparse-prefix-staging-tokens``).
    sm_scale, logits_soft_cap : float, optional
        The model's (every layer's; planned once per forward): 1/sqrt(head_dim) and none by default.
    resident_tokens : int
        Prefix tokens of the prompt being prefilled kept between its chunks, whole pages
        (``--sparse-resident-prefix-tokens``; 0: none).
    stats : SparseStats, optional
        The runtime's counters; this writes ``resident_prefix_pages``.
    """

    def __init__(self, store: SparseKVStore, num_q_heads: int, workspace: torch.Tensor, staging_tokens: int,
                 sm_scale: float | None = None, logits_soft_cap: float | None = None, resident_tokens: int = 0,
                 stats: SparseStats | None = None):  # fmt: skip
        import flashinfer

        from sparse_sglang.transfer import FlashH2D

        s = store.shape
        self.store, self.num_q_heads = store, num_q_heads
        self.constants = LayerConstants.of(s.head_dim, sm_scale, logits_soft_cap)
        self.capacity = staging_buffer_pages(staging_tokens, s.page_size)  # pages of one buffer
        pages = STAGING_BUFFERS * self.capacity
        self.k = torch.empty(pages * s.num_kv_heads, s.page_size, s.head_dim, dtype=s.dtype, device=store.device)
        self.v = torch.empty_like(self.k)
        self.load = FlashH2D(store.host.k, store.host.v, self.k, self.v)
        # What the kernel reads: the staged pages themselves, or their bf16 copy (fp8 stores).
        self.attend_dtype = kv_compute_dtype(s.dtype)
        self.k_attend = self.k if self.attend_dtype == s.dtype else torch.empty_like(self.k, dtype=self.attend_dtype)
        self.v_attend = self.v if self.attend_dtype == s.dtype else torch.empty_like(self.v, dtype=self.attend_dtype)
        self.kv = tuple(t.view(pages, s.num_kv_heads, s.page_size, s.head_dim) for t in (self.k_attend, self.v_attend))
        self.wrappers = [
            flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "HND") for _ in range(PLANNED_PIECES)
        ]
        # Re-planning a wrapper rewrites the pinned buffer its last plan's copy reads: wait for its last run first.
        self.last_run = [torch.cuda.Event() for _ in self.wrappers]
        self.slots = torch.arange(pages * s.num_kv_heads, device=store.device)
        self.page_index = torch.arange(pages, dtype=torch.int32, device=store.device)
        self.load_stream = torch.cuda.Stream(store.device)
        self.loaded = [torch.cuda.Event() for _ in range(STAGING_BUFFERS)]
        # (layer, piece) each buffer holds or is loading; None: nothing this plan can use.
        self.staged: list[tuple[int, int] | None] = [None] * STAGING_BUFFERS
        self.pieces: list[PrefixPiece] = []
        self.active = False
        # The resident prefix: every layer's pages [layers * capacity * Hkv, P, D] as the host
        # stores them (page j of head h of layer l at (l * capacity + j) * Hkv + h), one layer's
        # copy to attend from when the dtypes differ, and whose prefix it holds.
        self.stats = stats if stats is not None else SparseStats()
        self.resident_capacity = resident_tokens // s.page_size
        self.resident: ResidentPart = ResidentPart()  # this forward's
        self.owner: RequestKey | None = None
        self.owner_pages = 0
        if self.resident_capacity:
            units = s.num_layers * self.resident_capacity * s.num_kv_heads
            self.resident_k = torch.empty(units, s.page_size, s.head_dim, dtype=s.dtype, device=store.device)
            self.resident_v = torch.empty_like(self.resident_k)
            self.resident_load = FlashH2D(store.host.k, store.host.v, self.resident_k, self.resident_v)
            layer = (self.resident_capacity, s.num_kv_heads, s.page_size, s.head_dim)
            if self.attend_dtype == s.dtype:
                self.resident_attend = None
            else:
                self.resident_attend = tuple(
                    torch.empty(layer, dtype=self.attend_dtype, device=store.device) for _ in "kv"
                )
            self.resident_layers = tuple(t.view(s.num_layers, *layer) for t in (self.resident_k, self.resident_v))
            self.resident_index = torch.arange(self.resident_capacity, dtype=torch.int32, device=store.device)
            self.resident_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "HND")
            self.resident_loaded = torch.cuda.Event()

    @property
    def staging_bytes(self) -> int:
        """GPU bytes of the staging buffers (with their bf16 copies for an fp8 store)."""
        staged = 2 * self.k.numel() * self.k.element_size()
        return staged if self.k_attend is self.k else staged + 2 * self.k_attend.numel() * self.k_attend.element_size()

    @property
    def replans(self) -> bool:
        """More pieces than planned wrappers: each run re-plans them in turn."""
        return len(self.pieces) > len(self.wrappers)

    def plan(self, req_to_token: torch.Tensor, req_slots: torch.Tensor, prefix_lens_cpu: list[int],
             extend_lens_cpu: list[int], keys: list[RequestKey] | None = None) -> None:  # fmt: skip
        """Prepare one extend forward; no-op (``active`` false) when no request has a prefix.
        ``keys``: each request's slot and generation, for the resident prefix (None: a batch no
        request holds, which neither reads nor passes on the resident buffer)."""
        s = self.store.shape
        page, heads = s.page_size, s.num_kv_heads
        self.active = any(prefix_lens_cpu)
        self.staged = [None] * STAGING_BUFFERS
        self.resident = ResidentPart()
        if keys is not None and self.resident_capacity:
            part, self.owner, self.owner_pages = resident_part(
                keys, prefix_lens_cpu, self.owner, self.owner_pages, self.resident_capacity, page
            )
            if part.pages:
                qo = sum(extend_lens_cpu[: part.request])
                self.resident = dataclasses.replace(part, rows=slice(qo, qo + extend_lens_cpu[part.request]))
        if not self.active:
            self.pieces = []
            return
        skip = [0] * len(prefix_lens_cpu)
        if self.resident.pages:
            skip[self.resident.request] = self.resident.pages
            self._plan_resident(req_to_token, req_slots)
        self.pieces = prefix_pieces(prefix_lens_cpu, extend_lens_cpu, page, self.capacity, skip)
        device = req_slots.device
        # Host page of every staged prefix page, request by request.
        request, prefix_page = (host_to_device(t, device) for t in staged_pages(prefix_lens_cpu, skip, page))
        host_page = req_to_token[req_slots.long()[request], prefix_page * page].long() // page  # [staged pages]
        head = torch.arange(heads, device=device)
        # Host block of every (prefix page, kv head) in layer 0; a layer's are these shifted (host_block)
        self.src_base = host_block(0, head.view(1, -1), host_page.view(-1, 1), heads, s.num_host_pages).reshape(-1)
        self.src_base.record_stream(self.load_stream)  # read there: not reused before those loads are done
        if not self.replans:
            for i, (wrapper, piece) in enumerate(zip(self.wrappers, self.pieces)):
                self._plan(wrapper, piece, i % STAGING_BUFFERS)

    def _plan_resident(self, req_to_token: torch.Tensor, req_slots: torch.Tensor) -> None:
        """Stage the resident request's missing pages into the buffer, every layer in one load on
        the load stream (after what the compute stream has issued: the last forward's reads of the
        buffer), and plan its attention over the resident pages."""
        s, part = self.store.shape, self.resident
        heads, device = s.num_kv_heads, req_slots.device
        self.load_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.load_stream):
            if part.fill:
                columns = torch.arange(part.fill.start, part.fill.stop, device=device) * s.page_size
                host_pages = req_to_token[req_slots[part.request].long(), columns] // s.page_size
                self.resident_load(*resident_fill_blocks(host_pages, part.fill.start, s.num_layers, heads,
                                                         s.num_host_pages, self.resident_capacity))  # fmt: skip
            self.resident_loaded.record()
        self.resident_wrapper.plan(torch.tensor([0, part.rows.stop - part.rows.start], dtype=torch.int32),
                                   torch.tensor([0, part.pages], dtype=torch.int32), self.resident_index[: part.pages],
                                   torch.tensor([s.page_size], dtype=torch.int32), self.num_q_heads, heads, s.head_dim,
                                   s.page_size, causal=False, sm_scale=self.constants.sm_scale,
                                   logits_soft_cap=self.constants.logits_soft_cap, q_data_type=self.attend_dtype,
                                   kv_data_type=self.attend_dtype)  # fmt: skip
        self.stats.resident_prefix_pages += part.pages

    def _plan(self, wrapper, piece: PrefixPiece, buffer: int) -> None:
        s = self.store.shape
        num_pages = piece.kv_indptr[-1]
        first = buffer * self.capacity
        wrapper.plan(torch.tensor(piece.qo_indptr, dtype=torch.int32), torch.tensor(piece.kv_indptr, dtype=torch.int32),
                     self.page_index[first : first + num_pages], torch.tensor(piece.last_page_len, dtype=torch.int32), self.num_q_heads,
                     s.num_kv_heads, s.head_dim, s.page_size, causal=False, sm_scale=self.constants.sm_scale,
                     logits_soft_cap=self.constants.logits_soft_cap, q_data_type=self.attend_dtype,
                     kv_data_type=self.attend_dtype)  # fmt: skip

    def run(self, layer: int, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sm_scale: float | None = None,
            logits_soft_cap: float | None = None, k_scale: float | None = None, v_scale: float | None = None) -> None:  # fmt: skip
        """Merge the attention of ``q`` ``[T, Hq, D]`` over the prefixes of one layer into ``out``
        ``[T, Hq, D]`` and ``lse`` ``[T, Hq]`` (float32), in place: those hold the attention over
        the other keys (the new tokens'). ``sm_scale``/``logits_soft_cap``: the layer's, which must
        be the planned ones (None: not checked); ``k_scale``/``v_scale``: per-tensor scales of fp8 KV."""
        import flashinfer

        self.constants.check(sm_scale, logits_soft_cap, "prefix attention")

        compute = torch.cuda.current_stream()
        if self.resident.pages:
            self._run_resident(layer, q, out, lse, k_scale, v_scale)
        for i in range(min(STAGING_BUFFERS, len(self.pieces))):
            if self.staged[i] != (layer, i):  # not loaded ahead: the forward's first layer
                self._stage(layer, i)
        for i, piece in enumerate(self.pieces):
            w, b = i % len(self.wrappers), i % STAGING_BUFFERS
            wrapper = self.wrappers[w]
            if self.replans:
                self.last_run[w].synchronize()
                self._plan(wrapper, piece, b)
            assert self.staged[b] == (layer, i), (self.staged, layer, i)  # staged when piece i - 2 was done
            compute.wait_event(self.loaded[b])
            o, s_piece = wrapper.run(q[piece.rows], self.kv, k_scale=k_scale, v_scale=v_scale, return_lse=True)
            flashinfer.merge_state_in_place(out[piece.rows], lse[piece.rows], o, s_piece)
            if self.replans:
                self.last_run[w].record()
            self.staged[b] = None
            next_layer, next_piece = next_staged_piece(layer, i, len(self.pieces))
            if next_layer < self.store.shape.num_layers:
                self._stage(next_layer, next_piece)

    def _run_resident(self, layer: int, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                      k_scale: float | None, v_scale: float | None) -> None:  # fmt: skip
        """Merge the resident request's attention over its resident pages of ``layer``."""
        import flashinfer

        n = self.resident.pages
        torch.cuda.current_stream().wait_event(self.resident_loaded)
        kv = tuple(t[layer] for t in self.resident_layers)
        if self.resident_attend is not None:  # an fp8 store: attended in bf16, as the staged pieces are
            for dst, src in zip(self.resident_attend, kv):
                dst[:n].copy_(src[:n])
            kv = self.resident_attend
        rows = self.resident.rows
        o, s_resident = self.resident_wrapper.run(q[rows], kv, k_scale=k_scale, v_scale=v_scale, return_lse=True)
        flashinfer.merge_state_in_place(out[rows], lse[rows], o, s_resident)

    def _stage(self, layer: int, i: int) -> None:
        """Load piece ``i`` of ``layer`` into its buffer on the load stream, after everything issued
        on this stream so far (the last attention over that buffer among it)."""
        s = self.store.shape
        heads, piece, b = s.num_kv_heads, self.pieces[i], i % STAGING_BUFFERS
        units = (piece.pages.stop - piece.pages.start) * heads
        first = b * self.capacity * heads
        self.load_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.load_stream):
            layer_shift = host_block(layer, 0, 0, heads, s.num_host_pages)
            src = self.src_base[piece.pages.start * heads : piece.pages.stop * heads] + layer_shift
            self.load(src, self.slots[first : first + units])
            if self.k_attend is not self.k:
                self.k_attend[first : first + units].copy_(self.k[first : first + units])
                self.v_attend[first : first + units].copy_(self.v[first : first + units])
            self.loaded[b].record()
        self.staged[b] = (layer, i)
