"""SparseConfig: defaults, and every invalid value fails with the flag's name."""

from __future__ import annotations

import dataclasses

import pytest

from sparse_sglang.config import SELECTORS, SparseConfig, SparseConfigError, flag_name, machine_ram_bytes


def test_defaults_are_the_documented_ones():
    cfg = SparseConfig()
    assert cfg.enabled is True
    assert (cfg.page_size, cfg.token_budget, cfg.selector) == (32, 2048, "quest")
    assert cfg.working_set_window == 12 and cfg.reselect_interval == 1
    assert cfg.cache_lru_buckets == 0 and cfg.cache_lru_steps_per_bucket == 1  # exact LRU
    assert cfg.budget_pages == 64
    total, available = machine_ram_bytes()
    assert 0 < cfg.host_cache_gb * (1 << 30) <= available * 0.5 + (1 << 30) / 16
    assert cfg.gpu_cache_gb is None and cfg.max_inject_tokens is None


def test_every_field_documents_itself():
    for f in dataclasses.fields(SparseConfig):
        assert f.metadata["help"].strip(), f.name


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SparseConfig().token_budget = 4096


def test_inject_tokens_default_matches_a_2048_token_chunk():
    assert SparseConfig().inject_tokens(num_layers=32) == 2048 * 32
    assert SparseConfig(max_inject_tokens=5000).inject_tokens(num_layers=32) == 5000


BAD_VALUES = [
    ({"token_budget": -2048}, "--sparse-token-budget", "positive"),
    ({"token_budget": 0}, "--sparse-token-budget", "positive"),
    ({"token_budget": 2050}, "--sparse-token-budget", "multiple of --sparse-page-size"),
    ({"page_size": 24}, "--sparse-page-size", "power of two"),
    ({"page_size": 0}, "--sparse-page-size", "power of two"),
    ({"page_size": -32}, "--sparse-page-size", "power of two"),
    ({"selector": "topk"}, "--sparse-selector", "quest, arkvale, mean"),
    ({"sink_pages": -1}, "--sparse-sink-pages", ">= 0"),
    ({"recent_pages": 0}, "--sparse-recent-pages", ">= 1"),
    ({"token_budget": 64, "sink_pages": 1, "recent_pages": 2}, "--sparse-recent-pages", "exceed"),
    ({"working_set_window": 0}, "--sparse-working-set-window", ">= 1"),
    ({"reselect_interval": 0}, "--sparse-reselect-interval", ">= 1"),
    ({"cache_lru_buckets": -1}, "--sparse-cache-lru-buckets", ">= 0"),
    ({"cache_lru_steps_per_bucket": 0}, "--sparse-cache-lru-steps-per-bucket", ">= 1"),
    ({"gpu_cache_gb": 0.0}, "--sparse-gpu-cache-gb", "positive"),
    ({"gpu_cache_gb": -1.0}, "--sparse-gpu-cache-gb", "positive"),
    ({"host_cache_gb": 0.0}, "--sparse-host-cache-gb", "positive"),
    ({"host_cache_gb": 1e7}, "--sparse-host-cache-gb", "more than this machine's RAM"),
    ({"max_inject_tokens": 0}, "--sparse-max-inject-tokens", "positive"),
    ({"page_size": "32"}, "--sparse-page-size", "must be int"),
    ({"enabled": 1}, "--sparse-enabled", "must be bool"),
    ({"token_budget": 2048.0}, "--sparse-token-budget", "must be int"),
]


@pytest.mark.parametrize("kwargs,flag,reason", BAD_VALUES, ids=[str(b[0]) for b in BAD_VALUES])
def test_bad_value_names_flag_and_reason(kwargs, flag, reason):
    with pytest.raises(SparseConfigError) as err:
        SparseConfig(**kwargs)
    message = str(err.value)
    assert message.startswith(flag + ": ")
    assert reason in message
    assert "\n" not in message
    assert err.value.flag == flag


def test_valid_edge_values():
    cfg = SparseConfig(page_size=1, token_budget=2, sink_pages=0, recent_pages=2, selector=SELECTORS[-1])
    assert cfg.budget_pages == 2
    assert SparseConfig(gpu_cache_gb=8, host_cache_gb=1).gpu_cache_gb == 8  # ints accepted for GiB


def test_flag_name():
    assert flag_name("host_cache_gb") == "--sparse-host-cache-gb"
