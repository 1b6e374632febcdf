"""The plan of a layer-segmented prefill (SparseServe §3.4, with its in-layer chunking hybrid).

Chunked prefill cannot bound what a long prompt costs the decodes running next to it: SGLang runs
a prefill batch through every layer in one iteration, and the decodes wait for it. A
layer-segmented prefill runs a batch a few layers per scheduler iteration instead (the hidden
states wait on the GPU between iterations) and each iteration also runs one decode step.

The work one iteration may inject is ``max_inject_tokens`` token-layers (SparseServe's
maxInjectToken). By default it equals one 2048-token chunk of chunked prefill through every layer
(:meth:`SparseConfig.inject_tokens <sparse_sglang.config.SparseConfig.inject_tokens>`), so an
iteration next to the running decodes costs what a chunked-prefill iteration costs. A batch of
``T`` new tokens runs ``max_inject_tokens // T`` layers per iteration (at least one).

A prompt longer than one chunk (SGLang's ``--chunked-prefill-size``, capped at
``max_inject_tokens`` so one layer of it fits an iteration) is chunked too, the hybrid: each chunk
goes through all layers in segments before the next chunk starts, and attends to the earlier
chunks' KV of the same layer, staged from the host one layer at a time. Every layer's KV leaves
for the host as soon as the layer has run, so the GPU holds one layer's KV of the prompt at most.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def layers_per_iteration(batch_tokens: int, max_inject_tokens: int) -> int:
    """Layers a prefill batch of ``batch_tokens`` new tokens runs per iteration (at least one)."""
    return max(1, max_inject_tokens // max(1, batch_tokens))


def next_segment_end(done_layers: int, batch_tokens: int, num_layers: int, max_inject_tokens: int) -> int:
    """The layer a batch's next segment stops before, having run ``[0, done_layers)`` already."""
    if not 0 <= done_layers < num_layers:
        raise ValueError(f"a prefill of {num_layers} layers has no segment after layer {done_layers}")
    return min(num_layers, done_layers + layers_per_iteration(batch_tokens, max_inject_tokens))


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
    return prefill_pages(staged, 1, num_kv_heads, page_size) + prefill_pages(len(segment.tokens), 1, num_kv_heads, page_size)
