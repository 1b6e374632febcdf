"""Answers on real text: RULER-style tasks through the real servers, what sparse keeps of dense's answers.

Items are generated offline, seeded, from prose any Debian + Python machine has (the license
texts of ``/usr/share/common-licenses`` and the docstrings of the Python standard library),
deduplicated paragraph by paragraph, so no sentence repeats and a needle is one distinct
statement among many. Families (after RULER, Hsieh et al. 2024):

- ``niah_single``: one needle ``One of the special magic {kind} for {key} is: {value}.``, the value a
  7-digit number, a UUID or a word (by item);
- ``niah_multikey``: the same, with three distractor needles of the same phrasing and other keys;
- ``niah_multivalue``: four needles of one key, four values, all asked for;
- ``niah_multiquery``: four needles of four keys, all four asked for;
- ``vt``: variable tracking, a chain ``VAR A = 12345``, ``VAR B = VAR A``, ... spread over the text;
- ``cwe``: common word extraction over a numbered list of words drawn from the text's vocabulary;
- ``fwe``: frequent word extraction over Zipf-distributed coded words;
- ``qa``: a passage of numbered documents (real paragraphs); which word is missing from a sentence
  quoted from one of them (a span of the passage, unique in the prompt).

Each prompt is wrapped in the model's chat template and ends with an answer prefix, as RULER
does. Scoring follows RULER: ``all`` (the share of the references the output contains) or
``part`` (any reference), case-insensitive; an item is *fully right* at score 1.0.

What the suite measures is retention, item by item: what a user loses is the answers plain SGLang
(dense) gets right that sparse decode gets wrong. Dense and each sparse configuration answer the
same items one request at a time (``alone``: concurrency 1, radix cache off, so every answer is
the same each time). In a cell (family x length x compression), of the items dense answers fully
right, retention is the share the configuration answers fully right too; a *new error* is an item
dense gets fully right and sparse not, a *new correct* the reverse. For the multi-value families
(``niah_multivalue``, ``niah_multiquery``), value retention: of the reference values dense's
output holds, the share sparse's holds too, pooled over values. A family is *judged* when dense
answers at least ``JUDGED_SHARE`` of its items fully right; pooled numbers are over judged families
only. The CPU reference's ``oracle`` policy (the pages with the most true attention mass) is held
against the dense server's answers the same way: the ceiling of page selection. Plain SGLang under
other flags (``grid --vanilla-configs``, e.g. fp8 KV) is held against dense the same way, over all
its items (``retention_by_vanilla_config``): what those flags alone cost a user, apart from page
selection (the serving headline's fp8 KV, for one). The summary
reports the held-out items (``--seed 1``, ``HELD_OUT_SEED``; ``DEV_SEED`` 0 is what changes were
tried on), each run's missing items, and ``check`` holds it to ``BARS``. Every run records what it
is (``config``, ``alone``, ``budget``, ``vanilla``) and runs are paired by that, not by their names.
The earlier measure, agreement (the answer :func:`answer` reads from the output equal to dense's),
stays under ``legacy``.

    python -m benchmark.accuracy generate --seed 1 --out items.json.gz          # the held-out items (CPU, ~2 min)
    python -m benchmark.accuracy grid --items items.json.gz --out-dir acc --parallel 9 \
        --configs "quest=--sparse-selector quest"     # dense-alone-<len>, <config>-alone-<budget>, headline-alone-<budget>
    python -m benchmark.accuracy reference --items items.json.gz --budget 512 --lengths 2048 --per-cell 6 \
        --policy oracle=rerank_factor:4 --name oracle-512 --out acc/oracle-512.reference.json
    python -m benchmark.accuracy summarize acc/*.json --items items.json.gz     # benchmark/results/accuracy-<date>.json
    python -m benchmark.accuracy check benchmark/results/accuracy-<date>.json   # exit 1 naming the first bar short
    python -m benchmark.accuracy serve --items items.json.gz --name quest-alone-512 --config quest --alone \
        --budget 512 --server-args "--sparse-selector quest" --out quest-alone-512.json    # one run by hand

``serve`` starts the server itself (``sparse_sglang.launch_server``, or ``sglang.launch_server``
with ``--vanilla``) on the default model unless ``--url`` names a running one; with ``--budget``
it runs the lengths that budget compresses 4-32x (``--lengths`` narrows them). ``reference`` runs
the same items through the pure-torch reference of sparse decode (``benchmark/quality.py``'s
decoder: transformers, float32, exact page bounds unless ``--bound-format int8``); at 4x,
``rerank_factor:4`` makes every page a candidate, so its re-rank is the oracle. ``unpack`` turns a
result file back into run files, to summarize new runs against its dense ones (``--grid final``
is the grid of the first results, batched runs included).
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import hashlib
import inspect
import json
import random
import re
import string
import sys
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LICENSES = Path("/usr/share/common-licenses")
# Standard-library modules whose docstrings are prose (the API reference's own words).
DOC_MODULES = (
    "abc argparse array asyncio base64 bisect builtins calendar cmath codecs collections concurrent.futures "
    "configparser contextlib copy csv dataclasses datetime decimal difflib email enum fnmatch fractions "
    "functools gettext glob gzip hashlib heapq hmac html http.client http.server imaplib inspect io ipaddress "
    "itertools json locale logging mailbox math mimetypes multiprocessing numbers operator optparse os "
    "pathlib pickle pkgutil platform plistlib poplib pprint queue random re sched secrets selectors shelve "
    "shlex shutil signal smtplib socket socketserver sqlite3 ssl statistics string struct subprocess "
    "tarfile tempfile textwrap threading time timeit tkinter tokenize traceback types typing unittest "
    "urllib.parse urllib.request uuid warnings weakref xml.dom xml.etree.ElementTree zipfile zlib"
).split()

FAMILIES = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa")
LENGTHS = (2048, 4096, 8000)  # prompt tokens; SmolLM2's context is 8192, answers included
COMPRESSIONS = (4, 8, 16, 32)  # context / budget
NEW_TOKENS = {"niah_single": 32, "niah_multikey": 32, "niah_multivalue": 64, "niah_multiquery": 64,
              "vt": 48, "cwe": 64, "fwe": 32, "qa": 16}  # fmt: skip
LENGTH_SLACK = 0.03  # a prompt holds between (1 - slack) x its length and its length in tokens
GIVE_UP = 5  # items failing in a row after which a run stops sending
DEV_SEED = 0  # the items the suite was developed and tuned on
HELD_OUT_SEED = 1  # the items the summary reports (generate --seed 1): no change was chosen by its answers
MULTI_VALUE = ("niah_multivalue", "niah_multiquery")  # families asking for four values, scored per value too
# A family is judged when dense answers at least this share of its items fully right; on the others
# dense is right too rarely for what sparse keeps of it to mean anything.
JUDGED_SHARE = 0.10


# Corpus: real prose, one paragraph per entry, no paragraph twice.


def _paragraphs(text: str) -> list[str]:
    out = []
    for block in re.split(r"\n\s*\n", text):
        para = " ".join(block.split())
        words = para.split()
        letters = sum(c.isalpha() for c in para)
        if len(words) >= 8 and letters >= 0.7 * len(para) and not para.startswith((">>>", "...")):
            out.append(para)
    return out


def _module_docs(name: str) -> list[str]:
    import importlib

    try:
        module = importlib.import_module(name)
    except Exception:  # noqa: BLE001 - a module a machine lacks (tkinter) simply adds nothing
        return []
    docs = [inspect.getdoc(module) or ""]
    for attr in sorted(vars(module)):
        obj = getattr(module, attr, None)
        if attr.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        docs.append(inspect.getdoc(obj) or "")
        if inspect.isclass(obj):
            docs += [
                inspect.getdoc(m) or "" for k, m in sorted(vars(obj).items()) if not k.startswith("_") and callable(m)
            ]
    return docs


def corpus() -> list[str]:
    """Deduplicated prose paragraphs, licenses first, then standard-library docstrings (fixed order).

    Read in a fresh interpreter without site-packages (``-S -s -P``), with a fixed hash seed and
    UTF-8 I/O. The docstrings come from live module objects, which imported packages change: torch
    replaces ``inspect.getfile``, transformers adds ``warning_once`` and others to
    ``logging.Logger``. Read in the calling process, the corpus (and so every item) would follow
    what that process had imported and which package versions its machine has."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(PYTHONHASHSEED="0", PYTHONUTF8="1")
    cmd = [sys.executable, "-S", "-s", "-P", str(Path(__file__).resolve()), "corpus"]
    return json.loads(subprocess.run(cmd, env=env, capture_output=True, check=True, text=True).stdout)


