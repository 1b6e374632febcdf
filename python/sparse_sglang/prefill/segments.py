"""How a layer-segmented prefill advances (SparseServe §3.4, with its in-layer chunking hybrid).

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

The server's loop (:mod:`sparse_sglang.integration.segmented_prefill`) asks
:func:`next_segment_end` after each segment; :mod:`.reference` plans a whole prompt's segments at
once, the specification the tests hold the loop against.
"""

from __future__ import annotations


def layers_per_iteration(batch_tokens: int, max_inject_tokens: int) -> int:
    """Layers a prefill batch of ``batch_tokens`` new tokens runs per iteration (at least one)."""
    return max(1, max_inject_tokens // max(1, batch_tokens))


def next_segment_end(done_layers: int, batch_tokens: int, num_layers: int, max_inject_tokens: int) -> int:
    """The layer a batch's next segment stops before, having run ``[0, done_layers)`` already."""
    if not 0 <= done_layers < num_layers:
        raise ValueError(f"a prefill of {num_layers} layers has no segment after layer {done_layers}")
    return min(num_layers, done_layers + layers_per_iteration(batch_tokens, max_inject_tokens))
