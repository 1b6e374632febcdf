"""benchmark/probes/max_prompt.py's plan: vanilla's pool at a KV budget, the prompt lengths tried, the
longest one answered, and the sparse page cache that keeps the two systems' GPU memory equal."""

from benchmark.probes.max_prompt import host_cache_gb, ladder, longest, pool_tokens
from benchmark.serving import sparse_gpu_cache_gb


def test_the_ladder_brackets_the_pool_then_reaches_the_context():
    pool = pool_tokens(3.5)
    assert pool == 28672  # 3.5 GiB of the 8B shape's KV (128 KiB a token)
    lengths = ladder(pool, 262144, 8)
    assert lengths == [pool - 256, pool + 256, 2 * pool, 4 * pool, 8 * pool, 262134]
    assert ladder(pool, 131072, 8) == [pool - 256, pool + 256, 2 * pool, 4 * pool, 131062]  # 8x is past the context


def test_longest_is_the_last_answered_before_a_refusal():
    tries = [
        {"prompt_tokens": 100, "ok": True},
        {"prompt_tokens": 200, "ok": True},
        {"prompt_tokens": 400, "ok": False},
    ]
    assert longest(tries) == 200 and longest([{"prompt_tokens": 5, "ok": False}]) == 0


def test_the_sparse_server_gets_the_same_gpu_memory_for_kv():
    host = host_cache_gb(262144)
    assert host == 33  # one whole-context request's KV, plus a GiB
    cache = sparse_gpu_cache_gb(3.5, host, 262144)
    # the staging buffer is a fixed piece of one layer, whatever the context; only a context
    # shorter than it shrinks it (more page cache)
    assert 0.3125 < cache == sparse_gpu_cache_gb(3.5, host, 131072) < sparse_gpu_cache_gb(3.5, host, 8192) < 3.5
