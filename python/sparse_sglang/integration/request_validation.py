"""Every generate request checked in the main process, before anything reaches the scheduler.

A value the scheduler or the GPU cannot take must never get there: one token id at or past the
vocabulary ends the whole server (a device-side assert in the embedding), and a wrong type in the
sampling parameters is an exception in the scheduler loop. SGLang checks part of a request in the
tokenizer process (``TokenizerManager._validate_one_request``, ``SamplingParams.verify``); these
checks add the rest, at two points of the main process:

- ``GenerateReqInput.normalize_batch_and_arguments`` (the batch form: which input, how many items,
  per-item lists of the batch's length, the ``n`` it expands by) runs :func:`check_batch_form`
  first;
- ``TokenizerManager._validate_one_request`` (one request, its token ids known) runs
  :func:`check_request` first: token ids (type, range against the vocabulary), the prompt, every
  sampling parameter (type, finite, range, int32), logprob arguments, constrained-decoding specs
  (compiled, as the scheduler would), session parameters and fields a text model cannot take.

A refusal is a :class:`RequestRejected`, a ``ValueError`` whose text names the field: SGLang's
native ``/generate`` and its OpenAI routes (``/v1/completions``, ``/v1/chat/completions``) answer
a ``ValueError`` with HTTP 400 (a streamed request gets it as the stream's error event, as SGLang
sends its own). Nothing is changed in a request that passes.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from sparse_sglang.integration.registry import relies_on, wrap_once

INT32_MAX = 2**31 - 1  # SGLang batches top_k, min_new_tokens, ... into int32 tensors
INT64_MAX = 2**63 - 1
# Parallel samples (``n``) of one prompt: each is a request of its own with its own KV, and
# SGLang expands them into the batch before anything else is checked.
MAX_SAMPLES_PER_PROMPT = 128

SAMPLING_FLOATS = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")
# name -> (smallest, largest) accepted; None = may be null (SGLang's default)
SAMPLING_INTS = {
    "max_new_tokens": (0, INT32_MAX),
    "min_new_tokens": (0, INT32_MAX),
    "top_k": (-1, INT32_MAX),
    "n": (1, MAX_SAMPLES_PER_PROMPT),
    "stream_interval": (1, INT32_MAX),  # the scheduler streams every stream_interval tokens (a modulus)
    "sampling_seed": (0, INT64_MAX),
}
SAMPLING_BOOLS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")
GRAMMARS = ("json_schema", "regex", "ebnf", "structural_tag")
# SamplingParams fields that SGLang fills in itself (normalize()); a client setting them would skip
# that processing.
SAMPLING_INTERNAL = ("stop_strs", "stop_regex_strs", "stop_str_max_len", "stop_regex_max_len", "is_normalized")
SESSION_FIELDS = {"id": str, "rid": str, "offset": int, "replace": bool, "drop_previous_output": bool}
# Per-item fields of a batch request: each, given as a list, holds one entry per prompt.
BATCH_LIST_FIELDS = ("rid", "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num",
                     "return_sampling_mask", "lora_path", "custom_logit_processor", "return_hidden_states")  # fmt: skip


class RequestRejected(ValueError):
    """A request the server refuses: ``str(err)`` is one line, ``<field>: <reason>`` (HTTP 400)."""

    def __init__(self, field: str, reason: str):
        self.field = field
        super().__init__(f"{field}: {reason}")


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """What a request is checked against (from the tokenizer manager's model and server args)."""

    vocab_size: int
    grammar_backend: str | None = "xgrammar"  # constrained-decoding specs are compiled with it; None = not checked
    multimodal: bool = False  # the model takes image/video/audio data
    sparse: bool = True  # sparse decode serves token ids only (no input_embeds)


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_int(field: str, value: Any, low: int, high: int) -> None:
    if not _is_int(value):
        raise RequestRejected(field, f"must be an integer, got {_describe(value)}")
    if not low <= value <= high:
        raise RequestRejected(field, f"must be in [{low}, {high}], got {value}")


def check_token_ids(field: str, ids: Any, vocab_size: int) -> None:
    """``ids`` is a list of ints, each a token of the vocabulary (``0 <= id < vocab_size``): each
    one indexes the embedding table on the GPU."""
    if not isinstance(ids, list) or not all(_is_int(i) for i in ids):
        raise RequestRejected(field, "must be a list of integer token ids")
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        bad = next(i for i in ids if not 0 <= i < vocab_size)
        raise RequestRejected(field, f"token id {bad} is outside the vocabulary [0, {vocab_size})")


# -- the batch form, before SGLang expands it ------------------------------------------------------


def batch_size_of(obj) -> int | None:
    """Prompts in a batch request (``None``: a single request)."""
    if obj.text is not None:
        return None if isinstance(obj.text, str) else len(obj.text)
    if obj.input_ids is not None:
        return None if not obj.input_ids or _is_int(obj.input_ids[0]) else len(obj.input_ids)
    return None


def check_batch_form(obj) -> None:
    """The shape of a ``GenerateReqInput`` as the client sent it: exactly one input, a non-empty
    batch whose per-item lists have one entry per prompt, and an ``n`` SGLang can expand by."""
    given = [name for name in ("text", "input_ids", "input_embeds") if getattr(obj, name) is not None]
    if len(given) != 1:
        raise RequestRejected("text", f"give exactly one of text, input_ids or input_embeds, got {len(given)}"
                                      f"{' (' + ', '.join(given) + ')' if given else ''}")  # fmt: skip
    if obj.text is not None and not isinstance(obj.text, str):
        if not isinstance(obj.text, list) or not all(isinstance(t, str) for t in obj.text):
            raise RequestRejected("text", "must be a string or a list of strings")
    if obj.input_ids is not None:
        if not isinstance(obj.input_ids, list) or not obj.input_ids:
            raise RequestRejected("input_ids", "must be a non-empty list of token ids, or of such lists")
        if not _is_int(obj.input_ids[0]) and not all(isinstance(row, list) and row for row in obj.input_ids):
            raise RequestRejected("input_ids", "a batch must be a list of non-empty lists of token ids")
    embeds = obj.input_embeds
    if embeds is not None and not (isinstance(embeds, list) and embeds and isinstance(embeds[0], list) and embeds[0]):
        raise RequestRejected("input_embeds", "must be a non-empty list of embedding vectors, or of such lists")
    size = batch_size_of(obj)
    if size == 0:
        raise RequestRejected(given[0], "the batch is empty")
    for name in BATCH_LIST_FIELDS:
        value = getattr(obj, name)
        if isinstance(value, list) and (size is None or len(value) != size):
            if size is None and name == "return_hidden_states":
                continue  # SGLang takes a list of modes for a single request too
            raise RequestRejected(name, f"a list of {len(value)} entries for "
                                        f"{'a single prompt' if size is None else f'{size} prompts'}")  # fmt: skip
    params = obj.sampling_params
    if params is not None:
        items = params if isinstance(params, list) else [params]
        if not all(isinstance(p, dict) for p in items):
            raise RequestRejected("sampling_params", "must be an object, or a list of one object per prompt")
        for p in items:  # null too: SGLang compares it with 1 before any default applies
            _check_int("sampling_params.n", p.get("n", 1), *SAMPLING_INTS["n"])
        if len({p.get("n", 1) for p in items}) > 1:  # ints by now (a list or an object is unhashable)
            raise RequestRejected("sampling_params.n", "must be the same for every prompt of a batch")
    if obj.token_ids_logprob and size is not None and isinstance(obj.token_ids_logprob[0], list):
        if len(obj.token_ids_logprob) != size:
            raise RequestRejected(
                "token_ids_logprob", f"a list of {len(obj.token_ids_logprob)} lists for {size} prompts"
            )


# -- one request -----------------------------------------------------------------------------------


def check_request(obj, input_ids: list[int] | None, limits: ServerLimits) -> None:
    """One (single, normalized) ``GenerateReqInput`` with its prompt's token ids."""
    if obj.input_embeds is not None and limits.sparse:
        raise RequestRejected("input_embeds", "not accepted with sparse decode; send text or input_ids")
    if obj.contains_mm_input() and not limits.multimodal:
        field = next(name for name in ("image_data", "video_data", "audio_data") if getattr(obj, name))
        raise RequestRejected(field, "this model takes text only")
    if obj.input_embeds is None:
        field = "input_ids" if obj.input_ids is not None else "text"
        if input_ids is not None:
            check_token_ids(field, input_ids, limits.vocab_size)
        if not input_ids:
            raise RequestRejected(field, "the prompt is empty (no tokens)")
    prompt_len = len(input_ids or ())
    check_sampling_params(obj.sampling_params, limits)
    check_logprob_args(obj, prompt_len, limits.vocab_size)
    check_session(obj)
    if obj.rid is not None and (not isinstance(obj.rid, str) or not obj.rid):
        raise RequestRejected("rid", f"must be a non-empty string, got {_describe(obj.rid)}")


def check_logprob_args(obj, prompt_len: int, vocab_size: int) -> None:
    """``return_logprob``, ``top_logprobs_num`` (a top-k over the vocabulary on the GPU),
    ``logprob_start_len`` (-1 = output tokens only, else a prompt position) and
    ``token_ids_logprob`` (vocabulary ids, gathered on the GPU)."""
    if obj.return_logprob is not None and not isinstance(obj.return_logprob, bool):
        raise RequestRejected("return_logprob", f"must be true or false, got {_describe(obj.return_logprob)}")
    if obj.top_logprobs_num is not None:
        _check_int("top_logprobs_num", obj.top_logprobs_num, 0, vocab_size)
    if obj.logprob_start_len is not None:
        _check_int("logprob_start_len", obj.logprob_start_len, -1, max(prompt_len, 0))
    if obj.token_ids_logprob:
        check_token_ids("token_ids_logprob", obj.token_ids_logprob, vocab_size)


def check_session(obj) -> None:
    if obj.session_id is not None and (not isinstance(obj.session_id, str) or not obj.session_id):
        raise RequestRejected("session_id", f"must be a non-empty string, got {_describe(obj.session_id)}")
    params = obj.session_params
    if params is None:
        return
    if not isinstance(params, dict):
        raise RequestRejected("session_params", f"must be an object, got {_describe(params)}")
    for key, value in params.items():
        if key not in SESSION_FIELDS:
            raise RequestRejected(f"session_params.{key}", f"unknown; the fields are {', '.join(SESSION_FIELDS)}")
        want = SESSION_FIELDS[key]
        if value is not None and not (isinstance(value, want) and (want is bool or not isinstance(value, bool))):
            raise RequestRejected(f"session_params.{key}", f"must be {want.__name__}, got {_describe(value)}")
    if params.get("offset") is not None and not 0 <= params["offset"] <= INT32_MAX:
        raise RequestRejected("session_params.offset", f"must be in [0, {INT32_MAX}], got {params['offset']}")


# -- sampling parameters ---------------------------------------------------------------------------


def check_sampling_params(params: Any, limits: ServerLimits) -> None:
    """Every field of one request's ``sampling_params``: known, of its type, finite and in range
    where SGLang's ``SamplingParams.verify`` does not look (it checks the float ranges, which
    refuse NaN, after these), token ids in the vocabulary, specs that compile."""
    if params is None:
        return
    if not isinstance(params, dict):
        raise RequestRejected("sampling_params", f"must be an object, got {_describe(params)}")
    known = sampling_param_names()
    for key, value in params.items():
        field = f"sampling_params.{key}"
        if key not in known:
            raise RequestRejected(field, "unknown sampling parameter")
        if value is None:
            continue  # SGLang's default
        if key in SAMPLING_FLOATS:
            if not _is_number(value) or not math.isfinite(value):
                raise RequestRejected(field, f"must be a finite number, got {_describe(value)}")
        elif key in SAMPLING_INTS:
            _check_int(field, value, *SAMPLING_INTS[key])
        elif key in SAMPLING_BOOLS:
            if not isinstance(value, bool):
                raise RequestRejected(field, f"must be true or false, got {_describe(value)}")
        elif key in ("stop", "stop_regex"):
            strings = [value] if isinstance(value, str) else value
            if not isinstance(strings, list) or not all(isinstance(s, str) for s in strings):
                raise RequestRejected(field, "must be a string or a list of strings")
            if key == "stop_regex":
                for pattern in strings:
                    check_stop_regex(field, pattern)
        elif key == "stop_token_ids":
            check_token_ids(field, list(value) if isinstance(value, (list, set, tuple)) else value, limits.vocab_size)
        elif key == "logit_bias":
            check_logit_bias(field, value, limits.vocab_size)
        elif key == "custom_params":
            if not isinstance(value, dict):
                raise RequestRejected(field, f"must be an object, got {_describe(value)}")
        elif key in GRAMMARS:
            check_grammar(field, key, value, limits.grammar_backend)
    max_new, min_new = params.get("max_new_tokens"), params.get("min_new_tokens")
    if max_new is not None and min_new is not None and min_new > max_new:
        raise RequestRejected("sampling_params.min_new_tokens", f"{min_new} is more than max_new_tokens ({max_new})")


def sampling_param_names() -> frozenset[str]:
    """The parameters a client may set: SGLang's ``SamplingParams`` fields but its internal ones."""
    import msgspec
    from sglang.srt.sampling.sampling_params import SamplingParams

    return frozenset(f.name for f in msgspec.structs.fields(SamplingParams)) - set(SAMPLING_INTERNAL)


def check_logit_bias(field: str, bias: Any, vocab_size: int) -> None:
    """``{token id (as a string): finite bias}``: the scheduler adds each bias at its id's column on the GPU."""
    if not isinstance(bias, dict):
        raise RequestRejected(field, f"must be an object of token id -> bias, got {_describe(bias)}")
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise RequestRejected(field, f"key {_describe(key)} is not a token id") from None
        if not 0 <= token < vocab_size:
            raise RequestRejected(field, f"token id {token} is outside the vocabulary [0, {vocab_size})")
        if not _is_number(value) or not math.isfinite(value):
            raise RequestRejected(field, f"bias of token {token} must be a finite number, got {_describe(value)}")


def check_stop_regex(field: str, pattern: str) -> None:
    """A stop regex compiles, and SGLang can bound how many tokens it spans (``normalize()``)."""
    from sglang.srt.sampling.sampling_params import get_max_seq_length

    try:
        re.compile(pattern)
        get_max_seq_length(pattern)
    except (re.error, RecursionError, OverflowError, ValueError) as err:
        raise RequestRejected(field, f"invalid regex: {_first_line(err)}") from None


def _first_line(err: BaseException) -> str:
    # xgrammar prefixes its messages with "[time] file.cc:line: "; keep the reason, on one line.
    text = " ".join(str(err).split())
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text)[:200] or type(err).__name__


