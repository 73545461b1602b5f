"""Scheduler wiring: SGLang's own allocation functions and ChunkCache on the vattn allocator."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.allocation", reason="sglang (CPU import set) not installed")

from sglang.srt.mem_cache.allocation import (  # noqa: E402
    alloc_paged_token_slots_decode, alloc_paged_token_slots_extend)
from sglang.srt.mem_cache.chunk_cache import ChunkCache  # noqa: E402
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402

from vattn.adapters.sglang.allocator import VattnTokenAllocator  # noqa: E402
from vattn.adapters.sglang.pool import VattnMHATokenToKVPool, make_cache  # noqa: E402
from tests.core._util import count_calls  # noqa: E402
from vattn.core.errors import ConfigError, SlotError, UnsupportedError  # noqa: E402

PAGE = 16


def make(budget=64 << 20, reqs=4):
    cache = make_cache(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float32,
                       max_requests=reqs, max_context=96, device="cpu", page_budget=budget)
    alloc = VattnTokenAllocator.for_pool(VattnMHATokenToKVPool.from_cache(cache, page_size=PAGE))
    r2t = ReqToTokenPool(size=reqs, max_context_len=96, device="cpu", enable_memory_saver=False)
    tree = ChunkCache(SimpleNamespace(req_to_token_pool=r2t, token_to_kv_pool_allocator=alloc,
                                      page_size=PAGE))
    return cache, alloc, r2t, tree


def extend(tree, prefix, seq, last):
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    n = sum(s - p for p, s in zip(prefix, seq))
    return alloc_paged_token_slots_extend(tree, t(prefix), t(prefix), t(seq), t(seq), t(last), n)


def test_extend_decode_map_pages_and_index_is_slot_times_c_plus_position():
    cache, alloc, _, tree = make()
    c = cache.layout.rows_per_slot
    loc = extend(tree, [0], [7], [-1])
    slot = int(loc[0]) // c
    assert loc.tolist() == [slot * c + t for t in range(7)]
    assert cache.mapped_tokens(slot) >= 7
    loc = extend(tree, [7], [50], [int(loc[-1])])          # chunked prefill continues the slot
    assert loc.tolist() == [slot * c + t for t in range(7, 50)]
    t = torch.tensor
    new = alloc_paged_token_slots_decode(tree, t([51]), t([51]), t([slot * c + 49]))
    assert new.tolist() == [slot * c + 50] and cache.mapped_tokens(slot) >= 51
    with pytest.raises(SlotError, match="position"):
        alloc.alloc_decode(t([53]), t([53]), t([slot * c + 49]))  # stale last_loc


def test_available_size_is_physical_and_free_releases_slot():
    cache, alloc, r2t, tree = make()
    before = alloc.available_size()
    assert before % PAGE == 0 and before < alloc.size       # pages, not the VA reservation
    loc = extend(tree, [0], [80], [-1])
    assert alloc.available_size() < before
    req = SimpleNamespace(req_pool_idx=r2t.alloc([SimpleNamespace(req_pool_idx=None)])[0],
                          cache_protected_len=0)
    r2t.write((req.req_pool_idx, slice(0, 80)), loc.to(torch.int32))
    alloc.free(loc[60:])                                    # a tail only: slot kept
    assert alloc.live_slots()
    tree.cache_finished_req(req, kv_len_to_handle=80)       # SGLang's free on finish
    assert alloc.live_slots() == frozenset()
    assert alloc.available_size() == before                 # pages stay mapped, reclaimable
    with pytest.raises(SlotError, match="double free"):
        alloc.free(loc[:1])


def test_out_of_pages_is_sglang_oom_and_releases_fresh_slots():
    cache, alloc, _, tree = make(budget=12 << 20)  # 3 page-sets: core pad, pool pad (index 0), one request
    extend(tree, [0], [10], [-1])
    with pytest.raises(RuntimeError, match="out of memory"):
        extend(tree, [0], [5], [-1])                      # a second request: no page left
    assert len(alloc.live_slots()) == 1


def test_token_allocator_path_and_page_size_one_refused():
    cache, alloc, _, _ = make()
    with pytest.raises(UnsupportedError, match="page_size > 1"):
        alloc.alloc(4)
    with pytest.raises(ConfigError, match="page_size > 1"):
        VattnTokenAllocator.for_pool(VattnMHATokenToKVPool.from_cache(make_cache(
            num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float32, max_requests=2,
            max_context=96, device="cpu", page_budget=8 << 20), page_size=1))


@pytest.mark.parametrize("batch", [8])
def test_decode_step_host_work_does_not_grow_with_the_slot_count(batch):
    """SGLang's defaults give thousands of slots; a decode step's work must not scale with them."""
    per_step = {}
    from vattn.core import KVCacheConfig, VirtualKVCache
    for reqs in (64, 1024):
        page = 4096       # 8 tokens per page; 2 page-sets per slot pre-warmed, none free: growth
        #                   past 16 tokens takes idle slots' pages
        cache = VirtualKVCache(KVCacheConfig(
            num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float32, max_slots=reqs + 1,
            max_context=96, page_bytes=page, page_budget=(2 * (reqs + 1) + 4) * 2 * page,
            device="cpu", map_ahead_tokens=16))
        alloc = VattnTokenAllocator.for_pool(VattnMHATokenToKVPool.from_cache(cache, page_size=PAGE))
        r2t = ReqToTokenPool(size=reqs, max_context_len=96, device="cpu", enable_memory_saver=False)
        tree = ChunkCache(SimpleNamespace(req_to_token_pool=r2t, token_to_kv_pool_allocator=alloc,
                                          page_size=PAGE))
        c = cache.layout.rows_per_slot
        locs = [extend(tree, [0], [40], [-1]) for _ in range(batch)]
        cache.wait()                    # the pages mapped ahead have landed (deterministic counts)
        last = [int(loc[-1]) for loc in locs]
        t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
        worst = 0
        for n in range(41, 90):
            seq = [n] * batch
            calls = count_calls(lambda: alloc_paged_token_slots_decode(tree, t(seq), t(seq), t(last)))
            cache.wait()
            worst = max(worst, calls)
            last = [(x // c) * c + n - 1 for x in last]
        per_step[reqs] = worst
        assert cache.metrics()["pages_reclaimed"] > 0       # the pool was dry: idle slots gave pages
        cache.audit()
        cache.close()
    assert 0 < per_step[1024] <= per_step[64] * 1.1 + 5, per_step
