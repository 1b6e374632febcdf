"""CPU tests of the memory plan and of the sparse KV store's save path (pure-torch references)."""

from __future__ import annotations

import pytest
import torch

from sparse_sglang.config import GIB, SparseConfig
from sparse_sglang.mem_cache.kernels import SaveRuns
from sparse_sglang.mem_cache.kv_store import SparseKVStore
from sparse_sglang.mem_cache.plan import MemoryPlanError, plan_memory

LLAMA8B = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "dtype": torch.bfloat16, "context_len": 131072}


def test_plan_for_the_8b_shape_splits_gpu_memory_into_summaries_cache_and_rows():
    plan = plan_memory(SparseConfig(host_cache_gb=16), gpu_kv_bytes=40 * GIB, **LLAMA8B)
    s = plan.shape
    assert s.num_host_pages == 16 * GIB // (2 * 32 * 8 * 32 * 128 * 2)  # 4 MiB per host page
    assert plan.max_total_tokens == (s.num_host_pages - 1) * 32
    assert plan.selection_pages == 64 and s.min_row_width == 80 and s.row_width == 256 and s.max_pages == 4096
    assert plan.summary_bytes < 16 * GIB * 0.07  # 6.25% of the host KV, plus counts
    # Quest's summaries alone (no mean): bf16 bounds 3.1% of the KV, int8 ones (the default) half that.
    quest = {"with_mean": False, "with_radius": False}
    exact, int8 = (plan_memory(SparseConfig(host_cache_gb=16, bound_format=f), gpu_kv_bytes=40 * GIB, **LLAMA8B, **quest)
                   for f in ("exact", "auto"))  # fmt: skip
    pages = exact.shape.num_host_pages + 1
    assert (
        exact.summary_bytes - int8.summary_bytes == 32 * 8 * pages * (128 * 2 - 1)
        and int8.cache_bytes > exact.cache_bytes
    )
    assert plan.summary_bytes + plan.cache_bytes + plan.staging_bytes < 40 * GIB
    assert plan.max_running_requests == s.num_slots // (32 * 8 * 80) and s.max_requests == plan.max_running_requests + 1
    assert "requests at once" in plan.describe()
    # FlashD2H's ring, pinned: 4 buffers of one layer's K and V (bf16) and the slots of 8,192 tokens
    assert (
        plan.save_staging_bytes == 4 * 8192 * (2 * 8 * 128 * 2 + 8) and "save staging 128 MiB pinned" in plan.describe()
    )
    deeper = plan_memory(SparseConfig(host_cache_gb=16, save_staging_buffers=32), gpu_kv_bytes=40 * GIB, **LLAMA8B)
    assert deeper.save_staging_bytes == 8 * plan.save_staging_bytes
    capped = plan_memory(SparseConfig(host_cache_gb=16), gpu_kv_bytes=40 * GIB, max_running_requests=4,
                         max_total_tokens=1000, **LLAMA8B)  # fmt: skip
    assert capped.max_running_requests == 4 and capped.shape.num_host_pages == 33


def test_rows_are_at_least_the_row_ratio_and_may_grow_to_4x_the_selection():
    wide = plan_memory(SparseConfig(host_cache_gb=16, cache_row_ratio=2.0), gpu_kv_bytes=40 * GIB, **LLAMA8B)
    assert wide.shape.min_row_width == 128 and wide.max_running_requests == wide.shape.num_slots // (32 * 8 * 128)
    assert wide.shape.row_width == 4 * 64  # MAX_AUTO_ROW_RATIO x the selection
    # Budget 8192 (256 pages): a wider row would leave the fused kernels (256 x 512 pairs); it stays 256.
    big = plan_memory(SparseConfig(host_cache_gb=16, token_budget=8192, cache_row_ratio=1.0), gpu_kv_bytes=40 * GIB,
                      max_running_requests=1, **LLAMA8B)  # fmt: skip
    assert big.shape.row_width == big.shape.min_row_width == 256
    # A short-context model: no row grows past every page a request can hold.
    short = plan_memory(SparseConfig(host_cache_gb=1, token_budget=512), gpu_kv_bytes=4 * GIB, num_layers=30,
                        num_kv_heads=3, head_dim=64, dtype=torch.bfloat16, context_len=1000)  # fmt: skip
    assert short.shape.min_row_width == 20 and short.shape.row_width == 32
    with pytest.raises(Exception, match="cache_row_ratio: must be >= 1"):
        SparseConfig(host_cache_gb=1, cache_row_ratio=0.5)


