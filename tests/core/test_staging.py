"""Staging: a shared prefix mapped into idle slots ahead of the requests that will hit it."""

import pytest

from vattn.core import ContextLengthError, SlotError
from vattn.core.driver import FaultInjector
from vattn.core.driver.host import HostDriver

from tests.core._util import make_cache
from tests.core.test_sharing import T, fill, same

PREFIX = ["p0", "p1", "p2"]


def holder(cache, value=5):
    """A running request that wrote the prefix (and one block of its own)."""
    a = cache.acquire()
    assert cache.bind(a, 0, PREFIX + ["own"])
    cache.ensure({a: 4 * T})
    fill(cache, a, 0, 4 * T, value)
    return a


@pytest.fixture
def cache():
    c = make_cache(max_slots=6)
    yield c
    c.audit()
    c.close()


def test_staged_slots_hold_the_prefix_and_the_next_hits_need_no_vmm_call(cache):
    a = holder(cache)
    assert cache.stage_prefix(PREFIX, 2) == 2
    staged = [s for s in range(6) if s != a and cache._pages.at(s, 0) == cache._pages.at(a, 0)]
    assert len(staged) == 2 and all(not cache._active[s] for s in staged)
    assert all(cache._pages.at(s, i) == cache._pages.at(a, i) for s in staged for i in range(3))
    m = cache.metrics()
    assert m["page_sets_staged"] == 6 and m["pages_aliased"] == 6 * cache.layout.num_ranges
    for _ in range(2):                                 # the next requests with that hit
        before = cache.metrics()
        b = cache.acquire(prefix=PREFIX, expected_len=3 * T)
        assert b in staged
        assert cache.bind(b, 0, PREFIX, hits=3)
        after = cache.metrics()
        assert (after["map_calls"], after["unmap_calls"]) == (before["map_calls"], before["unmap_calls"])
        assert after["prefix_hits"] == before["prefix_hits"] + 3
        assert same(cache, b, 0, 3 * T, 5)             # the holder's KV, read through b's region
    assert cache.stage_prefix(PREFIX, 1) == 1          # both taken: one more empty slot is queued


def test_slots_already_holding_the_prefix_count_and_only_empty_slots_are_used(cache):
    a = holder(cache)
    w = cache.acquire()                                # a warm slot of another request ...
    cache.ensure({w: T})
    cache.release(w)
    b = cache.acquire(prefix=PREFIX)                   # (an empty slot costs it fewer calls)
    assert b != w and cache.bind(b, 0, PREFIX, hits=3)
    cache.release(b)                                   # an idle slot starting with the prefix
    assert cache.stage_prefix(PREFIX, 1) == 0
    assert cache.stage_prefix(PREFIX, 6) == 3          # ... is passed over: 6 slots - a, w, b
    assert cache._pages.at(w, 0) != cache._pages.at(a, 0)
    assert cache.stage_prefix(PREFIX, 4) == 0


def test_a_dropped_key_or_an_acquired_slot_ends_the_job(cache):
    holder(cache)
    staging = cache._staging
    with cache._cond:
        assert staging.plan(PREFIX, 2) == 2
        first, second = (job[0] for job in staging.jobs)
        staging.step()                                 # page-set 0 of the first job
    assert cache.forget(["p1"]) == 0                   # still mapped where the holder runs
    with cache._cond:
        staging.step()                                 # p1 is gone: the first job ends at 1 page-set
    assert cache._pages.usable(first) == 1 and [job[0] for job in staging.jobs] == [second]
    taken = cache.acquire(prefix=["p0"])               # the second job's slot, if it is the best fit
    assert not any(job[0] == taken for job in staging.jobs)
    with cache._cond:
        while staging.jobs:
            staging.step()


def test_background_staging_runs_on_the_map_ahead_worker():
    cache = make_cache(max_slots=6, map_ahead_tokens=T)
    try:
        a = holder(cache, value=9)
        assert cache.stage_prefix(PREFIX, 3) == 3
        cache.wait()
        assert cache.metrics()["page_sets_staged"] == 9
        b = cache.acquire(prefix=PREFIX)
        assert b != a and cache._pages.at(b, 2) == cache._pages.at(a, 2)
        assert cache.bind(b, 0, PREFIX, hits=3) and same(cache, b, 0, 3 * T, 9)
        cache.audit()
    finally:
        cache.close()


def test_a_driver_fault_ends_the_job_and_the_record_stays_exact():
    drv = FaultInjector(HostDriver(granularity=64 << 10))
    cache = make_cache(max_slots=6, driver=drv)
    try:
        a = holder(cache)
        drv.arm("map", drv.calls["map"] + 2)          # the second map call from now fails
        faults = cache.metrics()["driver_faults"]
        cache.stage_prefix(PREFIX, 2)
        assert cache.metrics()["driver_faults"] == faults + 1
        cache.audit()
        b = cache.acquire(prefix=PREFIX)               # whatever was staged, the hit binds right
        assert cache.bind(b, 0, PREFIX, hits=3) and same(cache, b, 0, 3 * T, 5)
        assert a != b
        cache.audit()
    finally:
        cache.close()


@pytest.mark.parametrize("keys, copies, error", [
    ([], 1, SlotError), (PREFIX, 0, SlotError), (PREFIX, True, SlotError), (PREFIX, 1.5, SlotError),
    (["p0", "p0"], 1, SlotError), (["nope"], 1, SlotError)])
def test_bad_staging_requests_are_refused(cache, keys, copies, error):
    holder(cache)
    with pytest.raises(error):
        cache.stage_prefix(keys, copies)


def test_a_prefix_longer_than_the_region_is_refused(cache):
    with pytest.raises(ContextLengthError):
        cache.stage_prefix([f"k{i}" for i in range(cache.layout.pages_per_slot + 1)], 1)


def test_a_request_without_the_prefix_is_not_handed_a_staged_slot(cache):
    a = holder(cache)
    cache.stage_prefix(PREFIX, 2)
    staged = {s for s in range(6) if s != a and cache._pages.usable(s)}
    assert len(staged) == 2
    for _ in range(3):                                 # the three empty slots go first
        assert cache.acquire(expected_len=2 * T) not in staged
    assert cache.acquire(expected_len=2 * T) in staged   # then a staged one (cold, but idle)
