"""Torch references apart from the code the server runs: the GPU page cache's replacement order,
and the index kernel's (:func:`index_runs_reference`, which the CPU store runs instead).

The server orders a row's slots by :meth:`GPUPageCache.recency
<sparse_sglang.mem_cache.gpu_cache.GPUPageCache.recency>` and takes a stable sort's first victims
(the retrieve kernel, :mod:`sparse_sglang.attention.retrieval`, does the same on the device). What
that order must choose is defined here: :class:`BucketedLRU`, SPIN's histogram eviction over
timestamp buckets (SPIN §5.3), and :func:`exact_lru_evict_reference`, exact LRU; and what
narrowing rows for a new request must do, one row at a time (:func:`shrink_rows_reference`). The
CPU tests hold the cache's choices against these; the server runs none of this module.

Bucketed LRU, all tensor ops on any device
------------------------------------------

Exact LRU needs a sort of the candidates by last use every time pages are evicted. Here each slot
carries only a small *timestamp bucket* (``steps_per_bucket`` decode steps per bucket,
``num_buckets`` buckets), and evicting ``n`` victims is a histogram: ``bincount`` of the
candidates' buckets, a ``cumsum`` to find the cutoff bucket where the count reaches ``n``, then
every candidate older than the cutoff plus the first few of the cutoff bucket. Linear in the
candidates, no sort, batched over rows (one row per request, or the whole pool as one row).

Pages a step selected are *mandatory*: that step reads them, so they are never victims of it;
everything else a request holds is a *buffer* page (kept for reuse by later steps) and may go.
When the cache must shrink, :func:`split_by_length` shares the buffer pages to reclaim among the
running requests in proportion to their lengths (longer contexts hold more buffer pages).

Timestamps stay small: when the step counter outruns the ``num_buckets`` range, buckets are
*rebased*: every bucket moves down by half the range and the older half merges into bucket 0.
Order is thus exact up to one bucket for slots used in the last ``num_buckets / 2`` buckets at
least; slots used before :attr:`BucketedLRU.merged_before` share bucket 0 unordered (they are all
long cold). Empty slots (never filled, or cleared) rank before bucket 0: they go first.
"""

from __future__ import annotations

import torch


