"""Sparse decode attention: page scoring and page selection; the references apart, in :mod:`.reference`.

Shared by the CPU reference (tests, ``benchmark/quality.py``) and the GPU decode path::

    scores = get_selector("quest").score(q, kmin, kmax, mean)            # [B, Hkv, N]
    sel = select_pages(scores, num_pages, budget_pages, sink_pages, recent_pages)
    out = reference.sparse_attention_reference(q_flat, k, v, sel.page_ids, page_size, seq_len)

- :mod:`.selectors`: ``Selector`` and the registry ``SELECTORS`` (quest, arkvale, mean).
- :mod:`.selection`: ``select_pages``, ``keep_cached``.
- :mod:`.reference`: the kernels' torch references and the evaluation references
  ``sparse_attention_reference``, ``attention_mass_recall``, ``max_reduce_logical`` (the CPU tests,
  the GPU tests' ground truth, ``benchmark/quality.py``); none of them runs in the server, and the
  package exports none of them: import them from :mod:`.reference`.

The decode path runs downhill, each stage importing only those below it and ``mem_cache``'s views:
:mod:`.sparse_decode` (``make_decoder``; plan once per step, run per layer) -> selection
(:mod:`.scoring`, the score kernels; a top-k) -> retrieval (:mod:`.retrieval`, the retrieve kernel
over ``GPUPageCache.view``) -> with ``--sparse-rerank-factor``, the re-rank of the loaded candidates
(:mod:`.rerank`) -> attention (FlashInfer's paged decode). :mod:`.reference` holds the
torch references of the kernels, which the CPU tests compare them with.
"""

from sparse_sglang.attention.selection import NOT_CACHED, Selection, keep_cached, select_pages
from sparse_sglang.attention.selectors import (
    DEFAULT_GROUP_REDUCE,
    GROUP_REDUCES,
    SELECTORS,
    Selector,
    cuboid_score,
    get_selector,
    kept_summaries,
)

__all__ = [
    "DEFAULT_GROUP_REDUCE",
    "GROUP_REDUCES",
    "NOT_CACHED",
    "SELECTORS",
    "Selection",
    "Selector",
    "cuboid_score",
    "get_selector",
    "keep_cached",
    "kept_summaries",
    "select_pages",
]
