"""Attention over a shared budget's heads in rows of fixed length (units).

Under :mod:`~sparse_sglang.attention.budget_share` a kv head's width changes from layer to layer,
while FlashInfer's decode is planned once per step from each row's length, and a plan that splits a
row into chunks reads past a row made shorter than planned. So FlashInfer's rows are *units* of
``u`` pages: a request holding more than ``K`` pages has ``UNITS x Hkv`` of them in every layer,
and a layer only decides which head each unit serves. Each unit attends with its head's queries;
a head's units are merged by their log-sum-exps (FlashInfer's ``merge_states``), which is the
head's attention over all its pages.

A request holding ``n <= K`` pages has every page on every head in every layer: each head's pages
make ``ceil(n / u)`` units (the last one short), and the rest of the request's ``UNITS x Hkv`` rows
are one-page padding rows that no head merges.

Layout, per request ``b`` (rows ``b * U .. (b + 1) * U - 1``, ``U = UNITS x Hkv``): its page
indices start at ``region[b]``; head ``h``'s pages follow head ``h - 1``'s (the retrieve kernel
writes them at :meth:`UnitRows.layer`'s indptr), its units cover them in order, and the newest page
ends each head's last unit, whose ``last_page_len`` is the request's. A layer rewrites only the
device-side ``last_page_len`` (which unit ends a head) and the maps from units to heads: every
row's length in pages is the plan's. FlashInfer's kernels read ``last_page_len`` on the device, and
a split plan's chunks start at whole pages before a row's last page, so a shorter last page never
leaves a chunk starting past its row's end.

Contract: :func:`plan_unit_rows` runs on the host once per step (FlashInfer's ``plan`` reads its
indptr); :meth:`UnitRows.build` makes the step's device tensors (no host synchronisation);
:meth:`UnitRows.layer` and :func:`attend_units` run per layer inside CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparse_sglang.attention.budget_share import CAP_UNITS, UNITS


def _units_per_head(num_pages: torch.Tensor, budget_pages: int) -> torch.Tensor:
    """``ceil(min(n, K) / u)``: each head's units (``UNITS`` for a request past the budget)."""
    u = budget_pages // UNITS
    return (num_pages.clamp(max=budget_pages) + u - 1) // u


def plan_unit_rows(num_pages_cpu: torch.Tensor, budget_pages: int, heads: int) -> torch.Tensor:
    """``[B * U + 1]`` int32 FlashInfer indptr of the step's unit rows (on the host)."""
    u, rows = budget_pages // UNITS, UNITS * heads
    n = num_pages_cpu.to(torch.int64).clamp(max=budget_pages)
    c = _units_per_head(n, budget_pages).view(-1, 1)
    j = torch.arange(rows).view(1, -1)
    k = j % c  # a unit's place among its head's (rows j < heads * c)
    short = n.view(-1, 1) - (c - 1) * u  # pages of a head's last unit
    pages = torch.where(j < heads * c, torch.where(k == c - 1, short, u), 1)
    indptr = torch.zeros(pages.numel() + 1, dtype=torch.int32)
    torch.cumsum(pages.view(-1), 0, out=indptr[1:])
    return indptr


@dataclass(frozen=True, slots=True)
class UnitBuffers:
    """Static device buffers of unit rows for up to ``max_batch`` requests: FlashInfer's wrappers
    over unit rows read the first two, a step's :class:`UnitRows` are views of the rest, rewritten
    in place by each plan (CUDA graphs keep their addresses). Allocated once, never reallocated."""

    # fmt: off
    indptr:        torch.Tensor  # [max_batch * U + 1] int32 FlashInfer indptr (the plan fills it)
    last_page_len: torch.Tensor  # [max_batch * U]     int32 FlashInfer last_page_len (layers rewrite it)
    exact:         torch.Tensor  # [max_batch]         bool
    region:        torch.Tensor  # [max_batch]         int64
    last:          torch.Tensor  # [max_batch]         int32
    # fmt: on

    @classmethod
    def allocate(cls, max_batch: int, heads: int, device: torch.device) -> UnitBuffers:
        rows = max_batch * UNITS * heads
        i32 = dict(dtype=torch.int32, device=device)
        return cls(indptr=torch.zeros(rows + 1, **i32), last_page_len=torch.ones(rows, **i32),
                   exact=torch.ones(max_batch, dtype=torch.bool, device=device),
                   region=torch.zeros(max_batch, dtype=torch.int64, device=device), last=torch.ones(max_batch, **i32))  # fmt: skip


@dataclass(frozen=True, slots=True)
class UnitLayer:
    """One layer's unit rows: where the retrieve kernel writes each head's pages, which head each
    unit serves, and which units each head merges."""

    # fmt: off
    indptr: torch.Tensor  # [B * Hkv + 1] int32 where head (b, h)'s pages start in the indices
    head:   torch.Tensor  # [B, U]       int64 the head whose queries each unit row takes
    gather: torch.Tensor  # [B, Hkv, CAP_UNITS] int64 each head's unit rows, -1 past its units
    # fmt: on


