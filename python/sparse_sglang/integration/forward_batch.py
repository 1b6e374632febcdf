"""Each forward's request slots on the host, for the sparse backend: SGLang's ``ForwardBatch.init_new``.

The backend's per-step bookkeeping (cache rows, page-table sizes, write-allocation) goes request
by request, so it needs the batch's request slots on the host. A ``ForwardBatch`` carries them on
the GPU only, and reading them back waits for every kernel queued before: under SGLang's overlap
scheduler that is the whole previous forward, which the next step's host work is meant to hide
behind. The ``ScheduleBatch`` a forward is built from keeps a host mirror
(``req_pool_indices_cpu``), and ``ForwardBatch.init_new`` is where the two meet; the next call into
the backend (``init_forward_metadata``, or a CUDA-graph replay's ``init_forward_metadata_out_graph``)
is that forward's.
"""

from __future__ import annotations

import functools

from sparse_sglang.integration.registry import relies_on


@relies_on("sglang.srt.model_executor.forward_batch_info:ForwardBatch.init_new",
           at="sglang/srt/model_executor/forward_batch_info.py:705")  # fmt: skip
def patch_forward_batch_init_new() -> None:
    """Make ``ForwardBatch.init_new`` hand the batch's host request slots to a sparse backend."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    from sparse_sglang.integration.attention_backend import SparseAttnBackend

    original = ForwardBatch.init_new  # a classmethod, bound to ForwardBatch
    if getattr(original, "sparse_sglang", False):
        return

    @functools.wraps(original.__func__)
    def init_new(cls, batch, model_runner, **kwargs):
        backend = getattr(model_runner, "attn_backend", None)
        if isinstance(backend, SparseAttnBackend):
            backend.note_req_slots(getattr(batch, "req_pool_indices_cpu", None))
        return original.__func__(cls, batch, model_runner, **kwargs)

    init_new.sparse_sglang = True
    ForwardBatch.init_new = classmethod(init_new)
