"""Page scorers: the *Index* half of SPIN's Index/Select split.

A selector turns decode queries and per-page key summaries into one score per (request, kv head,
page); :func:`sparse_sglang.attention.select_pages` (the *Select* half) keeps the top pages.
Callers gather each request's pages from :class:`~sparse_sglang.mem_cache.PageSummaries` first,
so every input here is dense ``[B, Hkv, N, D]`` and a request with fewer pages than ``N`` simply
has junk scores past its length, which selection masks.

Cuboid scores
-------------
Quest's bound ``sum_d max(q_d kmax_d, q_d kmin_d)`` and ArkVale's cuboid estimates are the same
function of a cuboid with centre ``c`` and per-channel radius ``r``: since
``max(a, b) = (a + b) / 2 + |a - b| / 2``,

    sum_d max(q_d (c_d + r_d), q_d (c_d - r_d)) = q . c + |q| . r,

two matmuls instead of a ``[B, Hkv, G, N, D]`` temporary. With ``r = (kmax - kmin) / 2`` it is
Quest (ArkVale's "cuboid-max"); ArkVale's "cuboid-mean" keeps the centre and shrinks the radius
to the mean distance of the page's keys from it (see :class:`ArkVale`).

GQA
---
All ``G`` query heads of a kv head score its pages; ``group_reduce`` folds them into the single
choice the kv head makes: ``"sum"`` (ArkVale's mean over the group, same ranking) or ``"max"``
(any head of the group may want the page). ``benchmark/quality.py`` measures both.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from sparse_sglang.mem_cache.key_sketch import sketch_page_scores

GROUP_REDUCES = ("sum", "max")
DEFAULT_GROUP_REDUCE = "sum"  # why: docs/results.md, "Selection quality"


def cuboid_score(q: torch.Tensor, center: torch.Tensor, radius: torch.Tensor) -> torch.Tensor:
    """Per query head ``max over the cuboid of q . k`` = ``q . c + |q| . r``.

    Parameters
    ----------
    q : torch.Tensor
        ``[B, Hkv, G, D]`` queries.
    center, radius : torch.Tensor
        ``[B, Hkv, N, D]`` cuboid centres and (non-negative) per-channel radii.

    Returns
    -------
    torch.Tensor
        ``[B, Hkv, G, N]`` float32.
    """
    q = q.float()
    return q @ center.float().transpose(-1, -2) + q.abs() @ radius.float().transpose(-1, -2)


class Selector(ABC):
    """Scores pages for the decode queries of each kv head.

    Subclasses set ``name`` (their registry key), ``summaries`` (the summary tensors they read, so
    a caller gathers only those) and implement :meth:`head_scores`.
    """

    name: ClassVar[str]
    summaries: ClassVar[tuple[str, ...]]

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        SELECTORS[cls.name] = cls

    def score(
        self,
        q: torch.Tensor,
        kmin: torch.Tensor | None,
        kmax: torch.Tensor | None,
        mean: torch.Tensor | None,
        group_reduce: str = DEFAULT_GROUP_REDUCE,
        radius: torch.Tensor | None = None,
        sketch: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Scores of every page for each kv head.

        Parameters
        ----------
        q : torch.Tensor
            ``[B, Hkv, G, D]`` decode queries (post-RoPE), ``G`` query heads per kv head.
        kmin, kmax, mean : torch.Tensor or None
            ``[B, Hkv, N, D]`` page summaries; only those in ``self.summaries`` are read.
        group_reduce : {"sum", "max"}
            How the ``G`` query heads' scores become the kv head's.
        radius : torch.Tensor, optional
            ``[B, Hkv, N, D]`` per-page mean ``|k - centre|`` (``PageSummaries(with_radius=True)``;
            :func:`~sparse_sglang.mem_cache.reference.page_mean_abs_deviation` from the keys); only selectors listing ``"radius"`` in ``summaries`` read it.
        sketch : torch.Tensor, optional
            ``[B, Hkv, N, page_size * rank]`` key sketches (``"sketch"`` selector; its ``q`` is
            then the projected query ``[B, Hkv, 1, rank]``, :func:`~sparse_sglang.mem_cache.key_sketch.project_query`).

        Returns
        -------
        torch.Tensor
            ``[B, Hkv, N]`` float32; higher is more important. Pages a request does not hold may
            score anything (even NaN): :func:`select_pages` masks them by ``num_pages``.
        """
        given = {"kmin": kmin, "kmax": kmax, "mean": mean, "radius": radius, "sketch": sketch}
        missing = [name for name in self.summaries if given[name] is None]
        if missing:  # e.g. the radius (with_radius), the key sketches (key_sketch)
            raise ValueError(f"selector {self.name!r} needs the summaries {', '.join(missing)}")
        scores = self.head_scores(q, kmin=kmin, kmax=kmax, mean=mean, radius=radius, sketch=sketch)
        if group_reduce == "sum":
            return scores.sum(dim=2)
        if group_reduce == "max":
            return scores.amax(dim=2)
        raise ValueError(f"group_reduce must be one of {GROUP_REDUCES}, got {group_reduce!r}")

    @abstractmethod
    def head_scores(self, q, *, kmin, kmax, mean, radius, sketch=None) -> torch.Tensor:
        """``[B, Hkv, G, N]`` float32 scores per query head (arguments as in :meth:`score`)."""


