"""The accuracy suite's task generator and scoring (benchmark/accuracy.py), on CPU.

Items are built with the default model's tokenizer from the machine's own prose; these tests check
what makes an item a fair question: its length, that its needles and answers are in it exactly as
asked, that the haystack repeats no paragraph, that the same seed gives the same items, and that
scoring reads answers as RULER does.
"""

from __future__ import annotations

import re
from collections import Counter

import pytest

from benchmark import accuracy

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from sparse_sglang.default_model import DefaultModelUnavailable, default_model_path

    try:
        return AutoTokenizer.from_pretrained(default_model_path())
    except DefaultModelUnavailable as err:
        pytest.skip(str(err))


@pytest.fixture(scope="module")
def paragraphs():
    return accuracy.corpus()


@pytest.fixture(scope="module")
def items(tokenizer, paragraphs):
    return accuracy.generate(tokenizer, per_cell=2, seed=7, lengths=(2048, 4096), paragraphs=paragraphs)


def test_the_corpus_is_prose_with_no_paragraph_twice(paragraphs):
    assert len(paragraphs) > 1000
    assert len(set(paragraphs)) == len(paragraphs)
    assert sum(len(p) for p in paragraphs) > 300_000  # several 8K-token haystacks' worth of distinct text


def test_every_family_and_length_is_built_within_its_token_range(items, tokenizer):
    cells = Counter((i.family, i.length) for i in items)
    assert set(cells) == {(f, n) for f in accuracy.FAMILIES for n in (2048, 4096)}
    for item in items:
        n = len(tokenizer(item.prompt, add_special_tokens=False).input_ids)
        assert n == item.prompt_tokens
        assert (1 - accuracy.LENGTH_SLACK) * item.length <= n <= item.length, item.id


def test_the_same_seed_gives_the_same_items_and_another_seed_others(tokenizer, paragraphs, items):
    again = accuracy.generate(tokenizer, per_cell=2, seed=7, families=("niah_multikey", "qa"), lengths=(2048,),
                              paragraphs=paragraphs)  # fmt: skip
    first = {i.id: i for i in items}
    for item in again:
        assert item.prompt == first[item.id].prompt and item.answers == first[item.id].answers
    other = accuracy.generate(tokenizer, per_cell=2, seed=8, families=("niah_multikey",), lengths=(2048,),
                              paragraphs=paragraphs)  # fmt: skip
    assert [i.prompt for i in other] != [first[i.id].prompt for i in other]


def test_needle_answers_are_in_the_prompt_once_and_distractors_share_the_phrasing(items):
    for item in items:
        if not item.family.startswith("niah"):
            continue
        for answer in item.answers:
            assert item.prompt.count(answer) == 1, (item.id, answer)
        needles = re.findall(r"One of the special magic \w+ for ([\w-]+) is: ", item.prompt)
        expected = {"niah_single": 1, "niah_multikey": 4, "niah_multivalue": 4, "niah_multiquery": 4}[item.family]
        assert len(needles) == expected, item.id
        for key in item.detail["keys"]:
            assert key in needles and key in item.prompt.rsplit("<|im_start|>user", 1)[1].split("\n\n")[-1]


def test_variable_chains_and_word_lists_hold_their_answers(items):
    for item in items:
        body = item.prompt
        if item.family == "vt":
            value = re.search(r"assigned the value (\d+) in the text above", body).group(1)
            assert f"VAR {item.answers[0]} = {value}." in body
            for a, b in zip(item.answers, item.answers[1:]):
                assert body.index(f"VAR {b} = VAR {a}.") > body.index(f"VAR {a} =")  # the chain in reading order
        elif item.family == "cwe":
            listed = Counter(re.findall(r"\d+\. ([a-z]+)", body))
            top = [w for w, _ in listed.most_common(10)]
            assert sorted(top) == sorted(item.answers)
            assert min(listed[w] for w in item.answers) > max(c for w, c in listed.items() if w not in item.answers)
        elif item.family == "fwe":
            text = body.split("coded words. ", 1)[1].split("\nQuestion:", 1)[0]
            counts = Counter(w for w in text.split() if w != "....")
            assert [w for w, _ in counts.most_common(3)] == item.answers
            assert counts.most_common(4)[2][1] > counts.most_common(4)[3][1]  # a clear third


