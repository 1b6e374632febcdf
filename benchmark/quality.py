"""Quality of sparse decode on CPU: attention-mass recall (Q2) and pass-key retrieval (Q3).

SmolLM2-135M-Instruct (the default model, float32, transformers) runs with its attention routed
through a registered attention function, so the selection code of ``sparse_sglang.attention`` is
what decides, on the model's real post-RoPE queries and keys:

- **Q2 recall**: one dense forward over ~7K tokens of license texts captures every layer's queries,
  keys and values; the last ``--queries`` positions act as decode queries (each over its own
  prefix). Pages of ``page_size`` tokens are summarized by ``PageSummaries``; each selector,
  GQA group reduction, budget (and the knobs: sink/recent pages, dense leading layers, LServe
  logical pages max-reduced to physical ones) is scored by the share of the dense softmax mass on
  the selected pages and by ``|o_sparse - o_dense| / |o_dense|``, per query head, averaged per
  layer. A layer the policy leaves dense (index < ``dense_layers``) counts as recall 1, error 0
  in the mean over all layers; the mean over the sparse layers alone is reported beside it.
- **Q3 pass key**: a random 5-digit key at depths 0.1/0.5/0.9 of ~2K/4K/7K-token prompts of filler
  text, ending "The pass key is". The prompt is prefilled densely, as the server prefills (filling
  the page summaries; its greedy token is the answer's first), then 7 more greedy tokens decode one
  at a time, with every layer's attention either dense or ``select_pages`` +
  ``sparse_attention_reference`` at the budget (summaries updated with each decoded key; the first
  ``dense_layers`` layers dense), so the answer is read under sparse attention. The answer is the
  number the completion gives, compared with dense's (whether all 8 tokens match is recorded too).
  ``--passkey-prefill question`` is stricter than any server step: the question's own tokens
  decode under the policy too, and the answer's every token.

Writes ``benchmark/results/quality-<date>.json`` and prints compact tables::

    python -m benchmark.quality                  # full run (minutes on a few CPU cores)
    python -m benchmark.quality --quick          # small smoke run
    python -m benchmark.quality --passkey-prefill question --out benchmark/results/quality-<date>-question.json
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from sparse_sglang.attention import (
    DEFAULT_GROUP_REDUCE,
    GROUP_REDUCES,
    SELECTORS,
    get_selector,
    keep_cached,
    select_pages,
)
from sparse_sglang.attention.reference import (
    attention_mass_recall,
    choose_reranked_reference,
    max_reduce_logical,
    sparse_attention_reference,
)
from sparse_sglang.config import SparseConfig
from sparse_sglang.default_model import default_model_path
from sparse_sglang.mem_cache import PageSummaries
from sparse_sglang.mem_cache.reference import page_mean_abs_deviation
from sparse_sglang.testing.provenance import run_header, save_result

REPO = Path(__file__).resolve().parents[1]
DEFAULTS = SparseConfig(host_cache_gb=1.0)
PAGE_SIZE = DEFAULTS.page_size
DEFAULT_SELECTOR = DEFAULTS.selector
LICENSES = Path("/usr/share/common-licenses")
# The selectors this study scores. The sketch selector reads per-token key sketches projected on a
# key basis fitted per model (sparse_sglang.calibrate); this study's summaries hold page bounds
# only, so it leaves sketch out and says so in its result (answer_levers scores sketch, several bases).
CPU_SELECTORS = tuple(s for s in SELECTORS if "sketch" not in SELECTORS[s].summaries)
LEFT_OUT_SELECTORS = {
    s: "scores per-token key sketches on a fitted key basis, which this study's page summaries do not hold: "
    "python -m benchmark.probes.answer_levers --policies sketchpkg,... scores it on the accuracy items"
    for s in SELECTORS
    if s not in CPU_SELECTORS
}
ORACLE = "oracle"  # Q2 only: pages ranked by their true attention mass (the best any selector can do)
TARGET_RECALL = 0.90  # mean over layers, default selector, budget 512, ~7K tokens

# Passkey prompt (the usual one of the pass-key retrieval test, Mohtashami & Jaggi 2023).
INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there.\n\n"
)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
# A bare continuation, as the model is known to answer it: with "What is the pass key?" before it,
# dense SmolLM2 itself answered "the pass key..." in 4 of 9 cases; without, it finds 9 of 9.
QUESTION = "\n\nThe pass key is"


@dataclass(frozen=True)
class Policy:
    """One sparse decode setting; ``selector=None`` is dense attention."""

    selector: str | None = DEFAULT_SELECTOR
    group_reduce: str = DEFAULT_GROUP_REDUCE
    budget: int = 512
    sink_pages: int = DEFAULTS.sink_pages
    recent_pages: int = DEFAULTS.recent_pages
    logical_page_size: int = PAGE_SIZE  # < PAGE_SIZE: LServe's logical pages, max-reduced
    # Layers with index < dense_layers attend densely (Quest's first two layers). A benchmark knob
    # only: the server's page cache rows hold a budget's pages, not a whole context.
    dense_layers: int = 0
    rerank_factor: int = 1  # --sparse-rerank-factor: F x the budget's candidates, the budget's by exact mass
    page_bounds: str = DEFAULTS.page_bounds  # --sparse-page-bounds: minmax (Quest's) or meanstd corners
    bound_spread: float = DEFAULTS.bound_spread  # --sparse-bound-spread: meanstd's std multiple

    def is_dense(self, layer: int) -> bool:
        """Whether this policy attends densely in ``layer``."""
        return self.selector is None or layer < self.dense_layers

    @property
    def name(self) -> str:
        """``selector`` (``dense`` for None), then the knobs that differ from the defaults:
        ``quest(dense_layers=2)``."""
        changed = [f"{k}={v}" for k, v in asdict(self).items() if k != "selector" and v != getattr(_DEFAULT_POLICY, k)]
        base = self.selector or "dense"
        return f"{base}({','.join(changed)})" if changed and self.selector else base


_DEFAULT_POLICY = Policy()


# Attention routing: one registered implementation that forwards to the active hook.

ATTN_IMPL = "sparse_sglang_reference"
_hook = None


def _attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """transformers attention function: query ``[B, Hq, Tq, D]`` (post-RoPE), key/value
    ``[B, Hkv, Tk, D]`` with the cache; returns ``([B, Tq, Hq, D], None)``."""
    if _hook is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    return _hook(module, query, key, value, attention_mask, scaling=scaling, **kwargs), None


AttentionInterface.register(ATTN_IMPL, _attention)


def run_with(hook, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with every attention call going through ``hook``."""
    global _hook
    previous, _hook = _hook, hook
    try:
        with torch.inference_mode():
            return fn(*args, **kwargs)
    finally:
        _hook = previous


