"""The free reserve (``KVCacheConfig.free_reserve``): pool pages pre-warm leaves unmapped and the
map-ahead worker refills between steps from idle page-sets that hold nothing, so a burst grows
from the free pool with no reclaim on the step's path; and the worker living on when a driver
call of its reclaim or refill fails."""

import pytest

from vattn.core import ConfigError
from tests.core._util import make_cache, small_config

T = 128          # tokens per page-set of the small cache


def test_the_reserve_is_checked():
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="free_reserve must be an int >= 0"):
            small_config(free_reserve=bad, map_ahead_tokens=T)
    with pytest.raises(ConfigError, match="needs the map-ahead worker"):
        small_config(free_reserve=4)


def test_prewarm_leaves_the_reserve_free_and_a_burst_grows_into_it_without_reclaim():
    ranges = 2
    with make_cache(free_reserve=8 * ranges, map_ahead_tokens=T) as cache:
        cache.prewarm()
        assert cache._pool.num_free >= 8 * ranges
        reclaims = []
        reclaim = cache._reclaim.reclaim
        cache._reclaim.reclaim = lambda *a, **k: reclaims.append(a) or reclaim(*a, **k)
        slot = next(s for s in range(cache.config.max_slots) if cache.mapped_tokens(s) == 0)
        got = cache.acquire()
        assert cache.mapped_tokens(got) > 0 or got == slot   # admission prefers warm slots
        cold = [cache.acquire() for _ in range(cache.config.max_slots - 1)]
        cold = [s for s in cold + [got] if cache.mapped_tokens(s) == 0]
        assert cold, "every slot was pre-warmed: no cold slot to grow"
        assert cache.ensure({cold[0]: 4 * T}) == []         # grows from the reserve
        assert reclaims == []
        cache.audit()


def test_the_worker_refills_the_reserve_from_idle_page_sets_that_hold_nothing():
    ranges = 2
    with make_cache(free_reserve=6 * ranges, map_ahead_tokens=T) as cache:
        cache.prewarm()
        slots = [cache.acquire() for _ in range(cache.config.max_slots)]
        cold = next(s for s in slots if cache.mapped_tokens(s) == 0)
        keeper = next(s for s in slots if s != cold)
        assert cache.bind(keeper, 0, ["k0", "k1"])           # bound: never taken by a refill
        cached = next(s for s in slots if s not in (cold, keeper))
        assert cache.bind(cached, 0, ["c0"])                 # idle later, its block still cached
        for s in slots:
            if s not in (cold, keeper):
                cache.release(s)                             # idle, warm, holding nothing but c0
        cache.step({cold: 5 * T, keeper: 2 * T})             # the cold slot grows into the reserve
        assert cache._pool.num_free < 6 * ranges
        cache.wait()                                          # the worker refilled meanwhile
        assert cache._pool.num_free >= 6 * ranges
        assert cache.holds("k0") and cache.holds("k1") and cache.mapped_tokens(keeper) >= 2 * T
        assert cache.mapped_tokens(cold) >= 5 * T
        assert cache.mapped_tokens(cached) >= T             # c0 stays mapped where it was cached
        cache.audit()


def test_a_refill_never_unmaps_a_cached_block():
    """Idle slots whose page-sets all hold cached blocks: a refill frees nothing there (unmapping
    them frees no page, and a later hit would have to map them again), so the reserve stays short."""
    ranges = 2
    with make_cache(free_reserve=8 * ranges, map_ahead_tokens=T) as cache:
        cache.prewarm()
        slots = [cache.acquire() for _ in range(cache.config.max_slots)]
        cold = next(s for s in slots if cache.mapped_tokens(s) == 0)
        idle = [s for s in slots if s != cold]
        for n, s in enumerate(idle):
            sets = cache.mapped_tokens(s) // T
            assert cache.bind(s, 0, [f"s{n}b{i}" for i in range(sets)])
            cache.release(s)
        mapped = {s: cache.mapped_tokens(s) for s in idle}
        cache.step({cold: 5 * T})
        cache.wait()
        assert {s: cache.mapped_tokens(s) for s in idle} == mapped
        assert cache._pool.num_free < 8 * ranges
        cache.audit()


def test_a_refill_whose_unmap_fails_stops_until_the_next_step_and_the_worker_lives_on():
    from vattn.core.driver import FaultInjector
    from vattn.core.driver.host import HostDriver
    ranges = 2
    drv = FaultInjector(HostDriver(granularity=64 << 10))
    with make_cache(free_reserve=6 * ranges, map_ahead_tokens=T, driver=drv) as cache:
        cache.prewarm()
        slots = [cache.acquire() for _ in range(cache.config.max_slots)]
        cold = next(s for s in slots if cache.mapped_tokens(s) == 0)
        for s in slots:
            if s != cold:
                cache.release(s)
        drv.arm_rate("unmap", 1.0)                            # every unmap fails from now on
        cache.step({cold: 5 * T})
        cache.wait()                                          # returns: the refill gave up
        assert cache._pool.num_free < 6 * ranges and cache.counters.driver_faults > 0
        drv.disarm()
        cache.step({cold: 5 * T})                             # the next step pokes it again
        cache.wait()
        assert cache._pool.num_free >= 6 * ranges
        cache.audit()


def test_a_map_ahead_whose_reclaim_fails_drops_its_jobs_and_the_worker_lives_on():
    """The worker takes idle slots' pages when the pool is dry; an unmap failing there must not
    end its thread (``wait`` would then never return): the jobs go, the next step asks again."""
    from vattn.core.driver import FaultInjector
    from vattn.core.driver.host import HostDriver
    drv = FaultInjector(HostDriver(granularity=64 << 10))
    with make_cache(map_ahead_tokens=T, driver=drv, page_budget=60 * (64 << 10)) as cache:
        cache.prewarm()                                       # 4 slots warm, 10 pages left free
        slots = [cache.acquire() for _ in range(cache.config.max_slots)]
        cold = next(s for s in slots if cache.mapped_tokens(s) == 0)
        for s in slots:
            if s != cold:
                cache.release(s)
        assert cache.ensure({cold: 5 * T}) == [] and cache._pool.num_free == 0
        drv.arm_rate("unmap", 1.0)
        cache.step({cold: 5 * T})                             # map-ahead of the next: reclaim fails
        cache.wait()
        assert cache.counters.driver_faults > 0 and cache.mapped_tokens(cold) == 5 * T
        drv.disarm()
        cache.step({cold: 5 * T})
        cache.wait()
        assert cache.mapped_tokens(cold) >= 6 * T
        cache.audit()
