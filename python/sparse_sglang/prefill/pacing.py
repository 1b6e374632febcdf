"""Layer segments sized to a time between tokens (``--sparse-tbt-target-ms``).

A fixed injection budget (``--sparse-max-inject-tokens``) bounds a segment's token-layers, not its
time: a chunk that attends to a long cached prefix costs more per layer than the first chunk of a
prompt, and the decode step beside it grows with the batch. The running requests see one token
per iteration, so what they feel is the iteration's period: one decode step plus one segment.

:class:`SegmentPacer` sizes each segment from that period, as the loop measures it (host time
between the ends of consecutive decode steps; in SGLang's normal loop a decode step's result is
read back on the host, so the period includes the segment launched before it):

- ``decode_s``: the period with no segment in it, a moving average;
- ``layer_s``: what one layer of the batch in flight adds, from its own last segment (every layer
  of one batch costs about the same); a new batch starts from the last batch's cost per
  token-layer, scaled to its tokens (or from the fixed budget before anything was measured);
- the next segment runs ``(target - decode_s) / layer_s`` layers, at least one (a decode step
  slower than the target alone still lets the prefill advance a layer an iteration).

Example::

    pacer = SegmentPacer(target_s=0.08, fallback_inject_tokens=65536)
    pacer.note_period(0.030, layers=0, batch_tokens=0)        # a decode step alone
    n = pacer.layers(batch_tokens=4096)                       # the first segment: 16 layers
    pacer.note_period(0.030 + n * 0.006, layers=n, batch_tokens=4096)
    pacer.layers(batch_tokens=4096)                           # (0.08 - 0.03) / 0.006 -> 8
"""

from __future__ import annotations

import math

from sparse_sglang.prefill.segments import layers_per_iteration

# Weight of the newest decode-only period in the moving average.
DECODE_EMA = 0.2


class SegmentPacer:
    def __init__(self, target_s: float, fallback_inject_tokens: int):
        if not (target_s > 0 and math.isfinite(target_s)):
            raise ValueError(f"the time between tokens to pace to must be positive and finite, got {target_s}")
        self.target_s = target_s
        self.fallback_inject_tokens = fallback_inject_tokens  # before anything is measured
        self.decode_s: float | None = None  # a decode step's period with no segment beside it
        self.token_layer_s: float | None = None  # the last measured segment's cost per token-layer
        self.layer_s: float | None = None  # the batch in flight's cost per layer (None: not measured yet)

    def start_batch(self) -> None:
        """A new prefill batch: its cost per layer is not known yet."""
        self.layer_s = None

    def note_period(self, period_s: float, layers: int, batch_tokens: int) -> None:
        """The time between two decode steps' ends, with a segment of ``layers`` layers of a batch
        of ``batch_tokens`` new tokens between them (0 layers: the decode step alone)."""
        if not (period_s > 0 and math.isfinite(period_s)):
            return
        if layers == 0:
            self.decode_s = (
                period_s if self.decode_s is None else (1 - DECODE_EMA) * self.decode_s + DECODE_EMA * period_s
            )
            return
        added = period_s - (self.decode_s or 0.0)
        if added <= 0:  # within the decode step's noise: no cost to learn from
            return
        self.layer_s = added / layers
        self.token_layer_s = self.layer_s / max(1, batch_tokens)

    def layers(self, batch_tokens: int) -> int:
        """Layers the next segment of the batch in flight (``batch_tokens`` new tokens) runs."""
        layer_s = self.layer_s
        if layer_s is None and self.token_layer_s is not None:
            layer_s = self.token_layer_s * max(1, batch_tokens)
        if layer_s is None:
            return layers_per_iteration(batch_tokens, self.fallback_inject_tokens)
        room = self.target_s - (self.decode_s or 0.0)
        return max(1, int(room // layer_s))