def check_grammar(field: str, kind: str, spec: Any, backend: str | None) -> None:
    """A constrained-decoding spec compiles, as the scheduler's grammar backend compiles it (the
    tokenizer-independent part, xgrammar's ``Grammar.from_*``); with another backend only its form
    is checked here and the scheduler refuses what does not compile."""
    if not isinstance(spec, str):
        raise RequestRejected(field, f"must be a string, got {_describe(spec)}")
    if kind == "structural_tag":
        import json

        try:
            tag = json.loads(spec)
        except ValueError as err:
            raise RequestRejected(field, f"is not JSON: {_first_line(err)}") from None
        if not isinstance(tag, dict):
            raise RequestRejected(field, "must be a JSON object")
        return
    if backend != "xgrammar" or (kind == "json_schema" and spec == "$$ANY$$"):
        return
    import xgrammar

    compile_spec = {"json_schema": xgrammar.Grammar.from_json_schema, "regex": xgrammar.Grammar.from_regex,
                    "ebnf": xgrammar.Grammar.from_ebnf}[kind]  # fmt: skip
    try:
        compile_spec(spec)
    except (RuntimeError, ValueError, TypeError, UnicodeError) as err:
        raise RequestRejected(field, f"does not compile: {_first_line(err)}") from None


# -- the hooks -------------------------------------------------------------------------------------


