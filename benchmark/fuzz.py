"""Fuzz: thousands of generated requests, valid, borderline and bad, against a running server.

Requests come from hypothesis strategies (seeded: the same ``--seed`` gives the same requests), over
SGLang's generate routes, ``/generate``, ``/v1/completions`` and ``/v1/chat/completions`` (the
package adds no HTTP route of its own: its counters are SGLang's ``/get_server_info``, read here).
Each request is one of :data:`KINDS`: valid ones, and bad ones of every class the server must
refuse with a 4xx while it keeps serving (token ids outside the vocabulary, wrong types, NaN,
infinities and huge or negative numbers as JSON, specs that do not compile, odd batch forms, bad
logprob arguments and stop conditions, unknown fields, image data for a text model, malformed
JSON); valid requests are often unicode or borderline (empty strings, zero new tokens).

Requests go out ``--batch-size`` at a time; after each batch ``/health`` must answer, else the
server counts as dead (a server ``--launch`` started is started again; one given by ``--url`` ends
the run). A fixed greedy request runs on the fresh server first and again at the end
(``output_matches_fresh``); the pools' counters before and after, the radix cache flushed, give
``leaked_host_pages`` (sparse servers). Writes ``benchmark/results/fuzz-<date>.json``::

    python -m benchmark.fuzz --launch --requests 5000                 # starts the sparse server (default model)
    python -m benchmark.fuzz --url http://127.0.0.1:30000 --requests 5000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from sparse_sglang.testing.server import generate_ids, healthy, post_body, unpooled_session

ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")
ID_ROUTES = ROUTES[:2]  # the routes whose prompt may be token ids
VALID_KINDS = ("valid", "unicode", "empty_strings")
BAD_KINDS = ("token_out_of_vocab", "negative_token", "wrong_type", "non_finite", "huge_number", "negative_number",
             "huge_max_new_tokens", "bad_regex", "bad_json_schema", "bad_ebnf", "odd_batch", "bad_logprob",
             "bad_stop", "unknown_field", "text_model_media", "bad_session", "malformed_json")  # fmt: skip
KINDS = VALID_KINDS + BAD_KINDS
# OpenAI names of the native sampling fields (the OpenAI routes map them back)
OPENAI_NAMES = {"max_new_tokens": "max_tokens", "sampling_seed": "seed", "min_new_tokens": "min_tokens"}
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")
INT_FIELDS = ("max_new_tokens", "top_k", "min_new_tokens", "n", "sampling_seed")


@dataclass(frozen=True)
class FuzzCase:
    kind: str
    route: str
    body: bytes  # what goes on the wire (JSON, NaN and Infinity literals included, or not JSON at all)


def _json(obj) -> bytes:
    return json.dumps(obj, allow_nan=True).encode()  # NaN / Infinity literals: Python's json (FastAPI's) reads them


# -- strategies ------------------------------------------------------------------------------------

text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)
words = st.text("abcdefghij klmnop.,", min_size=1, max_size=30)


def fuzz_cases(vocab_size: int, model: str) -> st.SearchStrategy[FuzzCase]:
    """Every kind of request, each over the routes it applies to."""
    token = st.integers(0, vocab_size - 1)
    prompt_ids = st.lists(token, min_size=1, max_size=48)
    small_new = st.integers(0, 12)

    def request(draw, route: str, sampling: dict, prompt=None, **native_extra) -> dict:
        """A request body for ``route``: the prompt, the sampling fields (native names) where the
        route takes them, native top-level fields only on /generate."""
        if prompt is None:
            prompt = draw(st.one_of(words, prompt_ids))
        if route == "/generate":
            body = {"input_ids" if isinstance(prompt, list) else "text": prompt, "sampling_params": sampling}
            return {**body, **native_extra}
        fields = {OPENAI_NAMES.get(k, k): v for k, v in sampling.items()}
        fields.setdefault("max_tokens", draw(st.integers(1, 12)))
        if route == "/v1/completions":
            return {"model": model, "prompt": prompt, **fields}
        content = prompt if isinstance(prompt, str) else "".join(map(chr, [65 + t % 26 for t in prompt]))
        return {"model": model, "messages": [{"role": "user", "content": content}], **fields}

    def with_route(kind: str, build, routes=ROUTES):
        @st.composite
        def case(draw):
            route = draw(st.sampled_from(routes))
            body = build(draw, route)
            return FuzzCase(kind, route, body if isinstance(body, bytes) else _json(body))

        return case()

    def valid(draw, route):
        sampling = {"max_new_tokens": draw(small_new), "temperature": draw(st.sampled_from([0, 0.5, 1.0]))}
        if draw(st.booleans()):
            sampling.update(top_p=draw(st.floats(0.05, 1.0)), top_k=draw(st.sampled_from([-1, 1, 20])))
        if draw(st.booleans()):
            sampling["stop"] = draw(st.lists(words, min_size=1, max_size=2))
        extra = {}
        if route == "/generate" and draw(st.booleans()):
            extra = {"return_logprob": True, "top_logprobs_num": draw(st.integers(0, 5))}
        return request(draw, route, sampling, **extra)

    def bad_sampling(field_values):
        def build(draw, route):
            field, value = draw(field_values)
            return request(draw, route, {"max_new_tokens": 4, field: value})

        return build

    any_field = st.sampled_from(FLOAT_FIELDS + INT_FIELDS)
    wrong_value = st.one_of(st.just("hot"), st.just([1, 2]), st.just({"a": 1}), st.just(True), text.filter(bool))
    non_finite = st.sampled_from([math.nan, math.inf, -math.inf])
    huge = st.one_of(st.integers(2**63, 2**80), st.sampled_from([1e300, 1.7e308]))  # past int64 (sampling_seed)
    huge_max_new = st.one_of(st.integers(2**31, 2**70), st.sampled_from([2**31, 2**63, 10**30]))
    bad_regexes = st.one_of(
        st.sampled_from(["(", "[a-", "a{2,1}", "*a", "(?P<x", "\\", "a)", "[z-a]"]),
        st.builds("{}{}".format, st.sampled_from(["(", "["]), st.text("ab*+?|^$.-", max_size=8)),
    )  # unclosed
    bad_schemas = st.sampled_from(['{"type": 5}', "not json", "[1, 2]", '{"type": "object", "properties": 3}',
                                   '{"$ref": "#/nowhere"}', '{"type": "strin"}', "{"])  # fmt: skip
    bad_ebnfs = st.sampled_from(["root ::= ", "foo", 'root ::= "a" |', "root ::= b", "::=", 'root ::= "a'])

    def odd_batch(draw, route):
        ids = draw(prompt_ids)
        if route == "/v1/completions":
            return {
                "model": model,
                "prompt": draw(st.sampled_from([[], [[]], [ids, []], [[ids]], [""]])),
                "max_tokens": 4,
            }
        if route == "/v1/chat/completions":
            messages = draw(st.sampled_from([[], [{"role": "user"}], [{"role": "user", "content": []}],
                                             [{"role": "wizard", "content": "x"}], [{"content": "x"}]]))  # fmt: skip
            return {"model": model, "messages": messages, "max_tokens": 4}
        return draw(st.sampled_from([
            {"text": []}, {"input_ids": []}, {"input_ids": [ids, []]}, {"input_ids": [[ids]]},
            {"text": "a", "input_ids": ids}, {"text": ["a", "b"], "sampling_params": [{}]},
            {"text": ["a", "b"], "rid": ["only-one"]}, {"text": ["a", "b"], "sampling_params": [{"n": 2}, {"n": 3}]},
            {"text": "a", "return_logprob": [True, False]}, {"input_embeds": [[]]}, {"sampling_params": {}},
        ]))  # fmt: skip

    def bad_logprob(draw, route):
        prompt = draw(prompt_ids)
        choice = draw(st.sampled_from(["top", "start", "ids"]))
        if route == "/generate":
            extra = {"top": {"top_logprobs_num": draw(st.one_of(st.integers(vocab_size + 1, 2**40), st.integers(-99, -1)))},
                     "start": {"logprob_start_len": draw(st.one_of(st.integers(len(prompt) + 1, 2**40), st.integers(-2**40, -2)))},
                     "ids": {"token_ids_logprob": [0, draw(st.integers(vocab_size, 2**40))]}}[choice]  # fmt: skip
            return request(draw, route, {"max_new_tokens": 2}, prompt=prompt, return_logprob=True, **extra)
        field = "logprobs" if route == "/v1/completions" else "top_logprobs"
        value = draw(st.one_of(st.integers(vocab_size + 1, 2**40), st.integers(-99, -1)))
        body = request(draw, route, {"max_new_tokens": 2}, prompt=prompt)
        return {**body, field: value, **({"logprobs": True} if field == "top_logprobs" else {})}

    def bad_stop(draw, route):
        field, value = draw(st.one_of(
            st.tuples(st.just("stop"), st.sampled_from([5, [1, 2], [["a"]], {"a": 1}])),
            st.tuples(st.just("stop_regex"), bad_regexes),
            st.tuples(st.just("stop_token_ids"), st.one_of(st.lists(st.integers(vocab_size, 2**40), min_size=1, max_size=3),
                                                          st.just([-1]), st.just(["a"]))),
        ))  # fmt: skip
        return request(draw, route, {"max_new_tokens": 4, field: value})

    def unknown_field(draw, route):
        name = draw(st.sampled_from(["temprature", "is_normalized", "stop_strs", "max_new_token", "beam_width"]))
        return request(draw, route, {"max_new_tokens": 4, name: draw(st.sampled_from([1, True, "x"]))})

    def text_model_media(draw, route):
        if route == "/v1/chat/completions":
            content = [{"type": "text", "text": "what is this"},
                       {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]  # fmt: skip
            return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4}
        field = draw(st.sampled_from(["image_data", "audio_data", "video_data"]))
        return {**request(draw, "/generate", {"max_new_tokens": 4}), field: "http://127.0.0.1:9/x"}

    def bad_session(draw, route):
        params = draw(st.sampled_from([{"id": "s", "bogus": 1}, {"id": "s", "offset": "x"}, {"id": 5}, "session"]))
        return {**request(draw, "/generate", {"max_new_tokens": 4}), "session_params": params}

    def malformed(draw, route):
        return draw(st.sampled_from([b'{"text": "abc"', b"", b"[]", b"5", b'"text"', b"{'text': 'a'}",
                                     b'{"text": "a", "sampling_params": {"temperature": nan}}', b"\xff\xfe"]))  # fmt: skip

    def with_ids(ids_strategy):
        return lambda draw, route: request(draw, route, {"max_new_tokens": 4},
                                           prompt=draw(prompt_ids) + [draw(ids_strategy)])  # fmt: skip

    native_only = ("/generate",)
    strategies = [
        with_route("valid", valid),
        with_route(
            "unicode",
            lambda draw, route: request(
                draw, route, {"max_new_tokens": draw(small_new)}, prompt=draw(text.filter(str.strip))
            ),
        ),  # fmt: skip
        with_route(
            "empty_strings",
            lambda draw, route: request(
                draw, route, {"max_new_tokens": 4, "stop": [""]}, prompt=draw(st.sampled_from(["", " "]))
            ),
        ),  # fmt: skip
        # token ids go on the wire only where a prompt may be ids (chat turns them into text)
        with_route("token_out_of_vocab", with_ids(st.integers(vocab_size, 2**62)), ID_ROUTES),
        with_route("negative_token", with_ids(st.integers(-(2**62), -1)), ID_ROUTES),
        with_route("wrong_type", bad_sampling(st.tuples(any_field, wrong_value))),
        with_route("non_finite", bad_sampling(st.tuples(any_field, non_finite))),
        # temperature has no upper bound (a huge one samples near-uniformly); every other field has
        with_route("huge_number", bad_sampling(st.tuples(any_field.filter(lambda f: f != "temperature"), huge))),
        with_route(
            "negative_number",
            bad_sampling(
                st.tuples(
                    st.sampled_from(("max_new_tokens", "n", "sampling_seed", "top_p", "repetition_penalty")),
                    st.integers(-(2**40), -1),
                )
            ),
        ),  # fmt: skip
        with_route("huge_max_new_tokens", bad_sampling(st.tuples(st.just("max_new_tokens"), huge_max_new))),
        with_route("bad_regex", bad_sampling(st.tuples(st.just("regex"), bad_regexes))),
        with_route("bad_json_schema", bad_sampling(st.tuples(st.just("json_schema"), bad_schemas))),
        with_route("bad_ebnf", bad_sampling(st.tuples(st.just("ebnf"), bad_ebnfs))),
        with_route("odd_batch", odd_batch),
        with_route("bad_logprob", bad_logprob),
        with_route("bad_stop", bad_stop),
        with_route("unknown_field", unknown_field, native_only),
        with_route("text_model_media", text_model_media, ("/generate", "/v1/chat/completions")),
        with_route("bad_session", bad_session, native_only),
        with_route("malformed_json", malformed),
    ]
    return st.one_of(*strategies)


def generate_cases(n: int, seed_value: int, vocab_size: int, model: str) -> list[FuzzCase]:
    """``n`` cases drawn by hypothesis from :func:`fuzz_cases`, the same for the same seed."""
    strategy = fuzz_cases(vocab_size, model)
    cases: list[FuzzCase] = []
    rounds = 0
    while len(cases) < n:  # hypothesis may end a run early; the next round continues from another seed

        @settings(max_examples=n - len(cases), database=None, deadline=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))  # fmt: skip
        @seed(seed_value * 1_000_003 + rounds)
        @given(strategy)
        def collect(case: FuzzCase) -> None:
            cases.append(case)

        collect()
        rounds += 1
    return cases[:n]


# -- running against a server ----------------------------------------------------------------------


async def send_batch(url: str, cases: list[FuzzCase], timeout: float) -> list[tuple[int, str]]:
    """Each case's status and the first 200 characters of its answer (599: no answer, counted with the 5xx)."""

    async def one(session, case: FuzzCase) -> tuple[int, str]:
        status, text = await post_body(session, url, case.body, timeout, case.route)
        return status, text[:200]

    async with unpooled_session() as session:
        return await asyncio.gather(*(one(session, case) for case in cases))