def test_rows_hold_the_rerank_candidates():
    """``--sparse-rerank-factor 2`` loads twice the budget's pages a step: rows are sized from those
    (fewer requests fit the same cache), the attended budget unchanged."""
    plain = plan_memory(SparseConfig(host_cache_gb=16), gpu_kv_bytes=40 * GIB, **LLAMA8B)
    rerank = plan_memory(SparseConfig(host_cache_gb=16, rerank_factor=2), gpu_kv_bytes=40 * GIB, **LLAMA8B)
    assert rerank.selection_pages == 128 and rerank.shape.min_row_width == 160
    assert rerank.max_running_requests == rerank.shape.num_slots // (32 * 8 * 160) < plain.max_running_requests
    assert SparseConfig(rerank_factor=2).budget_pages == 64 and SparseConfig(rerank_factor=2).candidate_pages == 128
    with pytest.raises(MemoryPlanError, match="--sparse-rerank-factor 8: 512 candidate pages"):
        plan_memory(SparseConfig(host_cache_gb=16, rerank_factor=8), gpu_kv_bytes=40 * GIB, **LLAMA8B)


def test_plan_errors_name_the_flag():
    with pytest.raises(MemoryPlanError, match="--sparse-host-cache-gb: the page summaries"):
        plan_memory(SparseConfig(host_cache_gb=16), gpu_kv_bytes=GIB // 8, **LLAMA8B)
    with pytest.raises(MemoryPlanError, match="--sparse-gpu-cache-gb: .* holds no request"):
        plan_memory(SparseConfig(host_cache_gb=8, gpu_cache_gb=0.1), gpu_kv_bytes=40 * GIB, **LLAMA8B)


def test_a_resident_prefix_comes_out_of_the_page_cache():
    """16K resident tokens of the 8B shape in fp8: every layer's K and V as stored (1 GiB) and one
    layer's bf16 copy (64 MiB), taken from the page cache whether its size is given or derived."""
    fp8 = {**LLAMA8B, "dtype": torch.float8_e4m3fn}
    for cache_gb in (None, 16.0):
        base, resident = (plan_memory(SparseConfig(host_cache_gb=16, gpu_cache_gb=cache_gb, resident_prefix_tokens=n),
                                      gpu_kv_bytes=20 * GIB, **fp8) for n in (0, 16384))  # fmt: skip
        assert resident.resident_bytes == GIB + 64 * 2**20 and base.resident_bytes == 0
        slot = 32 * 128  # fp8 bytes of one page of one (layer, kv head)
        assert base.cache_bytes - resident.cache_bytes == pytest.approx(resident.resident_bytes, abs=slot)
        assert "resident prefix 1.06 GiB" in resident.describe()
    with pytest.raises(
        MemoryPlanError, match="^--sparse-resident-prefix-tokens: its 8.50 GiB take the whole page cache"
    ):
        plan_memory(SparseConfig(host_cache_gb=16, gpu_cache_gb=8, resident_prefix_tokens=131072), gpu_kv_bytes=20 * GIB,
                    **fp8)  # fmt: skip
    with pytest.raises(MemoryPlanError, match="^--sparse-resident-prefix-tokens: its .* leave no GPU memory"):
        plan_memory(SparseConfig(host_cache_gb=16, resident_prefix_tokens=131072), gpu_kv_bytes=8 * GIB, **fp8)


def test_short_context_models_cache_every_page_of_a_request():
    plan = plan_memory(SparseConfig(host_cache_gb=1), gpu_kv_bytes=4 * GIB, num_layers=30, num_kv_heads=3,
                       head_dim=64, dtype=torch.bfloat16, context_len=1000)  # fmt: skip
    assert plan.selection_pages == plan.shape.row_width == plan.shape.max_pages == 32


@pytest.mark.parametrize("bound_format", ["exact", "auto"])
@pytest.mark.parametrize("fused", [False, True])
def test_store_save_updates_host_summaries_and_cached_pages(fused, bound_format):
    plan = plan_memory(SparseConfig(host_cache_gb=0.01, gpu_cache_gb=0.01), gpu_kv_bytes=GIB, num_layers=2,
                       num_kv_heads=2, head_dim=16, dtype=torch.bfloat16, context_len=256)  # fmt: skip
    store = SparseKVStore(
        plan.shape, "cpu", fused=fused, bound_format=bound_format
    )  # fused on CPU: Triton's interpreter
    cache = store.cache
    cache.open_request(1, 2)
    cache.write_allocate(1, 0, 1)  # page 0 cached, page 1 host-only
    k, v = torch.randn(3, 2, 16).bfloat16(), torch.randn(3, 2, 16).bfloat16()
    # A forward saving tokens 0, 1 (host page 5), then one saving token 32 (host page 7).
    store.bind_runs(SaveRuns.for_extend([1], [0], [2], page_size=32, device="cpu"))
    store.save(1, torch.tensor([5 * 32 + 0, 5 * 32 + 1]), k[:2], v[:2], staged=True)
    store.bind_runs(SaveRuns.for_decode(torch.tensor([1]), torch.tensor([33]), page_size=32))
    store.save(1, torch.tensor([7 * 32 + 0]), k[2:], v[2:], staged=False)
    assert torch.equal(store.host.k[1, :, 5, :2], k[:2].transpose(0, 1))
    assert torch.equal(store.host.v[1, :, 7, 0], v[2])
    assert store.summaries.count[1, 5] == 2 and store.summaries.count[1, 7] == 1
    kmin, kmax = (bound[:, 5] for bound in store.summaries.bounds(1))
    if bound_format == "exact":
        assert torch.equal(kmax, k[:2].amax(0).float())
    else:  # int8 levels (the default for bf16 KV): the keys inside, within a level of each side
        level = torch.ldexp(torch.ones(2, 1), store.summaries.bound_exp[1, :, 5].int().view(2, 1))
        assert (kmin <= k[:2].amin(0)).all() and (kmax >= k[:2].amax(0)).all()
        assert (kmax - k[:2].amax(0) <= level).all() and (k[:2].amin(0) - kmin <= level).all()
    slot = cache.page_table.lookup(1, 1, torch.arange(2), 0).long()
    assert torch.equal(cache.k[slot, :2], k[:2].transpose(0, 1))
    assert (cache.page_table.lookup(1, 1, torch.arange(2), 1) == -1).all()


def test_fp8_saves_saturate_instead_of_turning_into_nan():
    plan = plan_memory(SparseConfig(host_cache_gb=0.01, gpu_cache_gb=0.01), gpu_kv_bytes=GIB, num_layers=1,
                       num_kv_heads=1, head_dim=16, dtype=torch.float8_e4m3fn, context_len=256)  # fmt: skip
    store = SparseKVStore(plan.shape, "cpu", fused=False)
    store.cache.open_request(1, 1)
    k = torch.tensor([500.0, -1e5, 3.0, 0.0] * 4).view(1, 1, 16).bfloat16()  # beyond e4m3's 448 both ways
    store.bind_runs(SaveRuns.for_extend([1], [0], [1], page_size=32, device="cpu"))
    store.save(0, torch.tensor([2 * 32]), k, k, staged=True)
    saved = store.host.k[0, 0, 2, 0].float()
    assert torch.equal(saved, torch.tensor([448.0, -448.0, 3.0, 0.0] * 4))
    assert torch.equal(store.summaries.kmax[0, 0, 2].float(), saved)


def test_summaries_kept_are_the_selectors():
    from sparse_sglang.attention import kept_summaries

    assert kept_summaries("quest") == {"with_mean": False, "with_radius": False}
    assert kept_summaries("arkvale") == {"with_mean": False, "with_radius": True}
    assert kept_summaries("mean") == {"with_mean": True, "with_radius": False}
    plans = {name: plan_memory(SparseConfig(host_cache_gb=16, selector=name), gpu_kv_bytes=40 * GIB, **LLAMA8B,
                               **kept_summaries(name)) for name in ("quest", "mean")}  # fmt: skip
    # bf16 min and max (4 bytes a channel) vs those plus the float32 mean (8): half the bytes
    assert plans["quest"].summary_bytes * 2 < plans["mean"].summary_bytes * 1.01
    assert plans["quest"].cache_bytes > plans["mean"].cache_bytes


SMOLLM2 = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "dtype": torch.bfloat16, "context_len": 8192}