def load_model(path: str | None = None):
    path = path or default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=ATTN_IMPL)
    return tokenizer, model.eval()


def dense(module, query, key, value, attention_mask, **kwargs) -> torch.Tensor:
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)[0]


class Capture:
    """Hook recording, per layer, the queries and attention outputs of the last ``num_queries``
    positions (``[n, Hq, D]``) and all keys and values (``[Hkv, T, D]``) of a dense forward."""

    def __init__(self, num_queries: int):
        self.num_queries = num_queries
        self.q, self.k, self.v, self.out = {}, {}, {}, {}

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        out = dense(module, query, key, value, attention_mask, **kwargs)
        layer, n = module.layer_idx, self.num_queries
        self.q[layer] = query[0, :, -n:].transpose(0, 1).clone()
        self.k[layer], self.v[layer] = key[0].clone(), value[0].clone()
        self.out[layer] = out[0, -n:].clone()
        return out


def license_tokens(tokenizer, tokens: int) -> list[int]:
    """The first ``tokens`` token ids of the license texts in ``/usr/share/common-licenses``."""
    text = "\n\n".join(p.read_text() for p in sorted(LICENSES.iterdir()) if p.is_file() and not p.is_symlink())
    ids = tokenizer(text).input_ids[:tokens]
    assert len(ids) == tokens, f"license texts hold only {len(ids)} tokens"
    return ids


def capture(model, input_ids: torch.Tensor, num_queries: int) -> Capture:
    cap = Capture(num_queries)
    run_with(cap, model, input_ids=input_ids, use_cache=False, logits_to_keep=1)
    return cap


def license_capture(tokens: int = 7168, num_queries: int = 32) -> tuple[Capture, float]:
    """SmolLM2 over ``tokens`` tokens of the license texts, the last ``num_queries`` positions
    captured (the Q2 capture the recall studies share), and the model's attention scale."""
    tokenizer, model = load_model()
    cap = capture(model, torch.tensor([license_tokens(tokenizer, tokens)]), num_queries)
    return cap, model.model.layers[0].self_attn.scaling


