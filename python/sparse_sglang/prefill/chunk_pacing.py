"""Prefill chunks sized to a time between tokens (``--sparse-tbt-target-ms`` with
``--sparse-interleave-prefill``).

Interleaved prefill runs one decode step between any two prefill batches, so a running request
waits for one decode step plus one chunk between two of its tokens. A fixed
``--chunked-prefill-size`` bounds the chunk's tokens, not its time: a chunk deep into a long
prompt attends to (and stages from host memory) the whole prefix before it, so it costs more than
the prompt's first. Here each round's prefill budget is a number of tokens chosen from a cost
model of the chunk, learned from what the server measures:

- :class:`BatchTimer` times each batch on the GPU, from events recorded around its launch;
- :class:`ChunkPacer` keeps a decode step's time (a moving average) and fits a chunk's cost as
  ``a + b P + c x + d x (P + x / 2)`` over its recent chunks (``x`` new tokens after ``P`` tokens
  of prefix: a fixed cost, staging the prefix, the new tokens' own work, and attention over
  ``x (P + x / 2)`` query-key pairs), with non-negative terms; the next chunk is the largest
  ``x`` whose cost fits the target less a decode step, but never one that prefills more than
  :data:`MAX_SLOWDOWN` times slower per token than SGLang's chunk would at the same point.

A chunk more than :data:`OUTLIER_RATIO` times slower or faster than a fit robust to it predicts
(a cold first forward, a host stall) is left out (:func:`robust_fit`). Once paced, nearly every
chunk is about one size, and chunks of one size tell a fixed cost from a per-token one poorly: the
fit may trade the two for each other while predicting the chunks it saw as well, so the server
logs, beside each fit, the median chunk and time of each size class it rests on (sizes within a
factor of two), which show the cost by size without the model.

The floor is there because a chunk's fixed cost and its prefix's staging do not shrink with it:
deep into a prompt whose prefix is staged from host memory, a chunk that fits the target may hold
a few tokens and spend its whole time re-staging. A prompt cut into such chunks prefills at a
fraction of its speed, the requests waiting behind it are admitted that much later, and every
decode step carries a full target's wait for a few tokens of prefill. Where the target and the
floor disagree, the chunk is the floor's and its round goes over the target. The floor compares
two predicted costs, not the model's terms one by one (under noise the fit can trade its fixed
and staging terms for each other while predicting the chunks it saw as well).

Until it has seen enough chunks the pacer alternates SGLang's ``--chunked-prefill-size`` with half
of it (two sizes tell a chunk's per-token cost from its fixed one); that size also stays the
largest chunk paced, and with nothing decoding beside it the chunk is SGLang's.

Example::

    pacer = ChunkPacer(target_s=0.1, max_chunk_tokens=8192, align=64)
    pacer.note_decode(0.030)
    for x, p in [(2048, 0), (4096, 2048), (1024, 6144), (2048, 7168)]:   # chunks seen
        pacer.note_chunk(ChunkShape.of([(x, p)]), 0.002 + x * 8e-6 + x * (p + x / 2) * 1e-9)
    pacer.chunk_tokens(prefix_tokens=16384)   # 2624: the most (in 64s) predicted within 0.1 - 0.03 s
    pacer.chunk_tokens(prefix_tokens=0)       # 6080: a prompt's first chunk costs less per token
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

# Weight of the newest decode step in the moving average.
DECODE_EMA = 0.2
# Chunks the cost model is fitted on: the newest ones (the prompts in flight change).
CHUNK_WINDOW = 64
# A chunk this many times slower or faster than a fit robust to it predicts (a cold first
# forward, a host stall) is left out of the fit.
OUTLIER_RATIO = 3.0
# Chunks seen, of at least two sizes, before the model sizes a chunk.
MIN_CHUNKS = 4
# A paced chunk's predicted seconds per token over SGLang's chunk's at the same prefix, at most
# (module doc): however the target cuts a prompt, its prefill takes at most twice SGLang's time.
MAX_SLOWDOWN = 2.0


def size_class(tokens: int) -> int:
    """Chunks within a factor of two of each other share a class: 1, 2-3, 4-7, ... tokens."""
    return max(tokens, 1).bit_length()


def chunk_unit(page_size: int) -> int:
    """Tokens a paced chunk comes in multiples of: whole pages, and at least 64 tokens."""
    return max(page_size, 64)


@dataclass(frozen=True, slots=True)
class ChunkShape:
    """A prefill batch's work in the cost model's terms, summed over its requests."""

    # fmt: off
    new_tokens:     int    # x: tokens the batch prefills
    prefix_tokens:  int    # P: tokens before them (cached or earlier chunks), staged from host memory
    attended_pairs: float  # x (P + x / 2): query-key pairs its causal attention computes
    # fmt: on

    @classmethod
    def of(cls, requests: Iterable[tuple[int, int]]) -> ChunkShape:
        """From each request's ``(new tokens, prefix tokens)``."""
        reqs = list(requests)
        return cls(sum(x for x, _ in reqs), sum(p for _, p in reqs), float(sum(x * (p + x / 2) for x, p in reqs)))

    def features(self) -> tuple[float, float, float, float]:
        return 1.0, float(self.prefix_tokens), float(self.new_tokens), self.attended_pairs