def limits_of(tokenizer_manager) -> ServerLimits:
    server_args = tokenizer_manager.server_args
    sparse = getattr(server_args, "sparse", None)
    return ServerLimits(
        vocab_size=tokenizer_manager.model_config.vocab_size,
        grammar_backend=server_args.grammar_backend,
        multimodal=tokenizer_manager.mm_processor is not None,
        sparse=bool(sparse and sparse.enabled),
    )


@relies_on("sglang.srt.managers.io_struct:GenerateReqInput.normalize_batch_and_arguments",
           at="sglang/srt/managers/io_struct.py:355")  # fmt: skip
def patch_normalize_batch_and_arguments() -> None:
    """Make ``GenerateReqInput.normalize_batch_and_arguments`` run :func:`check_batch_form` first
    (it indexes and expands the batch; a malformed one failed there with a 500)."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    def wrap(original):
        def normalize_batch_and_arguments(self):
            check_batch_form(self)
            return original(self)

        return normalize_batch_and_arguments

    wrap_once(GenerateReqInput, "normalize_batch_and_arguments", wrap)


@relies_on("sglang.srt.managers.tokenizer_manager:TokenizerManager._validate_one_request",
           at="sglang/srt/managers/tokenizer_manager.py:1140")  # fmt: skip
def patch_validate_one_request() -> None:
    """Make ``TokenizerManager._validate_one_request`` run :func:`check_request` on a generate
    request first (every path, single, batch or batch-tokenized, calls it once per prompt, before
    the request is built and sent to the scheduler). Embedding requests get the token-id check."""
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    def wrap(original):
        def _validate_one_request(self, obj, input_ids):
            limits = limits_of(self)
            if isinstance(obj, GenerateReqInput):
                check_request(obj, input_ids, limits)
            elif input_ids is not None:
                check_token_ids("input_ids", list(input_ids), limits.vocab_size)
            return original(self, obj, input_ids)

        return _validate_one_request

    wrap_once(TokenizerManager, "_validate_one_request", wrap)


# OpenAI routes whose request models read the body as a mapping before validating it.
JSON_OBJECT_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")


@relies_on("sglang.srt.entrypoints.http_server:openai_v1_chat_completions",
           at="sglang/srt/entrypoints/http_server.py:1702")  # fmt: skip
def patch_openai_body_must_be_an_object() -> None:
    """A middleware on SGLang's FastAPI app (``http_server.app``, which serves this route): a POST
    to an OpenAI route whose body is JSON but not an object (``5``, ``"text"``, ``[]``) is a 400
    naming the body. ``ChatCompletionRequest``'s
    own "before" validator calls ``.get`` on the body, so such a request failed with a 500.
    Malformed JSON is left to FastAPI, which SGLang already answers with a 400."""
    from sglang.srt.entrypoints.http_server import app

    refuse_bodies_that_are_not_objects(app)


def refuse_bodies_that_are_not_objects(app) -> None:
    """Install the middleware of :func:`patch_openai_body_must_be_an_object` on a FastAPI ``app``
    (once; also after the app has started, when Starlette rebuilds its middleware stack on the
    next request)."""
    import json

    from fastapi.responses import JSONResponse
    from starlette.middleware import Middleware
    from starlette.middleware.base import BaseHTTPMiddleware

    if getattr(app.state, "sparse_json_object_guard", False):
        return
    app.state.sparse_json_object_guard = True

    async def openai_body_must_be_an_object(request, call_next):
        if request.method == "POST" and request.url.path in JSON_OBJECT_ROUTES:
            try:
                body = json.loads(await request.body())
            except ValueError:
                body = {}
            if not isinstance(body, dict):
                message = f"request body: must be a JSON object, got {type(body).__name__}"
                return JSONResponse(
                    {"object": "error", "message": message, "type": "BadRequestError", "param": None, "code": 400},
                    status_code=400,
                )
        return await call_next(request)

    app.user_middleware.insert(0, Middleware(BaseHTTPMiddleware, dispatch=openai_body_must_be_an_object))
    app.middleware_stack = None  # rebuilt with it on the next request