def model_facts(url: str) -> tuple[str, int | None]:
    """The served model's path and, when it is a local folder, its vocabulary size."""
    import requests

    path = requests.get(url + "/model_info", timeout=60).json()["model_path"]
    config = Path(path) / "config.json"
    vocab = json.loads(config.read_text()).get("vocab_size") if config.is_file() else None
    return path, vocab


def probe(url: str, vocab_size: int) -> list[int]:
    """The fixed greedy request whose tokens must not change over the run."""
    ids = [random.Random(7).randrange(vocab_size) for _ in range(200)]
    return generate_ids(url, ids, 32)["output_ids"]


def pool_state(url: str) -> dict | None:
    """The sparse pools' counters (``None`` for a server without them)."""
    from sparse_sglang.testing.server import flush_cache, sparse_state

    flush_cache(url, 60)
    try:
        return sparse_state(url)
    except (KeyError, IndexError, TypeError, ValueError):
        return None


def summarize(records: list[dict], deaths: int, fresh: list[int], after: list[int] | None,
              idle: dict | None, now: dict | None) -> dict:  # fmt: skip
    from sparse_sglang.testing.server import leaks

    by_kind: dict[str, dict[str, int]] = {}
    for r in records:
        counts = by_kind.setdefault(r["kind"], {})
        bucket = f"{r['status'] // 100}xx"
        counts[bucket] = counts.get(bucket, 0) + 1
    bad = [r for r in records if r["kind"] in BAD_KINDS]
    return {
        "requests": len(records),
        "errors_5xx": sum(r["status"] >= 500 for r in records),
        "server_deaths": deaths,
        "output_matches_fresh": after == fresh,
        "leaked_host_pages": None if idle is None or now is None else leaks(idle, now)["leaked_host_pages"],
        "bad_requests_refused_4xx": f"{sum(400 <= r['status'] < 500 for r in bad)}/{len(bad)}",
        "bad_requests_answered_200": sum(r["status"] == 200 for r in bad),
        "by_kind": by_kind,
    }