def summarize(keys: dict[int, torch.Tensor], page_size: int, page_bounds: str = "minmax",
              bound_spread: float = 1.0) -> PageSummaries:  # fmt: skip
    """PageSummaries of all layers' keys ``[Hkv, T, D]`` at ``page_size``, with ``page_bounds``
    corners (``bound_spread`` for meanstd's)."""
    heads, tokens, dim = keys[0].shape
    s = PageSummaries(len(keys), heads, -(-tokens // page_size), page_size, dim, keys[0].dtype,
                      page_bounds=page_bounds, bound_spread=bound_spread)  # fmt: skip
    for layer, k in keys.items():
        s.update(layer, k.transpose(0, 1), torch.arange(tokens))
    return s


def choose_pages(
    policy: Policy,
    q: torch.Tensor,
    summaries: PageSummaries,
    layer: int,
    keys: torch.Tensor,
    seq_len: torch.Tensor,
    cached: torch.Tensor | None = None,
    reselect: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """``[B, Hkv, K]`` pages of ``PAGE_SIZE`` tokens that ``policy`` attends for decode queries
    ``q`` ``[B, Hq, D]`` over ``keys`` ``[1, Hkv, T, D]`` (summarized by ``summaries`` at the
    policy's logical page size); ``seq_len`` ``[B]`` tokens per query. With ``cached``
    ``[B, Hkv, N]`` and ``reselect`` ``[B]``, rows not reselecting choose among cached pages
    (:func:`keep_cached`, as the server does with ``--sparse-reselect-interval``)."""
    selector, lps = get_selector(policy.selector), policy.logical_page_size
    n = -(-keys.shape[2] // lps)
    kmin, kmax, kmean = (getattr(summaries, name)[layer, :, :n].unsqueeze(0) for name in ("kmin", "kmax", "mean"))
    radius = page_mean_abs_deviation(keys, kmin, kmax, lps) if "radius" in selector.summaries else None
    batch, q_heads, dim = q.shape
    qg = q.view(batch, kmin.shape[1], q_heads // kmin.shape[1], dim)
    scores = selector.score(qg, kmin, kmax, kmean, policy.group_reduce, radius=radius)
    if lps != PAGE_SIZE:
        scores = max_reduce_logical(scores, PAGE_SIZE // lps, -(-seq_len // lps))
    if cached is not None:
        scores = keep_cached(scores, cached[..., : scores.shape[-1]], reselect)
    num_pages, budget = -(-seq_len // PAGE_SIZE), policy.budget // PAGE_SIZE
    if policy.rerank_factor == 1:
        return select_pages(scores, num_pages, budget, policy.sink_pages, policy.recent_pages).page_ids
    # The server's re-rank (sparse_sglang.attention.rerank) over candidates chosen the same way.
    candidates = select_pages(scores, num_pages, budget * policy.rerank_factor, policy.sink_pages,
                              policy.recent_pages).page_ids.long()  # fmt: skip
    heads, group, kc = kmin.shape[1], q_heads // kmin.shape[1], candidates.shape[-1]
    logits = qg.float() @ keys.float().transpose(-1, -2) * (dim**-0.5 if scale is None else scale)  # [B, Hkv, G, T]
    past = torch.arange(keys.shape[2]).view(1, 1, 1, -1) >= seq_len.view(-1, 1, 1, 1)
    logits = torch.nn.functional.pad(
        logits.masked_fill(past, -math.inf), (0, -keys.shape[2] % PAGE_SIZE), value=-math.inf
    )
    lse = logits.view(batch, heads, group, -1, PAGE_SIZE).logsumexp(-1)  # [B, Hkv, G, N]
    lse = lse.gather(3, candidates.clamp(min=0).unsqueeze(2).expand(-1, -1, group, -1)).transpose(2, 3)
    rows = batch * heads
    forced = (min(policy.sink_pages, budget - policy.recent_pages), policy.recent_pages)
    chosen, _ = choose_reranked_reference(candidates.view(rows, kc), num_pages.repeat_interleave(heads),
                                          lse.reshape(rows, kc, group), candidates.view(rows, kc), budget, forced)  # fmt: skip
    return chosen.view(batch, heads, budget).to(torch.int32)


# Q2: attention-mass recall and output error on captured queries.


def oracle_page_mass(q: torch.Tensor, k: torch.Tensor, seq_len: torch.Tensor, scale: float) -> torch.Tensor:
    """``[B, Hkv, N]`` dense softmax mass of each page, summed over the kv head's query heads: the
    scores of the best possible selection for the recall metric (an upper bound, not a selector)."""
    batch, q_heads, dim = q.shape
    heads, tokens = k.shape[1], k.shape[2]
    logits = q.view(batch, heads, q_heads // heads, dim) @ k.transpose(-1, -2) * scale
    past = torch.arange(tokens).view(1, 1, 1, -1) >= seq_len.view(-1, 1, 1, 1)
    probs = logits.masked_fill(past, -math.inf).softmax(dim=-1).sum(dim=2)
    return torch.nn.functional.pad(probs, (0, -tokens % PAGE_SIZE)).view(batch, heads, -1, PAGE_SIZE).sum(-1)


def recall_table(cap: Capture, policies: list[Policy], scale: float) -> list[dict]:
    num_layers, tokens = len(cap.k), cap.k[0].shape[1]
    seq_len = torch.arange(tokens - cap.num_queries, tokens) + 1  # query i sees its prefix
    kinds = {(p.logical_page_size, p.page_bounds, p.bound_spread) for p in policies}
    summaries = {kind: summarize(cap.k, *kind) for kind in kinds}
    recall = {p: [] for p in policies}
    error = {p: [] for p in policies}
    sparse = {p: [layer for layer in range(num_layers) if not p.is_dense(layer)] for p in policies}
    for layer in range(num_layers):
        # K/V shared by all queries, materialized per query once (a broadcast matmul copies per call).
        q, k, v = cap.q[layer], *(x.expand(len(seq_len), -1, -1, -1).contiguous() for x in (cap.k[layer], cap.v[layer]))
        o_dense = sparse_attention_reference(q, k, v, None, PAGE_SIZE, seq_len, scale)
        mass = oracle_page_mass(q, k[:1], seq_len, scale)
        for policy in policies:
            if policy.is_dense(layer):  # exact attention: all the mass, no error
                recall[policy].append(1.0)
                error[policy].append(0.0)
                continue
            if policy.selector == ORACLE:
                pages = select_pages(mass, -(-seq_len // PAGE_SIZE), policy.budget // PAGE_SIZE,
                                     policy.sink_pages, policy.recent_pages).page_ids  # fmt: skip
            else:
                kind = (policy.logical_page_size, policy.page_bounds, policy.bound_spread)
                pages = choose_pages(policy, q, summaries[kind], layer, k[:1], seq_len)
            o = sparse_attention_reference(q, k, v, pages, PAGE_SIZE, seq_len, scale)
            recall[policy].append(attention_mass_recall(q, k, pages, PAGE_SIZE, seq_len, scale).mean().item())
            error[policy].append(((o - o_dense).norm(dim=-1) / o_dense.norm(dim=-1)).mean().item())
    return [{**asdict(p), "name": p.name, "recall_mean": mean(recall[p]),
             "recall_mean_sparse_layers": mean(recall[p][i] for i in sparse[p]) if sparse[p] else None,
             "recall_min_layer": min(recall[p]), "recall_mean_from_layer2": mean(recall[p][2:]),
             "rel_err_mean": mean(error[p]), "rel_err_mean_sparse_layers": mean(error[p][i] for i in sparse[p]) if sparse[p] else None,
             "recall_per_layer": rounded(recall[p]), "rel_err_per_layer": rounded(error[p])} for p in policies]  # fmt: skip


DENSE_LAYERS = (0, 1, 2)  # knob values measured (the default among them or not)


def recall_policies(budgets: list[int], extra: list[Policy] = ()) -> list[Policy]:
    """The main grid (every selector x group reduction x budget), then the knobs at budget 512,
    then ``extra`` (the pass-key policies, so each has its recall row)."""
    grid = [Policy(s, g, b) for s in CPU_SELECTORS for g in GROUP_REDUCES for b in budgets]
    grid += [Policy(DEFAULT_SELECTOR, g, b, page_bounds="minmax") for g in GROUP_REDUCES for b in budgets]
    grid += [Policy(ORACLE, "sum", b) for b in budgets]
    sink_recent = [(0, 1), (1, 1), (2, 2), (1, 4), (4, 4)]
    knobs = [Policy(DEFAULT_SELECTOR, g, 512, s, r) for g in GROUP_REDUCES for s, r in sink_recent]
    knobs += [
        Policy(s, DEFAULT_GROUP_REDUCE, 512, dense_layers=n) for s in (DEFAULT_SELECTOR, ORACLE) for n in DENSE_LAYERS
    ]
    logical = [
        Policy(s, g, 512, logical_page_size=lps) for s in CPU_SELECTORS for g in GROUP_REDUCES for lps in (16, 8)
    ]
    return list(dict.fromkeys(grid + knobs + logical + list(extra)))


def passkey_policies() -> list[Policy]:
    """Every selector at the defaults, then the default selector's knobs: dense leading layers,
    2 sink + 2 recent pages (and both), budget 1024."""
    knobs = [Policy(dense_layers=n) for n in DENSE_LAYERS]
    knobs += [
        Policy(sink_pages=2, recent_pages=2),
        Policy(sink_pages=2, recent_pages=2, dense_layers=2),
        Policy(budget=1024),
    ]
    return list(dict.fromkeys([Policy(s) for s in CPU_SELECTORS] + [Policy(page_bounds="minmax")] + knobs))


# Q3: pass-key retrieval with sparse decode.


class SparseDecoder:
    """Hook for one generation: a dense prefill (from an empty cache) fills ``PageSummaries``;
    each later one-token step adds its key to them and attends per ``policy`` (dense when
    ``policy.selector`` is None, and in its first ``dense_layers`` layers), recording the
    attention-mass recall of each sparse (layer, step)."""

    def __init__(self, model, policy: Policy, max_tokens: int, bound_format: str = "exact"):
        cfg = model.config
        self.policy = self._check(policy)
        self.bound_format = bound_format
        self.shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, -(-max_tokens // PAGE_SIZE), cfg.head_dim)
        self.summaries = self._summaries(policy)
        self.prompt_keys: dict[int, torch.Tensor] = {}  # layer -> [Hkv, T, D], the dense prefill's
        self.recall: list[float] = []

    def _summaries(self, policy: Policy) -> PageSummaries:
        layers, heads, pages, dim = self.shape
        return PageSummaries(layers, heads, pages, PAGE_SIZE, dim, torch.float32, bound_format=self.bound_format,
                             page_bounds=policy.page_bounds, bound_spread=policy.bound_spread)  # fmt: skip

    def fork(self, policy: Policy) -> SparseDecoder:
        """A decoder continuing from this one's summaries under another policy (right after the
        prefill, summaries of other page corners are built anew from the prompt's keys)."""
        other = copy.copy(self)
        other.policy, other.recall = self._check(policy), []
        if (policy.page_bounds, policy.bound_spread) == (self.summaries.page_bounds, self.summaries.bound_spread):
            other.summaries = copy.deepcopy(self.summaries)
            return other
        summarized = int(self.summaries.count.sum())
        assert summarized == sum(k.shape[1] for k in self.prompt_keys.values()), "fork right after prefill"
        other.summaries = self._summaries(policy)
        for layer, k in self.prompt_keys.items():
            other.summaries.update(layer, k.transpose(0, 1), torch.arange(k.shape[1]))
        return other

    @staticmethod
    def _check(policy: Policy) -> Policy:
        # The decode summaries are kept at PAGE_SIZE only (Q2 builds one set per logical page size).
        assert policy.logical_page_size == PAGE_SIZE, "pass-key decode supports physical pages only"
        return policy

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        layer, tokens, new = module.layer_idx, key.shape[2], query.shape[2]
        self.summaries.update(layer, key[0, :, tokens - new :].transpose(0, 1), torch.arange(tokens - new, tokens))
        if new > 1:
            assert new == tokens, "multi-token steps only as the first prefill"
            self.prompt_keys[layer] = key[0]
            return dense(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        q, seq_len = query[:, :, 0], torch.tensor([tokens])
        pages = None
        if not self.policy.is_dense(layer):
            pages = choose_pages(self.policy, q, self.summaries, layer, key, seq_len, scale=scaling)
            self.recall.append(attention_mass_recall(q, key, pages, PAGE_SIZE, seq_len, scaling).mean().item())
        return sparse_attention_reference(q, key, value, pages, PAGE_SIZE, seq_len, scaling).unsqueeze(1)


def passkey_answer(text: str) -> str | None:
    """The number a pass-key completion gives (its first run of digits): the answer compared with
    dense's (the server's Q4 test reads it the same way)."""
    found = re.search(r"\d+", text)
    return found.group(0) if found else None


def passkey_prompt(tokenizer, target_tokens: int, depth: float, key: int) -> list[int]:
    """Token ids of a pass-key prompt of about ``target_tokens`` with the needle at ``depth``."""
    unit = len(tokenizer(FILLER).input_ids)
    overhead = len(tokenizer(INTRO + NEEDLE.format(key=key) + QUESTION).input_ids)
    units = max(1, (target_tokens - overhead) // unit)
    before = round(units * depth)
    text = INTRO + FILLER * before + NEEDLE.format(key=key) + FILLER * (units - before) + QUESTION
    return tokenizer(text).input_ids


def decode(
    model,
    hook: SparseDecoder,
    cache,
    tokens: list[int],
    new_tokens: int,
    first: int | None = None,
    stop: int | None = None,
) -> list[int]:
    """Feed ``tokens`` one at a time, then ``new_tokens`` greedy ones; returns the generated ids.
    With no ``tokens``, ``first`` is the first generated id (the prefill's greedy token). A
    generated ``stop`` id (the end-of-sequence token) ends the answer, itself included."""
    out = []

    def step(token: int) -> int:
        logits = model(input_ids=torch.tensor([[token]], device=model.device), past_key_values=cache, use_cache=True)
        return int(logits.logits[0, -1].argmax())

    nxt = first
    for token in tokens:
        nxt = run_with(hook, step, token)
    for _ in range(new_tokens):
        out.append(nxt)
        if nxt == stop:
            break
        nxt = run_with(hook, step, nxt)
    return out


def page_moments(key: torch.Tensor, page: int = PAGE_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """``[Hkv, N, D]`` per-page key mean and population variance of ``key`` ``[Hkv, T, D]``, from
    the keys exactly (the last page's missing tokens left out): what the mean/std corners store."""
    heads, tokens, dim = key.shape
    pad = -tokens % page
    k = torch.nn.functional.pad(key.float(), (0, 0, 0, pad)).view(heads, -1, page, dim)
    valid = torch.nn.functional.pad(torch.ones(tokens, device=key.device), (0, pad)).view(1, -1, page, 1)
    count = valid.sum(2).clamp_min(1)
    mean = (k * valid).sum(2) / count
    var = (((k - mean.unsqueeze(2)) * valid) ** 2).sum(2) / count
    return mean, var


def greedy_answer(model, hook, ids: list[int], new_tokens: int, stop: int | None = None) -> list[int]:
    """The prompt ``ids`` prefilled, then ``new_tokens`` greedy ones generated (``stop`` ends them,
    itself included), every attention call through ``hook``: the generated ids."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    logits = run_with(hook, model, input_ids=torch.tensor([ids], device=model.device), past_key_values=cache,
                      use_cache=True, logits_to_keep=1).logits  # fmt: skip
    return decode(model, hook, cache, [], new_tokens, int(logits[0, -1].argmax()), stop)


# Q3 protocols: what the dense prefill covers. "question": all of the prompt but its question, whose
# tokens then decode with the policy like the answer (stricter than any server step). "prompt":
# the whole prompt, whose greedy token is the answer's first, then the rest decodes with the
# policy: what the server does (its prefill is dense).
PASSKEY_PROTOCOLS = {
    "question": "dense prefill of the prompt but its question; question tokens and greedy answer decoded one "
    "token at a time with the policy (its first dense_layers layers dense); decode_recall_mean is "
    "over the sparse layers' steps",
    "prompt": "dense prefill of the whole prompt, as the server prefills: its greedy token is the answer's first; "
    "the other answer tokens decoded one at a time with the policy (its first dense_layers layers "
    "dense); decode_recall_mean is over the sparse layers' steps",
}


def passkey_table(tokenizer, model, lengths: list[int], depths: list[float], policies: list[Policy],
                  new_tokens: int, seed: int, protocol: str = "prompt", bound_format: str = "exact") -> list[dict]:  # fmt: skip
    """Q3's rows; ``bound_format`` is how the decode summaries keep page bounds (``--sparse-bound-format``)."""
    from transformers import DynamicCache

    rng = random.Random(seed)
    question = len(tokenizer(QUESTION).input_ids) if protocol == "question" else 0
    rows = []
    for length in lengths:
        for depth in depths:
            key = rng.randrange(10_000, 100_000)
            ids = passkey_prompt(tokenizer, length, depth, key)
            prefix, suffix = ids[: len(ids) - question], ids[len(ids) - question :]
            cache = DynamicCache(config=model.config)
            prefill = SparseDecoder(model, Policy(selector=None), len(ids) + new_tokens, bound_format)
            logits = run_with(
                prefill,
                model,
                input_ids=torch.tensor([prefix]),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            ).logits
            first = None if suffix else int(logits[0, -1].argmax())
            row = {"target_tokens": length, "prompt_tokens": len(ids), "depth": depth, "key": str(key)}
            answers = {}
            for policy in [Policy(selector=None)] + policies:
                hook = prefill.fork(policy)
                generated = decode(model, hook, copy.deepcopy(cache), suffix, new_tokens, first)
                name = policy.name
                answers[name] = tokenizer.decode(generated, clean_up_tokenization_spaces=False)
                row[name] = {"answer": answers[name], "has_key": str(key) in answers[name]}
                if policy.selector:
                    row[name]["equal_dense"] = answers[name] == answers["dense"]  # all new_tokens tokens
                    row[name]["answer_equal_dense"] = passkey_answer(answers[name]) == passkey_answer(answers["dense"])
                    # over the sparse layers' steps (a dense layer's recall is 1)
                    row[name]["decode_recall_mean"] = round(mean(hook.recall), 4) if hook.recall else 1.0
            rows.append(row)
            print(f"  passkey {len(ids):5d} tok depth {depth}: key {key} " +
                  " | ".join(f"{n}: {a!r}" for n, a in answers.items()), flush=True)  # fmt: skip
    return rows


# Output.


def mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs)


def rounded(xs: list[float]) -> list[float]:
    return [round(x, 4) for x in xs]


def find_row(rows: list[dict], **match) -> dict:
    return next(r for r in rows if all(r[k] == v for k, v in match.items()))


def r4(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def passkey_score(passkey: list[dict], recall: list[dict], policy: Policy) -> dict:
    """One pass-key policy's counts over the cases, with the Q2 recall of the same knobs."""
    rows = [row[policy.name] for row in passkey]
    q2 = find_row(recall, **asdict(policy))
    equal = sum(r["equal_dense"] for r in rows)
    answers = sum(r["answer_equal_dense"] for r in rows)
    return {"policy": policy.name, **asdict(policy), "found": sum(r["has_key"] for r in rows), "equal_dense": equal,
            "cases": len(rows), "all_equal_dense": equal == len(rows), "answers_equal_dense": answers,
            "all_answers_equal_dense": answers == len(rows),
            "recall_mean": r4(q2["recall_mean"]), "recall_mean_sparse_layers": r4(q2["recall_mean_sparse_layers"])}  # fmt: skip


def summarize_results(recall: list[dict], passkey: list[dict], policies: list[Policy], tokens: int,
                      protocol: str = "prompt") -> dict:  # fmt: skip
    default_policy = Policy()
    base = asdict(default_policy)
    rows_512 = {g: find_row(recall, **{**base, "group_reduce": g}) for g in GROUP_REDUCES}
    at_512 = {g: r["recall_mean"] for g, r in rows_512.items()}
    default = rows_512[DEFAULT_GROUP_REDUCE]
    oracle = find_row(recall, **{**base, "selector": ORACLE})
    # Knobs compared over the layers they select in (dense layers would win trivially in the mean).
    best_knob = max((r for r in recall if r["selector"] == DEFAULT_SELECTOR and r["budget"] == 512
                     and r["dense_layers"] == default_policy.dense_layers),
                    key=lambda r: r["recall_mean_sparse_layers"])  # fmt: skip
    scores = [passkey_score(passkey, recall, p) for p in policies]
    default_score = next(s for s in scores if s["policy"] == default_policy.name)
    # Best pass-key setting of the default selector at the default budget: most answers equal to
    # dense, then fewest dense layers (they cost full attention), then best recall over sparse layers.
    candidates = [s for s in scores if s["selector"] == DEFAULT_SELECTOR and s["budget"] == default_policy.budget]
    best = max(candidates, key=lambda s: (s["equal_dense"], -s["dense_layers"], s["recall_mean_sparse_layers"] or 1.0))
    return {
        "default_policy": {"name": default_policy.name, **base,
                           "from": "sparse_sglang.config.SparseConfig defaults at run time (budget: this benchmark's 512)"},
        "recall_context_tokens": tokens,
        "recall_512_7k": r4(default["recall_mean"]),
        "recall_512_7k_sparse_layers": r4(default["recall_mean_sparse_layers"]),
        "recall_note": "mean over all layers, a dense layer counting as recall 1.0; _sparse_layers: mean over the "
                       "layers the policy selects pages in",
        "recall_target": TARGET_RECALL,
        "recall_target_met": default["recall_mean"] >= TARGET_RECALL,
        "recall_target_met_sparse_layers": (default["recall_mean_sparse_layers"] or 1.0) >= TARGET_RECALL,
        "recall_shortfall": r4(max(0.0, TARGET_RECALL - default["recall_mean"])),
        "recall_512_oracle": r4(oracle["recall_mean"]),
        "recall_512_oracle_sparse_layers": r4(oracle["recall_mean_sparse_layers"]),
        "recall_512_by_group_reduce": {g: r4(r) for g, r in at_512.items()},
        "recall_512_by_dense_layers": {
            n: {"recall_mean": r4(r["recall_mean"]), "recall_mean_sparse_layers": r4(r["recall_mean_sparse_layers"])}
            for n in DENSE_LAYERS for r in [find_row(recall, **{**base, "dense_layers": n})]},
        "default_group_reduce": DEFAULT_GROUP_REDUCE,
        "group_reduce_by_recall": max(at_512, key=at_512.get),
        "best_default_selector_setting_512": {**{k: best_knob[k] for k in base}, "recall_mean": r4(best_knob["recall_mean"]),
                                              "recall_mean_sparse_layers": r4(best_knob["recall_mean_sparse_layers"])},
        "passkey_prefill": protocol,
        # the answer: the number given after "The pass key is" (passkey_answer), as the server's Q4 reads it
        "passkey_cpu_equal": default_score["all_answers_equal_dense"],
        "passkey_cpu_outputs_equal": default_score["all_equal_dense"],  # all generated tokens
        "passkey_dense_found": sum(row["dense"]["has_key"] for row in passkey),
        "passkey_sparse_found": default_score["found"],
        "passkey_sparse_answers_equal_dense": default_score["answers_equal_dense"],
        "passkey_sparse_equal_dense": default_score["equal_dense"],
        "passkey_cases": len(passkey),
        "passkey_best_setting": {**best, "rule": f"{DEFAULT_SELECTOR} at budget {default_policy.budget}: most answers "
                                 "equal to dense, then fewest dense layers, then best recall over sparse layers"},
        "passkey_by_policy": scores,
    }  # fmt: skip


def print_tables(result: dict) -> None:
    print(
        f"\nQ2 recall ({result['recall_setup']['tokens']} tokens, {result['recall_setup']['queries']} decode "
        f"queries, page {PAGE_SIZE}): mean attention-mass recall / mean output rel. error over layers "
        "(dense layers count 1 / 0; 'sparse': over the sparse layers only)"
    )
    print(f"{'selector':8} {'corners':7} {'reduce':6} {'sink':>4} {'rec':>3} {'lpage':>5} {'dense':>5} {'budget':>6} {'recall':>7} "
          f"{'sparse':>7} {'min lyr':>7} {'lyr 2+':>7} {'rel err':>7}")  # fmt: skip
    for r in result["recall"]:
        sparse = "-" if r["recall_mean_sparse_layers"] is None else f"{r['recall_mean_sparse_layers']:.4f}"
        print(f"{r['selector']:8} {r['page_bounds']:7} {r['group_reduce']:6} {r['sink_pages']:4} {r['recent_pages']:3} "
              f"{r['logical_page_size']:5} {r['dense_layers']:5} {r['budget']:6} {r['recall_mean']:7.4f} {sparse:>7} "
              f"{r['recall_min_layer']:7.4f} {r['recall_mean_from_layer2']:7.4f} {r['rel_err_mean']:7.4f}")  # fmt: skip
    print(f"\nQ3 pass key ({result['passkey_setup']['protocol']})")
    names = ["dense"] + [p["name"] for p in result["passkey_setup"]["policies"]]
    for row in result["passkey"]:
        print(f"{row['prompt_tokens']:5d} tok depth {row['depth']}: key {row['key']}")
        for n in names:
            print(f"    {n:45} {row[n]['answer']!r}{'' if row[n]['has_key'] else ' (miss)'}"
                  f"{'' if n == 'dense' or row[n]['equal_dense'] else ' (!= dense)'}")  # fmt: skip
    print(f"\n{'policy':45} {'recall':>7} {'sparse':>7} {'found':>5} {'answer=dense':>12} {'output=dense':>12}")
    for s in result["summary"]["passkey_by_policy"]:
        sparse = "-" if s["recall_mean_sparse_layers"] is None else f"{s['recall_mean_sparse_layers']:.4f}"
        print(f"{s['policy']:45} {s['recall_mean']:7.4f} {sparse:>7} {s['found']:5} {s['answers_equal_dense']:12} "
              f"{s['equal_dense']:12}")  # fmt: skip
    summary = {k: v for k, v in result["summary"].items() if k != "passkey_by_policy"}
    print("\nsummary:", json.dumps(summary, indent=1))
    print(f"run time {result['run_time_s']:.0f} s")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=7168, help="Q2 context (license texts), tokens")
    parser.add_argument("--queries", type=int, default=32, help="Q2 decode queries: the last positions")
    parser.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 7168], help="Q3 prompt tokens")
    parser.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--passkey-prefill", choices=sorted(PASSKEY_PROTOCOLS), default="prompt",
                        help="Q3: what the dense prefill covers: 'prompt' = the whole prompt, as the server prefills; "
                             "'question' = all but its question, whose tokens then decode sparsely (stricter)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="smoke run: 1K tokens, short prompts, one depth")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default OUT_DIR/quality-<date>.json)")
    parser.add_argument(
        "--out-dir", type=Path, default=REPO / "benchmark" / "results", help="where quality-<date>.json goes"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.budgets, args.lengths, args.depths = 1024, [256, 512], [1024], [0.5]
    torch.manual_seed(args.seed)
    for selector, why in LEFT_OUT_SELECTORS.items():
        print(f"quality: selector {selector!r} left out: {why}", flush=True)
    start = time.monotonic()
    tokenizer, model = load_model()
    scale = model.model.layers[0].self_attn.scaling

    ids = license_tokens(tokenizer, args.tokens)
    print(f"Q2: capturing {len(ids)} tokens ...", flush=True)
    cap = capture(model, torch.tensor([ids]), args.queries)
    pk_policies = passkey_policies()
    policies = recall_policies(args.budgets, pk_policies)
    recall = recall_table(cap, policies, scale)
    print(f"Q2 done at {time.monotonic() - start:.0f} s; Q3 ...", flush=True)

    passkey = passkey_table(tokenizer, model, args.lengths, args.depths, pk_policies, args.new_tokens, args.seed,
                            args.passkey_prefill)  # fmt: skip
    result = {
        **run_header("benchmark.quality", argv, device="cpu"),
        "model": "SmolLM2-135M-Instruct (bf16 weights, run in float32, transformers, CPU)",
        "torch_threads": torch.get_num_threads(),
        "recall_setup": {"tokens": len(ids), "queries": args.queries, "text": str(LICENSES), "page_size": PAGE_SIZE,
                         "recall": "dense softmax mass on the selected pages, per query head; mean over queries "
                                   "and heads per layer, then over layers",
                         "rel_err": "|o_sparse - o_dense| / |o_dense| per query head, same averaging",
                         "selectors_left_out": LEFT_OUT_SELECTORS},
        "recall": recall,
        "passkey_setup": {"lengths": args.lengths, "depths": args.depths, "new_tokens": args.new_tokens,
                          "seed": args.seed, "default_policy": asdict(Policy()),
                          "policies": [{"name": p.name, **asdict(p)} for p in pk_policies], "filler": FILLER.strip(),
                          "prefill": args.passkey_prefill, "protocol": PASSKEY_PROTOCOLS[args.passkey_prefill]},
        "passkey": passkey,
    }  # fmt: skip
    result["summary"] = summarize_results(recall, passkey, pk_policies, len(ids), args.passkey_prefill)
    result["run_time_s"] = round(time.monotonic() - start, 1)
    out = args.out or args.out_dir / f"quality-{result['date']}.json"
    save_result(result, out)
    print_tables(result)
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