class BucketedLRU:
    """Per-slot timestamp buckets and histogram eviction.

    Parameters
    ----------
    num_slots : int
    num_buckets : int
        Buckets in the timestamp range (even, >= 2); the stamps are int16.
    steps_per_bucket : int
        Steps one bucket spans: the granularity of the LRU order.
    device : torch.device or str

    Attributes
    ----------
    bucket : torch.Tensor
        ``[num_slots + 1]`` int16 bucket of each slot's last use, -1 when empty; entry
        ``num_slots`` is scratch (padded slot ids ``-1`` touch it).
    now : torch.Tensor
        0-dim int16, the current step's bucket on the device (so :meth:`touch` is capturable
        in a CUDA graph; :meth:`next_step` runs on the host between steps).
    """

    def __init__(
        self, num_slots: int, num_buckets: int = 64, steps_per_bucket: int = 1, device: torch.device | str = "cpu"
    ):
        if num_slots < 1 or steps_per_bucket < 1 or num_buckets < 2 or num_buckets % 2 or num_buckets > 1 << 14:
            raise ValueError(
                f"bad bucketed LRU shape: {num_slots} slots, {num_buckets} buckets, {steps_per_bucket} steps per bucket"
            )
        self.num_slots, self.num_buckets, self.steps_per_bucket = num_slots, num_buckets, steps_per_bucket
        self.bucket = torch.full((num_slots + 1,), -1, dtype=torch.int16, device=device)
        self.now = torch.zeros((), dtype=torch.int16, device=device)
        self.step = 0  # host-side step counter
        self.origin = 0  # bucket b >= 1 spans steps [origin + b * w, origin + (b + 1) * w)

    @property
    def merged_before(self) -> int:
        """Slots last used before this step are all in bucket 0, in no particular order."""
        return self.origin + self.steps_per_bucket

    def next_step(self) -> None:
        """Advance one step; rebase when the current bucket leaves the range."""
        self.step += 1
        now = (self.step - self.origin) // self.steps_per_bucket
        if now >= self.num_buckets:
            shift = self.num_buckets // 2
            self.bucket.copy_(torch.where(self.bucket >= 0, (self.bucket - shift).clamp_min(0), -1))
            self.origin += shift * self.steps_per_bucket
            now -= shift
        self.now.fill_(now)

    def _slots(self, slots: torch.Tensor) -> torch.Tensor:
        return torch.where(slots < 0, self.num_slots, slots).long()

    def touch(self, slots: torch.Tensor) -> None:
        """Mark ``slots`` (any shape, ``-1`` = padding) used now: hits and newly filled slots."""
        self.bucket[self._slots(slots)] = self.now

    def clear(self, slots: torch.Tensor) -> None:
        """Mark ``slots`` empty (their page was dropped): they are evicted first."""
        self.bucket[self._slots(slots)] = -1

    def evict(
        self, candidates: torch.Tensor, n: int | torch.Tensor, mandatory: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Choose ``n`` victims among ``candidates``, least recently used buckets first.

        Parameters
        ----------
        candidates : torch.Tensor
            ``[..., C]`` slot ids, ``-1`` = none; each leading index is one row evicted on its own.
        n : int or torch.Tensor
            Victims per row (an int, or ``[...]``).
        mandatory : torch.Tensor, optional
            ``[..., C]`` bool: this step's selection (e.g. ``torch.isin(candidates, selected)``),
            never chosen.

        Returns
        -------
        torch.Tensor
            ``[..., C]`` bool victims: exactly ``min(n, eligible)`` per row; within the cutoff
            bucket the earliest candidates are taken (the same tie order as a stable sort).
        """
        shape = candidates.shape
        cand = candidates.reshape(-1, shape[-1]).long()
        rows = cand.shape[0]
        nb = self.num_buckets
        key = self.bucket[self._slots(cand)].long() + 1  # 0 = empty, 1..nb = buckets
        excluded = cand < 0 if mandatory is None else (cand < 0) | mandatory.reshape(rows, -1)
        key = torch.where(excluded, nb + 1, key)  # nb + 1: a bucket past the end, never reached
        offsets = torch.arange(rows, device=cand.device).unsqueeze(1) * (nb + 2)
        hist = torch.bincount((offsets + key).flatten(), minlength=rows * (nb + 2)).view(rows, nb + 2)
        cum = hist[:, : nb + 1].cumsum(-1)  # eligible candidates in buckets <= b
        want = torch.as_tensor(n, device=cand.device).reshape(-1).expand(rows)
        take = torch.minimum(want, cum[:, -1]).unsqueeze(1)
        cutoff = (cum < take).sum(-1, keepdim=True)  # first bucket where the count reaches take
        before = torch.where(cutoff > 0, cum.gather(-1, (cutoff - 1).clamp_min(0)), 0)
        at_cutoff = key == cutoff
        victims = (key < cutoff) | (at_cutoff & (at_cutoff.long().cumsum(-1) <= take - before))
        return victims.view(shape)


def exact_lru_evict_reference(
    last_used: torch.Tensor, candidates: torch.Tensor, n: int, mandatory: torch.Tensor | None = None
) -> torch.Tensor:
    """Exact LRU for one row: the ``n`` eligible candidates with the smallest exact last-use step
    (``last_used[slot]``, -1 = empty), ties by position. Returns a ``[C]`` bool mask."""
    cand = candidates.long()
    excluded = cand < 0 if mandatory is None else (cand < 0) | mandatory
    stamp = torch.where(excluded, torch.iinfo(torch.int64).max, last_used[cand.clamp_min(0)].long())
    order = stamp.argsort(stable=True)[: min(n, int((~excluded).sum()))]
    victims = torch.zeros_like(excluded)
    victims[order] = True
    return victims


def _largest_remainder(total: int, weights: torch.Tensor) -> torch.Tensor:
    """Integer shares of ``total`` proportional to ``weights`` (sum > 0), summing to ``total``:
    floors, then one more for the largest remainders (ties: the earlier entry)."""
    scaled = total * weights
    share, remainder = scaled // weights.sum(), scaled % weights.sum()
    extra = total - int(share.sum())
    share[remainder.argsort(descending=True, stable=True)[:extra]] += 1
    return share


def split_by_length(total: int, lengths: torch.Tensor, caps: torch.Tensor | None = None) -> torch.Tensor:
    """Split ``total`` buffer pages to reclaim among running requests in proportion to ``lengths``.

    Parameters
    ----------
    total : int
    lengths : torch.Tensor
        ``[R]`` request lengths (tokens or pages); all zero = an even split.
    caps : torch.Tensor, optional
        ``[R]`` most each request can give (its buffer pages); a capped request's excess is split
        again among the others by length.

    Returns
    -------
    torch.Tensor
        ``[R]`` int64 shares summing to exactly ``min(total, caps.sum())``, each ``<= caps``
        (empty when there are no requests).
    """
    lengths = lengths.long()
    share = torch.zeros_like(lengths)
    open_ = torch.ones_like(lengths, dtype=torch.bool) if caps is None else caps > 0
    left = total if caps is None else min(total, int(caps.sum()))
    while left > 0 and lengths.numel():  # each round that leaves pages over caps one more request: at most R rounds
        weights = torch.where(open_, lengths, 0)
        if int(weights.sum()) == 0:
            weights = open_.long()
        part = _largest_remainder(left, weights)
        if caps is not None:
            part = torch.minimum(part, caps.long() - share)
        share += part
        left -= int(part.sum())
        if caps is not None:
            open_ &= share < caps
    return share


def index_runs_reference(summaries, cache, layer: int, k: torch.Tensor, v: torch.Tensor, token_slots: torch.Tensor,
                         runs) -> None:  # fmt: skip
    """What :func:`~sparse_sglang.mem_cache.kernels.index_runs` does in one kernel, in torch: fold
    the new keys into the page summaries, then write K/V into the cached blocks of their pages."""
    summaries.update(layer, k, token_slots)
    cache.store(layer, runs.token_req_slots, runs.token_positions, k, v)


def shrink_rows_reference(cache, widths: dict[int, int]) -> None:
    """``GPUPageCache._shrink_rows`` one row at a time: in each (layer, head) of each row, a
    stable sort of its slots by recency, most recent first; the first ``width`` stay, the rest
    are unmapped and freed (pushed row after row, in ``widths``' order)."""
    layers, heads = cache._layers.view(-1, 1, 1), cache._heads.view(1, -1, 1)
    for req, width in widths.items():
        row = cache.rows[req, :, :, : cache._width[req]]
        order = cache.recency(cache.last_used[row]).argsort(dim=-1, descending=True, stable=True)
        keep, drop = row.gather(-1, order[..., :width]), row.gather(-1, order[..., width:])
        cache.page_table.invalidate(req, layers, heads, cache.slot_page[drop])
        cache.slot_page[drop] = -1
        cache.last_used[drop] = -1
        cache.rows[req, :, :, :width] = keep
        cache.rows[req, :, :, width:] = -1
        cache._free.push(drop.reshape(-1))
        cache._width[req] = cache._filled[req] = width