def nonnegative_fit(rows: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient ``>= 0``, exactly: the best of the unconstrained fits
    on each subset of the columns whose coefficients come out non-negative (4 columns: 15 fits)."""
    scale = np.abs(rows).max(axis=0)
    scale[scale == 0] = 1.0
    scaled = rows / scale
    best, best_err = np.zeros(rows.shape[1]), float(np.sum(seconds**2))
    for size in range(1, rows.shape[1] + 1):
        for cols in itertools.combinations(range(rows.shape[1]), size):
            coef, *_ = np.linalg.lstsq(scaled[:, cols], seconds, rcond=None)
            if np.any(coef < 0):
                continue
            err = float(np.sum((scaled[:, cols] @ coef - seconds) ** 2))
            if err < best_err - 1e-18:
                best, best_err = np.zeros(rows.shape[1]), err
                best[list(cols)] = coef
    return best / scale


def robust_fit(rows: np.ndarray, seconds: np.ndarray, rounds: int = 2) -> np.ndarray:
    """:func:`nonnegative_fit` over the chunks within :data:`OUTLIER_RATIO` of a fit of each
    chunk's time relative to itself, reweighted toward least absolute deviations (a chunk far off
    its prediction pulls that fit no harder than one slightly off, so a few outliers cannot drag
    the fit that finds them; two rounds find the server's cold warm-up batches), or over all of
    them if fewer than :data:`MIN_CHUNKS` of two sizes would remain (column 2 is the size)."""
    weights = 1 / seconds
    for _ in range(rounds):
        cost = nonnegative_fit(rows * weights[:, None], seconds * weights)
        weights = 1 / seconds / np.sqrt(np.maximum(np.abs(rows @ cost / seconds - 1), 0.01))
    predicted = rows @ cost
    kept = (seconds <= OUTLIER_RATIO * predicted) & (seconds * OUTLIER_RATIO >= predicted)
    if kept.sum() < MIN_CHUNKS or len(set(rows[kept, 2])) < 2:
        kept[:] = True
    return nonnegative_fit(rows[kept], seconds[kept])


class ChunkPacer:
    """A decode step's time and a chunk's cost, as measured; the next chunk's tokens from them."""

    def __init__(self, target_s: float, max_chunk_tokens: int, align: int):
        if not (target_s > 0 and math.isfinite(target_s)):
            raise ValueError(f"the time between tokens to pace to must be positive and finite, got {target_s}")
        if max_chunk_tokens < align or align < 1:
            raise ValueError(f"the largest chunk ({max_chunk_tokens}) must hold one aligned unit ({align})")
        self.target_s, self.max_chunk_tokens, self.align = target_s, max_chunk_tokens, align
        self.decode_s: float | None = None  # a decode step's time, moving average
        self.chunks: deque[tuple[ChunkShape, float]] = deque(maxlen=CHUNK_WINDOW)
        self.cost: np.ndarray | None = None  # (a, b, c, d) of the module doc; None: not fitted yet
        self.unfitted_chunks = 0  # chunks sized before the model was fitted (they alternate two sizes)

    def note_decode(self, seconds: float) -> None:
        if seconds > 0 and math.isfinite(seconds):
            self.decode_s = (
                seconds if self.decode_s is None else (1 - DECODE_EMA) * self.decode_s + DECODE_EMA * seconds
            )

    def note_chunk(self, shape: ChunkShape, seconds: float) -> None:
        if not (seconds > 0 and math.isfinite(seconds) and shape.new_tokens > 0):
            return
        self.chunks.append((shape, seconds))
        if len(self.chunks) >= MIN_CHUNKS and len({s.new_tokens for s, _ in self.chunks}) >= 2:
            rows = np.array([s.features() for s, _ in self.chunks])
            self.cost = robust_fit(rows, np.array([t for _, t in self.chunks]))

    def chunk_tokens(self, prefix_tokens: int) -> int:
        """Tokens the next chunk of a prompt ``prefix_tokens`` in prefills: a multiple of ``align``
        in ``[align, max_chunk_tokens]``, the most whose predicted time fits the target less a
        decode step, and at least the fewest that prefill within :data:`MAX_SLOWDOWN` of SGLang's
        chunk's seconds per token (so also when no chunk fits, the prompt advances at least at half
        its speed)."""
        if self.cost is None or self.decode_s is None:
            self.unfitted_chunks += 1
            half = max(self.align, self.max_chunk_tokens // 2 // self.align * self.align)
            return self.max_chunk_tokens if self.unfitted_chunks % 2 else half
        a, b, c, d = (float(v) for v in self.cost)
        # cost(x) = fixed + lin x + quad x^2
        fixed, lin, quad = a + b * prefix_tokens, c + d * prefix_tokens, d / 2
        room = self.target_s - self.decode_s - fixed
        if room <= 0:
            fits = 0.0
        elif quad > 0:
            fits = (-lin + math.sqrt(lin * lin + 4 * quad * room)) / (2 * quad)
        else:
            fits = room / lin if lin > 0 else math.inf
        fitted = int(min(fits, self.max_chunk_tokens)) // self.align * self.align
        # the floor: fixed / x + lin + quad x <= MAX_SLOWDOWN * cost(X) / X, the smallest x
        big = self.max_chunk_tokens
        per_token = MAX_SLOWDOWN * (fixed + lin * big + quad * big * big) / big - lin
        disc = per_token * per_token - 4 * quad * fixed
        if per_token <= 0 or disc < 0:
            floor = float(big)
        else:
            floor = 2 * fixed / (per_token + math.sqrt(disc))  # the smaller root, without cancellation
        least = math.ceil(floor / self.align) * self.align
        return min(big, max(self.align, fitted, least))

    def describe(self) -> str:
        """The fitted model, for the server's log."""
        if self.cost is None or self.decode_s is None:
            return f"chunk pacing: fitting ({len(self.chunks)} chunks timed)"
        a, b, c, d = (float(v) for v in self.cost)
        by_size: dict[int, list[tuple[ChunkShape, float]]] = {}
        for shape, seconds in self.chunks:
            by_size.setdefault(size_class(shape.new_tokens), []).append((shape, seconds))
        measured = "; ".join(  # what the fit rests on: each size class's median chunk and time
            f"{len(chunks)} of ~{np.median([s.new_tokens for s, _ in chunks]):.0f} tokens "
            f"{np.median([t for _, t in chunks]) * 1e3:.1f} ms"
            for chunks in (by_size[size] for size in sorted(by_size))
        )
        return (f"chunk pacing: decode step {self.decode_s * 1e3:.1f} ms; a chunk {a * 1e3:.2f} ms + {b * 1e6:.2f} ms "
                f"per 1K prefix tokens + {c * 1e6:.2f} ms per 1K tokens + {d * 1e9:.3f} ms per 1M pairs "
                f"(fitted on {measured})")  # fmt: skip


class BatchTimer:
    """Each batch's time on the GPU, from two events on its stream, one recorded before the
    scheduler launches it and one after.

    The time between the scheduler's rounds is not a batch's time: under overlap scheduling a
    round waits for the batch before the one it launched, but a launch that itself waits for the
    GPU (a forward that synchronizes with the host) shifts which round waits for what, and the
    gaps between rounds then hold the chunk and the decode step together under the decode
    step's name (decision 19). Events time the batch on the GPU, whatever the host does after
    launching it: from when its stream reaches the first event (the batch before it done, or the
    launch beginning, whichever is later) to its last kernel, so a GPU left idle while the host
    prepares the batch counts to the batch, and an idle stream before its launch begins counts
    to none.

    ``make_event()`` returns an object with ``record(stream)``, ``query()`` (True once the GPU has
    passed it) and ``start.elapsed_time(end)`` in ms: ``torch.cuda.Event(enable_timing=True)`` in
    the server. :meth:`finished` never waits: it returns the batches whose end event has passed,
    oldest first, and keeps the rest for a later call."""

    def __init__(self, make_event):
        self.make_event = make_event
        self.pending: deque = deque()  # (label, start event, end event), launch order

    def started(self, stream=None):
        """The event a batch's launch is preceded by (on ``stream``; None: the current one)."""
        event = self.make_event()
        event.record(stream)
        return event

    def ended(self, label, start, stream=None) -> None:
        """The batch ``label`` launched since ``start``: time it once the GPU has run it."""
        end = self.make_event()
        end.record(stream)
        self.pending.append((label, start, end))

    def finished(self) -> list[tuple[object, float]]:
        """``(label, seconds)`` of every batch timed since the last call whose end has passed."""
        done = []
        while self.pending and self.pending[0][2].query():
            label, start, end = self.pending.popleft()
            done.append((label, start.elapsed_time(end) / 1000))
        return done
