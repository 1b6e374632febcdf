"""Radix sharing of host pages: SGLang's radix cache and paged allocator manage the host store's pages
(the sparse KV pool hands SGLang host slots as token locations), so a page shared by several
requests and the tree must be freed once, by its last holder, and never while held.

A seeded random walk of the scheduler's calls (match and lock a prefix, allocate the rest, finish,
abort, evict under pressure) over SGLang's own ``RadixCache``, ``ReqToTokenPool`` and
``PagedTokenToKVPoolAllocator``, page size 32. After every operation: no free page is held by a
running request or the tree, no page is free twice, and every page is either free or held (no leak).
At the end, with every request gone and the tree evicted, the store is entirely free again.
"""

from __future__ import annotations

import random
from array import array

import pytest
import torch

PAGE = 32
NUM_PAGES = 96  # a small host store: eviction happens often
DOCS = 4  # shared prefixes come from a few documents


def _tree_pages(tree) -> set[int]:
    return set((tree.all_values_flatten() // PAGE).tolist()) if tree.total_size() else set()


class Walk:
    def __init__(self, seed: int):
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
        from sglang.srt.mem_cache.radix_cache import RadixCache

        self.rng = random.Random(seed)
        self.pool = ReqToTokenPool(8, 64 * PAGE, "cpu", False)
        self.alloc = PagedTokenToKVPoolAllocator(NUM_PAGES * PAGE, PAGE, torch.bfloat16, "cpu", None, False)
        self.tree = RadixCache(CacheInitParams(disable=False, req_to_token_pool=self.pool,
                                               token_to_kv_pool_allocator=self.alloc, page_size=PAGE))  # fmt: skip
        self.docs = [[self.rng.randrange(10, 5000) for _ in range(12 * PAGE)] for _ in range(DOCS)]
        self.running: list = []  # (req, kv length)
        self.count = 0

    def held_by_requests(self) -> set[int]:
        held = set()
        for req, length in self.running:
            held |= set((self.pool.req_to_token[req.req_pool_idx, :length] // PAGE).tolist())
        return held

    def check(self) -> None:
        free = self.alloc.free_pages.tolist()
        assert len(free) == len(set(free)), "a page is free twice"
        held = self.held_by_requests() | _tree_pages(self.tree)
        assert not (set(free) & held), f"pages freed while held: {sorted(set(free) & held)[:8]}"
        assert set(free) | held == set(range(1, NUM_PAGES + 1)), "a page is neither free nor held (leaked)"

    def start(self) -> None:
        """A new request: a document prefix plus its own tokens; lock the matched prefix, allocate the rest."""
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey
        from sglang.srt.sampling.sampling_params import SamplingParams

        doc = self.rng.choice(self.docs)
        ids = doc[: self.rng.randrange(1, len(doc))] + [
            self.rng.randrange(10, 5000) for _ in range(self.rng.randrange(0, 3 * PAGE))
        ]
        ids = array("q", ids)  # as SGLang's tokenizer manager hands them over
        req = Req(f"r{self.count}", "", ids, SamplingParams())
        self.count += 1
        match = self.tree.match_prefix(MatchPrefixParams(key=RadixKey(ids)))
        prefix = match.device_indices
        self.tree.inc_lock_ref(match.last_device_node)
        rest = -(-(len(ids) - len(prefix)) // PAGE) * PAGE  # whole pages for the rest (the partial last one too)
        if self.alloc.available_size() < rest:
            self.tree.evict(EvictParams(num_tokens=rest - self.alloc.available_size()))
        new = self.alloc.alloc(rest)
        if new is None or not self.pool.available_size():  # no room even after eviction: it waits
            if new is not None:
                self.alloc.free(new)
            self.tree.dec_lock_ref(match.last_device_node)
            return
        (slot,) = self.pool.alloc([req])
        self.pool.req_to_token[slot, : len(ids)] = torch.cat([prefix, new[: len(ids) - len(prefix)]])
        req.prefix_indices, req.last_node, req.cache_protected_len = prefix, match.last_device_node, len(prefix)
        self.running.append((req, len(ids)))

    def end(self, aborted: bool) -> None:
        """A running request finishes (its pages go into the tree) or is aborted (they do not)."""
        req, length = self.running.pop(self.rng.randrange(len(self.running)))
        self.tree.cache_finished_req(req, is_insert=not aborted, kv_len_to_handle=length)
        self.pool.free(req)

    def step(self) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        roll = self.rng.random()
        if roll < 0.45 or not self.running:
            self.start()
        elif roll < 0.8:
            self.end(aborted=False)
        elif roll < 0.92:
            self.end(aborted=True)
        else:
            self.tree.evict(EvictParams(num_tokens=self.rng.randrange(1, 8) * PAGE))
        self.check()


@pytest.mark.parametrize("seed", range(6))
def test_shared_host_pages_are_freed_once_by_their_last_holder(seed):
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    walk = Walk(seed)
    hits = 0
    for _ in range(300):
        before = len(walk.running)
        walk.step()
        if len(walk.running) > before and len(walk.running[-1][0].prefix_indices):
            hits += 1
    assert hits > 10  # prefixes were really shared
    while walk.running:
        walk.end(aborted=walk.rng.random() < 0.3)
        walk.check()
    walk.tree.evict(EvictParams(num_tokens=NUM_PAGES * PAGE))
    walk.check()
    assert walk.tree.total_size() == 0 and walk.alloc.available_size() == NUM_PAGES * PAGE