SELECTORS: dict[str, type[Selector]] = {}


class Quest(Selector):
    """Quest: upper bound of ``q . k`` over the page's bounding box,
    ``sum_d max(q_d kmax_d, q_d kmin_d)`` (Tang et al., 2024; LServe eq. 2)."""

    name = "quest"
    summaries = ("kmin", "kmax")

    def head_scores(self, q, *, kmin, kmax, mean, radius, sketch=None):
        kmin, kmax = kmin.float(), kmax.float()
        return cuboid_score(q, (kmax + kmin) / 2, (kmax - kmin) / 2)


class ArkVale(Selector):
    """ArkVale's "cuboid-mean" digest (Chen et al., NeurIPS 2024): the bounding cuboid's centre
    ``c = (kmax + kmin) / 2`` with the radius shrunk to the mean distance of the keys from it,
    ``r_d = mean_t |k_td - c_d|``, scored as a cuboid: ``q . c + |q| . r``.

    As in pku-liang/ArkVale: ``source/arkvale/infer_state.py``
    (``_summarize_keys``: centers = (maxs + mins) / 2; dists = |centers - keys|.mean over the
    page; digest = (centers + dists, centers - dists)) scored by
    ``source/arkvale_cpp/src/estimate.cu`` (``sum max(q * dmax, q * dmin)``) and averaged over
    a group of query heads there. ArkVale's group is, by default, every head
    of the layer (one page choice per layer); here it is the kv head's ``G`` query heads, and the
    mean is ``group_reduce="sum"`` up to a constant factor.

    ``PageSummaries(with_radius=True)`` keeps the radius as keys arrive (exact for a page filled
    in one call; :func:`~sparse_sglang.mem_cache.reference.page_mean_abs_deviation` is its dense
    form); ArkVale computes it once per filled page.
    """

    name = "arkvale"
    summaries = ("kmin", "kmax", "radius")

    def head_scores(self, q, *, kmin, kmax, mean, radius, sketch=None):
        return cuboid_score(q, (kmax.float() + kmin.float()) / 2, radius)


class MeanKey(Selector):
    """``q . mean key`` of the page (the centroid baseline; InfLLM-style representative)."""

    name = "mean"
    summaries = ("mean",)

    def head_scores(self, q, *, kmin, kmax, mean, radius, sketch=None):
        return q.float() @ mean.float().transpose(-1, -2)


class KeySketch(Selector):
    """A page's best token under rank-``r`` key sketches: ``max_t q' . s_t`` with ``q'`` the
    group's summed query projected by the key basis and ``s_t`` the token's projected key
    (:mod:`sparse_sglang.mem_cache.key_sketch`). One score per kv head (``G = 1`` in ``q``)."""

    name = "sketch"
    summaries = ("sketch",)

    def head_scores(self, q, *, kmin, kmax, mean, radius, sketch=None):
        return sketch_page_scores(q, sketch)


def get_selector(name: str) -> Selector:
    """The registered selector ``name`` (one of ``sparse_sglang.config.SELECTORS``)."""
    try:
        return SELECTORS[name]()
    except KeyError:
        raise ValueError(f"unknown selector {name!r}; known: {', '.join(SELECTORS)}") from None


def kept_summaries(name: str) -> dict[str, bool]:
    """The optional summaries selector ``name`` reads, as ``PageSummaries``/``SparseKVStore``/
    ``plan_memory`` flags (``with_mean``, ``with_radius``); the key min/max are always kept (the
    ``sketch`` selector's sketches come with its key basis: ``SparseKVStore(key_basis=...)``)."""
    reads = SELECTORS[name].summaries
    return {"with_mean": "mean" in reads, "with_radius": "radius" in reads}