@dataclass(frozen=True, slots=True)
class UnitRows:
    """A step's unit rows as every layer reads them (a view of static buffers in CUDA-graph steps)."""

    # fmt: off
    budget_pages:  int
    page_size:     int
    exact:         torch.Tensor  # [B] bool      requests within the budget (their layout is fixed)
    region:        torch.Tensor  # [B] int64     where each request's page indices start
    last:          torch.Tensor  # [B] int32     tokens in each request's newest page
    last_page_len: torch.Tensor  # [B * U] int32 FlashInfer's last_page_len, rewritten per layer
    # fmt: on

    @classmethod
    def build(cls, num_pages: torch.Tensor, seq_lens: torch.Tensor, budget_pages: int, heads: int, page_size: int,
              buffers: UnitBuffers, batch: int) -> UnitRows:  # fmt: skip
        """The step's unit rows from the device's ``num_pages`` and ``seq_lens`` (``[B]``), written
        into ``buffers``' first ``batch`` entries."""
        u, rows = budget_pages // UNITS, UNITS * heads
        n = num_pages.to(torch.int64)
        c = _units_per_head(n, budget_pages)
        size = torch.where(n > budget_pages, rows * u, heads * n + rows - heads * c)  # pages + padding rows
        return cls(
            budget_pages, page_size, exact=buffers.exact[:batch].copy_(n <= budget_pages),
            region=buffers.region[:batch].copy_(torch.cumsum(size, 0) - size),
            last=buffers.last[:batch].copy_((seq_lens - 1) % page_size + 1),
            last_page_len=buffers.last_page_len[: batch * rows],
        )  # fmt: skip

    def layer(self, widths: torch.Tensor) -> UnitLayer:
        """This layer's :class:`UnitLayer` for the heads' ``widths`` (``[B, Hkv]``, whole units
        past the budget); rewrites :attr:`last_page_len`."""
        batch, heads = widths.shape
        u, rows, device = self.budget_pages // UNITS, UNITS * heads, widths.device
        w = widths.to(torch.int64)
        starts = torch.cumsum(w, -1) - w + self.region.view(-1, 1)
        indptr = torch.cat([starts.view(-1), (starts[-1, -1] + w[-1, -1]).view(1)]).to(torch.int32)
        # Units per head: a layer's share past the budget; ceil(n / u) within it.
        units = torch.where(self.exact.view(-1, 1), (w + u - 1) // u, w // u)
        end = torch.cumsum(units, -1)  # [B, Hkv] one past each head's last unit
        j = torch.arange(rows, device=device).view(1, -1, 1)
        head = (j >= end.unsqueeze(1)).sum(-1)  # [B, U]; heads * c .. : padding rows
        pad = head >= heads
        head = head.clamp(max=heads - 1)
        ends_head = j.squeeze(-1) == end.gather(1, head) - 1
        lpl = torch.where(ends_head & ~pad, self.last.view(-1, 1), self.page_size)
        self.last_page_len.copy_(lpl.view(-1).to(torch.int32))
        k = torch.arange(CAP_UNITS, device=device).view(1, 1, -1)
        base = torch.arange(batch, device=device).view(-1, 1, 1) * rows + (end - units).unsqueeze(-1)
        gather = torch.where(k < units.unsqueeze(-1), base + k, -1)
        return UnitLayer(indptr, head, gather)


def attend_units(wrapper, q: torch.Tensor, kv, layer: UnitLayer, **scales) -> torch.Tensor:
    """Decode attention of ``q`` (``[B, Hkv, G, D]``) over the unit rows FlashInfer's ``wrapper``
    was planned for, each head's units merged: ``[B * Hkv, G, D]``."""
    import flashinfer

    batch, heads, group, dim = q.shape
    rows = layer.head.shape[1]
    idx = layer.head.view(batch, rows, 1, 1).expand(batch, rows, group, dim)
    out, lse = wrapper.run(q.gather(1, idx).reshape(batch * rows, group, dim), kv, return_lse=True, **scales)
    pick = layer.gather.view(-1).clamp(min=0)
    states = out.index_select(0, pick).view(batch * heads, CAP_UNITS, group, dim)
    # A head's own units come first (it has at least one): the padding ones merge as nothing.
    masses = lse.index_select(0, pick).view(batch * heads, CAP_UNITS, group)
    masses = masses.masked_fill(layer.gather.view(batch * heads, CAP_UNITS, 1) < 0, -float("inf"))
    merged, _ = flashinfer.merge_states(states.contiguous(), masses.contiguous())
    return merged
