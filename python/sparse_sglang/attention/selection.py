"""Page selection (the *Select* half of SPIN's Index/Select split).

- :func:`select_pages`: per (request, kv head) the sink pages, the recent pages and the top-scored
  rest, as a fixed-width ``[B, Hkv, budget_pages]`` page table (``-1`` padded), ascending, so the
  partial newest page comes last where FlashInfer's ``last_page_len`` applies.
- :func:`keep_cached`: LServe's selection reuse, in the form the page cache allows: on a step
  between two full selections a kv head chooses among the pages its cache row holds.

Everything is vectorized over batch and heads (no host synchronization in ``select_pages``), for
CPU and CUDA tensors alike. The plain-torch attention over a selection, the share of the dense
softmax mass it keeps, and LServe's logical-page max (``max_reduce_logical``) are evaluation
references: :mod:`sparse_sglang.attention.reference`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F


class Selection(NamedTuple):
    """Output of :func:`select_pages`.

    Attributes
    ----------
    page_ids : torch.Tensor
        ``[B, Hkv, K]`` int32 page indices (into each request's pages), ascending, ``-1`` padded
        at the end; ``K = budget_pages``.
    num_selected : torch.Tensor
        ``[B]`` int32 valid entries per row: ``min(num_pages, K)``, the same for every kv head.
    """

    page_ids: torch.Tensor
    num_selected: torch.Tensor


def force_pages(scores: torch.Tensor, num_pages: torch.Tensor, sink_pages: int, recent_pages: int) -> torch.Tensor:
    """``[B, Hkv, N]`` scores as a selection priority: sink and recent pages ``+inf`` (the
    partial newest page is a recent page), pages past a request's end ``-inf``."""
    page = torch.arange(scores.shape[-1], device=scores.device).view(1, 1, -1)
    n = num_pages.to(scores.device).long().view(-1, 1, 1)
    forced = (page < sink_pages) | (page >= n - recent_pages)
    return torch.where(page < n, torch.where(forced, math.inf, scores), -math.inf)


def select_pages(
    scores: torch.Tensor,
    num_pages: torch.Tensor,
    budget_pages: int,
    sink_pages: int = 1,
    recent_pages: int = 2,
) -> Selection:
    """Top pages per (request, kv head) within a page budget, with sink and recent pages forced.

    Parameters
    ----------
    scores : torch.Tensor
        ``[B, Hkv, N]`` page scores (a :class:`~sparse_sglang.attention.Selector`'s); entries at or
        past a request's ``num_pages`` are ignored (may be NaN).
    num_pages : torch.Tensor
        ``[B]`` pages each request holds, the partial newest page included (``1 <= n <= N``).
    budget_pages : int
        ``K``, pages attended per kv head; ``sink_pages + recent_pages <= K``.
    sink_pages, recent_pages : int
        Pages ``[0, sink)`` and ``[n - recent, n)`` are always kept (``recent_pages >= 1``).

    Returns
    -------
    Selection
        When ``n <= K`` every page ``0..n-1`` (the exact path); otherwise the forced pages plus the
        ``K - |forced|`` best-scored others. Rows are sorted, so the newest page ``n - 1`` comes
        last among the valid entries.
    """
    assert 1 <= recent_pages and sink_pages + recent_pages <= budget_pages
    n_max = scores.shape[-1]
    # Forced pages above every finite score, pages past the request below all.
    finite = scores.float().nan_to_num(nan=-3e38, posinf=3e38, neginf=-3e38)
    priority = force_pages(finite, num_pages, sink_pages, recent_pages)
    if n_max < budget_pages:
        priority = F.pad(priority, (0, budget_pages - n_max), value=-math.inf)
    top = priority.topk(budget_pages, dim=-1, sorted=False)
    # Padding sorts after every page (index n_max), then reads -1.
    ids = torch.where(top.values > -math.inf, top.indices, n_max).sort(dim=-1).values
    page_ids = torch.where(ids < n_max, ids, -1).to(torch.int32)
    return Selection(page_ids, num_pages.to(scores.device).clamp(max=budget_pages).to(torch.int32))


# Score of a page outside the cache row on a reuse step: below every real score, above the -inf of
# pages past a request's end, so such a page is taken only to fill a row that holds too few.
NOT_CACHED = -1e38


def keep_cached(priority: torch.Tensor, cached: torch.Tensor, reselect: torch.Tensor) -> torch.Tensor:
    """Scores (or selection priorities) ``[B, Hkv, N]`` restricted to cached pages where a request
    reuses its selection.

    Requests with ``reselect[b]`` keep every score; the others keep the scores of the pages their
    cache row holds (``cached[b, h, p]``) and of non-finite entries (forced pages at ``+inf``,
    pages past the end at ``-inf``), and every other page drops to :data:`NOT_CACHED`. The top
    ``K`` of the result then loads nothing but new forced pages (the newest page) when the row
    holds at least ``K`` pages. :func:`select_pages` keeps its forced pages whatever their score.
    """
    keep = reselect.view(-1, 1, 1) | cached | ~torch.isfinite(priority)
    return torch.where(keep, priority, NOT_CACHED)
