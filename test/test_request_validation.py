"""The main process refuses every class of bad generate request with one line naming the field.

SGLang's own request objects: ``GenerateReqInput`` as ``/generate`` builds it (through the same
pydantic validation FastAPI runs), and the OpenAI ``CompletionRequest`` / ``ChatCompletionRequest``
turned into one as SGLang's OpenAI routes do. No server: the checks are called directly, and
through the patched SGLang symbols.
"""

from __future__ import annotations

import math
import types
import warnings

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from pydantic import TypeAdapter
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
    from sglang.srt.entrypoints.openai.serving_completions import OpenAIServingCompletion
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

from sparse_sglang.integration import request_validation as rv
from sparse_sglang.integration.request_validation import RequestRejected, ServerLimits

VOCAB = 1000
LIMITS = ServerLimits(vocab_size=VOCAB)
PROMPT = [5, 6, 7, 8]


def native(body: dict) -> GenerateReqInput:
    """``/generate``'s request object from a JSON body, validated as FastAPI validates it."""
    return TypeAdapter(GenerateReqInput).validate_python(body)


def check_native(body: dict) -> None:
    """What the main process does with a ``/generate`` body: the batch form, then each prompt."""
    obj = native(body)
    rv.check_batch_form(obj)
    obj.normalize_batch_and_arguments()
    for sub in [obj] if obj.is_single else [obj[i] for i in range(len(obj.rid) * obj.parallel_sample_num)]:
        ids = sub.input_ids if sub.input_ids is not None else ([1, 2, 3] if sub.text else [])
        rv.check_request(sub, ids, LIMITS)


def rejected(body: dict) -> RequestRejected:
    with pytest.raises(RequestRejected) as err:
        check_native(body)
    message = str(err.value)
    assert "\n" not in message and message.startswith(err.value.field + ": ")
    return err.value


