"""CPU tests of the bucketed LRU (SPIN §5.3) against exact LRU, and of the proportional
buffer-page reclaim split. Both live here, in the test: the server runs neither. What it runs is
:meth:`GPUPageCache.recency <sparse_sglang.mem_cache.gpu_cache.GPUPageCache.recency>`, whose
bucketed order must take :class:`BucketedLRU`'s victims
(``test_page_cache_bucketed_recency_takes_the_histograms_victims``).

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

import random

import torch

from sparse_sglang.mem_cache.reference import exact_lru_evict_reference


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


def random_state(seed: int, num_slots: int, steps: int, num_buckets: int, steps_per_bucket: int):
    """A bucketed LRU and the exact last-use steps (-1 = empty) after a random touch/clear history."""
    g = torch.Generator().manual_seed(seed)
    lru = BucketedLRU(num_slots, num_buckets, steps_per_bucket)
    last = torch.full((num_slots,), -1, dtype=torch.int64)
    for _ in range(steps):
        lru.next_step()
        slots = torch.randint(-1, num_slots, (int(torch.randint(0, num_slots // 4 + 1, (), generator=g)),), generator=g)
        lru.touch(slots)
        last[slots[slots >= 0]] = lru.step
        if torch.rand((), generator=g) < 0.2:
            dropped = torch.randint(0, num_slots, (2,), generator=g)
            lru.clear(dropped)
            last[dropped] = -1
    return lru, last


def test_evict_takes_exactly_n_and_never_mandatory_or_padding():
    g = torch.Generator().manual_seed(0)
    for seed in range(20):
        lru, _ = random_state(seed, 64, 100, 16, 2)
        cand = torch.randint(-1, 64, (5, 24), generator=g)  # 5 rows, padded
        mandatory = torch.rand(5, 24, generator=g) < 0.3
        n = torch.randint(0, 24, (5,), generator=g)
        victims = lru.evict(cand, n, mandatory)
        eligible = ((cand >= 0) & ~mandatory).sum(-1)
        assert torch.equal(victims.sum(-1), torch.minimum(n, eligible))
        assert not (victims & (mandatory | (cand < 0))).any()


def test_evict_is_exact_lru_before_any_rebase():
    # One step per bucket and fewer steps than buckets: buckets are exact stamps.
    g = torch.Generator().manual_seed(1)
    for seed in range(20):
        lru, last = random_state(seed, 48, 60, 64, 1)
        assert lru.origin == 0
        cand = torch.randperm(48, generator=g)[:32]
        mandatory = torch.rand(32, generator=g) < 0.25
        n = int(torch.randint(0, 32, (), generator=g))
        assert torch.equal(lru.evict(cand, n, mandatory), exact_lru_evict_reference(last, cand, n, mandatory))


def test_evict_agrees_with_exact_lru_up_to_one_bucket():
    g = torch.Generator().manual_seed(2)
    checked = 0
    for seed in range(30):
        lru, last = random_state(seed, 64, 150, 16, 3)  # 150 steps over a 48-step range: rebased
        assert lru.origin > 0 and -1 <= int(lru.bucket.min()) and int(lru.bucket.max()) < lru.num_buckets
        cand = torch.randperm(64, generator=g)[:40]
        mandatory = torch.rand(40, generator=g) < 0.2
        n = int(torch.randint(1, 33, (), generator=g))
        victims = lru.evict(cand, n, mandatory)
        exact = exact_lru_evict_reference(last, cand, n, mandatory)
        assert int(victims.sum()) == int(exact.sum())
        kept = (~victims & ~mandatory).nonzero().flatten()
        for v in victims.nonzero().flatten().tolist():
            for k in kept.tolist():
                lv, lk = int(last[cand[v]]), int(last[cand[k]])
                # Within one bucket width, unless both are older than the range (bucket 0 merged).
                assert lv <= lk + lru.steps_per_bucket or max(lv, lk) < lru.merged_before, (lv, lk)
                checked += 1
    assert checked > 1000


def simulate(trace: list[list[int]], num_slots: int, bucketed: bool) -> float:
    """Hit ratio of a page cache of ``num_slots`` slots over ``trace`` (pages per step)."""
    lru = BucketedLRU(num_slots, num_buckets=16, steps_per_bucket=4)
    last = torch.full((num_slots,), -1, dtype=torch.int64)
    slot_page = [-1] * num_slots
    page_slot: dict[int, int] = {}
    everything = torch.arange(num_slots)
    hits = accesses = 0
    for step, pages in enumerate(trace, 1):
        lru.next_step()
        hit_slots = [page_slot[p] for p in pages if p in page_slot]
        misses = [p for p in pages if p not in page_slot]
        hits, accesses = hits + len(hit_slots), accesses + len(pages)
        mandatory = torch.zeros(num_slots, dtype=torch.bool)
        mandatory[hit_slots] = True  # this step's selection stays
        if bucketed:
            victims = lru.evict(everything, len(misses), mandatory)
        else:
            victims = exact_lru_evict_reference(last, everything, len(misses), mandatory)
        for page, slot in zip(misses, victims.nonzero().flatten().tolist()):
            page_slot.pop(slot_page[slot], None)
            slot_page[slot], page_slot[page] = page, slot
        used = torch.tensor(hit_slots + [page_slot[p] for p in misses], dtype=torch.int64)
        lru.touch(used)
        last[used] = step
    return hits / accesses


def test_hit_ratio_close_to_exact_lru_on_a_local_trace():
    # Each step selects 8 of 1000 pages: most near a slowly drifting hot spot, some anywhere.
    rng = random.Random(3)
    trace, centre = [], 100.0
    for _ in range(1500):
        centre = (centre + rng.gauss(0.2, 1.0)) % 1000
        pages: set[int] = set()
        while len(pages) < 8:
            near = rng.random() < 0.85
            pages.add(int(rng.gauss(centre, 20)) % 1000 if near else rng.randrange(1000))
        trace.append(sorted(pages))
    exact = simulate(trace, 96, bucketed=False)
    bucketed = simulate(trace, 96, bucketed=True)
    assert 0.3 < exact < 0.95  # the trace is neither trivial nor hopeless for a 96-slot cache
    assert abs(bucketed - exact) < 0.03, (bucketed, exact)


def test_split_by_length_is_proportional_and_exact():
    g = torch.Generator().manual_seed(4)
    for _ in range(200):
        lengths = torch.randint(0, 5000, (int(torch.randint(1, 12, (), generator=g)),), generator=g)
        total = int(torch.randint(0, 3000, (), generator=g))
        share = split_by_length(total, lengths)
        assert int(share.sum()) == total and (share >= 0).all()
        if int(lengths.sum()):
            ideal = total * lengths.double() / lengths.sum()
            assert ((share - ideal).abs() < 1).all()
        else:
            assert int(share.max() - share.min()) <= 1


def test_split_by_length_respects_caps():
    g = torch.Generator().manual_seed(5)
    for _ in range(200):
        r = int(torch.randint(1, 10, (), generator=g))
        lengths = torch.randint(0, 100, (r,), generator=g)
        caps = torch.randint(0, 40, (r,), generator=g)
        total = int(torch.randint(0, 300, (), generator=g))
        share = split_by_length(total, lengths, caps)
        assert int(share.sum()) == min(total, int(caps.sum()))
        assert (share >= 0).all() and (share <= caps).all()
    # A capped request's excess goes to the others by length.
    assert split_by_length(10, torch.tensor([100, 100, 200]), torch.tensor([1, 10, 10])).tolist() == [1, 3, 6]
    assert split_by_length(5, torch.tensor([], dtype=torch.int64)).tolist() == []


def _cache_with_lru(num_buckets: int, steps_per_bucket: int, step: int):
    from sparse_sglang.mem_cache import GPUPageCache

    cache = GPUPageCache(16, 1, 1, 4, 16, torch.bfloat16, max_requests=2, row_width=8, max_pages=8, total_pages=16,
                         lru_buckets=num_buckets, lru_steps_per_bucket=steps_per_bucket)  # fmt: skip
    cache.step.fill_(step)
    return cache


def test_page_cache_bucketed_recency_takes_the_histograms_victims():
    # The page cache orders its rows by GPUPageCache.recency and takes a stable sort's first
    # victims; before any rebase that is exactly BucketedLRU.evict's histogram choice.
    g = torch.Generator().manual_seed(3)
    for seed in range(20):
        lru, last = random_state(seed, 48, 45, 16, 3)  # 45 steps < 16 buckets x 3: no rebase
        assert lru.origin == 0
        cache = _cache_with_lru(16, 3, lru.step)
        cand = torch.randperm(48, generator=g)[:32]
        mandatory = torch.rand(32, generator=g) < 0.25
        n = int(torch.randint(0, 32, (), generator=g))
        # The page cache's choice: a stable sort of the slots' recency (the exact-LRU reference's
        # sort, given recency instead of last-use steps).
        mine = exact_lru_evict_reference(cache.recency(last), cand, n, mandatory)
        assert torch.equal(mine, lru.evict(cand, n, mandatory)), seed


def test_page_cache_recency_is_exact_by_default_and_ties_what_left_the_bucket_range():
    used = torch.tensor([-1, 0, 5, 9, 10, 11, 12, 40, 41])
    assert torch.equal(_cache_with_lru(0, 1, 41).recency(used), used)  # exact LRU: the steps themselves
    # 4 buckets of 3 steps at step 41: buckets 10..13 in order, everything before bucket 10 tied there.
    assert _cache_with_lru(4, 3, 41).recency(used).tolist() == [-1, 10, 10, 10, 10, 10, 10, 13, 13]
