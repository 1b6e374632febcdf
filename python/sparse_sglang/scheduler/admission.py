"""Working-set-aware admission (SparseServe Algorithm 1).

Sparse decode moves only the pages a step selects, so what must fit in the GPU page cache is not
a request's whole KV but its *working set*: the pages it selected over the last ``window`` decode
steps. Running more requests than the cache holds working sets for turns every step into misses
(PCIe-bound thrashing); running fewer wastes the cache. So the scheduler keeps the summed working
sets of the running batch within the cache, retracting the newest requests when it overflows and
admitting waiting ones only while they fit.

- :class:`WorkingSetTracker` measures running requests' working sets on the device (a ring of the
  last ``window`` steps' selections per request, layer and kv head).
- :func:`prefill_pages` is a prefill's working set, which is exact: every KV page it attends.
- :class:`AdmissionPolicy` is the pure-Python decision: keep / retract / admit / defer / refuse.
- :class:`WorkingSetGate` asks it, for SGLang's prefill admission, whether one more request fits
  next to the running ones, and for SGLang's decode memory check whether the running ones still
  fit (else SGLang retracts one), with working sets the tracker reads back once per step.

Fairness rule: strict FCFS on the waiting queue. Requests are considered in arrival order and the
first one that does not fit (GPU working-set budget or free host pages) stops admission: every
later arrival is deferred with it, however small. Why not let small requests pass a blocked head:
any bypass lets a steady stream of short requests keep the cache full so the head never fits
(starvation; ``test_admission`` shows it for a greedy policy). Strict FCFS needs no per-request
state across scheduling rounds, and the head-of-line cost is bounded: a decode working set is at
most ``window x budget pages`` per (layer, head) whatever the context length, and a prefill's is
bounded by the layers it runs per iteration, so the head waits for at most about one working set
to drain. Requests whose KV can never fit in the host store are refused, so they block nobody.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

from sparse_sglang.mem_cache.utils import host_to_device
from sparse_sglang.stats import AdmissionStats, WorkingSetCounts


def prefill_pages(num_tokens: int, layers_now: int, num_kv_heads: int, page_size: int) -> int:
    """GPU cache pages a prefill needs this iteration: every KV page of its ``num_tokens`` tokens
    (cached prefix + new, all of which it attends) in each kv head of the ``layers_now`` layers it
    runs now (all layers, or one segment of a layer-segmented prefill)."""
    return -(-num_tokens // page_size) * layers_now * num_kv_heads


class WorkingSetTracker:
    """Per running request, the distinct pages selected over the last ``window`` decode steps.

    A ring ``[max_requests + 1, window, num_layers, num_kv_heads, max_selected]`` keeps each step's
    selection; :meth:`next_step` clears the column it reuses, so a request that skipped a step has
    nothing there. The ring's size depends on the token budget, not on context length (a
    per-page "last used" stamp would take ``max_pages`` entries per request, layer and head).
    Row ``max_requests`` is scratch: padded batch rows (request slot ``-1``) write there.

    Parameters
    ----------
    max_requests, num_layers, num_kv_heads : int
    max_selected : int
        Most pages one step selects per (request, layer, head) (the budget in pages).
    window : int
        Steps forming the working set (``--sparse-working-set-window``).
    device : torch.device or str
    """

    def __init__(
        self,
        max_requests: int,
        num_layers: int,
        num_kv_heads: int,
        max_selected: int,
        window: int = 12,
        device: torch.device | str = "cpu",
    ):
        for name, value in {"max_requests": max_requests, "num_layers": num_layers, "num_kv_heads": num_kv_heads,
                            "max_selected": max_selected, "window": window}.items():  # fmt: skip
            if value < 1:
                raise ValueError(f"{name} must be positive, got {value}")
        self.max_requests, self.window, self.max_selected = max_requests, window, max_selected
        shape = (max_requests + 1, window, num_layers, num_kv_heads, max_selected)
        self.ring = torch.full(shape, -1, dtype=torch.int32, device=device)
        self.column = 0  # ring column of the current step (host-known: no sync to advance)
        # publish(): counts on their way to the host (pinned double buffer), the newest landed.
        self._in_flight: list = []
        self._published: dict[int, int] = {}
        self._next_buffer = 0
        self._buffers = [torch.zeros(max_requests, dtype=torch.int64, pin_memory=torch.device(device).type == "cuda")
                         for _ in range(2)]  # fmt: skip

    def next_step(self) -> None:
        """Start a decode step: its column forgets the step ``window`` steps ago."""
        self.column = (self.column + 1) % self.window
        self.ring[:, self.column].fill_(-1)  # fill_, not `= -1`: see sparse_sglang.mem_cache.utils

    def record(self, req_slots: torch.Tensor, layer: int, page_ids: torch.Tensor) -> None:
        """Note this step's selection of one layer.

        req_slots : ``[B]`` request slots, ``-1`` = padding row.
        page_ids : ``[B, Hkv, K]`` selected logical pages, ``-1`` = none; ``K <= max_selected``.
        """
        k = page_ids.shape[-1]
        assert k <= self.max_selected, f"{k} selected pages exceed max_selected ({self.max_selected})"
        rows = torch.where(req_slots < 0, self.max_requests, req_slots).long()
        self.ring[rows, self.column, layer, :, :k] = page_ids.to(torch.int32)
        self.ring[:, self.column, layer, :, k:].index_fill_(0, rows, -1)

    def record_step(self, req_slots: torch.Tensor, selections: torch.Tensor) -> None:
        """Note a whole decode step's selection (a step of its own: :meth:`next_step` first).

        req_slots : ``[B]`` request slots, ``-1`` = padding row.
        selections : ``[B, num_layers, Hkv, K]`` selected logical pages, ``-1`` = none.
        """
        k = selections.shape[-1]
        assert k <= self.max_selected, f"{k} selected pages exceed max_selected ({self.max_selected})"
        self.next_step()
        rows = torch.where(req_slots < 0, self.max_requests, req_slots).long()
        self.ring[rows, self.column, :, :, :k] = selections.to(torch.int32)

    def sizes(self, req_slots: torch.Tensor | None = None, num_pages: int | None = None) -> torch.Tensor:
        """Working-set pages (distinct pages, summed over layers and heads): ``[max_requests]``
        int64, or ``[len(req_slots)]`` for those slots only.

        ``num_pages``: a bound on the page ids in the ring (the longest request's pages). With it
        the count is a scatter into a page bitmap (one pass, no sort); without, a sort per row."""
        ring = self.ring[: self.max_requests] if req_slots is None else self.ring[req_slots.long()]
        if num_pages is not None:
            ids = ring.permute(0, 2, 3, 1, 4).flatten(3).long()  # [R, L, H, window * K]
            seen = torch.zeros(*ids.shape[:3], num_pages + 1, dtype=torch.uint8, device=ids.device)
            seen.scatter_(-1, torch.where((ids < 0) | (ids >= num_pages), num_pages, ids), 1)  # none: column num_pages
            return seen[..., :num_pages].sum((1, 2, 3), dtype=torch.int64)
        pages = ring.permute(0, 2, 3, 1, 4).flatten(3).sort(-1).values  # [R, L, H, window * K]
        first = torch.ones_like(pages[..., :1], dtype=torch.bool)
        distinct = (pages >= 0) & torch.cat([first, pages[..., 1:] != pages[..., :-1]], -1)
        return distinct.sum((1, 2, 3))

    def publish(self, req_slots: list[int], num_pages: int | None = None) -> None:
        """Count the working sets of ``req_slots`` and start copying them to the host without
        waiting (a pinned buffer and an event on CUDA); :meth:`published` returns the newest
        counts whose copy has landed. Two copies may be in flight; a third publish is skipped."""
        if not req_slots:
            self._published = {}
            return
        on_cuda = self.ring.device.type == "cuda"
        if on_cuda and len(self._in_flight) == 2:
            return
        sizes = self.sizes(host_to_device(req_slots, self.ring.device), num_pages)
        if not on_cuda:
            self._published = dict(zip(req_slots, sizes.tolist()))
            return
        buffer = self._buffers[self._next_buffer]
        self._next_buffer ^= 1
        buffer[: len(req_slots)].copy_(sizes, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._in_flight.append((list(req_slots), buffer, event))

    def published(self) -> dict[int, int]:
        """Request slot -> working-set pages, as of the newest :meth:`publish` that has landed
        (never blocks; a slot not running then is absent)."""
        while self._in_flight and self._in_flight[0][2].query():
            slots, buffer, _ = self._in_flight.pop(0)
            self._published = dict(zip(slots, buffer[: len(slots)].tolist()))
        return self._published

    def forget(self, req_slot: int) -> None:
        """Drop a finished, aborted or retracted request's history (its slot may be reused)."""
        self.ring[req_slot].fill_(-1)  # fill_, not `= -1`: see sparse_sglang.mem_cache.utils


# Admission.


@dataclass(frozen=True, slots=True)
class Running:
    """A request in the running batch. ``arrival`` orders requests (smaller = older)."""

    rid: Hashable
    arrival: float
    working_set_pages: int


@dataclass(frozen=True, slots=True)
class Waiting:
    """A request that could start (or resume) now.

    ``working_set_pages``: its estimated GPU working set (a prefill: :func:`prefill_pages`).
    ``host_pages``: host KV pages it still has to allocate (all its KV for a new request; 0 for a
    retracted one, which kept its host KV).
    """

    rid: Hashable
    arrival: float
    working_set_pages: int
    host_pages: int


@dataclass(slots=True)
class AdmissionDecision:
    """One scheduling round's outcome; every input request is in exactly one list.

    ``retract`` is newest first (the requests keep their host KV; the decision only names them);
    ``admit`` and ``defer`` are in arrival order; ``refuse`` maps a request to the reason.
    ``working_set_pages`` sums the kept and admitted working sets; ``forced`` says the progress
    rule let one request run alone over ``budget_pages``.
    """

    keep: list[Hashable] = field(default_factory=list)
    retract: list[Hashable] = field(default_factory=list)
    admit: list[Hashable] = field(default_factory=list)
    defer: list[Hashable] = field(default_factory=list)
    refuse: dict[Hashable, str] = field(default_factory=dict)
    working_set_pages: int = 0
    budget_pages: int = 0
    forced: bool = False


class AdmissionPolicy:
    """Keep, retract, admit, defer and refuse so the summed working sets fit the GPU cache.

    Parameters
    ----------
    gpu_budget_pages : int
        GPU page-cache slots (one slot = one (layer, kv head, page)) the working sets may use.
    host_total_pages : int
        Pages in the host KV store: a request needing more can never run.
    stats : AdmissionStats, optional
        Where :meth:`decide` counts its rounds (its owner's, e.g. the runtime's
        :class:`~sparse_sglang.stats.SparseStats`); a fresh one by default.

    Rules of :meth:`decide`, in order:

    1. Running requests, oldest first, are kept while their working sets fit; the rest are
       retracted (so retraction takes the newest first). The oldest is always kept, even alone
       over the budget (retracting everything would stall).
    2. If anything was retracted, nothing is admitted (the cache is already over-full, and the
       retracted requests, being older, come first in the waiting queue anyway).
    3. Waiting requests, in arrival order: refused if ``host_pages > host_total_pages``; admitted
       while each fits both the remaining budget and the free host pages; the first that does not
       fit and everything after it are deferred (strict FCFS, see the module docstring).
    4. Progress: if nothing is running, the head request is admitted even when its working set
       alone exceeds the budget (it runs with its working set capped at the cache). Free host
       pages stay a hard limit: its KV has to be stored somewhere.
    """

    def __init__(self, gpu_budget_pages: int, host_total_pages: int, stats: AdmissionStats | None = None):
        if gpu_budget_pages < 1 or host_total_pages < 1:
            raise ValueError(f"budgets must be positive, got gpu {gpu_budget_pages}, host {host_total_pages} pages")
        self.gpu_budget_pages, self.host_total_pages = gpu_budget_pages, host_total_pages
        self.stats = AdmissionStats() if stats is None else stats  # totals over every decide(); only it writes them

    def decide(self, running: Sequence[Running], waiting: Sequence[Waiting], host_free_pages: int) -> AdmissionDecision:
        budget = self.gpu_budget_pages
        d = AdmissionDecision(budget_pages=budget)
        used = 0
        for i, r in enumerate(sorted(running, key=lambda r: r.arrival)):
            if not d.retract and (used + r.working_set_pages <= budget or i == 0):
                d.keep.append(r.rid)
                used += r.working_set_pages
            else:
                d.retract.append(r.rid)
        d.retract.reverse()  # newest first
        d.forced = used > budget

        blocked = bool(d.retract)
        host_free = host_free_pages
        for w in sorted(waiting, key=lambda w: w.arrival):
            if w.host_pages > self.host_total_pages:
                d.refuse[w.rid] = (
                    f"request {w.rid!r} needs {w.host_pages} host KV pages but the host cache holds "
                    f"{self.host_total_pages}; raise --sparse-host-cache-gb or shorten the prompt / max_new_tokens"
                )
                continue
            alone = not d.keep and not d.admit  # rule 4: nothing would run otherwise
            fits = used + w.working_set_pages <= budget or alone
            if blocked or not fits or w.host_pages > host_free:
                blocked = True
                d.defer.append(w.rid)
                continue
            d.admit.append(w.rid)
            used += w.working_set_pages
            host_free -= w.host_pages
            d.forced |= used > budget
        d.working_set_pages = used
        self._count(d)
        return d

    def _count(self, d: AdmissionDecision) -> None:
        self.stats.rounds += 1
        self.stats.admitted += len(d.admit)
        self.stats.deferred += len(d.defer)
        self.stats.retracted += len(d.retract)
        self.stats.refused += len(d.refuse)
        self.stats.forced += d.forced


class WorkingSetGate:
    """Algorithm 1 inside SGLang's scheduler: whether one more request may start, and whether the
    running ones may all stay.

    A running request's working set is the distinct pages it selected over the tracker's ``window``
    decode steps (:class:`WorkingSetTracker`, fed by the sparse decoder and read back without a
    sync), counted as at least a narrowest cache row: that much it holds whatever happens. A
    request starting needs a narrowest row, or a retracted one the working set it had.

    - :meth:`admits` (SGLang's prefill admission): the gate's one :class:`AdmissionPolicy`
      decides a round of the running requests, those admitted earlier in SGLang's round (a
      narrowest row each: they run once their prefill does) and the candidate; a deferred request
      stops the round (strict FCFS) and is asked about again in the next one.
    - :meth:`keeps` (SGLang's decode memory check): False while the running working sets exceed
      the cache, so SGLang retracts one more (its retraction order; the request keeps its host KV
      as a radix-cached prefix, ``integration/retraction.py``); the last request always stays.

    The :class:`~sparse_sglang.runtime.SparseRuntime` owns the gate and the ``counts`` it writes
    (its policy writes ``counts.admission``, one round per :meth:`admits`); SGLang's scheduler
    reaches the gate through its token allocator's KV pool.

    Ranks agree: under tensor parallelism every rank's scheduler asks the same questions in the same
    order, but each answers from its own kv heads' working sets (and its own cache size). ``agree``
    (:func:`max_over_ranks` over the TP group's CPU group) turns each rank's numbers into the same
    numbers on every rank, the largest demand and the smallest cache, so every rank decides alike
    (and, answering alike, asks alike next). The cache size is agreed once, here, so every rank
    must build its gate at the same point (the runtime's ``start_attention``, which each rank runs
    while its attention backend is made). ``None``: one rank.
    """

    def __init__(self, cache, tracker: WorkingSetTracker, agree=None, counts: WorkingSetCounts | None = None):
        self.cache, self.tracker = cache, tracker  # the tracker's window is the rule's w
        self.agree = agree  # list[int] -> list[int]: the elementwise max over ranks (None: one rank)
        self.counts = WorkingSetCounts() if counts is None else counts  # its answers since start (metrics)
        # The smallest cache over ranks: the working sets' budget, the same on every rank.
        capacity = cache.num_slots if agree is None else -agree([-cache.num_slots])[0]
        # Host memory is SGLang's to check (its token allocator): no request here needs host pages.
        self.policy = AdmissionPolicy(capacity, host_total_pages=1, stats=self.counts.admission)
        self.holding = False  # the last answer deferred: the waiting queue waits for working-set room
        self.resume_pages: dict = {}  # rid of a retracted request -> its working set then

    @property
    def capacity(self) -> int:
        """GPU cache slots the running working sets may use (the smallest cache over ranks)."""
        return self.policy.gpu_budget_pages

    def demand(self, running_slots: list[int]) -> list[int]:
        """Working-set pages of each running request (at least a narrowest row), the largest over ranks."""
        if not running_slots:  # every rank runs the same batch: all of them skip the exchange alike
            return []
        row = self.cache.row_slots
        published = self.tracker.published()
        local = [max(published.get(slot, 0), row) for slot in running_slots]
        return local if self.agree is None else self.agree(local)

    def admits(self, running_slots: list[int], starting: int, rid=None) -> bool:
        """``running_slots``: request slots of the running batch; ``starting``: requests already
        admitted in this round (slots not yet assigned); ``rid``: the candidate's. True when one
        more fits."""
        row = self.cache.row_slots
        demand = self.demand(running_slots)
        # The round as the policy sees it: the running requests by slot order, then this round's
        # earlier admissions (newer), then the candidate, the one request waiting.
        running = [Running(("running", i), i, pages) for i, pages in enumerate(demand)]
        running += [Running(("starting", j), len(demand) + j, row) for j in range(starting)]
        candidate = Waiting(rid, len(running), self.resume_pages.get(rid, row), host_pages=0)
        fits = bool(self.policy.decide(running, [candidate], host_free_pages=0).admit)
        self.holding = not fits
        if fits:
            self.resume_pages.pop(rid, None)
        return fits

    def keeps(self, running_slots: list[int]) -> bool:
        """True when the running requests' working sets fit the cache together (one always does);
        a False answer makes SGLang retract one request, so it counts a retraction."""
        if len(running_slots) <= 1:
            return True
        fits = sum(self.demand(running_slots)) <= self.capacity
        self.counts.retracted += not fits
        return fits

    def note_retracted(self, rid, req_slot: int) -> None:
        """A running request is being retracted: remember its working set, which it asks for again
        when it comes back (so it does not return the moment a narrowest row is free)."""
        self.resume_pages[rid] = self.demand([req_slot])[0]

    def note_queued_aborts(self, rids: list) -> None:
        """Waiting requests ``rids`` are being aborted; counted when the working-set rule holds
        the queue (strict FCFS: every waiting request then waits for room, not only the head)."""
        if self.holding:
            self.counts.aborted_while_holding += len(rids)
        for rid in rids:
            self.resume_pages.pop(rid, None)


def max_over_ranks(group):
    """``agree`` for :class:`WorkingSetGate`: the elementwise max of an int list over the ranks of
    the (gloo, CPU) process group ``group``; every rank must call it with lists of one length."""
    import torch.distributed as dist

    def agree(values: list[int]) -> list[int]:
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return t.tolist()

    return agree