BAD = [
    # token ids: out of the vocabulary (the server-ending one), negative, in a batch
    ({"input_ids": [1, VOCAB]}, "input_ids", "outside the vocabulary"),
    ({"input_ids": [1, -1]}, "input_ids", "outside the vocabulary"),
    ({"input_ids": [[1, 2], [3, VOCAB + 5]]}, "input_ids", "outside the vocabulary"),
    ({"input_ids": [[1, 2], []]}, "input_ids", "non-empty lists"),
    # text against ids, empty inputs and batches
    ({"text": "hi", "input_ids": PROMPT}, "text", "exactly one"),
    ({}, "text", "exactly one"),
    ({"text": []}, "text", "batch is empty"),
    ({"text": ""}, "text", "prompt is empty"),
    # batch forms
    ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params", "1 entries for 2 prompts"),
    ({"text": ["a", "b"], "rid": ["x"]}, "rid", "1 entries for 2 prompts"),
    ({"text": "a", "return_logprob": [True, False]}, "return_logprob", "single prompt"),
    ({"text": ["a", "b"], "sampling_params": [{"n": 2}, {"n": 3}]}, "sampling_params.n", "same for every prompt"),
    # sampling parameters: types, NaN and infinities, ranges, int32, unknown and internal fields
    ({"input_ids": PROMPT, "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature", "finite number"),
    (
        {"input_ids": PROMPT, "sampling_params": {"temperature": math.nan}},
        "sampling_params.temperature",
        "finite number",
    ),
    ({"input_ids": PROMPT, "sampling_params": {"top_p": math.inf}}, "sampling_params.top_p", "finite number"),
    (
        {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 10**12}},
        "sampling_params.max_new_tokens",
        "2147483647",
    ),
    ({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1.5}}, "sampling_params.max_new_tokens", "integer"),
    ({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": -3}}, "sampling_params.max_new_tokens", "[0,"),
    ({"input_ids": PROMPT, "sampling_params": {"top_k": True}}, "sampling_params.top_k", "integer"),
    ({"input_ids": PROMPT, "sampling_params": {"n": 10**6}}, "sampling_params.n", "[1, 128]"),
    ({"input_ids": PROMPT, "sampling_params": {"n": None}}, "sampling_params.n", "integer, got None"),
    ({"input_ids": PROMPT, "sampling_params": {"stream_interval": 0}}, "sampling_params.stream_interval", "[1,"),
    ({"input_ids": PROMPT, "sampling_params": {"sampling_seed": -1}}, "sampling_params.sampling_seed", "[0,"),
    ({"input_ids": PROMPT, "sampling_params": {"ignore_eos": "yes"}}, "sampling_params.ignore_eos", "true or false"),
    (
        {"input_ids": PROMPT, "sampling_params": {"min_new_tokens": 9, "max_new_tokens": 4}},
        "sampling_params.min_new_tokens",
        "more than",
    ),
    ({"input_ids": PROMPT, "sampling_params": {"temprature": 0.5}}, "sampling_params.temprature", "unknown"),
    ({"input_ids": PROMPT, "sampling_params": {"is_normalized": True}}, "sampling_params.is_normalized", "unknown"),
    ({"input_ids": PROMPT, "sampling_params": {"stop": [1, 2]}}, "sampling_params.stop", "list of strings"),
    (
        {"input_ids": PROMPT, "sampling_params": {"stop_regex": "(unclosed"}},
        "sampling_params.stop_regex",
        "invalid regex",
    ),
    (
        {"input_ids": PROMPT, "sampling_params": {"stop_token_ids": [VOCAB]}},
        "sampling_params.stop_token_ids",
        "outside",
    ),
    ({"input_ids": PROMPT, "sampling_params": {"logit_bias": {"7": math.nan}}}, "sampling_params.logit_bias", "finite"),
    (
        {"input_ids": PROMPT, "sampling_params": {"logit_bias": {"abc": 1.0}}},
        "sampling_params.logit_bias",
        "not a token id",
    ),
    (
        {"input_ids": PROMPT, "sampling_params": {"logit_bias": {str(VOCAB): 1.0}}},
        "sampling_params.logit_bias",
        "outside",
    ),
    # constrained decoding specs that do not compile
    ({"input_ids": PROMPT, "sampling_params": {"regex": "[a-"}}, "sampling_params.regex", "does not compile"),
    (
        {"input_ids": PROMPT, "sampling_params": {"json_schema": '{"type": 5}'}},
        "sampling_params.json_schema",
        "does not compile",
    ),
    (
        {"input_ids": PROMPT, "sampling_params": {"json_schema": "not json"}},
        "sampling_params.json_schema",
        "does not compile",
    ),
    (
        {"input_ids": PROMPT, "sampling_params": {"json_schema": {"type": "object"}}},
        "sampling_params.json_schema",
        "string",
    ),
    ({"input_ids": PROMPT, "sampling_params": {"ebnf": "root ::= "}}, "sampling_params.ebnf", "does not compile"),
    (
        {"input_ids": PROMPT, "sampling_params": {"structural_tag": "[1]"}},
        "sampling_params.structural_tag",
        "JSON object",
    ),
    # logprob arguments
    ({"input_ids": PROMPT, "return_logprob": True, "top_logprobs_num": VOCAB + 1}, "top_logprobs_num", "[0, 1000]"),
    ({"input_ids": PROMPT, "return_logprob": True, "top_logprobs_num": -1}, "top_logprobs_num", "[0, 1000]"),
    ({"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": 99}, "logprob_start_len", "[-1, 4]"),
    ({"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": -7}, "logprob_start_len", "[-1, 4]"),
    ({"input_ids": PROMPT, "return_logprob": True, "token_ids_logprob": [3, VOCAB]}, "token_ids_logprob", "outside"),
    # sessions and rids
    ({"input_ids": PROMPT, "session_params": {"id": "s", "bogus": 1}}, "session_params.bogus", "unknown"),
    ({"input_ids": PROMPT, "session_params": {"id": "s", "offset": "x"}}, "session_params.offset", "must be int"),
    ({"input_ids": PROMPT, "rid": ""}, "rid", "non-empty"),
    # what a text model cannot take
    ({"input_ids": PROMPT, "image_data": "http://example.com/cat.png"}, "image_data", "text only"),
    ({"input_ids": PROMPT, "audio_data": "http://example.com/a.wav"}, "audio_data", "text only"),
    ({"input_embeds": [[0.1, 0.2]]}, "input_embeds", "sparse decode"),
    ({"input_embeds": [[]]}, "input_embeds", "non-empty list"),
]


@pytest.mark.parametrize("body,field,reason", BAD, ids=[f"{b[1]}:{b[2]}" for b in BAD])
def test_native_request_refused_naming_the_field(body, field, reason):
    error = rejected(body)
    assert error.field == field
    assert reason in str(error)


WRONG_VALUES = ("hot", "1", [1, 2], [], {"a": 1}, True, None, 1e300)  # the fuzzer's wrong types, and more


@pytest.mark.parametrize("name", sorted(rv.SAMPLING_FLOATS) + sorted(rv.SAMPLING_INTS))
@pytest.mark.parametrize("batch", [False, True])
def test_every_numeric_sampling_field_of_a_wrong_type_is_refused_naming_it(name, batch):
    """Each numeric sampling field, given each value of a wrong type, one prompt or a batch of two:
    a refusal naming the field, never another exception (the fuzzer's one 500: ``n`` a list)."""
    for value in WRONG_VALUES:
        if value is None and name != "n":
            continue  # null is SGLang's default for the others
        if value == 1e300 and name in rv.SAMPLING_FLOATS:
            continue  # finite: SamplingParams.verify judges the float ranges
        params = {"max_new_tokens": 4, name: value}
        body = {"input_ids": [PROMPT, PROMPT], "sampling_params": [params, params]} if batch else \
            {"input_ids": PROMPT, "sampling_params": params}  # fmt: skip
        assert rejected(body).field == f"sampling_params.{name}", value


GOOD = [
    {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0}},
    {"text": "The capital of France is", "sampling_params": {"temperature": 0.7, "top_p": 0.9, "top_k": -1, "n": 2}},
    {
        "text": ["a", "b"],
        "sampling_params": [{"stop": ["\n"]}, {"stop": "x", "stop_regex": r"\d+"}],
        "rid": ["r1", "r2"],
    },
    {"input_ids": [[1, 2], [3, 4]], "return_logprob": True, "top_logprobs_num": 5, "logprob_start_len": 0},
    {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": 4, "token_ids_logprob": [0, VOCAB - 1]},
    {"input_ids": PROMPT, "sampling_params": {"regex": "[a-z]+", "max_new_tokens": 0}},
    {"input_ids": PROMPT, "sampling_params": {"json_schema": '{"type": "object"}', "logit_bias": {"3": -100}}},
    {"input_ids": PROMPT, "sampling_params": {"json_schema": "$$ANY$$", "sampling_seed": 2**63 - 1}},
    {"input_ids": PROMPT, "sampling_params": {"temperature": None, "max_new_tokens": None}},
    {"input_ids": PROMPT, "session_params": {"id": "s", "offset": 2, "replace": True}},
]


@pytest.mark.parametrize("body", GOOD, ids=range(len(GOOD)))
def test_valid_requests_pass_and_sglang_takes_their_sampling_params(body):
    check_native(body)
    obj = native(body)
    obj.normalize_batch_and_arguments()
    params = obj.sampling_params if isinstance(obj.sampling_params, list) else [obj.sampling_params]
    for p in params:
        SamplingParams(**p).verify(VOCAB)  # what the tokenizer manager does next


def test_grammar_specs_are_left_to_the_scheduler_under_another_backend():
    other = ServerLimits(vocab_size=VOCAB, grammar_backend="outlines")
    rv.check_sampling_params({"regex": "[a-"}, other)
    with pytest.raises(RequestRejected, match="must be a string"):
        rv.check_sampling_params({"regex": 5}, other)


def test_multimodal_models_take_image_data():
    obj = native({"input_ids": PROMPT, "image_data": "http://example.com/cat.png"})
    obj.normalize_batch_and_arguments()
    rv.check_request(obj, PROMPT, ServerLimits(vocab_size=VOCAB, multimodal=True))


# -- the OpenAI routes -----------------------------------------------------------------------------


def completion(**fields) -> GenerateReqInput:
    """``/v1/completions``' request object as SGLang's ``OpenAIServingCompletion`` builds it."""
    request = CompletionRequest(model="m", **fields)
    params = OpenAIServingCompletion._build_sampling_params(None, request)
    prompt = {"text": request.prompt} if isinstance(request.prompt, str) else {"input_ids": request.prompt}
    return GenerateReqInput(**prompt, sampling_params=params, return_logprob=request.logprobs is not None,
                            top_logprobs_num=request.logprobs if request.logprobs is not None else 0)  # fmt: skip


def chat(**fields) -> GenerateReqInput:
    """``/v1/chat/completions``' request object (its sampling parameters as SGLang converts them)."""
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **fields)
    return GenerateReqInput(input_ids=PROMPT, sampling_params=request.to_sampling_params(stop=None, model_generation_config={}),
                            return_logprob=bool(request.logprobs), top_logprobs_num=request.top_logprobs or 0)  # fmt: skip


OPENAI_BAD = [
    (lambda: completion(prompt=[1, 2, VOCAB]), "input_ids", "outside the vocabulary"),
    (lambda: completion(prompt="hi", temperature=math.nan), "sampling_params.temperature", "finite"),
    (lambda: completion(prompt="hi", max_tokens=2**40), "sampling_params.max_new_tokens", "2147483647"),
    (lambda: completion(prompt="hi", logprobs=VOCAB + 5), "top_logprobs_num", "[0, 1000]"),
    (lambda: completion(prompt="hi", regex="(a"), "sampling_params.regex", "does not compile"),
    (lambda: completion(prompt="hi", logit_bias={"abc": 1.0}), "sampling_params.logit_bias", "not a token id"),
    (lambda: chat(top_p=math.inf), "sampling_params.top_p", "finite"),
    (lambda: chat(frequency_penalty=math.nan), "sampling_params.frequency_penalty", "finite"),
    (lambda: chat(stop_token_ids=[VOCAB + 1]), "sampling_params.stop_token_ids", "outside"),
    (
        lambda: chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}),
        "sampling_params.json_schema",
        "does not compile",
    ),
]