def test_without_the_flag_the_host_store_holds_what_its_requests_can_use():
    """A 135M model with an 8K context on a 256 GiB host: the store holds every page the requests
    SGLang may run at once can fill (here 16, as the user capped them), not half the RAM."""
    plan = plan_memory(SparseConfig(), gpu_kv_bytes=4 * GIB, max_running_requests=16, host_ram_bytes=256 * GIB,
                       **SMOLLM2)  # fmt: skip
    pages_per_request = 8192 // 32
    assert plan.shape.num_host_pages == 16 * pages_per_request + 1  # + the reserved page 0
    assert plan.host_store_reason.startswith("2.81 GiB by need: 16 requests x 8192 tokens x 22.5 KiB a token")
    assert "50% of 256.0 GiB RAM available" in plan.host_store_reason
    assert plan.max_running_requests == 16


def test_the_need_is_what_the_gpu_page_cache_runs_at_once_when_sglang_is_not_capped():
    plan = plan_memory(SparseConfig(), gpu_kv_bytes=2 * GIB, host_ram_bytes=256 * GIB, **SMOLLM2)
    assert plan.shape.num_host_pages >= plan.max_running_requests * 256 + 1 > 1
    assert "by need" in plan.host_store_reason


def test_the_need_is_capped_at_half_the_ram_available():
    plan = plan_memory(SparseConfig(), gpu_kv_bytes=40 * GIB, host_ram_bytes=8 * GIB, **LLAMA8B)
    page = 2 * 32 * 8 * 32 * 128 * 2  # K and V of one page in every layer and kv head
    assert plan.shape.num_host_pages == 4 * GIB // page
    assert plan.host_store_reason.startswith("4.00 GiB, 50% of 8.0 GiB RAM available; the need is")


