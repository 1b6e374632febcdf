"""A retracted request's host KV stays in the radix tree (``integration/retraction.py``), on SGLang's
own ``RadixCache``, ``ReqToTokenPool``, paged allocator and ``release_req`` (what
``ScheduleBatch.retract_decode`` calls): its full pages become a cached prefix that the request finds
when it comes back; nothing leaks; under pressure those pages are evicted like any cached prefix.
"""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import pytest
import torch

from sparse_sglang.config import SparseConfig

PAGE, PAGES = 32, 64


@pytest.fixture(scope="module", autouse=True)
def published(tmp_path_factory):
    """SGLang's release path reads the process's published server config, as in a scheduler:
    publish a sparse server's (CPU device, dummy 8B-shaped model), and hook ``release_req``."""
    from sglang.srt.runtime_context import get_context, reset_context

    from sparse_sglang.integration.retraction import patch_release_req
    from sparse_sglang.integration.server_args import prepare_server_args
    from sparse_sglang.testing.models import write_llama3_8b_dummy

    model = write_llama3_8b_dummy(tmp_path_factory.mktemp("llama3-8b"))
    get_context().set_server_args(prepare_server_args(["--model-path", model, "--device", "cpu"]))
    patch_release_req()
    yield
    reset_context()


class Pools:
    def __init__(self):
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
        from sglang.srt.mem_cache.radix_cache import RadixCache

        self.pool = ReqToTokenPool(4, 32 * PAGE, "cpu", False)
        self.alloc = PagedTokenToKVPoolAllocator(PAGES * PAGE, PAGE, torch.bfloat16, "cpu", None, False)
        self.tree = RadixCache(CacheInitParams(disable=False, req_to_token_pool=self.pool,
                                               token_to_kv_pool_allocator=self.alloc, page_size=PAGE))  # fmt: skip

    def decoding(self, rid: str, prompt: list[int], output: list[int]):
        """A request ``len(output)`` tokens into its decode, as the scheduler holds it: every token's
        KV but the newest sampled one committed, whole pages allocated."""
        from sglang.srt.managers.schedule_batch import Req, ReqKvInfo
        from sglang.srt.sampling.sampling_params import SamplingParams

        req = Req(rid, "", array("q", prompt), SamplingParams())
        req.output_ids = array("q", output)
        committed = len(prompt) + len(output) - 1
        pages = -(-committed // PAGE) * PAGE
        (slot,) = self.pool.alloc([req])
        self.pool.req_to_token[slot, :pages] = self.alloc.alloc(pages)
        req.kv, req.kv_committed_len = ReqKvInfo(kv_allocated_len=committed, swa_evicted_seqlen=0), committed
        req.prefix_indices, req.last_node, req.cache_protected_len = (
            torch.empty(0, dtype=torch.int64),
            self.tree.root_node,
            0,
        )
        return req

    def retract(self, req, sparse: bool) -> None:
        from sglang.srt.managers import schedule_batch

        args = SimpleNamespace(sparse=SparseConfig(host_cache_gb=1.0, enabled=sparse), disaggregation_mode="null")
        schedule_batch.release_req(req=req, remaing_req_count=0, server_args=args, req_to_token_pool=self.pool,
                                   token_to_kv_pool_allocator=self.alloc, tree_cache=self.tree, hisparse_coordinator=None)  # fmt: skip

    def matched(self, ids: list[int]) -> int:
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        return len(self.tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", ids)))).device_indices)

    def accounted(self) -> bool:
        """Every page is free or in the tree, once (no request holds any)."""
        free = self.alloc.free_pages.tolist()
        tree = set((self.tree.all_values_flatten() // PAGE).tolist()) if self.tree.total_size() else set()
        return len(free) == len(set(free)) and not (set(free) & tree) and set(free) | tree == set(range(1, PAGES + 1))


def test_a_retracted_request_comes_back_as_a_prefix_hit_of_its_full_pages():
    pools = Pools()
    prompt, output = list(range(100, 100 + 5 * PAGE + 7)), list(range(9000, 9000 + 40))  # 167 + 40 tokens
    req = pools.decoding("r", prompt, output)
    pools.retract(req, sparse=True)
    committed = len(prompt) + len(output) - 1
    assert pools.matched(prompt + output) == committed // PAGE * PAGE == 6 * PAGE  # all but the partial page
    assert req.req_pool_idx is None and req.is_retracted and len(req.prefix_indices) == 0
    assert pools.tree.evictable_size() == 6 * PAGE and pools.tree.protected_size() == 0  # cached, not locked
    assert pools.accounted() and pools.pool.available_size() == 4


def test_without_sparse_sglang_frees_it_and_the_tree_can_evict_it_under_pressure():
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    pools = Pools()
    prompt, output = list(range(100, 100 + 3 * PAGE)), list(range(9000, 9010))
    plain = pools.decoding("plain", prompt, output)
    pools.retract(plain, sparse=False)  # SGLang's own path: nothing kept
    assert pools.matched(prompt + output) == 0 and pools.alloc.available_size() == PAGES * PAGE
    kept = pools.decoding("kept", prompt, output)
    pools.retract(kept, sparse=True)
    assert pools.matched(prompt + output) == 3 * PAGE
    pools.tree.evict(EvictParams(num_tokens=PAGES * PAGE))  # the host store runs short
    assert pools.matched(prompt + output) == 0 and pools.alloc.available_size() == PAGES * PAGE
    assert pools.accounted()
