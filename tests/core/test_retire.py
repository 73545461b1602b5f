"""``stream_ordered=True``: reclaim takes a released slot's pages without waiting for its fence
(``SlotPages.retire``), their old mapping unmapped once the fence completes (``flush``); the
pool keeps such pages apart from the map-ahead worker (``PagePool.take(unfenced=True)``)."""

import pytest

from vattn.core import ConfigError
from vattn.core.driver import HostDriver
from vattn.core.driver.lag import LaggingFences
from vattn.core.pages import PagePool

from tests.core._util import SMALL_PAGE, make_cache

BUDGET = 24 * SMALL_PAGE        # 24 pages: the padding slot's page-set + 11 more (2 ranges)


def _cache(lag_driver, **over):
    return make_cache(page_budget=BUDGET, max_context=2000, driver=lag_driver, **over)


def _full_then_released(cache):
    """Slot ``a`` holds 10 of the 11 page-sets and is released (fence pending) while ``b``
    runs with none; returns ``a, b`` and the tokens of a page-set."""
    per = int(cache.layout.tokens_per_page)
    a, b = cache.acquire(), cache.acquire()
    assert cache.ensure({a: 10 * per}) == []
    cache.release(a)
    return a, b, per


def test_the_pool_keeps_fenced_pages_from_unfenced_takers():
    device = LaggingFences(HostDriver(granularity=SMALL_PAGE), lag=1)
    pool = PagePool(device, page_bytes=SMALL_PAGE, num_pages=3)
    try:
        ids = pool.take(3)
        fence = device.record_fence()
        assert pool.give(ids[:2], fence=fence) == 2
        assert pool.num_free == 2 and pool.num_unfenced == 0
        assert pool.take(1, unfenced=True) is None
        assert pool.take(1) is not None                      # ordered after the fence: may use it
        device.tick()
        assert pool.num_unfenced == 1 and pool.take(1, unfenced=True) is not None
    finally:
        pool.close()


@pytest.mark.parametrize("ordered", [False, True])
def test_reclaim_under_a_pending_fence_waits_or_retires(ordered):
    host = HostDriver(granularity=SMALL_PAGE)
    device = LaggingFences(host, lag=1)
    with _cache(device, stream_ordered=ordered) as cache:
        a, b, per = _full_then_released(cache)
        old = {cache._pages.va(r, a, i) for r in range(2) for i in range(2, 10)}   # 8 of its 10 page-sets
        assert cache.ensure({b: 9 * per}) == []              # only a's pages are left
        m = cache.metrics()
        if not ordered:
            assert device.waits == 1 and m["fence_waits"] == 1 and m["pages_retired"] == 0
            assert not old & set(host._mapped)
            return
        assert device.waits == 0 and m["fence_waits"] == 0 and m["pages_retired"] == 16
        assert old <= set(host._mapped)                      # a's old mappings: until the fence
        cache.audit()
        unmaps = m["unmap_calls"]
        assert cache.ensure({b: 9 * per}) == [] and cache.metrics()["unmap_calls"] == unmaps
        device.tick()                                        # the device is done with a's request
        assert cache.ensure({b: 9 * per}) == []               # flushed at the next ensure
        assert not old & set(host._mapped) and not cache._pages.retired
        # one call per range: a range's 8 retired positions are one run (the host driver unmaps
        # adjacent mappings together)
        assert cache.metrics()["unmap_calls"] == unmaps + 2 and m["pages_retired"] == 16
        assert device.waits == 0
        cache.audit()


def test_growing_into_a_retired_slot_waits_for_its_fence_first():
    host = HostDriver(granularity=SMALL_PAGE)
    device = LaggingFences(host, lag=1)
    with _cache(device, stream_ordered=True) as cache:
        a, b, per = _full_then_released(cache)
        assert cache.ensure({b: 9 * per}) == [] and a in cache._pages.retired
        c = cache.acquire()                                  # the warmest idle slot: a (2 page-sets)
        assert c == a and cache.mapped_tokens(c) == 2 * per
        cache.release(b)
        assert cache.ensure({c: 4 * per}) == []              # maps where a's old mappings are
        assert device.waits == 1 and cache.metrics()["fence_waits"] == 1
        assert a not in cache._pages.retired and b in cache._pages.retired
        assert host.mapped_handle(cache._pages.va(0, a, 3)) is not None
        cache.audit()


