"""Every sparse-sglang knob, in one frozen dataclass.

Each field becomes one ``--sparse-<name>`` flag (underscores become dashes); its
``help`` metadata is the flag's help text and the README's flags table. The
dataclass validates itself on construction, so an invalid value never gets
past start-up: :class:`SparseConfigError` names the flag and the reason in one
line, which ``sparse_sglang.launch_server`` prints before exiting with status 2.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

# Page scorers the sparse decode path knows: quest (Quest: Query-Aware Sparsity for Efficient
# Long-Context LLM Inference, https://arxiv.org/abs/2406.10774), arkvale (ArkVale: Efficient
# Generative LLM Inference with Recallable Key-Value Eviction, NeurIPS 2024), mean, and sketch
# (docs/decisions/0015-key-sketch-selection.md).
SELECTORS = ("quest", "arkvale", "mean", "sketch")
# How a kv head's query heads' page scores become its one choice (sparse_sglang.attention.selectors).
GROUP_REDUCES = ("sum", "max")
# Storage of the page key bounds (sparse_sglang.mem_cache.summaries; kept here so the config
# imports no torch).
BOUND_FORMATS = ("auto", "exact", "int8")
# What a page's two key corners are (sparse_sglang.mem_cache.summaries): Quest's channel-wise
# min and max, or the keys' mean less and plus a spread of standard deviations.
PAGE_BOUNDS = ("minmax", "meanstd")
RERANK_BY = ("keys", "sketch", "quantized")
# Bits per channel the quantized re-rank's key codes may have (sparse_sglang.mem_cache.key_codes).
KEY_CODE_BITS = (2, 4)
# The kernel attending the selected pages (sparse_sglang.attention.sparse_decode, .xqa).
DECODE_KERNELS = ("flashinfer", "xqa")
XQA_PAGE_SIZES = (16, 32, 64, 128)  # the page sizes XQA's kernels take

# Without --sparse-host-cache-gb the host KV store takes what its requests can use, at most this
# share of the RAM available at start-up: the rest stays for the OS, the tokenizer and detokenizer
# processes and pinned staging buffers (mem_cache/plan.py: host_store_by_need).
HOST_STORE_RAM_SHARE = 0.5

# Tokens of one chunk of SGLang's chunked prefill that the default
# layer-segmented injection budget matches (tokens x layers per iteration).
PREFILL_CHUNK_TOKENS_EQUIVALENT = 2048

# SGLang's --chunked-prefill-size when --sparse-segmented-prefill is on and the user gave none:
# the in-layer chunk of the hybrid. A chunk's activations dominate a long prefill's GPU memory
# (the 8B shape: ~0.9 GiB at SGLang's 8192-token default, against 0.5 GiB for one layer of a 128K
# prompt's KV), so the segmented default halves it.
SEGMENTED_CHUNK_TOKENS = 4096

GIB = 1 << 30

# --sparse-save-staging-buffers at most: one per layer of the deepest models served, well past
# what lets a prefill's launch run a whole forward ahead of the host's scatter.
MAX_SAVE_STAGING_BUFFERS = 256

# --sparse-budget-share (sparse_sglang.attention.budget_share): a head's budget counts UNITS units
# of pages; every head keeps SHARE_FLOOR_UNITS of them and takes at most SHARE_CAP_UNITS.
SHARE_UNITS, SHARE_FLOOR_UNITS, SHARE_CAP_UNITS = 4, 2, 5


class SparseConfigError(ValueError):
    """An invalid sparse knob: ``field`` names it, ``reason`` says why, in one line.

    The caller chooses how knobs are named: ``str(err)`` names fields as Python spells them
    (``token_budget: must be positive, got -1``), :meth:`named` with a prefix as a containing
    object does (``sparse.token_budget``, ``sparse_sglang.Engine(sparse={...})``), and
    :meth:`cli_message` by their flags (``--sparse-token-budget``). A reason that mentions another
    knob does so through :func:`mention`, so that knob is named the same way.
    """

    def __init__(self, field: str, reason: str, *, prefix: str = ""):
        self.field, self.reason, self.prefix = field, reason, prefix
        super().__init__(self.render(lambda name: prefix + name))

    @property
    def flag(self) -> str:
        return flag_name(self.field)

    def render(self, name_of) -> str:
        """The message with every knob (this one first) named by ``name_of(field)``."""
        return f"{name_of(self.field)}: {render_mentions(self.reason, name_of)}"

    def cli_message(self) -> str:
        return self.render(flag_name)

    def named(self, prefix: str) -> SparseConfigError:
        """The same error naming knobs as fields of a containing object (``prefix`` = ``"sparse."``)."""
        return SparseConfigError(self.field, self.reason, prefix=prefix)


# A knob named inside a reason; user values are shown with repr() or as numbers, which never
# carry this control character, so a value cannot be mistaken for a mention.
_MENTION = re.compile("\x1f(\\w+)\x1f")


def mention(field: str) -> str:
    """Another knob, inside a :class:`SparseConfigError` reason."""
    return f"\x1f{field}\x1f"


def render_mentions(reason: str, name_of) -> str:
    """``reason`` with each :func:`mention` of a knob replaced by ``name_of(field)``."""
    return _MENTION.sub(lambda m: name_of(m[1]), reason)


def flag_name(name: str) -> str:
    """CLI flag of a SparseConfig field: ``token_budget`` -> ``--sparse-token-budget``."""
    return "--sparse-" + name.replace("_", "-")


# Integer knobs size or index int32 tensors on the GPU (page ids, row widths, step counters).
INT32_MAX = 2**31 - 1


def machine_ram_bytes() -> tuple[int, int]:
    """(total, available) RAM of this machine in bytes."""
    pages = os.sysconf("SC_PHYS_PAGES")
    page = os.sysconf("SC_PAGE_SIZE")
    available = pages * page
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    return pages * page, available


def knob(default: Any = dataclasses.MISSING, *, help: str, default_factory: Any = dataclasses.MISSING):
    """A dataclass field carrying its flag's help text."""
    if default_factory is not dataclasses.MISSING:
        return field(default_factory=default_factory, metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True, slots=True)
