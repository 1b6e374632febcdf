"""The plan of a whole prompt's layer-segmented prefill, the reference the server's loop is held
against (the server runs none of this module: it advances one segment at a time,
:func:`~sparse_sglang.prefill.segments.next_segment_end`).

:func:`plan_segments` lists every iteration of one prompt (chunks through layer groups);
:func:`segment_hbm_pages` bounds the KV pages the GPU holds while one runs. The tests check that
every (layer, token) is covered once within ``max_inject_tokens``, that the loop's segments are the
plan's, and that the GPU holds about one layer of the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

from sparse_sglang.prefill.segments import layers_per_iteration
from sparse_sglang.scheduler.admission import prefill_pages


@dataclass(frozen=True)
class Segment:
    """One iteration's share of a prefill: ``tokens`` (prompt positions) through ``layers``."""

    layers: range
    tokens: range

    @property
    def work(self) -> int:
        """Token-layers this iteration runs (what ``max_inject_tokens`` bounds)."""
        return len(self.layers) * len(self.tokens)


def plan_segments(prompt_tokens: int, num_layers: int, max_inject_tokens: int,
                  chunk_tokens: int | None = None) -> list[Segment]:  # fmt: skip
    """The iterations of one prompt's prefill, in order: chunks of ``chunk_tokens`` (at most
    ``max_inject_tokens``) in token order, each through its layer groups bottom-up. Every
    (layer, token) is covered once and no iteration exceeds ``max_inject_tokens``."""
    if prompt_tokens < 1 or num_layers < 1 or max_inject_tokens < 1 or (chunk_tokens is not None and chunk_tokens < 1):
        raise ValueError(f"need positive sizes, got {prompt_tokens} tokens, {num_layers} layers, "
                         f"{max_inject_tokens} inject tokens, chunks of {chunk_tokens}")  # fmt: skip
    chunk = min(prompt_tokens, max_inject_tokens, chunk_tokens or max_inject_tokens)
    plan = []
    for start in range(0, prompt_tokens, chunk):
        tokens = range(start, min(start + chunk, prompt_tokens))
        per_iteration = layers_per_iteration(len(tokens), max_inject_tokens)
        plan += [Segment(range(first, min(first + per_iteration, num_layers)), tokens)
                 for first in range(0, num_layers, per_iteration)]  # fmt: skip
    return plan


def segment_hbm_pages(segment: Segment, page_size: int, num_kv_heads: int, staging_tokens: int | None = None) -> int:
    """KV pages (per kv head counted separately) the GPU holds while ``segment`` runs: one layer's
    KV of the chunk's own tokens and of the earlier chunks' tokens staged from the host, at most
    ``staging_tokens`` of those at once (``--sparse-prefix-staging-tokens``; ``None``: all), since
    each layer's KV leaves for the host before the next layer runs (the bound the tests check a
    plan against)."""
    staged = segment.tokens.start if staging_tokens is None else min(segment.tokens.start, staging_tokens)
    return prefill_pages(staged, 1, num_kv_heads, page_size) + prefill_pages(
        len(segment.tokens), 1, num_kv_heads, page_size
    )
