"""The fuzzer's generators: seeded, covering every route and every class of bad value, and every bad
``/generate`` request they make is one the main process refuses (SGLang's request object and
pydantic validation, then the checks of ``integration/request_validation.py``), every valid one
passes."""

from __future__ import annotations

import json
import warnings
from collections import Counter

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from pydantic import TypeAdapter, ValidationError
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

from benchmark.fuzz import BAD_KINDS, ID_ROUTES, KINDS, ROUTES, VALID_KINDS, generate_cases, summarize
from sparse_sglang.integration import request_validation as rv

VOCAB = 49152


@pytest.fixture(scope="module")
def cases():
    return generate_cases(2000, 3, VOCAB, "m")


def test_same_seed_same_requests_other_seed_others(cases):
    assert generate_cases(300, 3, VOCAB, "m") == generate_cases(300, 3, VOCAB, "m")
    assert generate_cases(300, 3, VOCAB, "m") != generate_cases(300, 4, VOCAB, "m")


def test_every_route_and_kind_is_generated(cases):
    kinds = Counter(c.kind for c in cases)
    assert set(kinds) == set(KINDS), set(KINDS) - set(kinds)
    assert {c.route for c in cases} == set(ROUTES)
    for kind in ("valid", "non_finite", "bad_logprob", "odd_batch"):
        assert {c.route for c in cases if c.kind == kind} == set(ROUTES), kind
    for kind in ("token_out_of_vocab", "negative_token"):  # where a prompt may be ids, and the bad id is sent
        assert {c.route for c in cases if c.kind == kind} == set(ID_ROUTES), kind
    bodies = [c.body for c in cases if c.kind == "non_finite"]
    assert any(b"NaN" in b for b in bodies) and any(b"Infinity" in b for b in bodies)  # JSON's non-finite literals
    assert all(
        _parse(c.body) is None for c in cases if c.kind == "malformed_json" and c.body not in (b"[]", b"5", b'"text"')
    )


def _parse(body: bytes):
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None


def main_process_refusal(body: dict) -> Exception | None:
    """What the server's main process does with a ``/generate`` body (the tokenizer stands in as
    three ids per text): the first refusal, or None."""
    try:
        obj = TypeAdapter(GenerateReqInput).validate_python(body)  # FastAPI's validation (a 400)
        obj.normalize_batch_and_arguments()
        subs = [obj] if obj.is_single else [obj[i] for i in range(len(obj.rid) * obj.parallel_sample_num)]
        for sub in subs:
            ids = sub.input_ids if sub.input_ids is not None else ([1, 2, 3] if sub.text else [])
            rv.check_request(sub, ids, rv.ServerLimits(vocab_size=VOCAB))
            SamplingParams(**sub.sampling_params).verify(VOCAB)
    except (ValidationError, ValueError) as err:
        return err
    return None


def test_every_bad_generate_request_is_refused_and_every_valid_one_passes(cases):
    from sparse_sglang.integration import install

    install()  # the batch-form check runs inside normalize_batch_and_arguments
    native = [(c, _parse(c.body)) for c in cases if c.route == "/generate"]
    native = [(c, body) for c, body in native if isinstance(body, dict)]
    assert len(native) > 500
    for case, body in native:
        refusal = main_process_refusal(body)
        if case.kind in BAD_KINDS:
            assert refusal is not None, (case.kind, body)
            assert "\n" not in str(refusal) or isinstance(refusal, ValidationError)
        elif case.kind in VALID_KINDS and body.get("text", "x").strip():
            assert refusal is None, (case.kind, body, refusal)


def test_summary_counts_statuses_deaths_and_leaks():
    records = [{"kind": "valid", "status": 200}, {"kind": "non_finite", "status": 400},
               {"kind": "odd_batch", "status": 500}, {"kind": "bad_regex", "status": 200}]  # fmt: skip
    idle = {"gpu_cache_slots_free": 10, "gpu_cache_rows_open": 0, "host_tokens_free": 6400, "request_slots_free": 4}
    now = {**idle, "host_tokens_free": 6400 - 64}
    summary = summarize(records, 1, [1, 2], [1, 2], idle, now)
    assert (summary["requests"], summary["errors_5xx"], summary["server_deaths"]) == (4, 1, 1)
    assert summary["output_matches_fresh"] and summary["leaked_host_pages"] == 2
    assert summary["bad_requests_refused_4xx"] == "1/3" and summary["bad_requests_answered_200"] == 1
    assert summarize(records, 0, [1], [2], None, None)["output_matches_fresh"] is False