@pytest.mark.parametrize("build,field,reason", OPENAI_BAD, ids=[f"{b[1]}:{b[2]}" for b in OPENAI_BAD])
def test_openai_request_refused_naming_the_field(build, field, reason):
    obj = build()
    with pytest.raises(RequestRejected) as err:
        rv.check_batch_form(obj)
        obj.normalize_batch_and_arguments()
        rv.check_request(obj, obj.input_ids if obj.input_ids is not None else [1, 2], LIMITS)
    assert err.value.field == field and reason in str(err.value)


def test_valid_openai_requests_pass():
    for obj in (completion(prompt="hi", max_tokens=16, temperature=0.5, logprobs=3), chat(max_tokens=16, top_p=0.5)):
        rv.check_batch_form(obj)
        obj.normalize_batch_and_arguments()
        rv.check_request(obj, [1, 2], LIMITS)


# -- through the patched SGLang symbols ------------------------------------------------------------


def tokenizer_manager_standin(vocab_size: int = VOCAB):
    """The parts of a ``TokenizerManager`` the checks read (the model, the server args)."""
    return types.SimpleNamespace(
        model_config=types.SimpleNamespace(vocab_size=vocab_size),
        server_args=types.SimpleNamespace(grammar_backend="xgrammar", sparse=types.SimpleNamespace(enabled=True)),
        mm_processor=None,
    )