def test_an_explicit_host_cache_gb_wins_and_says_so():
    plan = plan_memory(SparseConfig(host_cache_gb=1), gpu_kv_bytes=4 * GIB, max_running_requests=16,
                       host_ram_bytes=256 * GIB, **SMOLLM2)  # fmt: skip
    assert plan.shape.num_host_pages == GIB // (2 * 30 * 3 * 32 * 64 * 2)
    assert plan.host_store_reason == "1 GiB (--sparse-host-cache-gb)"
    with pytest.raises(MemoryPlanError, match="--sparse-host-cache-gb: 50% of the 0.00 GiB RAM available holds no"):
        plan_memory(SparseConfig(), gpu_kv_bytes=4 * GIB, host_ram_bytes=1 << 20, **SMOLLM2)


def test_host_stores_are_sized_one_at_a_time_on_a_host(tmp_path):
    """Two processes starting together: the second waits until the first leaves its turn."""
    import subprocess
    import sys
    import time

    from sparse_sglang.mem_cache.host_pool import host_memory_turn

    lock = tmp_path / "turn.lock"
    waiter = (f"import time; from pathlib import Path; from sparse_sglang.mem_cache.host_pool import host_memory_turn\n"
              f"with host_memory_turn(Path({str(lock)!r})): print(time.time())")  # fmt: skip
    with host_memory_turn(lock):
        child = subprocess.Popen([sys.executable, "-c", waiter], stdout=subprocess.PIPE, text=True)
        time.sleep(8.0)  # the child imports torch, then waits for the turn
        released = time.time()
    out, _ = child.communicate(timeout=120)
    assert child.returncode == 0 and float(out) >= released