class SparseConfig:
    enabled: bool = knob(
        True, help="Serve decode with sparse attention over the per-head KV hierarchy; false = plain SGLang."
    )
    page_size: int = knob(32, help="Tokens per per-(layer, kv-head) KV page; a power of two.")
    token_budget: int = knob(
        2048,
        help="KV tokens each kv head attends to per decode step; a multiple of the page size. Contexts up to this length decode densely (exact).",
    )
    selector: str = knob("quest", help=f"Page scorer: {' | '.join(SELECTORS)}.")
    group_reduce: str = knob(
        "sum",
        help=f"How the query heads sharing a kv head combine their page scores: {' | '.join(GROUP_REDUCES)}. sum = the group's total; max = a page any head of the group scores high.",
    )
    bound_format: str = knob(
        "auto",
        help=f"How the GPU keeps each page's key bounds: {' | '.join(BOUND_FORMATS)}. exact = in the KV dtype; int8 = half the bytes of bf16 bounds, rounded outward so they still bound every key; auto = int8 for 16-bit KV, exact for fp8.",
    )
    page_bounds: str = knob(
        "meanstd",
        help=f"The two key corners each page keeps for scoring: {' | '.join(PAGE_BOUNDS)}. minmax = every key's channel-wise min and max (Quest: an upper bound of q . k); meanstd = the keys' channel-wise mean less and plus --sparse-bound-spread standard deviations (the same bytes and scoring cost; ranks pages by their keys' spread, not by their most extreme one).",
    )
    bound_spread: float = knob(
        1.0, help="meanstd page bounds: standard deviations from each page's mean key to its corners."
    )
    coarse_pages: int = knob(
        0,
        help="Coarse-first selection: S > 0 scores super-pages of S pages from their joint key bounds, then page by page only within the best ones (reads ~1/S of the bounds, keeps a second set of them); 0 = score every page.",
    )
    coarse_candidates: float = knob(
        4.0,
        help="Coarse-first selection: pages the coarse pass keeps for the fine one, as a multiple of the budget's pages (rounded up to whole super-pages).",
    )
    coarse_min_pages: int = knob(
        24576,
        help="Coarse-first selection runs on decode steps where it spares the page-by-page score at least this many pages (batch x pages past the candidates).",
    )
    sketch_rank: int | None = knob(
        None,
        help="sketch selector: directions each key is projected onto for scoring (kept on the GPU for every token); auto = the key basis's, head_dim / 4 when fitted here.",
    )
    key_basis: str | None = knob(
        None,
        help="sketch selector: the key basis file (python -m sparse_sglang.calibrate); auto = MODEL/sparse_key_basis.safetensors (fitted on first start for the default model; random for dummy weights).",
    )
    sink_pages: int = knob(1, help="Leading pages every decode step keeps (attention sinks).")
    recent_pages: int = knob(2, help="Newest pages every decode step keeps, the partial newest page included (>= 1).")
    exact_shortcut: bool = knob(
        True,
        help="Skip scoring when every request's context fits in the budget (all pages are attended anyway); false checks the selection machinery.",
    )
    decode_cuda_graph: bool = knob(
        True,
        help="Capture decode steps in SGLang's CUDA graphs (budgets too wide for the fused kernels, above ~4K tokens, decode eagerly); false = eager decode.",
    )
    prefill_cuda_graph: bool = knob(
        False,
        help="Run prefill under SGLang's breakable CUDA graphs: the layers' work between attention calls replays from graphs, attention (which saves KV to the host) runs eagerly between them, as it does for plain SGLang; false = eager prefill.",
    )
    reselect_interval: int = knob(
        1,
        help="Decode steps one page selection serves (LServe's reuse): in between, each kv head picks its top pages among those its GPU cache row holds, plus the sink and recent pages; 1 = select every step.",
    )
    rerank_factor: int = knob(
        1,
        help="Re-rank: score F x the budget's pages from the summaries and attend the budget's pages among them that --sparse-rerank-by ranks highest; 1 = off.",
    )
    rerank_by: str = knob(
        "keys",
        help=f"What re-ranks the candidates: {' | '.join(RERANK_BY)}. keys = their exact attention mass (loads every candidate's KV); sketch = their best token's key sketch (kept on the GPU for every token, as --sparse-selector sketch keeps them; loads only the pages attended); quantized = their attention mass from every key kept on the GPU in --sparse-rerank-key-bits per channel between its page's min and max (loads only the pages attended).",
    )
    rerank_key_bits: int = knob(
        2,
        help=f"Bits per channel of the keys the quantized re-rank reads: {' | '.join(map(str, KEY_CODE_BITS))}.",
    )
    budget_share: bool = knob(
        False,
        help="Share each layer's pages among its kv heads by estimated attention mass: every head keeps its best half of the budget, and the layer's other pages go, a quarter budget at a time, to the heads whose next pages hold the most mass (up to 1.25x the budget per head); the same pages per layer in total, the same summaries.",
    )
    decode_kernel: str = knob(
        "flashinfer",
        help=f"The kernel attending the selected pages: {' | '.join(DECODE_KERNELS)}. flashinfer = FlashInfer's paged decode; xqa = FlashInfer's XQA decode (fp8 KV, Hopper and newer GPUs): faster over fp8 pages, but it rounds the queries and the attention probabilities to fp8 as well.",
    )
    cache_row_ratio: float = knob(
        1.25,
        help="Fewest GPU page-cache slots a running request keeps per (layer, kv head), as a multiple of one step's selection: it sets how many requests fit; rows grow into free slots (up to 4x) while fewer run.",
    )
    cache_lru_buckets: int = knob(
        0,
        help="GPU page-cache replacement order: 0 = exact LRU; N > 0 = SPIN's bucketed LRU, last uses counted in N buckets of --sparse-cache-lru-steps-per-bucket decode steps.",
    )
    cache_lru_steps_per_bucket: int = knob(
        1, help="Bucketed LRU (--sparse-cache-lru-buckets > 0): decode steps one bucket spans."
    )
    working_set_admission: bool = knob(
        False,
        help="SparseServe's Algorithm 1: admit a waiting request only while the running requests' working sets plus a row for it fit the GPU page cache, and retract running requests when their working sets outgrow it.",
    )
    working_set_window: int = knob(
        12, help="Decode steps over which a request's selected pages form its working set (SparseServe's w)."
    )
    gpu_cache_gb: float | None = knob(
        None, help="HBM (GiB) for cached KV pages; auto = what SGLang's --mem-fraction-static leaves for KV."
    )
    host_cache_gb: float | None = knob(
        None,
        help=f"Pinned host RAM (GiB) holding all KV, the server's total (--tp-size ranks and --dp-size replicas split it); auto = what the requests the GPU page cache runs at once need for the model's whole context, at most {HOST_STORE_RAM_SHARE:.0%} of the RAM available at start-up (the start-up log says what it chose and why).",
    )
    segmented_prefill: bool = knob(
        False,
        help="Layer-segmented prefill (SparseServe): a prefill batch runs a few layers per scheduler iteration beside one decode step, so decodes never wait for a whole long prompt.",
    )
    max_inject_tokens: int | None = knob(
        None,
        help=f"Layer-segmented prefill: prompt tokens x layers run per iteration; auto = {PREFILL_CHUNK_TOKENS_EQUIVALENT} x the model's layers (what one {PREFILL_CHUNK_TOKENS_EQUIVALENT}-token chunk of chunked prefill costs).",
    )
    tbt_target_ms: float | None = knob(
        None,
        help="Size each prefill step so one decode step plus it take about this long (milliseconds, measured as the server runs): a layer segment under --sparse-segmented-prefill (unset: --sparse-max-inject-tokens alone), a chunk's tokens under --sparse-interleave-prefill (at most --chunked-prefill-size; unset: that size).",
    )
    interleave_prefill: bool = knob(
        False,
        help="While requests decode, run one decode step between any two prefill batches, so decodes wait for at most one prefill chunk (SGLang's --chunked-prefill-size bounds its time) instead of every pending chunk; SGLang's overlap scheduler stays on. Layer-segmented prefill is the finer-grained alternative.",
    )
    prefix_staging_tokens: int = knob(
        16384,
        help="Cached-prefix tokens a prefill stages from the host into GPU memory at once, per layer: a longer prefix is attended in pieces of half this size, one loading while the other is attended.",
    )
    resident_prefix_tokens: int = knob(
        0,
        help="Prefix tokens of the prompt being prefilled kept in GPU memory between its chunks (every layer, whole pages), so each chunk stages from the host only what the chunk before it added instead of its whole prefix; the bytes come out of the page cache. 0: off.",
    )
    save_staging_buffers: int = knob(
        4,
        help="Pinned host buffers a prefill's new K/V passes through on its way into host pages, one layer each: a prefill's launch runs at most this many layers ahead of the threads that scatter them (each buffer holds one layer's K and V of up to 8192 tokens).",
    )

    def __post_init__(self) -> None:
        self._check_types()
        self._check_finite_and_bounded()
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise SparseConfigError("page_size", f"must be a power of two, got {self.page_size}")
        if self.token_budget <= 0:
            raise SparseConfigError("token_budget", f"must be positive, got {self.token_budget}")
        if self.token_budget % self.page_size:
            raise SparseConfigError(
                "token_budget",
                f"must be a multiple of {mention('page_size')} ({self.page_size}), got {self.token_budget}",
            )
        if self.bound_format not in BOUND_FORMATS:
            raise SparseConfigError(
                "bound_format", f"must be one of {', '.join(BOUND_FORMATS)}; got {self.bound_format!r}"
            )
        if self.group_reduce not in GROUP_REDUCES:
            raise SparseConfigError(
                "group_reduce", f"must be one of {', '.join(GROUP_REDUCES)}; got {self.group_reduce!r}"
            )
        if self.page_bounds not in PAGE_BOUNDS:
            raise SparseConfigError("page_bounds", f"must be one of {', '.join(PAGE_BOUNDS)}; got {self.page_bounds!r}")
        if not self.bound_spread > 0:
            raise SparseConfigError("bound_spread", f"must be positive, got {self.bound_spread}")
        if self.selector not in SELECTORS:
            raise SparseConfigError("selector", f"must be one of {', '.join(SELECTORS)}; got {self.selector!r}")
        if self.sketch_rank is not None and self.sketch_rank < 1:
            raise SparseConfigError("sketch_rank", f"must be >= 1, got {self.sketch_rank}")
        if self.selector == "sketch" and self.group_reduce != "sum":
            raise SparseConfigError(
                "group_reduce",
                f"the sketch selector scores the group's summed query: use sum with {mention('selector')} sketch",
            )
        if self.selector == "sketch" and self.coarse_pages:
            raise SparseConfigError(
                "coarse_pages", f"coarse-first selection scores from key bounds: not with {mention('selector')} sketch"
            )
        if self.key_basis is not None and not os.path.isfile(self.key_basis):
            raise SparseConfigError("key_basis", f"no such file: {self.key_basis!r}")
        if self.sink_pages < 0:
            raise SparseConfigError("sink_pages", f"must be >= 0, got {self.sink_pages}")
        if self.recent_pages < 1:
            raise SparseConfigError(
                "recent_pages", f"must be >= 1 (the newest page is always attended), got {self.recent_pages}"
            )
        budget_pages = self.token_budget // self.page_size
        if self.sink_pages >= budget_pages:  # the sink alone leaves no room for the newest page
            raise SparseConfigError(
                "sink_pages",
                f"{self.sink_pages} pages leave no room for the newest page in the token budget's "
                f"{budget_pages} pages ({mention('token_budget')} {self.token_budget})",
            )
        if self.sink_pages + self.recent_pages > budget_pages:
            raise SparseConfigError(
                "recent_pages",
                f"sink ({self.sink_pages}) + recent ({self.recent_pages}) pages exceed the "
                f"token budget's {budget_pages} pages",
            )
        if self.coarse_pages < 0 or self.coarse_pages & (self.coarse_pages - 1):
            raise SparseConfigError("coarse_pages", f"must be 0 (off) or a power of two, got {self.coarse_pages}")
        if self.coarse_min_pages < 0:
            raise SparseConfigError("coarse_min_pages", f"must be >= 0, got {self.coarse_min_pages}")
        if self.coarse_candidates < 1:
            raise SparseConfigError(
                "coarse_candidates",
                f"must be >= 1 (the fine pass needs a budget's pages), got {self.coarse_candidates}",
            )
        if self.reselect_interval < 1:
            raise SparseConfigError("reselect_interval", f"must be >= 1, got {self.reselect_interval}")
        if self.rerank_factor < 1:
            raise SparseConfigError("rerank_factor", f"must be >= 1 (1 = off), got {self.rerank_factor}")
        if self.rerank_by not in RERANK_BY:
            raise SparseConfigError("rerank_by", f"must be one of {', '.join(RERANK_BY)}; got {self.rerank_by!r}")
        if self.rerank_key_bits not in KEY_CODE_BITS:
            raise SparseConfigError("rerank_key_bits", f"must be one of {', '.join(map(str, KEY_CODE_BITS))}; "
                                                       f"got {self.rerank_key_bits}")  # fmt: skip
        if self.rerank_by == "sketch" and self.rerank_factor > 1 and self.selector == "sketch":
            raise SparseConfigError("rerank_by", f"the candidates of {mention('selector')} sketch are ranked by "
                                                 "their sketches already: re-rank by keys, or pick another selector")  # fmt: skip
        if self.cache_row_ratio < 1:
            raise SparseConfigError(
                "cache_row_ratio",
                f"must be >= 1 (a row holds at least one step's selection), got {self.cache_row_ratio}",
            )
        if self.decode_kernel not in DECODE_KERNELS:
            raise SparseConfigError("decode_kernel", f"must be one of {', '.join(DECODE_KERNELS)}; "
                                                     f"got {self.decode_kernel!r}")  # fmt: skip
        if self.decode_kernel == "xqa" and self.page_size not in XQA_PAGE_SIZES:
            raise SparseConfigError("page_size", f"{mention('decode_kernel')} xqa takes pages of "
                                                 f"{', '.join(map(str, XQA_PAGE_SIZES))} tokens; got {self.page_size}")  # fmt: skip
        if self.budget_share:
            self._check_budget_share(budget_pages)
        # multiples of the budget's pages, as int32 widths
        for name in ("cache_row_ratio", "coarse_candidates", "rerank_factor"):
            if getattr(self, name) * budget_pages > INT32_MAX:
                raise SparseConfigError(name, f"{getattr(self, name):g} x the budget's {budget_pages} pages "
                                              f"exceeds {INT32_MAX} pages")  # fmt: skip
        if self.cache_lru_buckets < 0:
            raise SparseConfigError("cache_lru_buckets", f"must be >= 0 (0 = exact LRU), got {self.cache_lru_buckets}")
        if self.cache_lru_steps_per_bucket < 1:
            raise SparseConfigError(
                "cache_lru_steps_per_bucket", f"must be >= 1, got {self.cache_lru_steps_per_bucket}"
            )
        if self.working_set_window < 1:
            raise SparseConfigError("working_set_window", f"must be >= 1, got {self.working_set_window}")
        if self.gpu_cache_gb is not None and self.gpu_cache_gb <= 0:
            raise SparseConfigError("gpu_cache_gb", f"must be positive, got {self.gpu_cache_gb}")
        if self.host_cache_gb is not None and self.host_cache_gb <= 0:
            raise SparseConfigError("host_cache_gb", f"must be positive, got {self.host_cache_gb}")
        total, _ = machine_ram_bytes()
        if self.host_cache_gb is not None and self.host_cache_gb * GIB > total:
            raise SparseConfigError(
                "host_cache_gb",
                f"{self.host_cache_gb:g} GiB is more than this machine's RAM ({total / GIB:.1f} GiB)",
            )
        if self.max_inject_tokens is not None and self.max_inject_tokens <= 0:
            raise SparseConfigError("max_inject_tokens", f"must be positive, got {self.max_inject_tokens}")
        if self.tbt_target_ms is not None and self.tbt_target_ms <= 0:
            raise SparseConfigError("tbt_target_ms", f"must be positive, got {self.tbt_target_ms}")
        if self.tbt_target_ms is not None and not (self.segmented_prefill or self.interleave_prefill):
            raise SparseConfigError(
                "tbt_target_ms",
                f"paces layer-segmented or interleaved prefill: set {mention('segmented_prefill')} "
                f"or {mention('interleave_prefill')} true",
            )
        if self.interleave_prefill and self.segmented_prefill:
            raise SparseConfigError(
                "interleave_prefill",
                f"{mention('segmented_prefill')} already runs a decode step beside each layer segment: set one of them",
            )
        if self.prefill_cuda_graph and self.segmented_prefill:
            raise SparseConfigError(
                "prefill_cuda_graph",
                f"{mention('segmented_prefill')} runs a prefill a few layers at a time, outside the graphs: set one of them",
            )
        if self.prefix_staging_tokens < 2 * self.page_size:  # two buffers of a page at least
            raise SparseConfigError("prefix_staging_tokens",
                                    f"must hold at least two pages ({2 * self.page_size} tokens), got {self.prefix_staging_tokens}")  # fmt: skip
        if not 1 <= self.save_staging_buffers <= MAX_SAVE_STAGING_BUFFERS:
            raise SparseConfigError(
                "save_staging_buffers", f"must be 1-{MAX_SAVE_STAGING_BUFFERS}, got {self.save_staging_buffers}"
            )
        if self.resident_prefix_tokens < 0 or self.resident_prefix_tokens % self.page_size:
            raise SparseConfigError("resident_prefix_tokens", f"must be 0 or whole pages of {self.page_size} tokens, "
                                                              f"got {self.resident_prefix_tokens}")  # fmt: skip

    def _check_budget_share(self, budget_pages: int) -> None:
        share = mention("budget_share")
        if budget_pages % SHARE_UNITS:
            raise SparseConfigError("token_budget", f"{share} counts a head's budget in quarters: the budget's "
                                                    f"{budget_pages} pages must be a multiple of {SHARE_UNITS}")  # fmt: skip
        floor = budget_pages // SHARE_UNITS * SHARE_FLOOR_UNITS
        if self.sink_pages + self.recent_pages > floor:
            raise SparseConfigError("recent_pages", f"sink ({self.sink_pages}) + recent ({self.recent_pages}) pages "
                                                    f"exceed the {floor} pages every head keeps under {share}")  # fmt: skip
        if self.cache_row_ratio * SHARE_UNITS < SHARE_CAP_UNITS:
            raise SparseConfigError("cache_row_ratio", f"{share} attends up to {SHARE_CAP_UNITS / SHARE_UNITS:g}x "
                                                       f"the budget per head: must be >= that, got {self.cache_row_ratio:g}")  # fmt: skip
        for name, off, value in (("rerank_factor", 1, self.rerank_factor), ("coarse_pages", 0, self.coarse_pages),
                                 ("decode_kernel", "flashinfer", self.decode_kernel)):  # fmt: skip
            if value != off:
                raise SparseConfigError(name, f"{share} runs without it: must be {off}, got {value}")
        if self.selector == "sketch":
            raise SparseConfigError("selector", f"{share} shares pages by their corner bounds' mass: quest, arkvale "
                                                f"or mean, got 'sketch'")  # fmt: skip

    def _check_types(self) -> None:
        # Frozen dataclasses do not check annotations; a config built from code
        # (not the CLI, which converts) must still fail with the field's name.
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            base = field_type(f)
            if value is None and is_optional(f):
                continue
            ok = isinstance(value, base) and not (base is not bool and isinstance(value, bool))
            if base is float and isinstance(value, int) and not isinstance(value, bool):
                ok = True
            if not ok:
                raise SparseConfigError(f.name, f"must be {base.__name__}, got {value!r}")

    def _check_finite_and_bounded(self) -> None:
        # Every comparison below is false for NaN, and an infinity overflows the sizing arithmetic
        # (math.ceil), so non-finite numbers are refused first; integers must fit int32.
        for f in dataclasses.fields(self):
            value, base = getattr(self, f.name), field_type(f)
            if base is float and value is not None and not math.isfinite(value):
                raise SparseConfigError(f.name, f"must be a finite number, got {value}")
            if base is int and value is not None and abs(value) > INT32_MAX:
                raise SparseConfigError(f.name, f"must be at most {INT32_MAX} in magnitude, got {value}")

    @classmethod
    def from_fields(cls, fields: dict[str, Any]) -> SparseConfig:
        """A config from a dict of field values (the Python API); an unknown key is an error naming it."""
        known = [f.name for f in dataclasses.fields(cls)]
        for name in fields:
            if name not in known:
                raise SparseConfigError(name, f"is not a sparse knob (they are: {', '.join(known)})")
        return cls(**fields)

    def coarse_supers(self, selected_pages: int) -> int:
        """Super-pages the coarse pass keeps when a step selects ``selected_pages`` pages."""
        return math.ceil(self.coarse_candidates * selected_pages / self.coarse_pages)

    def coarse_pays(self, batch: int, max_pages: int, selected_pages: int) -> bool:
        """Whether a step of ``batch`` requests holding up to ``max_pages`` pages takes the
        coarse-first path (``--sparse-coarse-min-pages``)."""
        if not self.coarse_pages:
            return False
        kept = self.coarse_supers(selected_pages) * self.coarse_pages
        return batch * (max_pages - kept) >= max(1, self.coarse_min_pages)

    @property
    def budget_pages(self) -> int:
        """Pages each kv head attends to per decode step."""
        return self.token_budget // self.page_size

    @property
    def candidate_pages(self) -> int:
        """Pages each kv head loads per decode step: the budget's, or with re-ranking by keys
        ``rerank_factor`` times that (the budget's pages with the most exact mass are attended)."""
        return self.budget_pages * (self.rerank_factor if self.rerank_by == "keys" else 1)

    def reranked_by(self, what: str) -> int:
        """Pages each kv head's candidates number per decode step when ``what`` re-ranks them:
        ``rerank_factor`` times the budget's, or 0 when re-ranking is off or by something else."""
        return self.budget_pages * self.rerank_factor if self.rerank_by == what and self.rerank_factor > 1 else 0

    @property
    def sketch_candidates(self) -> int:
        """Pages each kv head's key sketches re-rank per decode step (0: none)."""
        return self.reranked_by("sketch")

    @property
    def code_candidates(self) -> int:
        """Pages each kv head's key codes re-rank per decode step (0: none)."""
        return self.reranked_by("quantized")

    @property
    def key_code_bits(self) -> int:
        """Bits per channel of the key codes the GPU keeps (0: none; the quantized re-rank reads them)."""
        return self.rerank_key_bits if self.code_candidates > 0 else 0

    @property
    def keeps_key_sketches(self) -> bool:
        """Whether the GPU keeps every token's key sketch: the sketch selector scores them, the
        sketch re-rank reads its candidates'."""
        return self.selector == "sketch" or self.sketch_candidates > 0

    def inject_tokens(self, num_layers: int) -> int:
        """Layer-segmented prefill budget (tokens x layers per iteration) for a model."""
        return self.max_inject_tokens or PREFILL_CHUNK_TOKENS_EQUIVALENT * num_layers

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


_TYPES = {"bool": bool, "int": int, "float": float, "str": str}


def field_type(f: dataclasses.Field) -> type:
    """The scalar type of a SparseConfig field (``int | None`` -> ``int``)."""
    return _TYPES[str(f.type).split("|")[0].strip()]


def is_optional(f: dataclasses.Field) -> bool:
    return "None" in str(f.type)