def test_the_worker_does_not_map_ahead_with_fenced_pages():
    device = LaggingFences(HostDriver(granularity=SMALL_PAGE), lag=1)
    with _cache(device, stream_ordered=True, map_ahead_tokens=256) as cache:
        a, b, per = _full_then_released(cache)
        assert cache.reclaim(6) == 6                          # retires 3 of a's page-sets
        pool = cache._pool
        assert pool.num_free == 8 and pool.num_unfenced == 2
        assert cache.step({b: per}) == []                     # on demand: the 2 unfenced pages
        cache.wait()
        assert cache.metrics()["pages_mapped_ahead"] == 0     # the worker left the fenced ones
        assert pool.num_free == 6 and cache.mapped_tokens(b) == per
        device.tick()                                         # a's fence completes
        assert cache.step({b: per + 1}) == []
        cache.wait()
        assert cache.metrics()["pages_mapped_ahead"] > 0 and cache.metrics()["fence_waits"] == 0
        cache.audit()


def test_close_unmaps_retired_mappings_and_the_flag_is_checked():
    host = HostDriver(granularity=SMALL_PAGE)
    device = LaggingFences(host, lag=3)
    cache = _cache(device, stream_ordered=True)
    a, b, per = _full_then_released(cache)
    assert cache.ensure({b: 9 * per}) == [] and cache._pages.retired
    cache.close()
    assert not host._mapped
    with pytest.raises(ConfigError, match="stream_ordered must be a bool"):
        make_cache(stream_ordered="yes")


def test_a_page_still_used_elsewhere_keeps_its_fence_until_it_is_freed():
    # a retired page another mapping or a key still holds is not free yet; when that last
    # reference goes while the fence is pending, it must not reach the unfenced free list
    device = LaggingFences(HostDriver(granularity=SMALL_PAGE), lag=1)
    pool = PagePool(device, page_bytes=SMALL_PAGE, num_pages=2)
    try:
        a, b = pool.take(2)
        pool.ref([a])                                        # a: two references (a key, say)
        fence = device.record_fence()
        assert pool.give([a, b], fence=fence) == 1           # b freed (fenced), a still held
        assert pool.give([a]) == 1                           # the key goes: a freed, still fenced
        assert pool.num_free == 2 and pool.num_unfenced == 0
        device.tick()
        assert pool.num_unfenced == 2 and pool.take(2, unfenced=True) is not None
        assert pool.give([a]) == 1 and pool.num_unfenced == 1   # no stale fence left behind
    finally:
        pool.close()


@pytest.mark.gpu
def test_on_cuda_a_kernel_in_flight_reads_the_old_mapping_while_its_pages_serve_another():
    # the real thing: a kernel still reading released slot a (queued behind a ~100 ms spin)
    # while reclaim hands a's pages to b without waiting, and b's writes are queued after it
    import torch
    with make_cache("cuda", num_kv_heads=8, head_dim=128, max_context=2560, page_budget=BUDGET // SMALL_PAGE
                    * (2 << 20), stream_ordered=True, scrub="never") as cache:
        per = int(cache.layout.tokens_per_page)
        assert per == 256 and cache.layout.pages_per_slot == 10
        a, b = cache.acquire(), cache.acquire()
        assert cache.ensure({a: 10 * per}) == []
        k0 = cache.k(0)
        k0[a, :10 * per].fill_(3)
        seen = torch.empty_like(k0[a, :10 * per])
        seen.copy_(k0[a, :10 * per])                          # once now: the allocator's cudaMalloc
        torch.cuda.synchronize()                              # (of the copy's buffers) syncs
        torch.cuda._sleep(1_000_000_000)                      # the device is busy for a while
        seen.copy_(k0[a, :10 * per])                          # ... then reads a, the old mapping
        cache.release(a)
        assert cache.ensure({b: 9 * per}) == []               # a's pages, no wait for the read
        m = cache.metrics()
        assert not torch.cuda.current_stream().query(), "the host waited for the device"
        assert m["fence_waits"] == 0 and m["pages_retired"] > 0
        k0[b, :9 * per].fill_(7)                              # queued after the read
        torch.cuda.synchronize()
        assert bool((seen == 3).all()), "the read in flight saw the next request's writes"
        assert bool((k0[b, :9 * per] == 7).all())
        unmaps = cache.metrics()["unmap_calls"]
        assert cache.ensure({b: 9 * per}) == []               # the fence is done: flushed now
        # one call per range where the driver unmaps a run of mappings at once
        calls = cache.layout.num_ranges if cache.driver.unmap_spans else m["pages_retired"]
        assert cache.metrics()["unmap_calls"] == unmaps + calls
        assert not cache._pages.retired
        cache.audit()
