"""Probe: how many streamed chunks a second can the serving benchmark's client read?

Sparse TP=2 decoded 5,134 tok/s by its server's log while the client received 3,717
(docs/results.md, Parallelism): with SGLang's default ``/generate`` streaming, each token's chunk
carries all of the request's output so far, so the JSON to write and to parse grows with the
request. This takes the server out: a mock server in another process writes prebuilt chunks as fast
as it can to ``--streams`` concurrent requests, and :func:`benchmark.serving.stream_generate` reads
them, as in a serving run. CPU only::

    python benchmark/probes/stream_client.py --streams 160 --chunks 200 --position 2500
    python benchmark/probes/stream_client.py --streams 160 --chunks 200 --position 2500 --incremental
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import random
import sys
import time
from pathlib import Path

import aiohttp
import orjson
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmark.serving import stream_generate  # noqa: E402

PORT = 18123


def chunks(count: int, position: int, incremental: bool) -> list[bytes]:
    """SSE events as SGLang's ``/generate`` streams them, tokens ``position`` to ``position + count``:
    each with its new token only (``incremental``) or all the output so far."""
    ids = [random.randrange(1000, 100_000) for _ in range(position + count)]
    meta = {"id": "x" * 32, "finish_reason": None, "prompt_tokens": 16_000, "cached_tokens": 0}
    events = []
    for k in range(position, position + count):
        output = ids[k : k + 1] if incremental else ids[: k + 1]
        body = {"text": None, "output_ids": output, "meta_info": {**meta, "completion_tokens": k + 1}}
        events.append(b"data: " + orjson.dumps(body) + b"\n\n")
    return events


def serve(events: list[bytes]) -> None:
    async def generate(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in events:
            await response.write(event)
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/generate", generate)
    web.run_app(app, port=PORT, print=None)


async def read_all(streams: int) -> tuple[int, float]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.perf_counter()
        received: list[list] = [[] for _ in range(streams)]
        url = f"http://127.0.0.1:{PORT}"
        await asyncio.gather(*(stream_generate(session, url, b"{}", r) for r in received))
        return sum(map(len, received)), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=160, help="requests streaming at once")
    parser.add_argument("--chunks", type=int, default=200, help="chunks (tokens) each stream sends")
    parser.add_argument("--position", type=int, default=2500, help="output tokens each stream has already sent")
    parser.add_argument("--incremental", action="store_true", help="as --incremental-streaming-output streams")
    args = parser.parse_args()
    server = multiprocessing.Process(
        target=serve, args=(chunks(args.chunks, args.position, args.incremental),), daemon=True
    )
    server.start()
    time.sleep(2)  # the mock server binds
    try:
        count, seconds = asyncio.run(read_all(args.streams))
    finally:
        server.terminate()
    kind = "incremental" if args.incremental else "cumulative"
    print(f"{kind}, {args.streams} streams at token {args.position}: {count} chunks in {seconds:.1f} s, "
          f"{count / seconds:,.0f} chunks/s")  # fmt: skip


if __name__ == "__main__":
    main()
