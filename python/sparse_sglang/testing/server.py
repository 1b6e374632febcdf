"""A real SGLang (or sparse-sglang) server in a child process, for tests and benchmarks."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import requests

from sparse_sglang.config import SparseConfig

SPARSE_MODULE = "sparse_sglang.launch_server"
VANILLA_MODULE = "sglang.launch_server"


def generate_ids(url: str, ids: list[int], new_tokens: int, rid: str | None = None, logprobs: bool = False,
                 logprob_start_len: int = 0, top_logprobs: int = 0) -> dict:  # fmt: skip
    """One greedy ``/generate`` request on token ids (``ignore_eos``); asserts HTTP 200. ``logprobs``
    asks for the log-probability of every token from ``logprob_start_len`` on (-1: output tokens
    only; SGLang recomputes prompt positions it returns log-probabilities for, so a cached prefix
    is reused only up to ``logprob_start_len``), and each position's ``top_logprobs`` best."""
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}}
    if rid:
        body["rid"] = rid
    if logprobs:
        body.update(return_logprob=True, logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs)
    response = requests.post(url + "/generate", json=body, timeout=600)
    assert response.status_code == 200, response.text[:500]
    return response.json()


def prompt_logprobs(response: dict) -> list[float]:
    """The log-probability of every prompt token but the first (which has none) in a
    :func:`generate_ids` answer asked with ``logprobs``."""
    return [entry[0] for entry in response["meta_info"]["input_token_logprobs"][1:]]


def greedy_comparison(reference: list[dict], other: list[dict]) -> dict:
    """Whether each pair of ``/generate`` answers has the same output tokens, and the largest
    difference of their output log-probabilities (answers asked with ``logprobs``)."""
    logprobs = lambda out: [entry[0] for entry in out["meta_info"]["output_token_logprobs"]]  # noqa: E731
    return {
        "greedy_equal": [a["output_ids"] == b["output_ids"] for a, b in zip(reference, other)],
        "output_logprob_max_abs_diff": max(
            abs(x - y) for a, b in zip(reference, other) for x, y in zip(logprobs(a), logprobs(b))
        ),  # fmt: skip
    }


def sparse_state(url: str) -> dict:
    """The sparse server's pools and counters: ``GET /get_server_info``'s ``internal_states[0]["sparse"]``."""
    return requests.get(url + "/get_server_info", timeout=60).json()["internal_states"][0]["sparse"]


def leaks(idle: dict, now: dict, page_size: int = SparseConfig().page_size) -> dict:
    """What an idle server holds beyond what the fresh one did (all zero when nothing leaked):
    ``idle`` and ``now`` are two :func:`sparse_state` readings of one server, ``page_size`` its
    ``--sparse-page-size``."""
    return {
        "leaked_gpu_slots": idle["gpu_cache_slots_free"] - now["gpu_cache_slots_free"],
        "leaked_gpu_rows": now["gpu_cache_rows_open"] - idle["gpu_cache_rows_open"],
        "leaked_host_pages": (idle["host_tokens_free"] - now["host_tokens_free"]) // page_size,
        "leaked_request_slots": idle["request_slots_free"] - now["request_slots_free"],
    }


def warm_then_each_alone(url: str, prompts: list[list[int]], run) -> list[dict]:
    """A GPU test's reference: one short request takes the first-request costs, then each prompt
    runs alone (``run(url, ids)``) on an emptied radix cache."""
    generate_ids(url, prompts[0][:300], 4)
    assert flush_cache(url)
    alone = []
    for ids in prompts:
        alone.append(run(url, ids))
        assert flush_cache(url)
    return alone


def healthy(url: str, timeout: float = 60.0) -> bool:
    """Whether the server answers ``/health`` with 200 within ``timeout`` s."""
    try:
        return requests.get(url + "/health", timeout=timeout).status_code == 200
    except requests.RequestException:
        return False


def unpooled_session():
    """An aiohttp client session for load tests: no connection cap (aiohttp's default is 100: a
    request must reach the server when planned, or its abort would fire before the server knows
    its rid) and a new connection per request (an idle keep-alive one races uvicorn closing it after
    its 5 s timeout, and the request then fails in the client without reaching the server)."""
    import aiohttp

    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True))


