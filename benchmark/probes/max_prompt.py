"""The longest prompt each system starts at the same GPU memory for KV (issue 6's ``max_prompt_ratio``).

Vanilla SGLang prefills in chunks into a KV pool that holds every layer of every token, so the
longest prompt it can start is its pool (``--max-total-tokens``, what ``--kv-hbm-gb`` of KV holds
for the 8B shape). sparse-sglang keeps all KV in host memory and holds at most a fixed piece of one
layer of a prefill's cached prefix on the GPU (the prefix staging buffer), so at the same GPU memory
(page cache + page summaries of the whole host store + staging) its longest prompt is the model's
context, as far as the host store holds it.

Two servers, the 8B shape with dummy weights and a ``--context`` long context, nothing else
running. Each gets prompts of rising length (just under and just over vanilla's pool, then 2x, 4x
and 8x it, then the whole context), one at a time, each generating ``--new-tokens`` tokens; the
longest one answered before the first refused (or timed out) is the system's longest prompt.

Summary: ``longest_prompt`` per system, ``max_prompt_ratio`` (sparse / vanilla), the budget.

    python benchmark/probes/max_prompt.py     # 3.5 GiB of KV, a 256K context: about 6 minutes on an H100

Writes ``benchmark/results/max-prompt-<date>.json``.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repo root holds `benchmark`
from benchmark.serving import SYSTEM_SERVER_ARGS, SYSTEMS, sparse_gpu_cache_gb  # noqa: E402
from sparse_sglang.config import GIB  # noqa: E402
from sparse_sglang.testing.models import LLAMA3_8B_KV_BYTES_PER_TOKEN, LLAMA3_8B_TOKEN_IDS, write_llama3_8b_dummy  # noqa: E402
from sparse_sglang.testing.provenance import add_server_run_args, finish_run  # noqa: E402
from sparse_sglang.testing.server import ServerProcess  # noqa: E402

PAGE = 32


def pool_tokens(kv_hbm_gb: float) -> int:
    """Vanilla's token pool in ``kv_hbm_gb`` of KV (every layer of the 8B shape, bf16)."""
    return int(kv_hbm_gb * GIB // LLAMA3_8B_KV_BYTES_PER_TOKEN)


def ladder(pool: int, context: int, new_tokens: int) -> list[int]:
    """Prompt lengths to try, rising: around the pool, its multiples, the whole context."""
    # SGLang's last token must stay one short of the context (the 2026-11-23 run asked for
    # context - new_tokens - 1 and got new_tokens - 1 tokens back, which counted as refused)
    longest = context - new_tokens - 2
    steps = {pool - 8 * PAGE, pool + 8 * PAGE, 2 * pool, 4 * pool, 8 * pool, longest}
    return sorted(n for n in steps if 0 < n <= longest)


def host_cache_gb(context: int) -> float:
    """Host KV for one whole-context request, plus a little."""
    return math.ceil(context * LLAMA3_8B_KV_BYTES_PER_TOKEN / GIB) + 1


def try_lengths(url: str, lengths: list[int], new_tokens: int, timeout: float) -> list[dict]:
    """Each length in turn until one is refused or times out; the tries, in order."""
    tries = []
    for n in lengths:
        rng = random.Random(n)
        body = {"input_ids": [rng.randrange(*LLAMA3_8B_TOKEN_IDS) for _ in range(n)],
                "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}}  # fmt: skip
        started = time.monotonic()
        try:
            response = requests.post(url + "/generate", json=body, timeout=timeout)
            status, text = response.status_code, response.text
        except requests.RequestException as err:
            status, text = 599, repr(err)
        ok = status == 200 and len(response.json().get("output_ids", [])) == new_tokens
        tries.append({"prompt_tokens": n, "status": status, "ok": ok, "seconds": round(time.monotonic() - started, 2),
                      "reason": None if ok else text[:300]})  # fmt: skip
        if not ok:
            break
    return tries


def longest(tries: list[dict]) -> int:
    return max((t["prompt_tokens"] for t in tries if t["ok"]), default=0)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kv-hbm-gb", type=float, default=3.5)
    parser.add_argument("--context", type=int, default=262144)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--systems", default="vanilla,sparse")
    add_server_run_args(parser, "max-prompt")
    args = parser.parse_args(argv)
    model = write_llama3_8b_dummy(Path(args.log_dir) / "llama3-8b-dummy-long", context_len=args.context)
    pool, host_gb = pool_tokens(args.kv_hbm_gb), host_cache_gb(args.context)
    budget = {
        "vanilla": ["--max-total-tokens", str(pool)],
        "sparse": ["--sparse-host-cache-gb", f"{host_gb:g}",
                   "--sparse-gpu-cache-gb", f"{sparse_gpu_cache_gb(args.kv_hbm_gb, host_gb, args.context):.3f}"],
    }  # fmt: skip
    common = ["--load-format", "dummy", "--skip-tokenizer-init", "--mem-fraction-static", "0.85",
              "--cuda-graph-max-bs-decode", "4", "--max-running-requests", "4"]  # fmt: skip
    lengths = ladder(pool, args.context, args.new_tokens)
    systems = {}
    for name in args.systems.split(","):
        flags = [*common, *SYSTEM_SERVER_ARGS[name], *budget[name]]
        with ServerProcess(SYSTEMS[name], model, flags, log_path=Path(args.log_dir) / f"{name}.log") as server:
            tries = try_lengths(server.url, lengths, args.new_tokens, args.request_timeout)
        systems[name] = {"flags": flags, "tries": tries, "longest_prompt": longest(tries)}
    v, s = (systems.get(k, {}).get("longest_prompt") for k in ("vanilla", "sparse"))
    summary = {"kv_hbm_gb": args.kv_hbm_gb, "context": args.context, "vanilla_pool_tokens": pool,
               "longest_prompt": {k: r["longest_prompt"] for k, r in systems.items()},
               "max_prompt_ratio": s / v if v and s else None}  # fmt: skip
    body = {"model": {"shape": "Llama-3-8B", "weights": "dummy", "context": args.context}, "ladder": lengths,
            "systems": systems, "summary": summary}  # fmt: skip
    return finish_run("benchmark/probes/max_prompt.py", argv, body, args.out_dir, "max-prompt-{date}.json")


if __name__ == "__main__":
    main()
