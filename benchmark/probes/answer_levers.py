"""Which selection levers keep dense's correct answers: the torch reference decoder (``quality.py``,
float32, exact bounds) on items of the accuracy suite that dense answers right, under several
policies, one of them an oracle (pages ranked by their true attention mass, summed over the kv
head's query heads) that no selector reaches but that bounds what page selection can keep.

    python -m benchmark.probes.answer_levers --items items.json.gz --runs dense.json --budget 512 --length 2048 --limit 15
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
from pathlib import Path

import torch

from benchmark import accuracy, quality
from sparse_sglang.attention import select_pages
from sparse_sglang.attention.budget_share import head_log_shares, share_budget
from sparse_sglang.attention.reference import selected_token_mask, sparse_attention_reference
from sparse_sglang.mem_cache.key_sketch import KeyBasis
from sparse_sglang.testing.provenance import run_header, save_result

E4M3_MAX = 448.0  # e4m3's largest finite value: XQA scales probabilities to it before rounding


class OracleDecoder(quality.SparseDecoder):
    """Pages by their true softmax mass (the kv head's query heads summed)."""

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        tokens, new = key.shape[2], query.shape[2]
        if new > 1:
            return quality.dense(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        q, seq_len = query[:, :, 0], torch.tensor([tokens])
        mass = quality.oracle_page_mass(q, key, seq_len, scaling)
        pages = select_pages(mass, -(-seq_len // quality.PAGE_SIZE), self.policy.budget // quality.PAGE_SIZE,
                             self.policy.sink_pages, self.policy.recent_pages).page_ids  # fmt: skip
        return sparse_attention_reference(q, key, value, pages, quality.PAGE_SIZE, seq_len, scaling).unsqueeze(1)


class QuestStepDecoder(quality.SparseDecoder):
    """A decode step that scores pages with Quest's bounds, lets :meth:`rank` turn those scores into
    the ranking selection takes (as they are, here), and attends over the pages selected."""

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        layer, tokens, new = module.layer_idx, key.shape[2], query.shape[2]
        if new > 1:
            return super().__call__(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        self.summaries.update(layer, key[0, :, tokens - new :].transpose(0, 1), torch.arange(tokens - new, tokens))
        q, seq_len = query[:, :, 0], torch.tensor([tokens])
        n = -(-tokens // quality.PAGE_SIZE)
        kmin, kmax = (getattr(self.summaries, name)[layer, :, :n].unsqueeze(0) for name in ("kmin", "kmax"))
        pages = self.select(layer, q, key, seq_len, scaling, kmin, kmax)
        return self.attend(q, key, value, pages, seq_len, scaling).unsqueeze(1)

    def attend(self, q, key, value, pages, seq_len, scaling):
        """``[1, Hq, D]`` the step's attention over the pages selected."""
        return sparse_attention_reference(q, key, value, pages, quality.PAGE_SIZE, seq_len, scaling)

    def select(self, layer, q, key, seq_len, scaling, kmin, kmax):
        """``[1, Hkv, width]`` pages attended (``-1`` padded), from the corners ``kmin``/``kmax``."""
        ranked = self.rank(layer, self.corner_scores(q, kmin, kmax), q, key, seq_len, scaling)
        return select_pages(ranked, -(-seq_len // quality.PAGE_SIZE), self.policy.budget // quality.PAGE_SIZE,
                            self.policy.sink_pages, self.policy.recent_pages).page_ids  # fmt: skip

    def corner_scores(self, q, kmin, kmax):
        """``[1, Hkv, N]`` Quest's bound of each page, the group's query heads reduced."""
        qg = q.view(1, kmin.shape[1], -1, q.shape[-1])
        return quality.get_selector("quest").score(qg, kmin, kmax, None, self.policy.group_reduce)

    def rank(self, layer, scores, q, key, seq_len, scaling):
        return scores


class Fp8AttentionDecoder(QuestStepDecoder):
    """The default's selection, its decode attention over fp8 keys and values (the serving flags'
    KV, at scale 1 as the server keeps this model's: ``ms-kv8``), and with ``xqa`` as XQA's fp8
    kernel computes it (``ms-xqa``: ``--sparse-decode-kernel xqa``): the queries rounded to e4m3 as
    they are, each probability (relative to its row's largest) times 448 rounded to e4m3 before its
    product with the values, the denominator summed unrounded; ``ms-xqaq`` and ``ms-xqap`` round
    only the queries or only the probabilities. Prefill stays as it is."""

    round_queries: bool = False
    round_probs: bool = False

    def attend(self, q, key, value, pages, seq_len, scaling):
        k, v = (x.to(torch.float8_e4m3fn).to(q.dtype) for x in (key, value))
        if not (self.round_queries or self.round_probs):
            return sparse_attention_reference(q, k, v, pages, quality.PAGE_SIZE, seq_len, scaling)
        batch, q_heads, dim = q.shape
        if self.round_queries:
            q = q.to(torch.bfloat16).to(torch.float8_e4m3fn).to(k.dtype)
        logits = (q.view(batch, k.shape[1], -1, dim) @ k.transpose(-1, -2)) * (
            dim**-0.5 if scaling is None else scaling
        )
        keep = selected_token_mask(pages, quality.PAGE_SIZE, seq_len, k.shape[2]).unsqueeze(2)
        logits = logits.masked_fill(~keep, -math.inf)
        probs = torch.exp(logits - logits.amax(dim=-1, keepdim=True))
        rounded = (probs * E4M3_MAX).to(torch.float8_e4m3fn).to(k.dtype) / E4M3_MAX if self.round_probs else probs
        return ((rounded @ v) / probs.sum(dim=-1, keepdim=True)).reshape(batch, q_heads, dim)


class RerankDecoder(QuestStepDecoder):
    """Quest's bounds pick ``factor`` x the budget's pages as candidates; the candidates' exact
    attention mass (their keys against the query, the group summed) picks the budget's pages. A
    server would read the candidates' keys (not their values) to score them; the softmax's
    denominator is the same for every page, so ranking by the full mass equals ranking by the
    candidates' own exp(q.k) sums."""

    factor: float = 2.0

    bits: int = 0  # > 0: the mass from keys kept in that many bits per channel, scaled per page (KIVI)
    channels: int = 0  # > 0: only that many channels of a page coded (its widest), the rest at the page's mean
    fixed: bool = False  # the same channels on every page of a kv head: the widest-spread ones over the prompt

    def rank(self, layer, scores, q, key, seq_len, scaling):
        n = scores.shape[-1]
        candidates = scores.topk(min(n, int(self.factor * (self.policy.budget // quality.PAGE_SIZE))), dim=-1).indices
        keys = quantized_keys(key, self.bits, self.channels, self.fixed) if self.bits else key
        mass = quality.oracle_page_mass(q, keys, seq_len, scaling)
        return torch.full_like(mass, -math.inf).scatter_(-1, candidates, mass.gather(-1, candidates))


def quantized_keys(key: torch.Tensor, bits: int, channels: int = 0, fixed: bool = False) -> torch.Tensor:
    """``key`` ``[1, Hkv, T, D]`` rounded to ``2**bits`` levels per (page, channel) between the
    page's channel min and max (KIVI's per-channel key quantization, a page as its group). With
    ``channels`` C > 0 only the C channels of each page with the widest range are kept so; the
    others read as the page's channel mean (C indices a page: C * P * bits / 8 bytes of codes);
    ``fixed``: the same C channels on every page of a kv head, those whose keys spread most over
    the whole prompt (no indices per page)."""
    _, heads, tokens, dim = key.shape
    pad = -tokens % quality.PAGE_SIZE
    k = torch.nn.functional.pad(key[0].float(), (0, 0, 0, pad), mode="replicate").view(
        heads, -1, quality.PAGE_SIZE, dim
    )
    lo, hi = k.amin(2, keepdim=True), k.amax(2, keepdim=True)
    step = (hi - lo).clamp_min(1e-6) / (2**bits - 1)
    coded = ((k - lo) / step).round() * step + lo
    if channels:
        if fixed:
            spread = k.flatten(1, 2).std(dim=1)  # [H, D]
            widest = spread.topk(channels, dim=-1).indices.view(heads, 1, 1, channels).expand(-1, k.shape[1], 1, -1)
        else:
            widest = (hi - lo).topk(channels, dim=-1).indices  # [H, N, 1, C]
        kept = torch.zeros_like(hi, dtype=torch.bool).scatter_(-1, widest, True)
        coded = torch.where(kept, coded, k.mean(2, keepdim=True))
    return coded.view(1, heads, -1, dim)[:, :, :tokens]


class ReusedRerankDecoder(RerankDecoder):
    """The exact re-rank on one decode step in ``every`` (per layer), its pages attended again on
    the steps between without any scoring (LServe's reuse, of the re-rank's choice): what a step
    costs on average falls with ``every``, what it keeps is what this measures."""

    every: int = 4

    def rank(self, layer, scores, q, key, seq_len, scaling):
        if not hasattr(self, "steps"):
            self.steps, self.chosen = {}, {}
        step = self.steps.get(layer, 0)
        self.steps[layer] = step + 1
        if step % self.every and layer in self.chosen:
            return torch.full_like(scores, -math.inf).scatter_(-1, self.chosen[layer], 1.0)
        ranked = super().rank(layer, scores, q, key, seq_len, scaling)
        k = self.policy.budget // quality.PAGE_SIZE
        self.chosen[layer] = ranked.topk(min(k, ranked.shape[-1]), dim=-1).indices
        return ranked


class LayerRerankDecoder(RerankDecoder):
    """The exact re-rank in the layers of ``layers`` only, the corners alone in the others: what
    a step that re-ranks a share of its layers keeps (its cost grows with that share)."""

    layers: frozenset = frozenset()

    def rank(self, layer, scores, q, key, seq_len, scaling):
        if layer not in self.layers:
            return scores
        return super().rank(layer, scores, q, key, seq_len, scaling)


class ShareDecoder(QuestStepDecoder):
    """The layer's page budget shared among its kv heads by estimated attention mass (a budget
    set by mass, not a count per head): every head keeps its ``floor`` x the budget's best pages
    (the forced ones among them), then the rest of the layer's ``Hkv`` x ``K`` pages go to the
    (head, page) pairs with the largest estimated share of their head's mass. A page's share is
    the softmax, over the head's pages, of its corners' logit bound (each query head's, then the
    group's mean; or of the group's mean bound, ``pool = "logits"``): the same scores the
    default ranks by, the same pages attended in total."""

    floor: float = 0.5
    pool: str = "probs"  # "logits": the group's bounds averaged before the softmax
    cap: float = 0.0  # > 0: no head attends more than cap x the budget's pages (a cache row's width)

    def shares(self, layer, q, key, seq_len, scaling, kmin, kmax):
        """``[1, Hkv, N]`` each page's estimated share of its head's mass."""
        qg = q.view(1, kmin.shape[1], -1, q.shape[-1])
        bound = quality.get_selector("quest").head_scores(qg, kmin=kmin, kmax=kmax, mean=None, radius=None)
        if self.pool == "probs":
            return head_log_shares(bound, scaling).exp()
        return (bound.mean(2) * scaling).softmax(-1)  # the group's mean bound: from the score a server keeps

    def select(self, layer, q, key, seq_len, scaling, kmin, kmax):
        heads, n, budget = kmin.shape[1], kmin.shape[2], self.policy.budget // quality.PAGE_SIZE
        share = self.shares(layer, q, key, seq_len, scaling, kmin, kmax)
        sink, recent = self.policy.sink_pages, self.policy.recent_pages
        num_pages = -(-seq_len // quality.PAGE_SIZE)
        if n <= budget:
            return select_pages(share, num_pages, budget, sink, recent).page_ids
        base = max(sink + recent, int(self.floor * budget))
        kept = torch.zeros(1, heads, n, dtype=torch.bool)
        kept.scatter_(-1, select_pages(share, num_pages, base, sink, recent).page_ids.long(), True)
        free = share.masked_fill(kept, -math.inf)
        if self.cap:  # no head past cap x the budget's pages: its pages past that rank among its own stay out
            rank = free.argsort(-1, descending=True).argsort(-1)
            free = free.masked_fill(rank >= int(self.cap * budget) - base, -math.inf)
        extra = free.flatten().topk(heads * (budget - base)).indices
        kept.view(-1)[extra] = True
        pages = torch.where(kept, torch.arange(n), n).sort(-1).values[..., : int(kept.sum(-1).max())]
        return torch.where(pages < n, pages, -1).int()  # each head's pages in order, -1 padded


class UnitShareDecoder(ShareDecoder):
    """:func:`sparse_sglang.attention.budget_share.share_budget`: a floor of half the budget, a cap
    of 1.25x, the layer's remaining pages handed out in quarters of the budget, each page's share
    from :func:`~sparse_sglang.attention.budget_share.head_log_shares` (each query head's softmax,
    averaged: ``pool = "probs"``, the server's ``--sparse-budget-share``) or from the softmax of
    the group-summed bound the default ranks by (``"logits"``, its first build)."""

    pool: str = "logits"

    def select(self, layer, q, key, seq_len, scaling, kmin, kmax):
        budget, num_pages = self.policy.budget // quality.PAGE_SIZE, -(-seq_len // quality.PAGE_SIZE)
        shares = self.shares(layer, q, key, seq_len, scaling, kmin, kmax).log()
        sel = share_budget(shares, num_pages, budget, self.policy.sink_pages, self.policy.recent_pages)
        return sel.page_ids[..., : int(sel.widths.max())]


class ShareRerankDecoder(ShareDecoder, RerankDecoder):
    """The re-rank's candidates (the corners' best ``factor`` x K per head), their mass from their
    keys (or codes, ``bits``) as each page's share, and the layer's ``Hkv`` x K pages shared among
    the heads by it (:class:`ShareDecoder`): a head whose mass is spread takes what a peaked one
    does not need."""

    def shares(self, layer, q, key, seq_len, scaling, kmin, kmax):
        scores = self.corner_scores(q, kmin, kmax)
        return RerankDecoder.rank(self, layer, scores, q, key, seq_len, scaling).clamp_min(0.0)


class BandRerankDecoder(QuestStepDecoder):
    """The re-rank of a band only: the bound's best ``keep`` x the budget's pages are kept as
    they are, the next ``band`` x the budget's compete by exact mass for the places left. A server
    would read the band's keys only (``band`` x the budget's pages, against the full re-rank's
    ``factor``)."""

    keep: float = 0.5
    band: float = 1.0

    def rank(self, layer, scores, q, key, seq_len, scaling):
        n, k = scores.shape[-1], self.policy.budget // quality.PAGE_SIZE
        order = scores.topk(min(n, int((self.keep + self.band) * k)), dim=-1).indices
        outright, band = order[..., : int(self.keep * k)], order[..., int(self.keep * k) :]
        mass = quality.oracle_page_mass(q, key, seq_len, scaling)
        ranked = torch.full_like(mass, -math.inf).scatter_(-1, band, mass.gather(-1, band))
        return ranked.scatter_(-1, outright, torch.full_like(mass, 1e30).gather(-1, outright))


class SketchDecoder(QuestStepDecoder):
    """Pages ranked by their attention mass computed from rank-``rank`` key sketches: each key
    projected on the top ``sketch_rank`` right singular vectors of its (layer, kv head)'s keys (ShadowKV's low-rank
    keys; a per-token sketch of ``rank`` numbers costs what a page's min/max bounds cost when
    ``sketch_rank = 2 * head_dim / page_size``). ``basis`` maps layer -> ``[Hkv, D, rank]``; missing
    layers take it from the prompt's own keys (set at the first decode step)."""

    sketch_rank: int = 8
    reduce: str = "mass"  # "mass" (softmax per query head, summed), "max", "lse"
    fp8: bool = False
    basis: dict

    def rank_pages(self, layer, q, key, seq_len, scaling):
        if layer not in self.basis:
            self.basis[layer] = key_basis(key[0][:, : getattr(self, "fit_tokens", None)], self.sketch_rank)
        b = self.basis[layer]  # [Hkv, D, r]
        qb = self.query_basis[layer] if getattr(self, "query_basis", None) else b
        if qb is not b:  # separate projections: scores (q Wq) . (k Wk), max over a page's tokens
            heads, tokens = key.shape[1], key.shape[2]
            qp = (q.float().view(heads, -1, q.shape[-1]).sum(1).unsqueeze(1) @ qb).squeeze(1)  # [Hkv, r]
            sk = key[0].float() @ b  # [Hkv, T, r]
            logits = (sk @ qp.unsqueeze(-1)).squeeze(-1)  # [Hkv, T]
            pad = -tokens % quality.PAGE_SIZE
            paged = torch.nn.functional.pad(logits, (0, pad), value=-math.inf).view(heads, -1, quality.PAGE_SIZE)
            if self.reduce == "lse":  # the group's mean logit, a page's log-sum-exp of it
                return (paged * (scaling * heads / q.shape[1])).logsumexp(-1).unsqueeze(0)
            return paged.amax(-1).unsqueeze(0)
        sketch = key[0].float() @ b  # [Hkv, T, r]
        if self.fp8:  # stored as e4m3, as a server could keep them
            sketch = sketch.to(torch.float8_e4m3fn).float()
        sketch = sketch @ b.transpose(-1, -2)  # [Hkv, T, D]: q . sketch = (q B) . (k B)
        if self.reduce == "mass":
            return quality.oracle_page_mass(q.float(), sketch.unsqueeze(0), seq_len, scaling)
        heads, tokens = sketch.shape[0], sketch.shape[1]
        logits = q.float().view(heads, -1, q.shape[-1]) @ sketch.transpose(-1, -2) * scaling  # [Hkv, G, T]
        pad = -tokens % quality.PAGE_SIZE
        paged = torch.nn.functional.pad(logits, (0, pad), value=-math.inf).view(
            heads, logits.shape[1], -1, quality.PAGE_SIZE
        )
        if self.reduce == "max":  # the page's best token for the group's summed logits
            return paged.sum(1).amax(-1).unsqueeze(0)
        return paged.logsumexp(-1).sum(1).unsqueeze(0)  # "lse": the group's summed log page masses

    def rank(self, layer, scores, q, key, seq_len, scaling):
        return self.rank_pages(layer, q, key, seq_len, scaling)


class SketchRerankDecoder(SketchDecoder):
    """Two stages: the page corners (``QuestStepDecoder``'s scores) shortlist ``factor`` x the
    budget's pages, and the candidates' key sketches (``SketchDecoder.rank_pages``, a GPU-resident
    sketch a server would keep) rank them; pages outside the shortlist are never taken."""

    factor: float = 2.0
    keep: float = 0.0  # the corners' best keep x the budget's pages are taken outright

    def rank(self, layer, scores, q, key, seq_len, scaling):
        n, k = scores.shape[-1], self.policy.budget // quality.PAGE_SIZE
        order = scores.topk(min(n, int(self.factor * k)), dim=-1).indices
        sketched = self.rank_pages(layer, q, key, seq_len, scaling)
        ranked = torch.full_like(sketched, -math.inf).scatter_(-1, order, sketched.gather(-1, order))
        outright = order[..., : int(self.keep * k)]
        return ranked.scatter_(-1, outright, torch.full_like(ranked, 1e30).gather(-1, outright))


class RotatedQuestDecoder(QuestStepDecoder):
    """Quest's bounds taken in a rotated key space: per (layer, kv head) an orthonormal ``[D, D]``
    rotation ``R``, page bounds of ``k R`` and the query ``q R`` (``q . k`` unchanged; only the
    bounding boxes turn). ``rotation`` maps layer -> ``[Hkv, D, D]``; ``"self"`` fits each layer's
    from the prompt's own centred keys (principal axes) at the first decode step."""

    rotation: dict | str

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        layer, tokens, new = module.layer_idx, key.shape[2], query.shape[2]
        if new > 1:
            return quality.SparseDecoder.__call__(self, module, query, key, value, attention_mask, scaling=scaling,
                                                  **kwargs)  # fmt: skip
        if self.rotation == "self":
            self.rotation = {}
        if isinstance(self.rotation, dict) and layer not in self.rotation:
            k0 = key[0].float()
            self.rotation[layer] = torch.linalg.svd(k0 - k0.mean(1, keepdim=True), full_matrices=False).Vh.transpose(
                -1, -2
            )
        r = self.rotation[layer] if isinstance(self.rotation, dict) else self.rotation  # [Hkv, D, D] or [D, D]
        q, seq_len = query[:, :, 0], torch.tensor([tokens])
        kr = key[0].float() @ r  # [Hkv, T, D]
        pad = -tokens % quality.PAGE_SIZE
        kr = torch.cat([kr, kr[:, -1:].expand(-1, pad, -1)], dim=1) if pad else kr
        heads, dim = kr.shape[0], kr.shape[-1]
        paged = kr.view(heads, -1, quality.PAGE_SIZE, dim)
        kmin, kmax = paged.amin(2).unsqueeze(0), paged.amax(2).unsqueeze(0)
        qg = q.float().view(1, heads, -1, dim) @ (r if r.dim() == 2 else r.unsqueeze(0))
        scores = quality.get_selector("quest").score(qg, kmin, kmax, None, self.policy.group_reduce)
        pages = select_pages(scores, -(-seq_len // quality.PAGE_SIZE), self.policy.budget // quality.PAGE_SIZE,
                             self.policy.sink_pages, self.policy.recent_pages).page_ids  # fmt: skip
        return sparse_attention_reference(q, key, value, pages, quality.PAGE_SIZE, seq_len, scaling).unsqueeze(1)


class PageStatDecoder(QuestStepDecoder):
    """Pages ranked by other statistics of their keys than Quest's corners, each computed exactly
    from the page's keys: ``meanstd<k>``, the cuboid of centre ``mean`` and radius ``k * std`` per
    channel (Quest's score function on other corners: ``q . mean + k |q| . std``, the same bytes);
    ``gauss``, the log of a page's expected softmax mass were its keys Gaussian with those
    per-channel moments (``s q . mean + s^2 (q^2) . var / 2``); ``sub<n>``, Quest's bounds of
    ``n``-token sub-pages, a page scored by its best sub-page (LServe); ``mssub<n>``, the same with
    the default's mean/std corners (spread 1) of ``n``-token sub-pages."""

    stat: str = "meanstd2"

    def rank(self, layer, scores, q, key, seq_len, scaling):
        heads, tokens, dim = key.shape[1], key.shape[2], key.shape[3]
        qg = q.float().view(1, heads, -1, dim)
        if self.stat.startswith("sub"):
            sub = int(self.stat.removeprefix("sub"))
            pad = -tokens % quality.PAGE_SIZE
            ks = torch.nn.functional.pad(key[0].float(), (0, 0, 0, pad)).view(heads, -1, sub, dim)
            vs = (torch.arange(tokens + pad) < tokens).view(1, -1, sub, 1).expand(heads, -1, -1, -1)
            kmin = ks.masked_fill(~vs, math.inf).amin(2).unsqueeze(0)
            kmax = ks.masked_fill(~vs, -math.inf).amax(2).unsqueeze(0)
            empty = ~vs.any(2).squeeze(-1)
            kmin, kmax = kmin.nan_to_num(0.0, 0.0, 0.0), kmax.nan_to_num(0.0, 0.0, 0.0)
            s = quality.get_selector("quest").score(qg, kmin, kmax, None, self.policy.group_reduce)
            s = s.masked_fill(empty.unsqueeze(0), -math.inf)
            return s.view(1, heads, -1, quality.PAGE_SIZE // sub).amax(-1)
        if self.stat.startswith("mssub"):  # the default's corners (spread 1) of n-token sub-pages, the page's best
            sub = int(self.stat.removeprefix("mssub"))
            s = self.corner_scores(qg, *quality.page_moments(key[0], sub), spread=1.0)
            per = quality.PAGE_SIZE // sub
            return torch.nn.functional.pad(s, (0, -s.shape[-1] % per), value=-math.inf).view(1, heads, -1, per).amax(-1)
        mean, var = quality.page_moments(key[0])
        if self.stat.startswith("l2max"):  # the page's expected best logit, were its keys Gaussian:
            # q . mean + z sqrt(q^2 . var) (z ~ 2 for the largest of 32 normal draws)
            z = float(self.stat.removeprefix("l2max"))
            s = qg @ mean.unsqueeze(0).transpose(-1, -2) + z * ((qg**2) @ var.unsqueeze(0).transpose(-1, -2)).sqrt()
            return s.sum(2) if self.policy.group_reduce == "sum" else s.amax(2)
        if self.stat == "gauss":
            s = scaling * qg @ mean.unsqueeze(0).transpose(-1, -2)
            s = s + 0.5 * scaling**2 * (qg**2) @ var.unsqueeze(0).transpose(-1, -2)
            return s.sum(2) if self.policy.group_reduce == "sum" else s.amax(2)
        return self.corner_scores(qg, mean, var, spread=float(self.stat.removeprefix("meanstd")))

    def corner_scores(self, qg, mean, var, spread: float) -> torch.Tensor:
        """Quest's score of the corners ``mean -+ spread * std`` (``[Hkv, N, D]`` moments)."""
        std = var.sqrt()
        return quality.get_selector("quest").score(
            qg, (mean - spread * std).unsqueeze(0), (mean + spread * std).unsqueeze(0), None, self.policy.group_reduce
        )


def hadamard(dim: int) -> torch.Tensor:
    """The ``[dim, dim]`` orthonormal Walsh-Hadamard matrix (``dim`` a power of two)."""
    h = torch.ones(1, 1)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / dim**0.5


def key_basis(keys: torch.Tensor, rank: int) -> torch.Tensor:
    """``[Hkv, D, rank]`` top right singular vectors of each kv head's keys ``[Hkv, T, D]``."""
    return torch.linalg.svd(keys.float(), full_matrices=False).Vh[:, :rank].transpose(-1, -2).contiguous()


# Layer spans the layer-restricted re-rank is tried on (SmolLM2-135M has 30 layers): thirds, halves
LAYER_SPANS = ((0, 10), (10, 20), (20, 30), (0, 15), (15, 30), (0, 5), (5, 10))
WINDOW = 32  # the prompt's last queries whose attention picks the pages a request keeps (SnapKV's window)


class WindowDecoder(QuestStepDecoder):
    """Quest, plus pages the prompt's last ``WINDOW`` queries attend to most (per layer and kv head,
    their softmax mass summed over the window and the group): a quarter of the budget, kept every
    step (SnapKV's observation window, used to pin pages rather than to drop tokens)."""

    pinned: dict

    def rank(self, layer, scores, q, key, seq_len, scaling):
        scores[0].scatter_(-1, self.pinned[layer].clamp(max=scores.shape[-1] - 1), math.inf)
        return scores


def window_pins(model, tokenizer, ids, budget) -> dict:
    """Per layer, ``[Hkv, M]`` pages with the most attention mass from the prompt's last WINDOW queries."""
    pins = {}

    def hook(module, query, key, value, attention_mask, scaling=None, **kwargs):
        out = quality.dense(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        heads, tokens = key.shape[1], key.shape[2]
        qw = query[0, :, -WINDOW:]  # [Hq, W, D]
        group = qw.shape[0] // heads
        logits = (qw.view(heads, group, WINDOW, -1) @ key[0].transpose(-1, -2).unsqueeze(1)) * scaling
        causal = torch.arange(tokens).view(1, -1) > torch.arange(tokens - WINDOW, tokens).view(-1, 1)
        probs = logits.masked_fill(causal, -math.inf).softmax(-1).sum(dim=(1, 2))  # [Hkv, T]
        page = quality.PAGE_SIZE
        mass = torch.nn.functional.pad(probs, (0, -tokens % page)).view(heads, -1, page).sum(-1)
        pins[module.layer_idx] = mass.topk(max(1, budget // page // 4), dim=-1).indices
        return out

    quality.run_with(hook, model, input_ids=torch.tensor([ids]), use_cache=False, logits_to_keep=1)
    return pins


def window_bound_pins(summaries, queries: dict, budget: int, group_reduce: str = "sum") -> dict:
    """Per layer, ``[Hkv, M]`` pages the prompt's last WINDOW queries score highest by Quest's bounds
    (what a server holding only page summaries can compute at the end of a prefill)."""
    selector = quality.get_selector("quest")
    pins = {}
    for layer, qw in queries.items():  # qw [Hq, W, D]
        heads = summaries.kmin.shape[1]
        tokens = qw.shape[1]
        kmin, kmax = (getattr(summaries, name)[layer].unsqueeze(0) for name in ("kmin", "kmax"))
        qg = qw.transpose(0, 1).reshape(qw.shape[1], heads, -1, qw.shape[-1])  # [W, Hkv, G, D]
        scores = torch.stack([selector.score(qg[w : w + 1], kmin, kmax, None, group_reduce)[0] for w in range(tokens)])
        finite = scores.nan_to_num(nan=-3e38, posinf=3e38, neginf=-3e38)
        ranks = finite.argsort(-1, descending=True).argsort(-1).float()  # per query: 0 = its best page
        pins[layer] = (-ranks).mean(0).topk(max(1, budget // quality.PAGE_SIZE // 4), dim=-1).indices
    return pins


def fit_text_bases(model, tokenizer, text_path, rank, tokens: int = 4096) -> dict:
    """Three ways to fit per-(layer, kv head) projections on one text's keys (and queries):
    ``svd`` (top right singular vectors of the keys), ``centred`` (of the keys less their mean:
    a constant key part adds the same to every token's score), ``bilinear`` (the rank-r
    approximation of q . k under the text's query and centred key second moments: key projection
    S_k^-1/2 V, query projection S_q^-1/2 U S, with U S V' the SVD of S_q^1/2 S_k^1/2).
    Returns kind -> (key bases, query bases or None), layer -> [Hkv, D, r]."""
    from sparse_sglang.calibrate import calibration_texts

    text = Path(text_path).read_text() if text_path else calibration_texts()[0]  # torch.nn's docstrings
    ids = tokenizer(text, add_special_tokens=False).input_ids[:tokens]
    qs, ks = {}, {}

    def hook(module, query, key, value, attention_mask, scaling=None, **kwargs):
        heads = key.shape[1]
        qs[module.layer_idx] = query[0].view(heads, -1, *query.shape[2:]).sum(1).float()  # [Hkv, T, D] group sums
        ks[module.layer_idx] = key[0].float()
        return quality.dense(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    quality.run_with(hook, model, input_ids=torch.tensor([ids]), use_cache=False, logits_to_keep=1)

    def sqrt_and_inv(m):
        w, v = torch.linalg.eigh(m)
        w = w.clamp_min(w.max() * 1e-6)
        return v @ torch.diag_embed(w.sqrt()) @ v.transpose(-1, -2), v @ torch.diag_embed(w.rsqrt()) @ v.transpose(
            -1, -2
        )

    out = {"svd": ({}, None), "centred": ({}, None), "bilinear": ({}, {})}
    for layer, k in ks.items():
        out["svd"][0][layer] = key_basis(k, rank)
        kc = k - k.mean(1, keepdim=True)
        out["centred"][0][layer] = key_basis(kc, rank)
        t = k.shape[1]
        sq = qs[layer].transpose(-1, -2) @ qs[layer] / t
        sk = kc.transpose(-1, -2) @ kc / t
        (q_half, q_inv), (k_half, k_inv) = sqrt_and_inv(sq), sqrt_and_inv(sk)
        u, sv, vh = torch.linalg.svd(q_half @ k_half)
        out["bilinear"][0][layer] = k_inv @ vh[:, :rank].transpose(-1, -2)
        out["bilinear"][1][layer] = q_inv @ u[:, :, :rank] * sv[:, None, :rank]
    return out


def calibration_keys(model, ids) -> dict:
    """Per layer, ``[Hkv, T, D]`` post-RoPE keys of one prompt."""
    keys = {}

    def hook(module, query, key, value, attention_mask, scaling=None, **kwargs):
        keys[module.layer_idx] = key[0].clone()
        return quality.dense(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    quality.run_with(hook, model, input_ids=torch.tensor([ids]), use_cache=False, logits_to_keep=1)
    return keys


def window_queries(model, ids) -> dict:
    qs = {}

    def hook(module, query, key, value, attention_mask, scaling=None, **kwargs):
        qs[module.layer_idx] = query[0, :, -WINDOW:].clone()
        return quality.dense(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    quality.run_with(hook, model, input_ids=torch.tensor([ids]), use_cache=False, logits_to_keep=1)
    return qs


def main() -> None:
    p = argparse.ArgumentParser()
    accuracy.add_answered_args(p, length=2048, limit=15)
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--out", required=True)
    p.add_argument("--policies", default="", help="comma-separated subset of the policies")
    p.add_argument(
        "--calibration-text", default=None, help="sketchtext-* policies: the text (default torch.nn's docstrings)"
    )
    p.add_argument("--calibration-tokens", type=int, default=4096)
    p.add_argument("--basis", default=None, help="a key basis file (python -m sparse_sglang.calibrate)")
    p.add_argument("--ids", default="", help="comma-separated item ids instead of dense's right answers")
    p.add_argument("--page-size", type=int, default=quality.PAGE_SIZE,
                   help="tokens per page (the server's --sparse-page-size); the forced pages keep their tokens")  # fmt: skip
    args = p.parse_args()
    forced_tokens = (quality.PAGE_SIZE * quality.DEFAULTS.sink_pages, quality.PAGE_SIZE * quality.DEFAULTS.recent_pages)
    quality.PAGE_SIZE = args.page_size  # the reference reads its page size at run time, here set once
    _, items = accuracy.load_items(Path(args.items))
    by_id = {i.id: i for i in items}
    chosen = accuracy.items_answered(items, Path(args.runs), args.length, args.family, args.limit)
    if args.ids:
        chosen = [by_id[i] for i in args.ids.split(",")]
    tokenizer, model = quality.load_model()
    calibration = {}
    text_bases = {}
    pkg_basis = None
    if "sketchpkg" in args.policies or "sketchrr" in args.policies:
        from sparse_sglang.calibrate import calibration_texts, fit_basis

        pkg_basis = fit_basis(model, tokenizer, calibration_texts(), 16)
        pkg_bases = {32: fit_basis(model, tokenizer, calibration_texts(), 32)} if "-r32" in args.policies else {}
    if "sketchtext" in args.policies or "quest-rot-cal" in args.policies:
        rank = model.config.head_dim if "quest-rot-cal" in args.policies else 16
        text_bases = fit_text_bases(model, tokenizer, args.calibration_text, rank, args.calibration_tokens)
    if any(name.startswith("sketchcal") for name in (args.policies.split(",") if args.policies else ["sketchcal"])):
        # A fixed basis per (layer, kv head), from the keys of one item outside the chosen ones.
        other = next(i for i in items if i.length == args.length and i.id not in {c.id for c in chosen}
                     and not i.family.startswith(args.family))  # fmt: skip
        keys = calibration_keys(model, tokenizer(other.prompt, add_special_tokens=False).input_ids)
        calibration = {r: {layer: key_basis(k, r) for layer, k in keys.items()} for r in (4, 8, 16)}
    policies = {
        # quest-*: Quest's min/max corners, as these policies were measured; ms-*: the default's mean/std corners
        "quest": quality.Policy(budget=args.budget, page_bounds="minmax"),
        "quest-gmax": quality.Policy(budget=args.budget, group_reduce="max", page_bounds="minmax"),
        "oracle": quality.Policy(budget=args.budget),
        "quest-window": quality.Policy(budget=args.budget, page_bounds="minmax"),
        "quest-window-bounds": quality.Policy(budget=args.budget, page_bounds="minmax"),
        "arkvale": quality.Policy(selector="arkvale", budget=args.budget),
        "mean": quality.Policy(selector="mean", budget=args.budget),
        "quest-dense2": quality.Policy(budget=args.budget, dense_layers=2, page_bounds="minmax"),  # Quest's own
        **{f"quest-rerank{f}": quality.Policy(budget=args.budget, page_bounds="minmax") for f in (2, 3, 4)},
        "ms": quality.Policy(budget=args.budget),
        # fp8 KV, and XQA's kernel (its query and probability roundings, and each alone)
        **{f"ms-{a}": quality.Policy(budget=args.budget) for a in ("kv8", "xqa", "xqaq", "xqap")},
        **{f"ms-shared{p}": quality.Policy(budget=args.budget) for p in ("", "-probs")},  # --sparse-budget-share
        **{f"ms-rerank{f}": quality.Policy(budget=args.budget) for f in (1.25, 1.5, 2, 3)},
        **{f"ms-rerank2-every{n}": quality.Policy(budget=args.budget) for n in (2, 4, 8)},
        # ms-rerank2-layers<a>-<b>: the re-rank in layers a .. b - 1 only
        **{f"ms-rerank2-layers{a}-{b}": quality.Policy(budget=args.budget) for a, b in LAYER_SPANS},
        **{f"ms-rerank2-int{b}": quality.Policy(budget=args.budget) for b in (1, 2, 3, 4)},
        **{f"ms-rerank2-int2-c{c}{g}": quality.Policy(budget=args.budget) for c in (8, 16, 32) for g in ("", "g")},
        **{f"ms-rerank2{b}-share0.5": quality.Policy(budget=args.budget) for b in ("", "-int2")},
        **{f"ms-band{a}x{b}": quality.Policy(budget=args.budget) for a, b in ((0.5, 1.0), (0.75, 0.5), (0.5, 0.5))},
        **{
            f"ms-share{p}{f}{c}": quality.Policy(budget=args.budget)
            for f in (0.25, 0.5, 0.75)
            for p in ("", "mean")
            for c in ("", "-cap1.25", "-cap1.5")
        },
        **{f"sketch{r}": quality.Policy(budget=args.budget) for r in (4, 8, 16)},
        "sketch16-max": quality.Policy(budget=args.budget),  # the per-request basis, scored as the server scores
        # the same from the prompt's first W tokens only (what a server fits at a first prefill chunk),
        # rank 8, sketches in fp8 (what fits a GPU beside a large host store)
        **{f"sketch{r}-max{w}": quality.Policy(budget=args.budget) for r in (8, 16) for w in ("", "-w512", "-w1024")},
        "sketch8-max-fp8": quality.Policy(budget=args.budget),
        **{f"sketchcal{r}": quality.Policy(budget=args.budget) for r in (4, 8, 16)},
        **{f"sketchcal{r}-{red}": quality.Policy(budget=args.budget) for r in (8, 16) for red in ("max", "lse")},
        **{f"sketchtext-{k}": quality.Policy(budget=args.budget) for k in ("svd", "centred", "bilinear")},
        "sketchpkg": quality.Policy(budget=args.budget),
        **{f"ms-sketchrr{f}{red}": quality.Policy(budget=args.budget) for f in (1.5, 2, 3, 4) for red in ("", "-lse")},
        **{f"ms-sketchrr2{v}": quality.Policy(budget=args.budget) for v in ("-k0.25", "-k0.5", "-r32", "-lse-r32")},
        "sketchself": quality.Policy(budget=args.budget),
        "sketchfile-max": quality.Policy(budget=args.budget),  # --basis: sparse_sglang.calibrate's file
        "sketchfile-max8": quality.Policy(budget=args.budget),  # the same, sketches in fp8
        **{f"quest-rot-{k}": quality.Policy(budget=args.budget) for k in ("identity", "self", "cal", "hadamard")},
        **{
            f"stat-{k}": quality.Policy(budget=args.budget)
            for k in (
                "meanstd0.5",
                "meanstd1",
                "meanstd1.5",
                "meanstd2",
                "meanstd3",
                "gauss",
                "sub16",
                "sub8",
                "mssub16",
                "mssub8",
                *(f"l2max{z}" for z in (1, 2, 3, 4)),
            )
        },  # fmt: skip
    }
    if args.policies:
        policies = {k: v for k, v in policies.items() if k in args.policies.split(",")}
    # the same forced tokens in pages of --page-size
    sink, recent = (max(1, t // args.page_size) for t in forced_tokens)

    def sized(policy: quality.Policy) -> quality.Policy:
        return dataclasses.replace(policy, logical_page_size=args.page_size, sink_pages=sink, recent_pages=recent)

    policies = {k: sized(v) for k, v in policies.items()}
    rows = []
    for item in chosen:
        ids = tokenizer(item.prompt, add_special_tokens=False).input_ids
        from transformers import DynamicCache

        cache = DynamicCache(config=model.config)
        prefill = quality.SparseDecoder(model, sized(quality.Policy(selector=None)), len(ids) + item.max_new_tokens)
        logits = quality.run_with(prefill, model, input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True,
                                  logits_to_keep=1).logits  # fmt: skip
        first = int(logits[0, -1].argmax())
        pins = window_pins(model, tokenizer, ids, args.budget) if "quest-window" in policies else None
        bound_pins = (window_bound_pins(prefill.summaries, window_queries(model, ids), args.budget)
                      if "quest-window-bounds" in policies else None)  # fmt: skip
        row = {"id": item.id}
        for name, policy in [("dense", sized(quality.Policy(selector=None)))] + list(policies.items()):
            hook = prefill.fork(policy)
            if name == "oracle":
                hook.__class__ = OracleDecoder
            if name == "ms":
                hook.__class__ = QuestStepDecoder
            if name in ("ms-kv8", "ms-xqa", "ms-xqaq", "ms-xqap"):
                hook.__class__ = Fp8AttentionDecoder
                hook.round_queries, hook.round_probs = name in ("ms-xqa", "ms-xqaq"), name in ("ms-xqa", "ms-xqap")
            if name.startswith("ms-rerank") and "-share" in name:  # ms-rerank<F>[-int<b>]-share<floor>
                spec, _, floor = name.removeprefix("ms-rerank").partition("-share")
                factor, _, bits = spec.partition("-int")
                hook.__class__ = ShareRerankDecoder
                hook.factor, hook.bits, hook.floor, hook.pool = float(factor), int(bits or 0), float(floor), "probs"
            elif name.startswith("ms-rerank2-layers"):
                lo, hi = (int(x) for x in name.removeprefix("ms-rerank2-layers").split("-"))
                hook.__class__ = LayerRerankDecoder
                hook.factor, hook.bits, hook.channels, hook.fixed = 2.0, 0, 0, False
                hook.layers = frozenset(range(lo, hi))
            elif name.startswith(("quest-rerank", "ms-rerank")):
                factor, _, every = name.rpartition("rerank")[2].partition("-every")
                factor, _, bits = factor.partition("-int")
                bits, _, channels = bits.partition("-c")
                hook.__class__ = ReusedRerankDecoder if every else RerankDecoder
                hook.factor, hook.every, hook.bits = float(factor), int(every or 1), int(bits or 0)
                hook.channels, hook.fixed = int(channels.removesuffix("g") or 0), channels.endswith("g")
            if name.startswith("ms-shared"):  # ms-shared[-probs]
                hook.__class__ = UnitShareDecoder
                hook.pool = "probs" if name.endswith("-probs") else "logits"
            elif name.startswith("ms-share"):
                hook.__class__ = ShareDecoder
                floor, _, cap = name.removeprefix("ms-share").removeprefix("mean").partition("-cap")
                hook.pool = "logits" if name.startswith("ms-sharemean") else "probs"
                hook.floor, hook.cap = float(floor), float(cap or 0)
            if name.startswith("ms-band"):
                hook.__class__ = BandRerankDecoder
                hook.keep, hook.band = (float(x) for x in name.removeprefix("ms-band").split("x"))
            if name == "sketchself":  # fitted on the prompt's own keys and queries (a per-request basis)
                from sparse_sglang.calibrate import fit_basis

                own = fit_basis(model, tokenizer, [item.prompt], 16, window=len(ids))
                hook.__class__ = SketchDecoder
                hook.reduce, hook.fp8 = "max", False
                hook.basis, hook.query_basis = dict(enumerate(own.keys)), dict(enumerate(own.queries))
            elif name == "sketchpkg":  # sparse_sglang.calibrate's default fit (what a server fits for itself)
                hook.__class__ = SketchDecoder
                hook.reduce, hook.fp8 = "max", False
                hook.basis, hook.query_basis = dict(enumerate(pkg_basis.keys)), dict(enumerate(pkg_basis.queries))
            elif name.startswith("ms-sketchrr"):  # the corners shortlist, the package's sketches rank
                hook.__class__ = SketchRerankDecoder
                factor, *variants = name.removeprefix("ms-sketchrr").split("-")
                hook.factor, hook.reduce, hook.fp8 = float(factor), "lse" if "lse" in variants else "max", False
                hook.keep = next((float(v[1:]) for v in variants if v.startswith("k")), 0.0)
                basis = pkg_bases[32] if "r32" in variants else pkg_basis
                hook.basis, hook.query_basis = dict(enumerate(basis.keys)), dict(enumerate(basis.queries))
            elif name.startswith("sketchtext"):  # bases fitted on --calibration-text: svd, centred svd, bilinear
                hook.__class__ = SketchDecoder
                hook.reduce, hook.fp8 = "max", False
                kind = name.removeprefix("sketchtext-")
                hook.basis, hook.query_basis = text_bases[kind]
            elif name.startswith("sketchfile"):
                hook.__class__ = SketchDecoder
                hook.reduce, hook.fp8 = "max", name.endswith("8")
                loaded = KeyBasis.load(args.basis)
                hook.basis, hook.query_basis = dict(enumerate(loaded.keys)), dict(enumerate(loaded.queries))
            elif name.startswith("sketch"):
                hook.__class__ = SketchDecoder
                rank, _, hook.reduce = name.removeprefix("sketchcal").removeprefix("sketch").partition("-")
                hook.reduce, _, window = hook.reduce.partition("-w")
                hook.reduce, fp8 = hook.reduce.removesuffix("-fp8"), hook.reduce.endswith("-fp8")
                hook.sketch_rank, hook.reduce, hook.fp8 = int(rank), hook.reduce or "mass", fp8
                hook.fit_tokens = int(window) if window else None
                hook.basis = dict(calibration[hook.sketch_rank]) if name.startswith("sketchcal") else {}
            if name.startswith("stat-"):
                hook.__class__ = PageStatDecoder
                hook.stat = name.removeprefix("stat-")
            if name.startswith("quest-rot-"):  # Quest's bounds in a rotated key space
                hook.__class__ = RotatedQuestDecoder
                kind = name.removeprefix("quest-rot-")
                dim = model.config.head_dim
                hook.rotation = {"identity": torch.eye(dim), "self": "self", "hadamard": hadamard(dim),
                                 "cal": text_bases.get("centred", ({}, None))[0]}[kind]  # fmt: skip
            if name in ("quest-window", "quest-window-bounds"):
                hook.__class__ = WindowDecoder
                hook.pinned = pins if name == "quest-window" else bound_pins
            out = quality.decode(
                model,
                hook,
                copy.deepcopy(cache),
                [],
                min(item.max_new_tokens, 24),
                first,
                stop=tokenizer.convert_tokens_to_ids("<|im_end|>"),
            )
            text = tokenizer.decode(out, skip_special_tokens=True)
            row[name] = accuracy.score(item, text)
        rows.append(row)
        print(row, flush=True)
    means = {k: round(sum(r[k] for r in rows) / len(rows), 3) for k in rows[0] if k != "id"}
    print("means", means)
    header = run_header("benchmark.probes.answer_levers", None, device=str(model.device))
    # summary: each policy's mean score over the items (an item's score under RULER's rule)
    save_result({**header, "budget": args.budget, "length": args.length, "rows": rows, "summary": means}, args.out)


if __name__ == "__main__":
    main()