async def post_body(session, url: str, body: bytes, timeout: float, route: str = "/generate") -> tuple[int, str]:
    """POST a prebuilt JSON ``body`` (valid or not) to ``url + route``: the HTTP status and the
    answer's text; 599 and the client's error when no answer came (counted as a server failure)."""
    import aiohttp

    try:
        async with session.post(url + route, data=body, headers={"Content-Type": "application/json"},
                                timeout=aiohttp.ClientTimeout(total=timeout)) as response:  # fmt: skip
            return response.status, await response.text()
    except (TimeoutError, aiohttp.ClientError) as err:
        return 599, f"client: {err!r}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flush_cache(url: str, timeout: float = 30.0) -> bool:
    """Empty a server's radix cache; SGLang waits up to ``timeout`` s for in-flight aborts to
    drain and refuses otherwise. ``False`` also when the server does not answer."""
    try:
        return requests.post(url + "/flush_cache", params={"timeout": timeout}, timeout=timeout + 30).status_code == 200
    except requests.RequestException:
        return False


async def sse_events(stream) -> AsyncIterator[bytes]:
    """The ``data:`` payloads of a server-sent-event stream (an aiohttp ``StreamReader``; own
    framing: a chunk's cumulative output_ids can outgrow aiohttp's line-length limit)."""
    buffer = b""
    async for piece in stream.iter_any():
        *events, buffer = (buffer + piece).split(b"\n\n")
        for event in events:
            if event.startswith(b"data: "):
                yield event[len(b"data: ") :]


async def streamed_meta(session, url: str, ids: list[int], new_tokens: int,
                        rid: str | None = None) -> AsyncIterator[tuple[float, dict]]:  # fmt: skip
    """A streamed greedy ``/generate`` on token ids (``ignore_eos``; ``session`` an aiohttp client
    session): each event's arrival time (``time.perf_counter()``) and ``meta_info``."""
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}}  # fmt: skip
    if rid:
        body["rid"] = rid
    async with session.post(
        url + "/generate", data=orjson.dumps(body), headers={"Content-Type": "application/json"}
    ) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        async for event in sse_events(resp.content):
            if event == b"[DONE]":
                break
            yield time.perf_counter(), orjson.loads(event)["meta_info"]


class ServerProcess:
    """``python -m <module> --model-path ... --port ...`` in its own process group.

    Use as a context manager: entering starts it and waits until ``/health``
    answers, leaving stops it (SIGTERM to the group, then SIGKILL after
    ``stop_timeout``) and records ``exit_code`` and ``stopped_cleanly``.
    """

    def __init__(
        self,
        module: str,
        model_path: str | None,
        args: list[str] = (),
        log_path: str | Path | None = None,
        env: dict[str, str] | None = None,
        start_timeout: float = 900.0,
        stop_timeout: float = 60.0,
    ):
        self.module = module
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        model = ["--model-path", model_path] if model_path else []
        self.command = [sys.executable, "-m", module, *model, "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.log_path = Path(log_path) if log_path else Path(f"/tmp/server-{self.port}.log")
        self.env = {**os.environ, **(env or {})}
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.proc: subprocess.Popen | None = None
        self.exit_code: int | None = None
        self.stopped_cleanly = False

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        self._log.write(" ".join(self.command) + "\n")
        self._log.flush()
        self.proc = subprocess.Popen(
            self.command, stdout=self._log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} while starting:\n{self.log_tail()}")
            try:
                if requests.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1.0)
        self.stop()
        raise TimeoutError(f"server not healthy after {self.start_timeout:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM the whole process group; clean = it was gone, children too, within stop_timeout."""
        if self.proc is None or self.exit_code is not None:
            return
        pgid = self.proc.pid
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.exit_code = self.proc.wait(timeout=self.stop_timeout)
            deadline = time.monotonic() + self.stop_timeout
            while _group_alive(pgid) and time.monotonic() < deadline:
                time.sleep(0.5)
            self.stopped_cleanly = not _group_alive(pgid)
        except subprocess.TimeoutExpired:
            self.stopped_cleanly = False
        if _group_alive(pgid):
            os.killpg(pgid, signal.SIGKILL)
            self.exit_code = self.proc.wait()
        self._log.close()

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _group_alive(pgid: int) -> bool:
    """Whether any live (non-zombie) process is in the group: zombies wait for a reaper, not for us."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # fields: state, ppid, pgrp, ...
            return True
    return False


@contextlib.asynccontextmanager
async def standin_server(routes: list) -> AsyncIterator[str]:
    """An aiohttp server on a free local port answering ``routes`` (``aiohttp.web`` route defs)
    in place of SGLang's, for testing benchmark clients without a GPU; yields its base URL."""
    from aiohttp import web

    app = web.Application(client_max_size=1 << 24)
    app.add_routes(routes)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()