def test_qa_asks_for_a_word_of_one_document_that_the_prompt_holds_once(items):
    for item in [i for i in items if i.family == "qa"]:
        (answer,) = item.answers
        doc = item.detail["document"]
        masked = re.search(r'which word is missing from this sentence: "(.*)"\?', item.prompt).group(1)
        assert "____" in masked
        sentence = masked.replace("____", answer)
        document = item.prompt.split(f"Document {doc}:\n", 1)[1].split("\n\nDocument ", 1)[0]
        assert sentence in document
        assert len(re.findall(rf"\b{re.escape(answer.lower())}\b", item.prompt.lower())) == 1


def test_haystacks_repeat_no_paragraph(items):
    for item in items:
        if item.family in ("cwe", "fwe"):
            continue
        user = item.prompt.split("<|im_start|>user\n", 1)[1]
        # RULER's QA template states its instruction before and after the documents, on purpose
        paras = [p for p in user.split("\n\n") if len(p.split()) >= 8 and not p.startswith("Answer the question")]
        assert len(paras) == len(set(paras)), item.id


def test_scoring_reads_answers_as_ruler_does():
    item = accuracy.Item("x", "niah_multivalue", 2048, "", ["1234567", "7654321"], "all", 8)
    assert accuracy.score(item, "The numbers are 1234567 and 7654321.") == 1.0
    assert accuracy.score(item, "1234567, 1111111") == 0.5
    assert accuracy.score(item, "nothing") == 0.0
    qa = accuracy.Item("q", "qa", 2048, "", ["Lowest"], "part", 8)
    assert accuracy.score(qa, " lowest") == 1.0


def test_answers_compare_by_what_a_user_reads():
    niah = accuracy.Item("x", "niah_single", 2048, "", ["1234567"], "all", 8, detail={"kind": "numbers"})
    assert accuracy.answer(niah, " 1234567.") == accuracy.answer(niah, " 1234567. This is the number")
    assert accuracy.answer(niah, " 1234567.") != accuracy.answer(niah, " 1234561.")
    vt = accuracy.Item("v", "vt", 2048, "", ["ABCDE", "FGHIJ"], "all", 8)
    assert accuracy.answer(vt, " ABCDE, FGHIJ.") == accuracy.answer(vt, " FGHIJ and ABCDE")
    assert accuracy.answer(vt, " ABCDE") != accuracy.answer(vt, " ABCDE, FGHIJ")


def test_budgets_give_the_compressions_asked():
    assert accuracy.budget_lengths(512) == pytest.approx({2048: 4.0, 4096: 8.0, 8000: 15.625})
    assert accuracy.budget_lengths(2048) == pytest.approx({8000: 3.90625})
    assert 2048 not in accuracy.budget_lengths(64)  # under sink + recent pages: not run
    assert accuracy.budget_lengths(1024, compressions=(2,)) == pytest.approx({2048: 2.0})  # reference --compressions 2
    for budget in accuracy.BUDGETS:
        for ratio in accuracy.budget_lengths(budget).values():
            assert 0.97 * accuracy.nominal(ratio) <= ratio <= accuracy.nominal(ratio)


def test_legacy_agreement_and_gap_from_runs(tmp_path):
    """The legacy numbers from synthetic runs in the old files' form (no recorded identity: the
    names say it): agreement on the alone runs at 4x, the 16x gap as the mean over families of dense
    minus sparse accuracy."""
    items = [accuracy.Item(f"niah_single-2048-{i}", "niah_single", 2048, "p", [str(1000000 + i)], "all", 8,
                           detail={"kind": "numbers"}) for i in range(4)]  # fmt: skip
    items += [accuracy.Item(f"qa-2048-{i}", "qa", 2048, "p", ["word"], "part", 8) for i in range(2)]
    items_path = tmp_path / "items.json.gz"
    accuracy.save_items(items, items_path, {"digest": "x"})

    def run(name, outputs, budget=None, vanilla=False, repeat=None):
        rows = []
        for item, out in zip(items, outputs):
            row = {"id": item.id, "output": out, "score": accuracy.score(item, out)}
            if repeat is not None:
                row["repeat_output"] = repeat
            rows.append(row)
        path = tmp_path / f"{name}.json"
        path.write_text(__import__("json").dumps({"kind": "server", "name": name, "vanilla": vanilla,
                                                  "budget": budget, "outputs": rows}))  # fmt: skip
        return str(path)

    right = [f" {1000000 + i}." for i in range(4)] + [" word", " word"]
    dense = run("dense", right, vanilla=True)
    dense_alone = run("dense-alone-2048", right, vanilla=True)
    # 4x at 2048 is budget 512: one answer changes its number, one only its wording
    alone = run("sparse-alone-512", [" 1000000.", " 1000001. Yes", " 999.", " 1000003."] + right[4:], budget=512)
    # 16x at 2048 is budget 128: niah loses half its items, qa none
    sixteen = run("sparse-128", [" 1000000.", " 0", " 1000002.", " 0"] + right[4:], budget=128)
    result = accuracy.summarize([dense, dense_alone, alone, sixteen], str(items_path))
    summary = result["summary"]["legacy"]
    assert summary["agreement_4x"] == pytest.approx(5 / 6, abs=1e-4)
    assert summary["accuracy_gap_16x"] == pytest.approx((0.5 + 0.0) / 2)
    assert result["legacy"]["by_family_batched"]["niah_single"]["16"]["sparse"] == 0.5
    # a committed result's runs, unpacked, summarize to the same numbers
    again = accuracy.summarize([str(p) for p in accuracy.unpack(result, tmp_path / "unpacked")], str(items_path))
    assert again["summary"] == result["summary"]
    assert again["legacy"]["by_family_alone_4x"] == result["legacy"]["by_family_alone_4x"]


