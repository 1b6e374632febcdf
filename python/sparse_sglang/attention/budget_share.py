"""A layer's page budget shared among its kv heads by estimated attention mass.

By default every kv head attends ``K`` pages per layer. Heads differ in how widely their attention
spreads, so here a request's ``Hkv x K`` pages of a layer are shared among its heads, counted in
*units* of ``u = K / UNITS`` pages:

1. each page has an estimated share of its head's mass (:func:`head_log_shares`: each query
   head's softmax of its corner bounds, averaged over the group; not the softmax of the
   group-summed bound the default ranks by, which is no query head's mass: decision 29 compares
   them);
2. every head keeps its ``FLOOR_UNITS`` units of pages with the largest shares (the forced sink
   and recent pages among them);
3. a head's next units are its remaining pages in order of share, ``u`` at a time; the layer's
   ``Hkv x (UNITS - FLOOR_UNITS)`` units holding the most share go to whichever heads they belong
   to, at most ``CAP_UNITS`` units per head.

The same summaries and the same number of pages per layer as the default; what changes is which head
attends them. Widths are whole units so that attention runs over rows of ``u`` pages whose
lengths do not change from layer to layer (:class:`~sparse_sglang.attention.unit_rows.UnitRows`):
FlashInfer's plan is made once per step. A request holding at most ``K`` pages attends all of them
on every head (the exact path), as without sharing.

:func:`share_budget` is torch operations with no host synchronisation (it runs inside CUDA graphs);
:func:`~sparse_sglang.attention.reference.share_budget_reference` is its per-request reference.

Example::

    >>> import torch
    >>> bounds = torch.randn(2, 4, 3, 40)           # [B, Hkv, G, N] each query head's page bounds
    >>> num_pages = torch.tensor([40, 9])           # the second request fits in the budget
    >>> shares = head_log_shares(bounds, scale=0.1)
    >>> sel = share_budget(shares, num_pages, budget_pages=16, sink_pages=1, recent_pages=2)
    >>> sel.page_ids.shape, sel.widths.sum(-1).tolist()
    (torch.Size([2, 4, 20]), [64, 36])
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sparse_sglang.config import SHARE_CAP_UNITS as CAP_UNITS  # most units one head takes (a 1.25 K cache row)
from sparse_sglang.config import SHARE_FLOOR_UNITS as FLOOR_UNITS  # units every head keeps
from sparse_sglang.config import SHARE_UNITS as UNITS  # units in a head's default width K


def head_log_shares(head_scores: torch.Tensor, scale: float) -> torch.Tensor:
    """``[B, Hkv, N]`` the log of each page's estimated share of its kv head's mass, from
    ``head_scores`` ``[B, Hkv, G, N]`` (each query head's score of each page, ``-inf`` past a
    request's pages): each query head's softmax of its scores times ``scale``, averaged over the
    group. Per kv head the shares sum to 1: what :func:`share_budget` takes."""
    return torch.logsumexp(torch.log_softmax(head_scores.float() * scale, dim=-1), dim=2) - math.log(
        head_scores.shape[2]
    )


def unit_pages(budget_pages: int) -> int:
    """``u``, pages in a unit: ``K / UNITS`` (``K`` must be a multiple of ``UNITS``)."""
    if budget_pages % UNITS:
        raise ValueError(f"a shared budget needs a multiple of {UNITS} pages per head, got {budget_pages}")
    return budget_pages // UNITS


@dataclass(frozen=True, slots=True)
class SharedSelection:
    """One layer's pages under a shared budget."""

    # fmt: off
    page_ids: torch.Tensor  # [B, Hkv, CAP_UNITS * u] int32 pages attended, ascending, then -1
    widths:   torch.Tensor  # [B, Hkv] int32 pages each head attends: whole units, or n where n <= K
    # fmt: on


def share_budget(log_shares: torch.Tensor, num_pages: torch.Tensor, budget_pages: int, sink_pages: int,
                 recent_pages: int) -> SharedSelection:  # fmt: skip
    """Share each request's ``Hkv x K`` pages of one layer among its heads (module doc).

    Parameters
    ----------
    log_shares : torch.Tensor
        ``[B, Hkv, N]`` the log of each page's share of its head's mass (:func:`head_log_shares`;
        each head's sum to 1); entries at or past a request's pages are ignored (may be anything,
        NaN included).
    num_pages : torch.Tensor
        ``[B]`` pages each request holds (``1 <= n <= N``), on ``log_shares``' device.
    budget_pages : int
        ``K``, a head's pages without sharing: a multiple of :data:`UNITS`, with
        ``sink_pages + recent_pages <= FLOOR_UNITS * K / UNITS``.
    sink_pages, recent_pages : int
        Pages ``[0, sink)`` and ``[n - recent, n)`` every head keeps.
    """
    batch, heads, n_max = log_shares.shape
    u = unit_pages(budget_pages)
    floor, cap = FLOOR_UNITS * u, CAP_UNITS * u
    if sink_pages + recent_pages > floor:
        raise ValueError(f"{sink_pages} sink and {recent_pages} recent pages exceed a head's floor of {floor} pages")
    device, n = log_shares.device, num_pages.view(-1, 1, 1).to(log_shares.device)
    if n_max < cap:  # room for every choice below
        log_shares = F.pad(log_shares, (0, cap - n_max))
    col = torch.arange(log_shares.shape[-1], device=device)
    valid = col < n
    raw = torch.where(valid, log_shares.float(), -math.inf)
    forced = valid & ((col < sink_pages) | (col >= n - recent_pages))
    floor_ids = raw.masked_fill(forced, math.inf).topk(floor, dim=-1).indices  # [B, Hkv, floor]
    # Pages a head cannot take again (its floor) or does not hold read -1, below every share.
    share = raw.exp().masked_fill(~valid, -1.0).scatter(-1, floor_ids, -1.0)
    extra = share.topk(cap - floor, dim=-1, sorted=True)  # [B, Hkv, E], best share first
    parts = extra.values.view(batch, heads, CAP_UNITS - FLOOR_UNITS, u)
    # A unit's mass; a unit short of pages is never taken (a head holding more than K pages has
    # enough full units for the layer's count).
    unit_mass = parts.sum(-1).masked_fill((parts < 0).any(-1), -math.inf)
    won = unit_mass.view(batch, -1).topk(heads * (UNITS - FLOOR_UNITS), dim=-1).indices
    # A head's units hold non-increasing mass: it takes its first `count`, whichever tied unit won.
    count = torch.zeros(batch, unit_mass[0].numel(), dtype=torch.int32, device=device).scatter_(-1, won, 1)
    count = count.view(batch, heads, -1).sum(-1, dtype=torch.int32)
    rank = torch.arange(cap - floor, device=device)
    extra_ids = torch.where(rank < (count * u).unsqueeze(-1), extra.indices, -1)
    ids = torch.cat([floor_ids, extra_ids], dim=-1)
    widths = floor + count * u
    # Requests within the budget: every page, on every head.
    exact = num_pages.to(device) <= budget_pages
    every = torch.arange(cap, device=device).expand(batch, heads, cap)
    ids = torch.where(exact.view(-1, 1, 1), torch.where(every < n, every, -1), ids)
    widths = torch.where(exact.view(-1, 1), num_pages.to(device).view(-1, 1).to(torch.int32), widths)
    # Ascending, then -1: the newest page last among a head's pages (FlashInfer's last page).
    ordered = torch.where(ids >= 0, ids, log_shares.shape[-1]).sort(dim=-1).values
    page_ids = torch.where(ordered < log_shares.shape[-1], ordered, -1).to(torch.int32)
    return SharedSelection(page_ids, widths.to(torch.int32))
