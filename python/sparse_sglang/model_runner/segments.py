"""The plan of a layer-segmented prefill (SparseServe §3.4, with its in-layer chunking hybrid).

Chunked prefill cannot bound a long prompt's GPU memory: every chunk attends to the KV of every
earlier chunk in every layer. A layer-segmented prefill runs the whole prompt through a few layers
per scheduler iteration instead (the hidden states wait on the GPU between iterations), and each
finished layer's KV leaves for the host, so the GPU holds about one layer's KV of the prompt.

The work one iteration may inject is ``max_inject_tokens`` token-layers (SparseServe's
maxInjectToken). By default it equals one 2048-token chunk of chunked prefill through every layer
(:func:`default_max_inject_tokens`), so an iteration next to the running decodes costs what a
chunked-prefill iteration costs. A prompt of ``T`` tokens then runs ``max_inject_tokens // T``
layers per iteration; a prompt longer than ``max_inject_tokens`` (one layer alone is too much work
for an iteration) runs one layer per iteration in chunks of ``max_inject_tokens`` tokens, each
chunk attending to the earlier chunks of the same layer (the hybrid).
"""

from __future__ import annotations

from dataclasses import dataclass

from sparse_sglang.scheduler.admission import prefill_pages

CHUNK_TOKENS = 2048  # the chunked-prefill chunk whose per-iteration work the default matches


@dataclass(frozen=True)
class Segment:
    """One iteration's share of a prefill: ``tokens`` (prompt positions) through ``layers``."""

    layers: range
    tokens: range

    @property
    def work(self) -> int:
        """Token-layers this iteration runs (what ``max_inject_tokens`` bounds)."""
        return len(self.layers) * len(self.tokens)


def default_max_inject_tokens(num_layers: int, chunk_tokens: int = CHUNK_TOKENS) -> int:
    """Token-layers of one ``chunk_tokens`` chunk of chunked prefill through every layer."""
    return chunk_tokens * num_layers


def plan_segments(prompt_tokens: int, num_layers: int, max_inject_tokens: int) -> list[Segment]:
    """The iterations of one prefill, in order: layer groups bottom-up, each layer's chunks in
    token order. Every (layer, token) is covered once and no iteration exceeds ``max_inject_tokens``."""
    if prompt_tokens < 1 or num_layers < 1 or max_inject_tokens < 1:
        raise ValueError(f"need positive sizes, got {prompt_tokens} tokens, {num_layers} layers, "
                         f"{max_inject_tokens} inject tokens")  # fmt: skip
    chunk = min(prompt_tokens, max_inject_tokens)
    per_iteration = max(1, max_inject_tokens // chunk)  # layers; 1 whenever the layer is chunked
    return [
        Segment(range(first, min(first + per_iteration, num_layers)), range(start, min(start + chunk, prompt_tokens)))
        for first in range(0, num_layers, per_iteration)
        for start in range(0, prompt_tokens, chunk)
    ]


def segment_hbm_pages(segment: Segment, page_size: int, num_kv_heads: int) -> int:
    """KV pages (per kv head counted separately) the GPU holds while ``segment`` runs: its layers'
    KV of every token up to the segment's end (earlier chunks of the layer included). The working-
    set admission counts a layer-segmented prefill as this, not as the whole prompt's KV."""
    return prefill_pages(segment.tokens.stop, len(segment.layers), num_kv_heads, page_size)