def test_reference_table_scores_each_policy_and_its_agreement_with_dense_by_family():
    single = accuracy.Item("s", "niah_single", 2048, "", ["1234567"], "all", 8, detail={"kind": "numbers"})
    qa = accuracy.Item("q", "qa", 2048, "", ["Lowest"], "part", 8)
    outputs = [
        {
            "id": "s",
            "dense": {"output": " 1234567.", "score": 1.0},
            "oracle": {"output": "It is 1234567", "score": 1.0},
        },
        {"id": "q", "dense": {"output": " Lowest", "score": 1.0}, "oracle": {"output": " highest", "score": 0.0}},
    ]
    table = accuracy.reference_table(outputs, {"s": single, "q": qa})
    assert list(table) == ["niah_single", "qa", "all"]  # families sorted, the total last
    assert table["niah_single"] == {"dense:score": 1.0, "oracle:score": 1.0, "oracle:agree": 1.0, "n": 1}
    assert table["all"] == {"dense:score": 1.0, "oracle:score": 0.5, "oracle:agree": 0.5, "n": 2}


# Items built in a process of their own: one with another hash seed and a standard-library class
# extended the way an imported package extends it (transformers adds methods to logging.Logger).
# A stand-in tokenizer (words as tokens, ChatML) keeps it fast; the corpus is the real one.
BUILD_IN_A_PROCESS = """
import hashlib, json, logging, sys, types

from benchmark import accuracy


class WordTokenizer:
    def __call__(self, text, add_special_tokens=False):
        ids = [t.split() for t in text] if isinstance(text, list) else text.split()
        return types.SimpleNamespace(input_ids=ids)

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        turns = "".join(f"<|im_start|>{m['role']}\\n{m['content']}<|im_end|>\\n" for m in messages)
        return turns + "<|im_start|>assistant\\n"


if sys.argv[1] == "patched":
    def warning_once(self, *args):
        \"\"\"Emit the warning with the same message only once, however many callers reach it with that text.\"\"\"

    logging.Logger.warning_once = warning_once
builder = accuracy.Builder(WordTokenizer(), accuracy.corpus(), seed=1)
items = [builder.item("qa", 2048, i) for i in range(3)] + [builder.item("niah_single", 2048, 0)]
print(json.dumps({i.id: hashlib.sha256(i.prompt.encode()).hexdigest() for i in items}))
"""


def test_items_are_the_same_whatever_the_hash_seed_and_the_imports_before():
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = str(Path(accuracy.__file__).resolve().parents[1])
    builds = []
    for hash_seed, imports in (("1", "plain"), ("2", "patched")):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": f"{repo}:{repo}/python"}
        out = subprocess.run([sys.executable, "-c", BUILD_IN_A_PROCESS, imports], env=env, check=True,
                             capture_output=True, text=True).stdout  # fmt: skip
        builds.append(json.loads(out))
    assert len(builds[0]) == 4
    assert builds[0] == builds[1]


def test_the_reference_stops_where_the_chat_template_ends_a_turn(tokenizer):
    stop = accuracy.turn_end_ids(tokenizer)
    assert tokenizer.convert_ids_to_tokens(stop) == ["<|im_end|>", tokenizer.eos_token]
    end = stop[0]
    assert accuracy.until_stop([5, 6, end, 7, 8], stop) == [5, 6, end]
    assert accuracy.until_stop([5, stop[-1], end], stop) == [5, stop[-1]]
    assert accuracy.until_stop([5, 6], stop) == [5, 6]
