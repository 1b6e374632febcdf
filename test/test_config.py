"""SparseConfig: defaults, and every invalid value fails with the flag's name."""

from __future__ import annotations

import dataclasses
import math

import pytest

from sparse_sglang.config import SELECTORS, SparseConfig, SparseConfigError, flag_name


def test_defaults_are_the_documented_ones():
    cfg = SparseConfig()
    assert cfg.enabled is True
    assert (cfg.page_size, cfg.token_budget, cfg.selector) == (32, 2048, "quest")
    assert cfg.working_set_window == 12 and cfg.reselect_interval == 1
    assert cfg.cache_lru_buckets == 0 and cfg.cache_lru_steps_per_bucket == 1  # exact LRU
    assert cfg.budget_pages == 64
    assert cfg.host_cache_gb is None  # sized by need at start-up (mem_cache/plan.py)
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
    ({"token_budget": -2048}, "token_budget", "positive"),
    ({"token_budget": 0}, "token_budget", "positive"),
    ({"token_budget": 2050}, "token_budget", "multiple of {page_size}"),
    ({"page_size": 24}, "page_size", "power of two"),
    ({"page_size": 0}, "page_size", "power of two"),
    ({"page_size": -32}, "page_size", "power of two"),
    ({"page_size": 2**40}, "page_size", "at most 2147483647"),
    ({"selector": "topk"}, "selector", "quest, arkvale, mean"),
    ({"sink_pages": -1}, "sink_pages", ">= 0"),
    ({"sink_pages": 100}, "sink_pages", "no room for the newest page"),
    ({"recent_pages": 0}, "recent_pages", ">= 1"),
    ({"token_budget": 64, "sink_pages": 1, "recent_pages": 2}, "recent_pages", "exceed"),
    ({"working_set_window": 0}, "working_set_window", ">= 1"),
    ({"reselect_interval": 0}, "reselect_interval", ">= 1"),
    ({"rerank_factor": 0}, "rerank_factor", ">= 1"),
    ({"cache_lru_buckets": -1}, "cache_lru_buckets", ">= 0"),
    ({"cache_lru_steps_per_bucket": 0}, "cache_lru_steps_per_bucket", ">= 1"),
    ({"cache_row_ratio": math.inf}, "cache_row_ratio", "finite"),
    ({"cache_row_ratio": math.nan}, "cache_row_ratio", "finite"),
    ({"cache_row_ratio": 1e308}, "cache_row_ratio", "exceeds 2147483647 pages"),
    ({"coarse_candidates": math.nan}, "coarse_candidates", "finite"),
    ({"gpu_cache_gb": 0.0}, "gpu_cache_gb", "positive"),
    ({"gpu_cache_gb": -1.0}, "gpu_cache_gb", "positive"),
    ({"gpu_cache_gb": math.nan}, "gpu_cache_gb", "finite"),
    ({"host_cache_gb": 0.0}, "host_cache_gb", "positive"),
    ({"host_cache_gb": math.nan}, "host_cache_gb", "finite"),
    ({"host_cache_gb": -math.inf}, "host_cache_gb", "finite"),
    ({"host_cache_gb": 1e7}, "host_cache_gb", "more than this machine's RAM"),
    ({"max_inject_tokens": 0}, "max_inject_tokens", "positive"),
    ({"save_staging_buffers": 0}, "save_staging_buffers", "must be 1-256"),
    ({"save_staging_buffers": 257}, "save_staging_buffers", "must be 1-256"),
    ({"decode_kernel": "triton"}, "decode_kernel", "flashinfer, xqa"),
    ({"decode_kernel": "xqa", "page_size": 8, "token_budget": 2048}, "page_size", "xqa takes pages of 16, 32, 64, 128"),
    ({"decode_kernel": "xqa", "budget_share": True}, "decode_kernel", "runs without it: must be flashinfer"),
    ({"page_size": "32"}, "page_size", "must be int"),
    ({"enabled": 1}, "enabled", "must be bool"),
    ({"token_budget": 2048.0}, "token_budget", "must be int"),
]


@pytest.mark.parametrize("kwargs,field,reason", BAD_VALUES, ids=[str(b[0]) for b in BAD_VALUES])
def test_bad_value_names_the_knob_as_the_caller_spells_it(kwargs, field, reason):
    """Python names fields (``token_budget``), the CLI flags (``--sparse-token-budget``), an
    object holding the config its path (``sparse.token_budget``); knobs the reason mentions too."""
    with pytest.raises(SparseConfigError) as err:
        SparseConfig(**kwargs)
    error = err.value
    assert (error.field, error.flag) == (field, flag_name(field))
    for message, name_of in ((str(error), lambda f: f), (error.cli_message(), flag_name),
                             (str(error.named("sparse.")), lambda f: "sparse." + f)):  # fmt: skip
        assert message.startswith(name_of(field) + ": ") and "\n" not in message
        assert reason.format(page_size=name_of("page_size")) in message


def test_from_fields_names_an_unknown_knob():
    with pytest.raises(SparseConfigError, match="^token_budgte: is not a sparse knob"):
        SparseConfig.from_fields({"token_budgte": 1024})
    assert SparseConfig.from_fields({"token_budget": 1024}).token_budget == 1024


def test_valid_edge_values():
    cfg = SparseConfig(page_size=1, token_budget=2, sink_pages=0, recent_pages=2, selector=SELECTORS[-1])
    assert cfg.budget_pages == 2
    assert SparseConfig(gpu_cache_gb=8, host_cache_gb=1).gpu_cache_gb == 8  # ints accepted for GiB


def test_flag_name():
    assert flag_name("host_cache_gb") == "--sparse-host-cache-gb"
