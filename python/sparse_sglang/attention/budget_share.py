"""A layer's page budget shared among its kv heads by estimated attention mass.

By default every kv head attends ``K`` pages per layer. Heads differ in how widely their attention
spreads, so here a request's ``Hkv x K`` pages of a layer are shared among its heads, counted in
*units* of ``u = K / UNITS`` pages:

1. every head keeps its best ``FLOOR_UNITS`` units of pages by score (the forced sink and recent
   pages among them);
2. each of its remaining pages gets an estimated share of the head's mass: the softmax, over the
   head's pages, of its score times ``scale``. The server scores a page by its share itself
   (:func:`head_log_shares`: each query head's softmax of its corner bounds, averaged over the
   group, as a log; ``scale`` 1), not by the softmax of the group-summed bound the default ranks
   by, which is no query head's mass (decision 29 compares them);
3. a head's next units are its remaining pages in order of share, ``u`` at a time; the layer's
   ``Hkv x (UNITS - FLOOR_UNITS)`` units holding the most share go to whichever heads they belong
   to, at most ``CAP_UNITS`` units per head.

The same scores and the same number of pages per layer as the default; what changes is which head
attends them. Widths are whole units so that attention runs over rows of ``u`` pages whose
lengths do not change from layer to layer (:class:`~sparse_sglang.attention.unit_rows.UnitRows`):
FlashInfer's plan is made once per step. A request holding at most ``K`` pages attends all of them
on every head (the exact path), as without sharing.

:func:`share_budget` is torch operations with no host synchronisation (it runs inside CUDA graphs);
:func:`~sparse_sglang.attention.reference.share_budget_reference` is its per-request reference.

Example::

    >>> import torch
    >>> scores = torch.randn(2, 4, 40)              # [B, Hkv, N] page scores
    >>> num_pages = torch.tensor([40, 9])           # the second request fits in the budget
    >>> sel = share_budget(scores, num_pages, budget_pages=16, sink_pages=1, recent_pages=2, scale=0.1)
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
    group. Per kv head the shares sum to 1, so :func:`share_budget` takes them with ``scale`` 1."""
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


def share_budget(scores: torch.Tensor, num_pages: torch.Tensor, budget_pages: int, sink_pages: int,
                 recent_pages: int, scale: float) -> SharedSelection:  # fmt: skip
    """Share each request's ``Hkv x K`` pages of one layer among its heads (module doc).

    Parameters
    ----------
    scores : torch.Tensor
        ``[B, Hkv, N]`` page scores (higher is more mass); entries at or past a request's pages are
        ignored (may be anything, NaN included).
    num_pages : torch.Tensor
        ``[B]`` pages each request holds (``1 <= n <= N``), on ``scores``' device.
    budget_pages : int
        ``K``, a head's pages without sharing: a multiple of :data:`UNITS`, with
        ``sink_pages + recent_pages <= FLOOR_UNITS * K / UNITS``.
    sink_pages, recent_pages : int
        Pages ``[0, sink)`` and ``[n - recent, n)`` every head keeps.
    scale : float
        Turns a score into a logit (the softmax's temperature).
    """
    batch, heads, n_max = scores.shape
    u = unit_pages(budget_pages)
    floor, cap = FLOOR_UNITS * u, CAP_UNITS * u
    if sink_pages + recent_pages > floor:
        raise ValueError(f"{sink_pages} sink and {recent_pages} recent pages exceed a head's floor of {floor} pages")
    device, n = scores.device, num_pages.view(-1, 1, 1).to(scores.device)
    if n_max < cap:  # room for every choice below
        scores = F.pad(scores, (0, cap - n_max))
    col = torch.arange(scores.shape[-1], device=device)
    valid = col < n
    raw = torch.where(valid, scores.float(), -math.inf)
    forced = valid & ((col < sink_pages) | (col >= n - recent_pages))
    floor_ids = raw.masked_fill(forced, math.inf).topk(floor, dim=-1).indices  # [B, Hkv, floor]
    logit = raw * scale
    share = (logit - logit.logsumexp(-1, keepdim=True)).exp()
    # Pages a head cannot take again (its floor) or does not hold read -1, below every share.
    share = share.masked_fill(~valid, -1.0).scatter(-1, floor_ids, -1.0)
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
    ordered = torch.where(ids >= 0, ids, scores.shape[-1]).sort(dim=-1).values
    page_ids = torch.where(ordered < scores.shape[-1], ordered, -1).to(torch.int32)
    return SharedSelection(page_ids, widths.to(torch.int32))