def test_patched_sglang_symbols_refuse_before_sglangs_own_code_runs():
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    from sparse_sglang.integration import install

    install()
    obj = native({"input_ids": [1, VOCAB + 3]})
    obj.normalize_batch_and_arguments()
    with pytest.raises(RequestRejected, match=f"^input_ids: token id {VOCAB + 3} is outside"):
        TokenizerManager._validate_one_request(tokenizer_manager_standin(), obj, obj.input_ids)
    with pytest.raises(RequestRejected, match="^text: give exactly one"):
        native({"text": "a", "input_ids": [1]}).normalize_batch_and_arguments()
    with pytest.raises(RequestRejected, match="^sampling_params: a list of 3 entries for 2 prompts"):
        native({"text": ["a", "b"], "sampling_params": [{}, {}, {}]}).normalize_batch_and_arguments()
    assert getattr(TokenizerManager._validate_one_request, "sparse_sglang", False)


@pytest.mark.parametrize("body", [b"5", b'"text"', b"[]", b"null", b"[1, 2]"])
def test_openai_routes_refuse_a_body_that_is_not_an_object_with_a_400(body):
    """SGLang's chat request model reads such a body as a mapping: a 500 (seen by the fuzzer) on an
    app with SGLang's own request models, a 400 naming the body once the guard is installed."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from sparse_sglang.integration.request_validation import refuse_bodies_that_are_not_objects

    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: ChatCompletionRequest):
        return {"ok": True}

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest):
        return {"ok": True}

    client = TestClient(app, raise_server_exceptions=False)
    post = lambda route: client.post(route, content=body, headers={"content-type": "application/json"})  # noqa: E731
    assert post("/v1/chat/completions").status_code == 500  # SGLang's chat model alone reads the body as a mapping
    refuse_bodies_that_are_not_objects(app)  # after the app has started, as in a test session
    for route in ("/v1/chat/completions", "/v1/completions"):
        response = post(route)
        assert response.status_code == 400, response.text
        assert response.json()["message"].startswith("request body: must be a JSON object")
    assert client.post("/v1/completions", json={"model": "m", "prompt": "hi"}).json() == {"ok": True}  # objects pass
