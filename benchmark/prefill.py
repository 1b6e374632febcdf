"""Layer-segmented prefill against chunked prefill on the sparse server (issue 6's measurement).

The 8B shape with dummy weights, ``input_ids`` in. Two sparse servers, one per system:

- ``chunked``: SGLang's chunked prefill, ``--chunked-prefill-size 2048`` (each chunk runs through
  every layer in one iteration; the running decodes wait for the whole prompt);
- ``segmented``: ``--sparse-segmented-prefill true`` at the default injection budget (2048 tokens
  x the layers per iteration) and the default in-layer chunk (4096 tokens).

On each: ``--decodes`` requests start and decode (streamed; every token's arrival time kept); once
they all decode, a ``--prompt-tokens`` prompt arrives. Its TTFT, and the gaps between the running
decodes' tokens while it prefills (mean, p99, max), are the TTFT and TBT numbers. On the segmented
server the same runs again with a ``--peak-prompt-tokens`` (128K) prompt: the hybrid's TBT for the
longest prompts. Then, with nothing running, one ``--peak-prompt-tokens`` prompt alone and one
prompt of the server's chunk size alone, each between two reads of the server's GPU memory peak
(``/get_server_info``). The GPU memory one long prefill uses is its peak over what was allocated
before it plus the prefix staging buffer (allocated at start-up, so in no peak; the server reports
its size): against one layer's KV of that prompt, ``peak_hbm_over_one_layer``. The chunk-long
prompt's peak (the chunk's activations and its own KV) shows how much of that is activations;
``peak_kv_hbm_over_one_layer`` counts the KV alone: the staging buffer, what the long prompt's peak
adds to the chunk-long one's, and the chunk's own KV.

Summary: ``ttft_ratio_vs_chunked`` (segmented / chunked), ``tbt_ratio_vs_chunked`` (p99 of the
decode gaps during the prefill, segmented / chunked), ``tbt_p99_long_prompt_s`` (segmented, the
128K prompt), ``peak_hbm_over_one_layer`` and ``peak_kv_hbm_over_one_layer`` (segmented server),
``max_prompt_ratio`` (not measured here: ``null``).

    python -m benchmark.prefill      # two server starts

Writes ``benchmark/results/prefill-<date>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from pathlib import Path

import aiohttp
import requests

from sparse_sglang.testing.models import (
    LLAMA3_8B_CONFIG,
    LLAMA3_8B_KV_BYTES_PER_TOKEN,
    LLAMA3_8B_TOKEN_IDS,
    write_llama3_8b_dummy,
)
from sparse_sglang.testing.provenance import add_server_run_args, finish_run
from sparse_sglang.testing.server import (
    SPARSE_MODULE,
    ServerProcess,
    flush_cache,
    generate_ids,
    sparse_state,
    streamed_meta,
)

SYSTEMS = {
    "chunked": ["--chunked-prefill-size", "2048"],
    "segmented": ["--sparse-segmented-prefill", "true"],
}


def prompt(tag: str, n: int) -> list[int]:
    rng = random.Random(tag)
    return [rng.randrange(*LLAMA3_8B_TOKEN_IDS) for _ in range(n)]


def one_layer_kv_bytes(tokens: int) -> int:
    """K and V of ``tokens`` tokens in one layer of the 8B shape (bf16)."""
    return tokens * LLAMA3_8B_KV_BYTES_PER_TOKEN // LLAMA3_8B_CONFIG["num_hidden_layers"]


async def stream(session: aiohttp.ClientSession, url: str, rid: str, ids: list[int], new_tokens: int) -> dict:
    """A streamed greedy request; ``arrivals``: (seconds since the epoch of perf_counter, tokens so far)."""
    sent, arrivals, finish = time.perf_counter(), [], None
    async for arrived, meta in streamed_meta(session, url, ids, new_tokens, rid):
        arrivals.append((arrived, meta.get("completion_tokens", 0)))
        finish = meta.get("finish_reason")
    return {"sent": sent, "arrivals": arrivals, "finish": finish}


def gaps_within(arrivals: list[tuple[float, int]], start: float, end: float) -> list[float]:
    """Seconds between consecutive new tokens of one stream, for every gap that overlaps
    ``(start, end)``: one that spans the whole window is a decode stalled by the prefill."""
    out = []
    for (t0, n0), (t1, n1) in zip(arrivals, arrivals[1:]):
        if t1 > start and t0 < end and n1 > n0:
            out.append((t1 - t0) / (n1 - n0))
    return out


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def prefill_next_to_decodes(url: str, args, prompt_tokens: int) -> dict:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=1800)) as session:  # fmt: skip
        # Request ids unique per run, none a prefix of another (SGLang aborts every request whose
        # rid starts with the aborted one's): a second run that reused the first run's ids had its
        # decodes stop before its prompt arrived.
        rids = [f"decode-{i}-of-{prompt_tokens}" for i in range(args.decodes)]
        decodes = [asyncio.create_task(stream(session, url, rid, prompt(f"decode-{i}", args.decode_prompt_tokens),
                                              args.decode_new_tokens)) for i, rid in enumerate(rids)]  # fmt: skip
        await asyncio.sleep(args.settle_s)  # every decode past its prefill
        long = await stream(session, url, f"long-{prompt_tokens}", prompt("long", prompt_tokens), 1)
        first = long["arrivals"][0][0] if long["arrivals"] else float("nan")
        for i in range(args.decodes):  # done measuring: stop them
            async with session.post(url + "/abort_request", json={"rid": rids[i]}) as resp:
                resp.raise_for_status()
        decoded = await asyncio.gather(*decodes)
    gaps = [g for d in decoded for g in gaps_within(d["arrivals"], long["sent"], first)]
    before = [g for d in decoded for g in gaps_within(d["arrivals"], long["sent"] - args.settle_s / 2, long["sent"])]
    return {
        "prompt_tokens": prompt_tokens,
        # decodes that got a token while the prompt prefilled (all of them, or the gaps mean little)
        "decodes_alive_during_prefill": sum(any(long["sent"] < t <= first for t, _ in d["arrivals"]) for d in decoded),
        "ttft_s": first - long["sent"],
        "decode_gaps_during_prefill": len(gaps),
        "tbt_mean_s": statistics.fmean(gaps) if gaps else float("nan"),
        "tbt_p99_s": percentile(gaps, 0.99),
        "tbt_max_s": max(gaps, default=float("nan")),
        "tbt_p50_before_s": percentile(before, 0.5),
        # each decode's token arrivals, seconds from the long prompt's arrival, within 2 s of the prefill
        "arrivals": [
            [(round(t - long["sent"], 4), n) for t, n in d["arrivals"] if long["sent"] - 2 < t < first + 2]
            for d in decoded
        ],  # fmt: skip
    }


def peak_of(url: str, ids: list[int]) -> dict:
    """GPU memory peak over what was allocated before, while one prompt prefills alone."""
    flush_cache(url, 60)
    before = sparse_state(url)  # resets the peak
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    requests.post(url + "/generate", json=body, timeout=1800).raise_for_status()
    after = sparse_state(url)
    return {"tokens": len(ids), "allocated_before_bytes": before["hbm_allocated_bytes"],
            "peak_over_before_bytes": after["hbm_peak_bytes_since_last_report"] - before["hbm_allocated_bytes"],
            "prefix_staging_bytes": after.get("prefix_staging_bytes")}  # fmt: skip


def summarize(systems: dict, peak_tokens: int) -> dict:
    c, s = systems["chunked"], systems["segmented"]
    layer = one_layer_kv_bytes(peak_tokens)
    peaks = s["peaks"]
    staging = peaks["long"]["prefix_staging_bytes"]  # allocated at start-up, so in no peak
    long_prompt = s.get("next_to_decodes_long") or {}
    return {
        "ttft_ratio_vs_chunked": s["next_to_decodes"]["ttft_s"] / c["next_to_decodes"]["ttft_s"],
        "tbt_ratio_vs_chunked": s["next_to_decodes"]["tbt_p99_s"] / c["next_to_decodes"]["tbt_p99_s"],
        "tbt_p99_long_prompt_s": long_prompt.get("tbt_p99_s"),
        "long_prompt_tokens": long_prompt.get("prompt_tokens"),
        "peak_hbm_over_one_layer": (staging + peaks["long"]["peak_over_before_bytes"]) / layer,
        # KV in HBM: the staging buffer, what the long prompt's peak adds to a chunk-long
        # prompt's, and the chunk's own new KV
        "peak_kv_hbm_over_one_layer": (
            staging
            + peaks["long"]["peak_over_before_bytes"]
            - peaks["chunk"]["peak_over_before_bytes"]
            + one_layer_kv_bytes(peaks["chunk"]["tokens"])
        )
        / layer,  # fmt: skip
        "chunked_prefill_all_layers_over_one_layer": LLAMA3_8B_CONFIG["num_hidden_layers"],
        "max_prompt_ratio": None,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", default="chunked,segmented")
    parser.add_argument("--prompt-tokens", type=int, default=65536)
    parser.add_argument("--decodes", type=int, default=16)
    parser.add_argument("--decode-prompt-tokens", type=int, default=1024)
    parser.add_argument("--decode-new-tokens", type=int, default=4000, help="more than they decode while measured")
    parser.add_argument("--settle-s", type=float, default=3.0)
    parser.add_argument("--peak-prompt-tokens", type=int, default=131072 - 64)
    parser.add_argument("--host-cache-gb", type=float, default=32.0)
    parser.add_argument("--extra-server-args", default="")
    add_server_run_args(parser, "prefill")
    args = parser.parse_args(argv)
    model = write_llama3_8b_dummy(Path(args.log_dir) / "llama3-8b-dummy")
    flags = ["--load-format", "dummy", "--skip-tokenizer-init", "--mem-fraction-static", "0.8", "--cuda-graph-max-bs-decode", "32",
             "--sparse-host-cache-gb", str(args.host_cache_gb), *args.extra_server_args.split()]  # fmt: skip
    systems = {}
    for name in args.systems.split(","):
        with ServerProcess(
            SPARSE_MODULE, model, [*flags, *SYSTEMS[name]], log_path=Path(args.log_dir) / f"{name}.log"
        ) as server:
            url = server.url
            generate_ids(url, prompt("warm", 4096), 8)
            flush_cache(url, 60)
            run = {"next_to_decodes": asyncio.run(prefill_next_to_decodes(url, args, args.prompt_tokens))}
            flush_cache(url, 60)
            if name == "segmented":
                run["next_to_decodes_long"] = asyncio.run(prefill_next_to_decodes(url, args, args.peak_prompt_tokens))
                flush_cache(url, 60)
                chunk = requests.get(url + "/get_server_info", timeout=60).json()["chunked_prefill_size"]
                run["peaks"] = {"chunk": peak_of(url, prompt("chunk", chunk)),
                                "long": peak_of(url, prompt("peak", args.peak_prompt_tokens))}  # fmt: skip
            run["segmented_prefill"] = sparse_state(url).get("segmented_prefill")
            systems[name] = run
    summary = summarize(systems, args.peak_prompt_tokens) if {"chunked", "segmented"} <= systems.keys() else {}
    body = {"flags": flags, "systems_flags": SYSTEMS, "args": vars(args) | {"out_dir": str(args.out_dir)},
            "systems": systems, "summary": summary}  # fmt: skip
    return finish_run("benchmark.prefill", argv, body, args.out_dir, "prefill-{date}.json")


if __name__ == "__main__":
    main()