def corpus_here() -> list[str]:
    """:func:`corpus` as this process's modules give it (what the clean interpreter runs)."""
    texts = []
    if LICENSES.is_dir():
        texts += [
            p.read_text(encoding="utf-8", errors="replace")
            for p in sorted(LICENSES.iterdir())
            if p.is_file() and not p.is_symlink()
        ]
    for name in DOC_MODULES:
        texts += _module_docs(name)
    seen, out = set(), []
    for text in texts:
        for para in _paragraphs(text):
            if para not in seen:
                seen.add(para)
                out.append(para)
    return out


def corpus_digest(paragraphs: list[str]) -> str:
    """What two machines compare when their items differ: the same digest, the same text."""
    return hashlib.sha256("\n".join(paragraphs).encode()).hexdigest()[:16]


def vocabulary(paragraphs: list[str]) -> list[str]:
    """Lower-case words of 4-10 letters that occur at least twice in the corpus, sorted."""
    counts = Counter(w for p in paragraphs for w in re.findall(r"\b[a-z]{4,10}\b", p))
    return sorted(w for w, c in counts.items() if c >= 2)


# Items.


@dataclass
class Item:
    id: str
    family: str
    length: int  # the target prompt tokens (one of LENGTHS)
    prompt: str  # chat template applied, answer prefix included
    answers: list[str]
    metric: str  # "all" | "part"
    max_new_tokens: int
    prompt_tokens: int = 0
    detail: dict = field(default_factory=dict)


