"""A sparse decode step outside the server, for the GPU tests and ``benchmark/decode.py``.

:class:`DecodeBench` holds one :class:`SparseKVStore` with ``batch`` requests of ``context``
tokens each (their own host pages), a decoder (:func:`make_decoder`) planned for the step, and helpers to
fill the host store and summaries from real K/V, and to evict a fraction of the cached pages.
:meth:`DecodeBench.step` is what ``SparseRuntime.begin_decode`` does to the cache and decoder for
a step whose rows are open already (no SGLang request slots, no tracker); it returns the step's
:class:`~sparse_sglang.attention.sparse_decode.DecodePlan`, which ``decoder.run`` takes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sparse_sglang.attention.sparse_decode import DecodePlan, make_decoder
from sparse_sglang.config import SparseConfig
from sparse_sglang.mem_cache.kernels import SaveRuns
from sparse_sglang.mem_cache.key_sketch import KeyBasis
from sparse_sglang.mem_cache.kv_store import SparseKVStore, StoreShape
from sparse_sglang.mem_cache.plan import row_width_for
from sparse_sglang.runtime import build_store


@dataclass(frozen=True)
class Llama8BShape:
    num_layers: int = 1
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128


def make_store(shape: Llama8BShape, config: SparseConfig, max_batch: int, max_context: int,
               dtype=torch.bfloat16) -> SparseKVStore:  # fmt: skip
    page = config.page_size
    max_pages = math.ceil((max_context + 1) / page)
    width = row_width_for(config.candidate_pages, max_pages, config.cache_row_ratio)
    s = StoreShape(
        num_layers=shape.num_layers, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, page_size=page,
        dtype=dtype, num_host_pages=max_batch * max_pages + 1, num_slots=max_batch * shape.num_layers * shape.num_kv_heads * width,
        max_requests=max_batch + 1, row_width=width, max_pages=max_pages, max_save_tokens=8192,
    )  # fmt: skip
    key_basis = None
    if config.keeps_key_sketches:  # random directions: the test and timing KV is random too
        rank = config.sketch_rank or max(1, shape.head_dim // 4)
        key_basis = KeyBasis.random(shape.num_layers, shape.num_kv_heads, shape.head_dim, rank)
    return build_store(config, s, "cuda", key_basis)


def fill_codes_randomly(codes: dict[str, torch.Tensor], generator: torch.Generator | None = None) -> None:
    """Random key codes and frames for one layer's table (``PageKeyCodes.layer``), each frame's
    ``hi`` above its ``lo``."""
    codes["codes"].random_(0, 256, generator=generator)
    lo = torch.randn(codes["lo"].shape, device=codes["lo"].device, generator=generator)
    codes["lo"].copy_(lo)
    codes["hi"].copy_(lo + torch.rand(lo.shape, device=lo.device, generator=generator))


class DecodeBench:
    """``batch`` requests (slots ``1..batch``) of ``context`` tokens plus the one decoded now."""

    def __init__(self, store: SparseKVStore, config: SparseConfig, num_q_heads: int, batch: int, context: int,
                 workspace: torch.Tensor, **decoder_options):  # fmt: skip
        s = store.shape
        self.store, self.batch, self.context = store, batch, context
        self.seq_len = context + 1
        self.num_pages = math.ceil(self.seq_len / s.page_size)
        self.req_slots = torch.arange(1, batch + 1, device="cuda")
        cache = store.cache
        for slot in range(1, s.max_requests):
            if cache.is_open(slot):
                cache.close_request(slot)
        for slot in range(1, batch + 1):
            cache.open_request(slot, self.num_pages)
        # Request b holds host pages 1 + b * num_pages ... (distinct pages, as in the server).
        self.host_pages = (1 + torch.arange(batch, device="cuda").view(-1, 1) * self.num_pages
                           + torch.arange(self.num_pages, device="cuda").view(1, -1)).to(torch.int32)  # fmt: skip
        self.decoder = make_decoder(store, config, num_q_heads, workspace, batch, **decoder_options)
        self.positions = torch.full((batch,), context, device="cuda")

    def plan(self, staggered: bool = False) -> DecodePlan:
        """The bench's own step (every request at ``seq_len``), its save runs bound.

        ``staggered`` (``--sparse-reselect-interval`` N > 1): the steady state a server reaches,
        where the requests' phases are spread and one in N of them selects from all its pages
        this step while the others reuse their cached rows. Without it every request is due (the
        first step of each, which fills the rows: run one before timing a staggered plan)."""
        interval = self.decoder.interval
        if staggered and interval > 1:
            due = torch.arange(self.batch, device=self.req_slots.device) % interval == 0
            # due_for_selection counts tokens since each request's last full selection
            self.store.cache.selected_at[self.req_slots] = torch.where(due, self.seq_len - interval, self.seq_len - 1)
        plan = self.step(self.req_slots, torch.full((self.batch,), self.seq_len), self.host_pages)
        self.store.bind_runs(SaveRuns.for_decode(self.req_slots, self.positions + 1, self.store.shape.page_size))
        return plan

    def step(self, req_slots: torch.Tensor, seq_lens: torch.Tensor, host_pages: torch.Tensor,
             graph: bool = False) -> DecodePlan:  # fmt: skip
        """A decode step of ``req_slots`` at ``seq_lens`` (host) over ``host_pages``: the cache's
        step counter, the re-selection phase, the decoder's plan."""
        cache, interval = self.store.cache, self.decoder.interval
        cache.next_step()
        reselect = None if interval == 1 else cache.due_for_selection(req_slots, seq_lens, interval)
        return self.decoder.plan(req_slots, seq_lens, host_pages, seq_lens=seq_lens.to(req_slots.device), graph=graph,
                                 reselect=reselect)  # fmt: skip

    def token_slots(self) -> torch.Tensor:
        """``[batch, seq_len]`` host token slots of every token of every request."""
        page = self.store.shape.page_size
        t = torch.arange(self.seq_len, device="cuda")
        return (self.host_pages.long()[:, t // page] * page + t % page).view(self.batch, -1)

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Save ``[batch, seq_len, Hkv, D]`` K/V of one layer (host store, summaries; not cached)."""
        slots = self.token_slots().reshape(-1)
        page = self.store.shape.page_size
        self.store.bind_runs(
            SaveRuns.for_extend(self.req_slots.tolist(), [0] * self.batch, [self.seq_len] * self.batch, page, "cuda")
        )
        heads, dim = k.shape[-2:]
        self.store.save(layer, slots, k.reshape(-1, heads, dim), v.reshape(-1, heads, dim), staged=True)
        self.store.wait_saves()

    def fill_summaries_randomly(self, generator: torch.Generator | None = None) -> None:
        """Random page summaries (timing runs: the pages a step selects look random)."""
        summ = self.store.summaries
        for layer in range(summ.kmin.shape[0]):  # a layer at a time: the float32 temporaries stay small
            lo = torch.randn(summ.kmin[layer].shape, device="cuda", generator=generator)
            # Summed in float32 (fp8 tensors have no add); rounding is monotone, so kmax >= kmin.
            summ.set_bounds(layer, lo, lo + torch.rand(lo.shape, device="cuda", generator=generator))
            if summ.mean is not None:
                summ.mean[layer].copy_(summ.center(layer))
            if summ.sketch is not None:
                summ.sketch[layer].normal_(generator=generator)
            if summ.key_codes is not None:  # random keys: the quantized re-rank's masses differ page by page
                fill_codes_randomly(summ.key_codes.layer(layer), generator)

    def evict(self, layer: int, page_ids: torch.Tensor, fraction: float, generator: torch.Generator) -> int:
        """Unmap ``fraction`` of the selected pages ``[B, Hkv, K]`` of ``layer`` (the next step misses
        them); returns how many."""
        cache = self.store.cache
        valid = page_ids >= 0
        pick = valid & (torch.rand(page_ids.shape, device="cuda", generator=generator) < fraction)
        req = self.req_slots.view(-1, 1, 1)
        heads = torch.arange(page_ids.shape[1], device="cuda").view(1, -1, 1)
        pages = torch.where(pick, page_ids.long(), -1)
        slots = cache.page_table.lookup(req, layer, heads, pages).long()
        cache.page_table.invalidate(req, layer, heads, pages)
        scratch = torch.where(slots < 0, cache.num_slots, slots)
        cache.slot_page[scratch] = -1
        cache.last_used[scratch] = -1
        return int(pick.sum())