def start_server(args, attempt: int):
    from sparse_sglang.testing.server import SPARSE_MODULE, ServerProcess

    server = ServerProcess(SPARSE_MODULE, args.model_path, args.extra_server_args.split(),
                           log_path=Path(args.log_dir) / f"fuzz-server-{attempt}.log")  # fmt: skip
    server.start()
    return server


def run(args) -> dict:
    server = start_server(args, 0) if args.launch else None
    url = server.url if server else args.url.rstrip("/")
    try:
        model, vocab = model_facts(url)
        vocab = args.vocab_size or vocab
        if vocab is None:
            raise SystemExit("fuzz.py: the server's model is not a local folder; give --vocab-size")
        started = time.monotonic()
        cases = generate_cases(args.requests, args.seed, vocab, model)
        generate_s = time.monotonic() - started
        fresh = probe(url, vocab)
        idle = pool_state(url)
        records, deaths = [], 0
        for start in range(0, len(cases), args.batch_size):
            batch = cases[start : start + args.batch_size]
            answers = asyncio.run(send_batch(url, batch, args.request_timeout))
            # a 5xx keeps its body: hypothesis may draw other cases elsewhere, so the seed alone may not replay it
            records += [{"i": start + i, "kind": c.kind, "route": c.route, "status": s, "answer": text,
                         **({"body": c.body.decode(errors="replace")} if s >= 500 else {})}
                        for i, (c, (s, text)) in enumerate(zip(batch, answers))]  # fmt: skip
            if healthy(url):
                continue
            deaths += 1
            if server is None:
                break  # a server we did not start cannot be started again
            server.stop()
            server = start_server(args, deaths)
            url = server.url
        now = pool_state(url)
        after = probe(url, vocab)
    finally:
        if server is not None:
            server.stop()
    return {"server": {"url": None if args.launch else url, "launched": args.launch, "model": model,
                       "vocab_size": vocab, "extra_server_args": args.extra_server_args},
            "generate_s": round(generate_s, 1), "probe_fresh": fresh, "probe_after": after,
            "pools_idle_before": idle, "pools_idle_after": now, "records": records,
            "summary": summarize(records, deaths, fresh, after, idle, now)}  # fmt: skip


def device_name() -> str:
    try:
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (client; server elsewhere)"
    except ImportError:
        return "unknown"


def main(argv: list[str] | None = None) -> dict:
    from sparse_sglang.testing.provenance import add_server_run_args, finish_run

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="a running server, e.g. http://127.0.0.1:30000")
    target.add_argument("--launch", action="store_true", help="start the sparse server (sparse_sglang.testing.server)")
    parser.add_argument("--model-path", default=None, help="with --launch; default: the launcher's default model")
    parser.add_argument("--extra-server-args", default="", help="with --launch: more launcher flags")
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument(
        "--batch-size", type=int, default=64, help="requests in flight at once; /health after each batch"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=None, help="default: the model folder's config.json")
    parser.add_argument("--request-timeout", type=float, default=300.0)
    add_server_run_args(parser, "fuzz")
    args = parser.parse_args(argv)
    return finish_run("benchmark.fuzz", argv, run(args), args.out_dir, "fuzz-{date}.json", device=device_name())


if __name__ == "__main__":
    main()