class Haystack:
    """Contiguous corpus paragraphs from a seeded start, with token counts known per paragraph."""

    def __init__(self, paragraphs: list[str], counts: list[int]):
        self.paragraphs, self.counts = paragraphs, counts

    def take(self, rng: random.Random, tokens: int) -> list[str]:
        """About ``tokens`` tokens of consecutive paragraphs, the last one cut at a word."""
        start = rng.randrange(len(self.paragraphs))
        out, total, i = [], 0, start
        while total < tokens:
            para, count = self.paragraphs[i % len(self.paragraphs)], self.counts[i % len(self.paragraphs)] + 1
            if total + count > tokens:  # keep the share of its words that fits
                words = para.split()
                para = " ".join(words[: max(1, len(words) * (tokens - total) // count)])
            out.append(para)
            total += count
            i += 1
        return out


def insert_at_depths(paragraphs: list[str], needles: list[tuple[float, str]]) -> list[str]:
    """Paragraphs with each needle inserted as its own paragraph at ``depth`` (0..1) of the text."""
    out = list(paragraphs)
    for depth, needle in sorted(needles, key=lambda n: -n[0]):
        out.insert(round(depth * len(paragraphs)), needle)
    return out


def _key(rng: random.Random, vocab: list[str], taken: set[str]) -> str:
    while True:
        key = f"{rng.choice(vocab)}-{rng.choice(vocab)}"
        if key not in taken:
            taken.add(key)
            return key


def _number(rng: random.Random, taken: set[str]) -> str:
    while True:
        value = str(rng.randrange(1_000_000, 10_000_000))
        if value not in taken:
            taken.add(value)
            return value


def _value(kind: str, rng: random.Random, vocab: list[str], taken: set[str]) -> str:
    if kind == "numbers":
        return _number(rng, taken)
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    while True:
        value = rng.choice(vocab)
        if value not in taken:
            taken.add(value)
            return value


NEEDLE = "One of the special magic {kind} for {key} is: {value}."
NIAH_TASK = ("Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
             "I will quiz you about the {kind} afterwards.\n\n{context}\n\n")  # fmt: skip


class Builder:
    """Builds items of every family to a target length in tokens, with one tokenizer."""

    def __init__(self, tokenizer, paragraphs: list[str], seed: int):
        self.tok, self.seed = tokenizer, seed
        self.hay = Haystack(paragraphs, [len(t) for t in tokenizer(paragraphs, add_special_tokens=False).input_ids])
        self.vocab = vocabulary(paragraphs)

    def count(self, prompt: str) -> int:
        return len(self.tok(prompt, add_special_tokens=False).input_ids)

    def wrap(self, user: str, answer_prefix: str) -> str:
        """The model's chat template around ``user``, the answer prefix after the generation prompt."""
        messages = [{"role": "user", "content": user}]
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + answer_prefix

    def fit(self, length: int, build) -> tuple[tuple, int]:
        """``build(filler_tokens)`` (a family's ``(prompt, answers, metric, detail)``) at a filler
        that puts the prompt within ``LENGTH_SLACK`` under ``length`` tokens, and its token count."""
        lo_ok = int(length * (1 - LENGTH_SLACK))
        filler, short, long = length, 16, None  # fillers known to give too few / too many tokens
        for attempt in range(60):
            parts = build(filler)
            n = self.count(parts[0])
            if lo_ok <= n <= length:
                return parts, n
            if n < lo_ok:
                short = max(short, filler)
            else:
                long = filler if long is None else min(long, filler)
            # The token count's own correction, 30 times (the items of every seed so far); a
            # correction that keeps missing (a cut paragraph's tokens jump) then gives way to
            # bisecting the bracket.
            if attempt < 30:
                filler = max(16, filler + (lo_ok + length) // 2 - n)
            elif long is None:
                filler *= 2
            elif long - short > 1:
                filler = (short + long) // 2
            else:  # the bracket closed with no filler that fits
                break
        raise RuntimeError(f"could not fit a prompt to {length} tokens (last {n})")

    def item(self, family: str, length: int, index: int) -> Item:
        rng = random.Random(f"{self.seed}/{family}/{length}/{index}")
        # The haystack and needles are drawn once; fit() only varies how much text is taken.
        state = rng.getstate()

        def build(filler: int) -> tuple:
            rng.setstate(state)
            return getattr(self, family)(rng, length, index, filler)

        (prompt, answers, metric, detail), n = self.fit(length, build)
        return Item(
            f"{family}-{length}-{index}", family, length, prompt, answers, metric, NEW_TOKENS[family], n, detail
        )

    # Families: each returns (prompt, answers, metric, detail) with about ``filler`` tokens of text.

    def _niah(self, rng, filler, kind, keys_n, values_per_key, queried, distractors=0):
        taken_k, taken_v = set(), set()
        keys = [_key(rng, self.vocab, taken_k) for _ in range(keys_n + distractors)]
        needles, truth = [], {}
        for key in keys:
            for _ in range(values_per_key if key in keys[:keys_n] else 1):
                value = _value(kind, rng, self.vocab, taken_v)
                truth.setdefault(key, []).append(value)
                needles.append((rng.random(), NEEDLE.format(kind=_kind_word(kind), key=key, value=value)))
        context = "\n\n".join(insert_at_depths(self.hay.take(rng, filler), needles))
        asked = keys[:queried]
        noun = _kind_word(kind)
        if len(asked) == 1 and values_per_key == 1:
            question = f"What is the special magic {noun} for {asked[0]} mentioned in the provided text?"
            prefix = f"The special magic {noun} for {asked[0]} mentioned in the provided text is"
        else:
            joined = (
                ", ".join(asked[:-1]) + (", and " if len(asked) > 2 else " and ") + asked[-1]
                if len(asked) > 1
                else asked[0]
            )
            question = f"What are all the special magic {kind} for {joined} mentioned in the provided text?"
            prefix = f"The special magic {kind} for {joined} mentioned in the provided text are"
        user = NIAH_TASK.format(kind=kind, context=context) + question
        answers = [v for k in asked for v in truth[k]]
        depths = sorted(round(d, 3) for d, _ in needles)
        return self.wrap(user, prefix), answers, "all", {"keys": asked, "depths": depths, "kind": kind}

    def niah_single(self, rng, length, index, filler):
        return self._niah(rng, filler, ("numbers", "uuids", "words")[index % 3], 1, 1, 1)

    def niah_multikey(self, rng, length, index, filler):
        return self._niah(rng, filler, "numbers", 1, 1, 1, distractors=3)

    def niah_multivalue(self, rng, length, index, filler):
        return self._niah(rng, filler, "numbers", 1, 4, 1)

    def niah_multiquery(self, rng, length, index, filler):
        return self._niah(rng, filler, "numbers", 4, 1, 4)

    def vt(self, rng, length, index, filler):
        names = set()

        def var() -> str:
            while True:
                name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
                if name not in names:
                    names.add(name)
                    return name

        value = str(rng.randrange(10_000, 100_000))
        chain = [var() for _ in range(5)]
        statements = [f"VAR {chain[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(chain, chain[1:])]
        depths = sorted(rng.random() for _ in statements)  # the chain in reading order
        context = "\n\n".join(insert_at_depths(self.hay.take(rng, filler), list(zip(depths, statements))))
        user = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
                f"{context}\n\nQuestion: Find all variables that are assigned the value {value} in the text above.")  # fmt: skip
        prefix = (f"Answer: According to the chain(s) of variable assignment in the text above, {len(chain)} variables "
                  f"are assigned the value {value}, they are:")  # fmt: skip
        return self.wrap(user, prefix), chain, "all", {"depths": [round(d, 3) for d in depths]}

    def cwe(self, rng, length, index, filler):
        freq_common = {2048: 8, 4096: 16}.get(length, 30)
        words = rng.sample(self.vocab, 10 + 2000)
        common, rare = words[:10], words[10:]
        listed = [w for w in common for _ in range(freq_common)]
        per_entry = 5  # tokens of "N. word " about
        n_rare = max(0, (filler - per_entry * len(listed)) // (3 * per_entry))
        listed += [w for w in rare[:n_rare] for _ in range(3)]
        rng.shuffle(listed)
        context = " ".join(f"{i + 1}. {w}" for i, w in enumerate(listed))
        user = ("Below is a numbered list of words. In these words, some appear more often than others. "
                f"Memorize the ones that appear most often.\n{context}\n"
                "Question: What are the 10 most common words in the above list?")  # fmt: skip
        prefix = "Answer: The top 10 words that appear most often in the list are:"
        return self.wrap(user, prefix), common, "all", {"frequency": freq_common}

    def fwe(self, rng, length, index, filler):
        coded = sorted({"".join(rng.choice(string.ascii_lowercase) for _ in range(5)) for _ in range(400)})
        rng.shuffle(coded)
        n = max(30, filler // 3)
        # Zipf-like frequencies with three clear leaders (RULER's alpha = 2)
        weights = [1 / (r + 1) ** 2 for r in range(len(coded))]
        draws = rng.choices(coded, weights=weights, k=n)
        counts = Counter(draws)
        top = [w for w, _ in counts.most_common(4)]
        if len(top) == 4 and counts[top[2]] == counts[top[3]]:  # a tie for third: make the third clear
            draws.append(top[2])
        rng.shuffle(draws)
        context = " ".join(w if i % 10 else f".... {w}" for i, w in enumerate(draws))
        user = ("Read the following coded text and track the frequency of each coded word. Find the three most "
                f"frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
                "the dots '....'. What are the three most frequently appeared words in the above coded text?")  # fmt: skip
        prefix = "Answer: According to the coded text above, the three most frequently appeared words are:"
        return self.wrap(user, prefix), [w for w, _ in Counter(draws).most_common(3)], "all", {}

    def qa(self, rng, length, index, filler):
        docs = self.hay.take(rng, filler)
        everything = " ".join(docs).lower()
        order = list(range(len(docs)))
        rng.shuffle(order)
        for target in order:  # the first document (in a seeded order) with a word the prompt holds once
            sentences = [s for s in re.split(r"(?<=[.;:])\s+", docs[target]) if 8 <= len(s.split()) <= 40]
            choices = []
            for s in sentences:
                words = s.split()
                for j, w in enumerate(words[2:], start=2):
                    bare = w.strip(".,;:()\"'")
                    if (
                        len(bare) >= 5
                        and bare.isalpha()
                        and len(re.findall(rf"\b{re.escape(bare.lower())}\b", everything)) == 1
                    ):
                        choices.append((s, j, bare))
            if choices:
                break
        else:
            raise RuntimeError("no document holds a word found once in the prompt")
        sentence, j, answer = rng.choice(choices)
        words = sentence.split()
        words[j] = words[j].replace(answer, "____")
        masked = " ".join(words)
        context = "\n\n".join(f"Document {i + 1}:\n{d}" for i, d in enumerate(docs))
        instruction = "Answer the question based on the given documents. Only give me the answer and do not output any other words."
        user = (f"{instruction}\n\nThe following are given documents.\n\n{context}\n\n{instruction}\n\n"
                f"Question: In Document {target + 1}, which word is missing from this sentence: \"{masked}\"?")  # fmt: skip
        return (
            self.wrap(user, "Answer:"),
            [answer],
            "part",
            {"document": target + 1, "depth": round(target / len(docs), 3)},
        )


def _kind_word(kind: str) -> str:
    return {"numbers": "number", "uuids": "uuid", "words": "word"}[kind]


def generate(tokenizer, per_cell: int, seed: int, families=FAMILIES, lengths=LENGTHS, paragraphs=None) -> list[Item]:
    builder = Builder(tokenizer, paragraphs if paragraphs is not None else corpus(), seed)
    return [builder.item(f, n, i) for f in families for n in lengths for i in range(per_cell)]


def save_items(items: list[Item], path: Path, meta: dict) -> None:
    body = {"meta": meta, "items": [asdict(i) for i in items]}
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as f:
        json.dump(body, f)


def load_items(path: Path) -> tuple[dict, list[Item]]:
    with gzip.open(path, "rt") as f:
        body = json.load(f)
    return body["meta"], [Item(**i) for i in body["items"]]


def items_answered(
    items: list[Item], runs: Path, length: int, family: str = "", limit: int | None = None
) -> list[Item]:
    """The ``items`` of ``length`` tokens, of a family starting with ``family``, that a serve output
    ``runs`` (``generate``'s JSON) answers fully right, in its order, at most ``limit``: what the
    probes ask a sparse policy to keep."""
    by_id = {i.id: i for i in items}
    outputs = json.loads(Path(runs).read_text())["outputs"]
    right = [by_id[o["id"]] for o in outputs if o.get("score") == 1 and o["id"] in by_id]
    return [i for i in right if i.length == length and i.family.startswith(family)][:limit]


def add_answered_args(parser, length: int, limit: int) -> None:
    """The arguments :func:`items_answered` takes, for a probe: ``--items``, ``--runs``,
    ``--length``, ``--family``, ``--limit``."""
    parser.add_argument("--items", required=True)
    parser.add_argument("--runs", required=True, help="a dense serve output: its right answers pick the items")
    parser.add_argument("--length", type=int, default=length)
    parser.add_argument("--family", default="niah", help="items whose family starts with this")
    parser.add_argument("--limit", type=int, default=limit)


def items_digest(items: list[Item]) -> str:
    h = hashlib.sha256()
    for item in items:
        h.update(item.prompt.encode())
    return h.hexdigest()[:16]


# Scoring.


def score(item: Item, output: str) -> float:
    """RULER's string match: ``all`` = share of references in the output, ``part`` = any (case-insensitive)."""
    out = output.lower()
    found = [ref.lower() in out for ref in item.answers]
    if item.metric == "part":
        return float(any(found))
    return sum(found) / len(found)


def answer(item: Item, output: str) -> tuple:
    """What a user reads as the answer, for agreement (the legacy measure): the values asked for, in the order given
    (digit runs for numbers, UUID-like runs, words), as many as the item has references; the set of
    variable names (vt) or listed words (cwe, fwe); the first word (qa). Text around it is ignored,
    so two outputs giving the same answer in other words agree."""
    text, k = output or "", len(item.answers)
    if item.family == "vt":
        return tuple(sorted(set(re.findall(r"\b[A-Z]{5}\b", text))))
    words = re.findall(r"[a-z0-9_]+", text.lower())
    if item.family == "qa":
        return tuple(words[:1])
    if item.family in ("cwe", "fwe"):
        return tuple(sorted(set(re.findall(r"[a-z]+", text.lower())[:k])))
    kind = item.detail.get("kind", "numbers")
    if kind == "numbers":
        return tuple(re.findall(r"\d{3,}", text)[:k])
    if kind == "uuids":
        return tuple(re.findall(r"[0-9a-f][0-9a-f-]{7,}", text.lower())[:k])
    return tuple(words[:k])


def budget_lengths(budget: int, lengths=LENGTHS, compressions=COMPRESSIONS, page_size: int = 32) -> dict[int, float]:
    """The item lengths whose compression (length / budget) at ``budget`` lies within 3% of one of
    ``compressions``, each with the compression it gives (budget at least 3 pages: sink + recent)."""
    out = {}
    if budget < 3 * page_size:
        return out
    for length in lengths:
        ratio = length / budget
        if any(abs(ratio / c - 1) <= 0.03 or 0.97 * c <= ratio <= c for c in compressions):
            out[length] = ratio
    return out


def nominal(ratio: float, compressions=COMPRESSIONS) -> int:
    return min(compressions, key=lambda c: abs(c - ratio))


# Through a server.


def run_server(items: list[Item], url: str, concurrency: int) -> list[dict]:
    """Every item through ``/generate`` (greedy, the prompt as text: the server's tokenizer reads
    it as the generator's did). After ``GIVE_UP`` items in a row fail, the rest are not sent (a
    server that died answers nothing; its run ends at once with the errors recorded)."""
    from concurrent.futures import ThreadPoolExecutor

    import requests

    failed_in_a_row = [0]

    def one(item: Item) -> dict:
        if failed_in_a_row[0] >= GIVE_UP:
            return {"id": item.id, "output": None, "error": "not sent: the server stopped answering"}
        body = {"text": item.prompt, "sampling_params": {"temperature": 0, "max_new_tokens": item.max_new_tokens}}
        for attempt in range(3):
            try:
                r = requests.post(url + "/generate", json=body, timeout=900)
                if r.status_code == 200:
                    out = r.json()
                    meta = out.get("meta_info", {})
                    failed_in_a_row[0] = 0
                    return {"id": item.id, "output": out["text"], "prompt_tokens": meta.get("prompt_tokens"),
                            "completion_tokens": meta.get("completion_tokens")}  # fmt: skip
                error = f"HTTP {r.status_code}: {r.text[:300]}"
            except requests.RequestException as e:
                error = repr(e)
            time.sleep(2 * (attempt + 1))
        failed_in_a_row[0] += 1
        return {"id": item.id, "output": None, "error": error}

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, items))


def serve(args) -> dict:
    from sparse_sglang.testing.provenance import git_commit

    meta, items = load_items(Path(args.items))
    if args.budget:
        keep = budget_lengths(args.budget)
        items = [i for i in items if i.length in keep]
    if args.families:
        items = [i for i in items if i.family in args.families.split(",")]
    if args.lengths:
        items = [i for i in items if str(i.length) in args.lengths.split(",")]
    if args.per_cell:
        items = [i for i in items if int(i.id.rsplit("-", 1)[1]) < args.per_cell]
    alone = args.alone or args.concurrency == 1
    concurrency = 1 if alone else args.concurrency
    extra = args.server_args.split() if args.server_args else []
    if alone and "--disable-radix-cache" not in extra:  # every request prefills cold, as dense's alone runs do
        extra.append("--disable-radix-cache")
    if not args.vanilla and args.budget:
        extra += ["--sparse-token-budget", str(args.budget)]
    started = time.time()
    if args.url:
        outputs, command = run_server(items, args.url, concurrency), None
    else:
        from sparse_sglang.default_model import default_model_path
        from sparse_sglang.testing.server import SPARSE_MODULE, VANILLA_MODULE, ServerProcess

        module = VANILLA_MODULE if args.vanilla else SPARSE_MODULE
        with ServerProcess(module, args.model_path or default_model_path(), extra, log_path=args.log) as server:
            command = " ".join(server.command)
            outputs = run_server(items, server.url, concurrency)
            if args.repeat:  # the same server again, items in reverse: dense's own run-to-run floor
                again = run_server(items[::-1], server.url, concurrency)[::-1]
                for o, a in zip(outputs, again):
                    o["repeat_output"] = a["output"]
    by_id = {i.id: i for i in items}
    for o in outputs:
        if o["output"] is not None:
            o["score"] = score(by_id[o["id"]], o["output"])
    import torch

    run = {"kind": "server", "name": args.name, "config": args.config or ("dense" if args.vanilla else "default"),
           "alone": alone, "vanilla": bool(args.vanilla), "budget": args.budget, "concurrency": concurrency,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "server_args": extra,
           "command": command, "items_digest": meta.get("digest"), "items_seed": meta.get("seed"),
           "commit": git_commit(), "seconds": round(time.time() - started, 1), "outputs": outputs}  # fmt: skip
    return {**run, **run_counts(run)}


# Through the torch reference.


def turn_end_ids(tokenizer) -> list[int]:
    """The ids that end an answer, the turn's end first: the special token the chat template writes
    after a message (``<|im_end|>`` in ChatML), then the tokenizer's end of sequence. A converted
    SmolLM2 names ``<|im_start|>`` its eos: stopping on that alone decodes past the turn's end, where
    the server stops."""
    marker = "turn-end-probe"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    after = text.split(marker, 1)[1]
    special = set(tokenizer.all_special_tokens) | set(tokenizer.get_added_vocab())
    ends = sorted((t for t in special if t and after.startswith(t)), key=len, reverse=True)
    ids = [tokenizer.convert_tokens_to_ids(t) for t in ends[:1]]
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def until_stop(generated: list[int], stop: list[int]) -> list[int]:
    """``generated`` up to and including its first id in ``stop``."""
    for n, token in enumerate(generated):
        if token in stop:
            return generated[: n + 1]
    return generated


def reference(args) -> dict:
    import copy

    import torch
    from transformers import DynamicCache

    from benchmark import quality  # the reference decoder: transformers with sparse_sglang.attention's selection
    from sparse_sglang.testing.provenance import git_commit

    meta, items = load_items(Path(args.items))
    compressions = tuple(int(c) for c in args.compressions.split(",")) if args.compressions else COMPRESSIONS
    keep = budget_lengths(args.budget, compressions=compressions) if args.budget else {n: 1.0 for n in LENGTHS}
    if args.lengths:
        keep = {n: r for n, r in keep.items() if str(n) in args.lengths.split(",")}
    if args.families:
        items = [i for i in items if i.family in args.families.split(",")]
    cells: dict = {}
    chosen = []
    for item in items:
        cell = (item.family, item.length)
        if item.length in keep and cells.get(cell, 0) < args.per_cell:
            cells[cell] = cells.get(cell, 0) + 1
            chosen.append(item)
    device = args.device
    tokenizer, model = quality.load_model(args.model_path)
    model = model.to(device)
    quality.PAGE_SIZE = args.page_size  # the reference decoder's pages (module-level in quality.py)
    policies = {"dense": quality.Policy(selector=None)}
    if args.budget:
        policies[f"sparse-{args.budget}"] = quality.Policy(budget=args.budget, dense_layers=args.dense_layers,
                                                           logical_page_size=args.page_size)  # fmt: skip
    for extra in args.policy:  # name=field:value,field:value
        name, _, fields = extra.partition("=")
        types = {f.name: type(f.default) for f in dataclasses.fields(quality.Policy)}  # str, int or float
        pairs = [f.split(":", 1) for f in fields.split(",")]
        unknown = [k for k, *_ in pairs if k not in types]
        if unknown or any(len(p) != 2 for p in pairs):
            raise SystemExit(f"--policy {extra!r}: fields are name:value among {', '.join(types)}")
        knobs = {k: v if types[k] is str else types[k](v) for k, v in pairs}
        policies[name] = quality.Policy(**{"budget": args.budget, "logical_page_size": args.page_size, **knobs})
    stop = turn_end_ids(tokenizer)
    outputs = []
    for item in chosen:
        ids = tokenizer(item.prompt, add_special_tokens=False).input_ids
        cache = DynamicCache(config=model.config)
        prefill = quality.SparseDecoder(
            model, quality.Policy(selector=None), len(ids) + item.max_new_tokens, args.bound_format
        )
        logits = quality.run_with(prefill, model, input_ids=torch.tensor([ids], device=device), past_key_values=cache,
                                  use_cache=True, logits_to_keep=1).logits  # fmt: skip
        first = int(logits[0, -1].argmax())
        row = {"id": item.id}
        for name, policy in policies.items():
            hook = prefill.fork(policy)
            # quality.decode stops on one id: the turn's end; the answer is then cut at any of them
            generated = quality.decode(model, hook, copy.deepcopy(cache), [], item.max_new_tokens, first, stop=stop[0])
            generated = until_stop(generated, stop)
            text = tokenizer.decode(generated, skip_special_tokens=True)
            row[name] = {"output": text, "score": score(item, text)}
        outputs.append(row)
        print(
            f"  {item.id}: " + " | ".join(f"{n}: {r['output'][:40]!r}" for n, r in row.items() if n != "id"), flush=True
        )
    run = {"kind": "reference", "name": args.name or f"reference-{args.budget}", "budget": args.budget,
           "policies": list(policies), "compressions": list(compressions), "bound_format": args.bound_format,
           "dense_layers": args.dense_layers, "items_digest": meta.get("digest"), "items_seed": meta.get("seed"),
           "commit": git_commit(), "outputs": outputs,
           "by_family": reference_table(outputs, {i.id: i for i in chosen})}  # fmt: skip
    return {**run, **run_counts(run)}


# Summary: what sparse decode keeps of dense's answers.


def reference_table(outputs: list[dict], by_id: dict[str, Item]) -> dict:
    """A reference run's ``outputs`` by family (and ``all``): each policy's mean RULER score
    (``<policy>:score``) and, but for dense, the share of items whose answer (:func:`answer`)
    equals dense's (``<policy>:agree``), with ``n``."""
    cells: dict = {}
    for row in outputs:
        item = by_id[row["id"]]
        dense = answer(item, row["dense"]["output"])
        for family in (item.family, "all"):
            cell = cells.setdefault(family, {})
            for name, out in row.items():
                if name == "id":
                    continue
                cell.setdefault(f"{name}:score", []).append(out["score"])
                if name != "dense":
                    cell.setdefault(f"{name}:agree", []).append(answer(item, out["output"]) == dense)
    return {f: {**{k: round(_mean(v), 3) for k, v in cell.items()}, "n": len(cell["dense:score"])}
            for f, cell in sorted(cells.items(), key=lambda kv: (kv[0] == "all", kv[0]))}  # fmt: skip


def _mean(xs) -> float | None:
    xs = list(xs)
    return round(sum(xs) / len(xs), 4) if xs else None


def _share(part: int, whole: int) -> float | None:
    return round(part / whole, 4) if whole else None


def _outputs(run: dict) -> dict[str, dict]:
    return {o["id"]: o for o in run["outputs"] if o.get("output") is not None}


def run_identity(run: dict) -> dict:
    """What a run is, the fields runs are paired by: ``config`` (``dense`` for plain SGLang,
    ``default``, ``headline`` or a variant's name), ``alone`` (one request at a time), ``budget``
    and ``vanilla``. As the run recorded them, or, in files written before runs recorded them, as its
    name and concurrency say (``dense``, ``dense-alone-<len>``, ``sparse-<budget>``,
    ``sparse-alone-<budget>``, ``headline-alone-<budget>``, ``<variant>-<budget>``)."""
    name = run["name"]
    if run["kind"] == "reference":
        return {"config": "reference", "alone": True, "budget": run.get("budget"), "vanilla": False}
    vanilla = run.get("vanilla", name.startswith("dense"))
    alone = run.get("alone")
    if alone is None:
        alone = run["concurrency"] == 1 if "concurrency" in run else "-alone" in name
    config = run.get("config")
    if config is None:
        base = name.rsplit("-", 1)[0].removesuffix("-alone")
        config = "dense" if vanilla else {"sparse": "default"}.get(base, base)
    return {"config": config, "alone": bool(alone), "budget": run.get("budget"), "vanilla": bool(vanilla)}


def run_counts(run: dict) -> dict:
    """``items_sent``, ``items_answered``, ``items_missing`` and the ``missing_ids``, as the run
    recorded them or as its outputs give them: a server run's outputs hold every item it was given,
    those it got no answer for (or never sent, after ``GIVE_UP``) with ``output`` None."""
    if "items_sent" in run:
        return {k: run[k] for k in ("items_sent", "items_answered", "items_missing", "missing_ids")}
    missing = [] if run["kind"] == "reference" else [o["id"] for o in run["outputs"] if o.get("output") is None]
    sent = len(run["outputs"])
    return {"items_sent": sent, "items_answered": sent - len(missing), "items_missing": len(missing),
            "missing_ids": missing}  # fmt: skip


def fully_right(item: Item, output: str) -> bool:
    return score(item, output) == 1.0


def retention(pairs) -> dict:
    """Over ``(item, sparse output, dense output)``: of the items dense answers fully right (RULER
    score 1.0), how many sparse answers fully right too (``retained``, ``retention``); new errors
    (dense fully right, sparse not) and new corrects (the reverse), counted and by id. Over the
    multi-value families' items: of the reference values dense's output holds, the share sparse's
    holds too (``value_retention``, pooled over values)."""
    n = dense_right = retained = values_dense = values_kept = 0
    new_errors, new_corrects, multi = [], [], False
    for item, sparse, dense in pairs:
        n += 1
        dense_ok, sparse_ok = fully_right(item, dense), fully_right(item, sparse)
        dense_right += dense_ok
        retained += dense_ok and sparse_ok
        if dense_ok and not sparse_ok:
            new_errors.append(item.id)
        if sparse_ok and not dense_ok:
            new_corrects.append(item.id)
        if item.family in MULTI_VALUE:
            multi = True
            held = [a.lower() for a in item.answers if a.lower() in dense.lower()]
            values_dense += len(held)
            values_kept += sum(a in sparse.lower() for a in held)
    out = {"n": n, "n_dense_right": dense_right, "retained": retained, "retention": _share(retained, dense_right),
           "new_errors": len(new_errors), "new_corrects": len(new_corrects),
           "new_error_ids": new_errors, "new_correct_ids": new_corrects}  # fmt: skip
    if multi:
        out.update(values_dense=values_dense, values_kept=values_kept,
                   value_retention=_share(values_kept, values_dense))  # fmt: skip
    return out


def _brief(cell: dict) -> dict:
    return {k: cell[k] for k in ("retention", "n_dense_right", "new_errors", "new_corrects")}


def config_pairs(server: list[dict], config: str, dense: dict[str, str], by_id: dict[str, Item],
                 vanilla: bool = False) -> list[tuple]:  # fmt: skip
    """``(item, compression, sparse output, dense output)`` for each item a one-at-a-time run of
    ``config`` answered that dense's one-at-a-time runs answered too (``vanilla``: plain SGLang's
    runs under that config's flags, compression 1)."""
    out = []
    for run in server:
        if run["vanilla"] != vanilla or run["config"] != config or not run["alone"]:
            continue
        ratios = {} if vanilla else budget_lengths(run["budget"])
        for i, o in _outputs(run).items():
            if i in dense:
                out.append((by_id[i], 1 if vanilla else nominal(ratios[by_id[i].length]), o["output"], dense[i]))
    return out


def reference_pairs(ref: dict, policy: str, dense: dict[str, str], by_id: dict[str, Item]) -> list[tuple]:
    """The same for one policy of a reference run, against the dense server's one-at-a-time answers."""
    compressions = tuple(ref.get("compressions") or COMPRESSIONS)
    ratios = budget_lengths(ref["budget"], compressions=compressions) if ref.get("budget") else {}
    out = []
    for row in ref["outputs"]:
        item = by_id[row["id"]]
        if policy in row and row["id"] in dense and item.length in ratios:
            out.append((item, nominal(ratios[item.length], compressions), row[policy]["output"], dense[row["id"]]))
    return out


def pooled(pairs: list[tuple], compression: int, families, lengths=LENGTHS) -> dict:
    """:func:`retention` over the pairs at ``compression`` of ``families`` and ``lengths``."""
    return retention(
        (i, s, d) for i, c, s, d in pairs if c == compression and i.family in families and i.length in lengths
    )


def retention_table(pairs: list[tuple]) -> dict:
    """family -> length -> compression -> :func:`retention` of that cell."""
    cells: dict = {}
    for item, comp, sparse, dense in pairs:
        by_length = cells.setdefault(item.family, {}).setdefault(str(item.length), {})
        by_length.setdefault(str(comp), []).append((item, sparse, dense))
    by_number = lambda kv: int(kv[0])  # noqa: E731
    return {f: {n: {c: retention(v) for c, v in sorted(by_comp.items(), key=by_number)}
                for n, by_comp in sorted(by_length.items(), key=by_number)}
            for f, by_length in sorted(cells.items(), key=lambda kv: FAMILIES.index(kv[0]))}  # fmt: skip


def family_judgement(items: list[Item], dense: dict[str, str]) -> dict:
    """family -> dense's fully-right share of its items (those dense's one-at-a-time runs answered)
    and whether the family is judged (share at least ``JUDGED_SHARE``)."""
    out = {}
    for family in [f for f in FAMILIES if any(i.family == f for i in items)]:
        ran = [i for i in items if i.family == family and i.id in dense]
        right = sum(fully_right(i, dense[i.id]) for i in ran)
        share = _share(right, len(ran))
        out[family] = {"items": len(ran), "dense_right": right, "dense_right_share": share,
                       "judged": share is not None and share >= JUDGED_SHARE}  # fmt: skip
    return out


def _pairs(runs: list[dict], by_id: dict[str, Item], reference: list[dict]):
    """(run, item, compression, output, dense output) for every item a run of ``runs`` answered and
    a run in ``reference`` (dense) answered too."""
    dense = {}
    for run in reference:
        dense.update(_outputs(run))
    for run in runs:
        ratios = budget_lengths(run["budget"])
        for i, o in _outputs(run).items():
            if i in dense:
                yield run, by_id[i], nominal(ratios[by_id[i].length]), o, dense[i]


def family_table(pairs) -> dict:
    """family -> compression -> {n, dense, sparse, agreement}: mean RULER scores and the share of
    items whose answer (:func:`answer`) equals dense's."""
    cells: dict = {}
    for _, item, comp, o, d in pairs:
        cells.setdefault(item.family, {}).setdefault(str(comp), []).append(
            (d["score"], o["score"], answer(item, o["output"]) == answer(item, d["output"]))
        )
    return {f: {c: {"n": len(v), "dense": _mean(x[0] for x in v), "sparse": _mean(x[1] for x in v),
                    "agreement": _mean(x[2] for x in v)} for c, v in sorted(by.items(), key=lambda kv: int(kv[0]))}
            for f, by in cells.items()}  # fmt: skip


def legacy(server: list[dict], references: list[dict], by_id: dict[str, Item]) -> tuple[dict, dict]:
    """The suite's earlier measures, kept to compare with older files, not as bars: agreement
    (answers equal to dense's, :func:`answer`) one request at a time, the batched accuracy gap, dense's
    run-to-run floors, each variant's batched gap, and the reference against the server. Returns
    (numbers, tables)."""
    dense_batched = [r for r in server if r["vanilla"] and not r["alone"]]
    dense_alone = [r for r in server if r["vanilla"] and r["alone"]]

    def sparse(config: str, alone: bool) -> list[dict]:
        return [r for r in server if not r["vanilla"] and r["config"] == config and r["alone"] == alone]

    batched = family_table(_pairs(sparse("default", False), by_id, dense_batched))
    alone = list(_pairs(sparse("default", True), by_id, dense_alone))
    headline = list(_pairs(sparse("headline", True), by_id, dense_alone))

    def floor(run_list):
        pairs = [(by_id[o["id"]], o) for r in run_list for o in r["outputs"] if o.get("repeat_output") is not None]
        return _mean(answer(i, o["output"]) == answer(i, o["repeat_output"]) for i, o in pairs)

    def agreement(pairs: list, comp: int) -> float | None:
        return _mean(answer(i, o["output"]) == answer(i, d["output"]) for _, i, c, o, d in pairs if c == comp)

    def gap(table: dict, comp: str) -> float | None:
        return _mean(t[comp]["dense"] - t[comp]["sparse"] for t in table.values() if comp in t)

    numbers = {
        "agreement_4x": agreement(alone, 4),
        "accuracy_gap_16x": gap(batched, "16"),
        "headline_config_agreement_4x": agreement(headline, 4),
        "dense_repeat_agreement_alone": floor(dense_alone),
        "dense_repeat_agreement_batched": floor(dense_batched),
    }
    variants = {}
    for config in sorted({r["config"] for r in server if not r["vanilla"] and not r["alone"]} - {"default"}):
        table = family_table(_pairs(sparse(config, False), by_id, dense_batched))
        ran = {o["id"] for r in sparse(config, False) for o in r["outputs"]}
        base = family_table(p for p in _pairs(sparse("default", False), by_id, dense_batched) if p[1].id in ran)
        variants[config] = {c: {"gap": gap(table, c), "default_gap": gap(base, c)} for c in map(str, COMPRESSIONS)
                            if gap(table, c) is not None}  # fmt: skip
    ref_rows = []
    for ref in references:
        name = f"sparse-{ref['budget']}"  # the reference's own policy at the server's default
        # the default's one-at-a-time answers where there are, its batched answers elsewhere
        at_budget = sorted(
            (r for r in server if not r["vanilla"] and r["config"] == "default" and r["budget"] == ref["budget"]),
            key=lambda r: r["alone"],
        )
        srv = {i: o for r in at_budget for i, o in _outputs(r).items()}
        for row in ref["outputs"]:
            if row["id"] in srv and name in row:
                ref_rows.append({"id": row["id"], "budget": ref["budget"], "reference": row[name]["score"],
                                 "server": srv[row["id"]]["score"], "reference_dense": row["dense"]["score"]})  # fmt: skip
    if ref_rows:
        numbers["server_vs_reference_gap"] = round(
            abs(_mean(r["server"] for r in ref_rows) - _mean(r["reference"] for r in ref_rows)), 4
        )
        numbers["reference_items"] = len(ref_rows)
    tables = {"by_family_batched": batched, "by_family_alone_4x": family_table(alone),
              "headline_alone_4x": family_table(headline), "variants_gap_batched": variants,
              "reference_vs_server": ref_rows}  # fmt: skip
    return numbers, tables


def summarize(paths: list[str], items_path: str) -> dict:
    """The suite's result from ``serve`` and ``reference`` outputs (the module doc says what it
    measures): retention by configuration x family x length x compression, pooled over the judged
    families for the summary and its bars (:data:`BARS`), each run's missing items, and the legacy
    agreement numbers."""
    meta, items = load_items(Path(items_path))
    by_id = {i.id: i for i in items}
    runs = []
    for path in paths:
        run = json.loads(Path(path).read_text())
        runs.append({**run, **run_identity(run), **run_counts(run)})
    twice = sorted(n for n, k in Counter(r["name"] for r in runs).items() if k > 1)
    if twice:  # outputs are kept by run name
        raise ValueError(f"more than one run named {', '.join(twice)}: name them apart (serve/reference --name)")
    for run in runs:
        if run.get("items_digest") and meta.get("digest") and run["items_digest"] != meta["digest"]:
            raise ValueError(
                f"{run['name']} ran other items ({run['items_digest']}) than {items_path} ({meta['digest']})"
            )
    server = [r for r in runs if r["kind"] == "server"]
    references = [r for r in runs if r["kind"] == "reference"]
    dense = {}  # item id -> dense's one-at-a-time answer
    for run in server:
        if run["vanilla"] and run["alone"] and run["config"] == "dense":
            dense.update((i, o["output"]) for i, o in _outputs(run).items())
    families = family_judgement(items, dense)
    judged = [f for f, j in families.items() if j["judged"]]
    configs = sorted({r["config"] for r in server if not r["vanilla"] and r["alone"]})
    pairs = {c: config_pairs(server, c, dense, by_id) for c in configs}
    vanilla_configs = sorted({r["config"] for r in server if r["vanilla"] and r["alone"] and r["config"] != "dense"})
    vanilla_pairs = {c: config_pairs(server, c, dense, by_id, vanilla=True) for c in vanilla_configs}
    with_oracle = [r for r in references if any("oracle" in row for row in r["outputs"])]

    def reference_4x(policy: str) -> dict:
        rows = [p for ref in with_oracle for p in reference_pairs(ref, policy, dense, by_id)]
        return pooled(rows, 4, judged)

    summary = {
        "retention_4x": pooled(pairs.get("default", []), 4, judged)["retention"],
        "retention_4x_headline": pooled(pairs.get("headline", []), 4, judged)["retention"],
        "retention_16x_long": pooled(pairs.get("default", []), 16, judged, lengths=(4096, 8000))["retention"],
        "value_retention_4x": pooled(pairs.get("default", []), 4, MULTI_VALUE).get("value_retention"),
        "oracle_retention_4x": reference_4x("oracle")["retention"],
        "reference_dense_retention_4x": reference_4x("dense")["retention"],  # float32 torch against the server
        "retention_by_config": {
            c: {str(comp): _brief(pooled(pairs[c], comp, judged)) for comp in sorted({p[1] for p in pairs[c]})}
            for c in configs
        },
        "value_retention_4x_by_config": {c: pooled(pairs[c], 4, MULTI_VALUE).get("value_retention") for c in configs},
        "retention_by_vanilla_config": {c: _brief(pooled(vanilla_pairs[c], 1, judged)) for c in vanilla_configs},
        "held_out": meta.get("seed") is not None and meta["seed"] != DEV_SEED,
        "items_seed": meta.get("seed"),
        "items": len(items),
        "items_answered": {r["name"]: r["items_answered"] for r in runs},
        "items_missing": {r["name"]: r["items_missing"] for r in runs},
        "judged_families": judged,
        "dense_right_share": {f: j["dense_right_share"] for f, j in families.items()},
    }
    legacy_numbers, legacy_tables = legacy(server, references, by_id)
    summary["legacy"] = legacy_numbers
    reference_retention = {
        ref["name"]: {policy: {str(comp): _brief(pooled(rows, comp, judged)) for comp in sorted({p[1] for p in rows})}
                      for policy in ref.get("policies") or [k for k in ref["outputs"][0] if k != "id"]
                      if (rows := reference_pairs(ref, policy, dense, by_id))}
        for ref in references if ref["outputs"]
    }  # fmt: skip
    return {
        "summary": summary,
        "families": families,
        "retention": {c: retention_table(pairs[c]) for c in configs},
        "reference_retention": reference_retention,
        "legacy": legacy_tables,
        "items_meta": meta,
        "runs": [{k: v for k, v in r.items() if k != "outputs"} for r in runs],
        "outputs": {r["name"]: [_compact(o, r) for o in r["outputs"]] for r in runs},
    }


# The bars a result is held to (`check`): summary key, how it is held, the bar.
BARS = (
    ("retention_4x", ">=", 0.90),
    ("retention_4x_headline", ">=", 0.87),
    ("retention_16x_long", ">=", 0.50),
    ("value_retention_4x", ">=", 0.80),
    ("held_out", "true", None),
    ("oracle_retention_4x", "present", None),
    ("items_missing", "none in any run", None),
)


def bar_report(summary: dict, key: str, rule: str, bar) -> tuple[bool, str]:
    """Whether the summary meets one bar, and the line that says so."""
    value = summary.get(key)
    if value is None:
        return False, f"{key} missing"
    if rule == ">=":
        return value >= bar, f"{key} {value:.4g} {'>=' if value >= bar else '<'} {bar:.2f}"
    if rule == "true":
        why = "" if value is True else f" (items of seed {summary.get('items_seed')}; held out: --seed {HELD_OUT_SEED})"
        return value is True, f"{key} {json.dumps(value)}{why}"
    if rule == "present":
        return True, f"{key} {value} (present)"
    short = {name: n for name, n in value.items() if n}
    answered = summary.get("items_answered", {})
    missed = ", ".join(f"{name} {n} of {n + answered.get(name, 0)}" for name, n in short.items())
    return not short, f"{key}: {missed}" if short else f"{key} 0 in every run"


def check(result: dict) -> int:
    """Prints the first bar of :data:`BARS` the result falls short of and returns 1, or prints
    every bar and returns 0."""
    lines = []
    for key, rule, bar in BARS:
        ok, line = bar_report(result["summary"], key, rule, bar)
        if not ok:
            print(line)
            return 1
        lines.append(line)
    print("\n".join(lines))
    return 0


def unpack(result: dict, out_dir: Path) -> list[Path]:
    """A result file's runs as the per-run files :func:`summarize` reads (their outputs as the file
    keeps them): new runs summarize against a committed file's, e.g. sparse runs of a candidate
    change against the dense runs of the same items."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for run in result["runs"]:
        path = out_dir / f"{run['name']}.json"
        path.write_text(json.dumps({**run, "outputs": result["outputs"][run["name"]]}))
        paths.append(path)
    return paths


def _compact(row: dict, run: dict) -> dict:
    """An output row as kept in the result file: a server run's without token counts, a reference
    run's whole (every policy's output and score)."""
    if run["kind"] == "reference":
        return row
    return {k: v for k, v in row.items() if k in ("id", "output", "score", "repeat_output", "error")}


# A grid: several servers at once on one GPU (SmolLM2 is small), each a `serve` subprocess.

BUDGETS = (128, 256, 512, 1024, 2048)  # with LENGTHS, compressions 4x to 32x (budget_lengths)
FOUR_X = {2048: 512, 4096: 1024, 8000: 2048}  # length -> budget at compression 4x
HEADLINE_FLAGS = "--kv-cache-dtype fp8_e4m3 --sparse-reselect-interval 8"  # the serving headline's quality flags


@dataclass(frozen=True)
class Run:
    """One server of a grid: its items (by budget, lengths, items per cell) and how they are sent.
    ``alone``: one request at a time, so every request decodes as a batch of one and a server
    answers the same item the same way every time (batched runs vary with what shares the batch)."""

    name: str
    config: str = "default"  # what the run's file records it as (serve --config)
    vanilla: bool = False
    budget: int | None = None
    flags: str = ""
    per_cell: int = 0
    lengths: tuple[int, ...] = ()
    alone: bool = False
    repeat: bool = False


# A configuration's runs in the retention grid: budget -> the lengths it runs. Together the 4x cells
# of every length and the 16x cells of 4096 and 8000 (budget 512 is 4x at 2048 and 16x at 8000).
# One server per (budget, length): the 4x cells of every length and the 16x cells of the long ones;
# a server per length keeps every run near 400 items, so a grid's servers end together.
RETENTION_BUDGETS = {(512, 2048): (2048,), (512, 8000): (8000,), (1024, 4096): (4096,), (2048, 8000): (8000,),
                     (256, 4096): (4096,)}  # fmt: skip
HEADLINE_BUDGETS = {512: (2048,), 1024: (4096,), 2048: (8000,)}  # 4x only


def _grid_retention(configs: dict[str, str], vanilla_configs: dict[str, str]) -> list[Run]:
    """One request at a time only: dense at every length, the default and each of ``configs``
    (name -> flags) over ``RETENTION_BUDGETS``, the serving headline's flags at 4x, and plain SGLang
    under each of ``vanilla_configs`` at every length."""
    runs = [Run(f"dense-alone-{n}", config="dense", vanilla=True, lengths=(n,), alone=True) for n in LENGTHS]
    runs += [Run(f"{config}-alone-{n}", config=config, vanilla=True, flags=flags, lengths=(n,), alone=True)
             for config, flags in vanilla_configs.items() for n in LENGTHS]  # fmt: skip
    for config, flags in {"default": "", **configs}.items():
        runs += [Run(f"{config}-alone-{b}-{n}", config=config, budget=b, flags=flags, lengths=lengths, alone=True)
                 for (b, n), lengths in RETENTION_BUDGETS.items()]  # fmt: skip
    runs += [Run(f"headline-alone-{b}", config="headline", budget=b, flags=HEADLINE_FLAGS, lengths=lengths, alone=True)
             for b, lengths in HEADLINE_BUDGETS.items()]  # fmt: skip
    return runs


def _grid_final(configs: dict[str, str], vanilla_configs: dict[str, str]) -> list[Run]:
    """The grid of the first results: batched runs at every budget and variants beside the 4x
    one-at-a-time runs (no ``--configs``)."""
    if configs or vanilla_configs:
        raise SystemExit("--configs and --vanilla-configs go with --grid retention")
    runs = [Run("dense", config="dense", vanilla=True, repeat=True)]
    runs += [Run(f"dense-alone-{n}", config="dense", vanilla=True, lengths=(n,), alone=True, repeat=n == 2048)
             for n in LENGTHS]  # fmt: skip
    runs += [Run(f"sparse-{b}", budget=b) for b in BUDGETS]
    runs += [Run(f"sparse-alone-{b}", budget=b, lengths=(n,), alone=True) for n, b in FOUR_X.items()]
    runs += [Run(f"headline-alone-{b}", config="headline", budget=b, lengths=(n,), alone=True, flags=HEADLINE_FLAGS)
             for n, b in FOUR_X.items()]  # fmt: skip
    variants = (("arkvale", "--sparse-selector arkvale"), ("mean", "--sparse-selector mean"),
                ("gmax", "--sparse-group-reduce max"), ("recent4", "--sparse-recent-pages 4"))  # fmt: skip
    runs += [Run(f"{name}-{b}", config=name, budget=b, flags=flags, per_cell=25) for name, flags in variants
             for b in (256, 512)]  # fmt: skip
    return runs


GRIDS = {"retention": _grid_retention, "final": _grid_final}
RESERVED_CONFIGS = ("dense", "default", "headline", "reference")  # what runs the grid or the summary name themselves


def parse_configs(text: str, flag: str = "--configs", taken=()) -> dict[str, str]:
    """``"name=flags;name=flags"`` -> {name: flags}: configurations run beside the default (or
    beside dense, ``--vanilla-configs``); ``taken``: names another flag already gave."""
    configs = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, _, flags = part.partition("=")
        name = name.strip()
        if not re.fullmatch(r"[A-Za-z0-9_.]+", name) or name in RESERVED_CONFIGS or name in configs or name in taken:
            raise SystemExit(f"{flag}: {name!r} is not a free configuration name (letters, digits, _ and .)")
        configs[name] = flags.strip()
    return configs


# Flags every grid server gets: a small share of the GPU and of pinned host memory each.
GRID_SERVER_ARGS = "--mem-fraction-static 0.1 --cuda-graph-max-bs-decode 64 --max-running-requests 64"
# Plain SGLang's attention backend: FlashInfer, which the sparse server's prefill and decode use too.
GRID_VANILLA_ARGS = "--attention-backend flashinfer"
GRID_SPARSE_ARGS = "--sparse-host-cache-gb 6"
# One-at-a-time runs measure retention: every request prefills cold, so dense answers each item the
# same way every time (its repeat pass measures that floor), not a cold prefill against one from a
# cached prefix.
GRID_ALONE_ARGS = "--disable-radix-cache"


def grid(args) -> None:
    import subprocess

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    configs = parse_configs(args.configs)
    vanilla_configs = parse_configs(args.vanilla_configs, "--vanilla-configs", taken=configs)
    runs = [r for r in GRIDS[args.grid](configs, vanilla_configs) if not args.only or r.name in args.only.split(",")]
    # the longest first: one-at-a-time runs, those of the most prompt tokens first
    runs = sorted(runs, key=lambda r: (not r.alone, -sum(r.lengths)))
    index, _, count = args.shard.partition("/")
    pending, running = runs[int(index) :: int(count)], []  # --shard I/N: every N-th run from the I-th
    while pending or running:
        while pending and len(running) < args.parallel:
            run = pending.pop(0)
            sparse_flags = f"{GRID_SPARSE_ARGS} {args.sparse_args}"
            flags = " ".join([GRID_SERVER_ARGS, run.flags, GRID_VANILLA_ARGS if run.vanilla else sparse_flags,
                              GRID_ALONE_ARGS if run.alone else ""])  # fmt: skip
            cmd = [sys.executable, __file__, "serve", "--items", args.items, "--name", run.name,
                   "--config", run.config, "--out", str(out / f"{run.name}.json"), "--server-args", flags,
                   "--log", str(out / f"{run.name}.server.log"), "--concurrency", "1" if run.alone else "64"]  # fmt: skip
            cmd += ["--alone"] if run.alone else []
            cmd += ["--vanilla"] if run.vanilla else []
            cmd += ["--budget", str(run.budget)] if run.budget else []
            cmd += ["--repeat"] if run.repeat else []
            cmd += ["--per-cell", str(run.per_cell)] if run.per_cell else []
            cmd += ["--lengths", ",".join(map(str, run.lengths))] if run.lengths else []
            log = open(out / f"{run.name}.client.log", "w")
            running.append((run.name, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), time.time()))
            print(f"started {run.name}", flush=True)
            time.sleep(args.stagger)
        for entry in list(running):
            name, proc, t0 = entry
            if proc.poll() is not None:
                running.remove(entry)
                print(f"{name}: exit {proc.returncode} after {time.time() - t0:.0f} s", flush=True)
        time.sleep(2)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="write the seeded items")
    g.add_argument("--out", required=True)
    g.add_argument("--per-cell", type=int, default=50, help="items per family and length")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--model-path", default=None, help="whose tokenizer and chat template (default: the default model)")
    s = sub.add_parser("serve", help="run the items through a server")
    s.add_argument("--items", required=True)
    s.add_argument("--name", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--vanilla", action="store_true", help="plain sglang.launch_server (dense)")
    s.add_argument("--config", default=None,
                   help="what the run is, recorded in its file, runs paired by it (default: dense or default)")  # fmt: skip
    s.add_argument("--alone", action="store_true",
                   help="one request at a time, radix cache off (also implied by --concurrency 1)")  # fmt: skip
    s.add_argument(
        "--budget", type=int, default=None, help="--sparse-token-budget; runs the lengths it compresses 4-32x"
    )
    s.add_argument("--server-args", default="", help="more server flags, one string")
    s.add_argument("--families", default="")
    s.add_argument("--lengths", default="", help="comma-separated item lengths")
    s.add_argument("--url", default=None, help="a running server instead of starting one")
    s.add_argument("--model-path", default=None)
    s.add_argument("--concurrency", type=int, default=64)
    s.add_argument("--per-cell", type=int, default=0, help="the first N items of each family and length (0: all)")
    s.add_argument("--repeat", action="store_true", help="run the items twice (run-to-run agreement)")
    s.add_argument("--log", default=None)
    r = sub.add_parser("reference", help="run a subset through the torch reference")
    r.add_argument("--items", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--name", default=None, help="the run's name in a summary (default reference-<budget>)")
    r.add_argument("--budget", type=int, default=None)
    r.add_argument("--per-cell", type=int, default=4)
    r.add_argument("--bound-format", default="exact", choices=("exact", "int8"))
    r.add_argument("--dense-layers", type=int, default=0)
    r.add_argument("--device", default="cpu")
    r.add_argument("--families", default="")
    r.add_argument("--page-size", type=int, default=32)
    r.add_argument("--policy", action="append", default=[], help="more policies: name=field:value,... (quality.Policy)")
    r.add_argument("--lengths", default="", help="comma-separated item lengths")
    r.add_argument("--compressions", default="", help="comma-separated context/budget ratios whose lengths run "
                   f"(default {','.join(map(str, COMPRESSIONS))}, the grid's; e.g. 2 for a milder setting)")  # fmt: skip
    r.add_argument("--model-path", default=None)
    sm = sub.add_parser("summarize", help="combine serve/reference outputs into accuracy-<date>.json")
    sm.add_argument("runs", nargs="+")
    sm.add_argument("--items", required=True)
    sm.add_argument("--out-dir", default=str(REPO / "benchmark" / "results"))
    sm.add_argument("--name", default="accuracy-{date}.json",
                    help="the result file's name in --out-dir ({date}: today's); a file of that name is replaced")  # fmt: skip
    sm.add_argument("--attach", action="append", default=[], help="name=path of a probe's JSON to keep in the file")
    ck = sub.add_parser("check", help="exit 1 naming the first bar a summarized result falls short of")
    ck.add_argument("result")
    sub.add_parser("corpus", help="the corpus's paragraphs as JSON on stdout (corpus() runs it in a clean interpreter)")
    up = sub.add_parser("unpack", help="a result file's runs as per-run files, to summarize new runs against")
    up.add_argument("result")
    up.add_argument("--out-dir", required=True)
    gr = sub.add_parser("grid", help="run a grid of servers, several at once")
    gr.add_argument("--items", required=True)
    gr.add_argument("--grid", default="retention", choices=sorted(GRIDS))
    gr.add_argument("--configs", default="",
                    help='more configurations beside the default, "name=flags;name=flags": each runs the default\'s budgets')  # fmt: skip
    gr.add_argument("--vanilla-configs", default="",
                    help='plain SGLang under other flags beside dense, "name=flags;name=flags" (e.g. fp8 KV): every length')  # fmt: skip
    gr.add_argument("--only", default="", help="comma-separated run names")
    gr.add_argument("--out-dir", required=True)
    gr.add_argument("--parallel", type=int, default=6)
    gr.add_argument("--shard", default="0/1", help="I/N: this process runs every N-th run from the I-th (one GPU each)")
    gr.add_argument("--sparse-args", default="",
                    help="flags every sparse server of the grid gets too: a candidate default, measured as the default is")  # fmt: skip
    gr.add_argument(
        "--stagger",
        type=float,
        default=15.0,
        help="seconds between server starts (servers on one GPU size their KV pool from what is free after loading)",
    )
    args = parser.parse_args(argv)
    if args.cmd == "corpus":
        json.dump(corpus_here(), sys.stdout)
    elif args.cmd == "check":
        raise SystemExit(check(json.loads(Path(args.result).read_text())))
    elif args.cmd == "grid":
        grid(args)
    elif args.cmd == "summarize":
        from sparse_sglang.testing.provenance import finish_run

        result = summarize(args.runs, args.items)
        for extra in args.attach:  # name=path: a probe's JSON kept beside the suite's numbers
            name, _, path = extra.partition("=")
            result.setdefault("attached", {})[name] = json.loads(Path(path).read_text())
        devices = sorted({r.get("device") for r in result["runs"] if r.get("kind") == "server"} - {None})
        commits = sorted({r.get("commit") for r in result["runs"]} - {None})  # the code that ran, not this checkout
        finish_run(
            "benchmark.accuracy",
            argv,
            result,
            args.out_dir,
            args.name,
            device=", ".join(devices) or "cpu",
            commit=", ".join(commits) or None,
        )
    elif args.cmd == "unpack":
        for path in unpack(json.loads(Path(args.result).read_text()), Path(args.out_dir)):
            print(path)
    elif args.cmd == "generate":
        from transformers import AutoTokenizer

        from sparse_sglang.default_model import default_model_path

        tokenizer = AutoTokenizer.from_pretrained(args.model_path or default_model_path())
        paragraphs = corpus()
        items = generate(tokenizer, args.per_cell, args.seed, paragraphs=paragraphs)
        meta = {"seed": args.seed, "per_cell": args.per_cell, "families": FAMILIES, "lengths": LENGTHS,
                "digest": items_digest(items), "corpus_digest": corpus_digest(paragraphs),
                "python": sys.version.split()[0]}  # fmt: skip
        save_items(items, Path(args.out), meta)
        print(f"{len(items)} items, digest {meta['digest']}: {args.out}")
    elif args.cmd == "serve":
        result = serve(args)
        Path(args.out).write_text(json.dumps(result))
        done = [o for o in result["outputs"] if o.get("output") is not None]
        print(f"{args.name}: {result['items_answered']}/{result['items_sent']} answered, mean score "
              f"{sum(o['score'] for o in done) / max(1, len(done)):.3f}, {result['seconds']} s")  # fmt: skip
    elif args.cmd == "reference":
        result = reference(args)
        Path(args.out).write_text(json.dumps(result))
        for family, cell in result["by_family"].items():  # scores and agreement with dense, by family
            print(f"{family:<16}" + " ".join(f"{k}={v}" for k, v in cell.items()))


if __name__ == "__main__":
    main()
