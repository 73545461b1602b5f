"""A failing VMM call at any point: a typed error or a reported shortfall, never a leak or a crash."""

import pytest

from tests.core._util import SMALL_PAGE, small_config
from vattn.core import VirtualKVCache
from vattn.core.driver import FaultInjector, HostDriver
from vattn.core.errors import ConfigError, DriverError, InjectedFault


def _workload(cache):
    """Acquire, grow, map ahead, release, reuse and reclaim under pressure; retry after a fault."""
    per = int(cache.layout.tokens_per_page)
    slots = []
    for tenant, n in (("a", 3 * per), ("b", 2 * per + 5), ("a", per // 2)):
        slots.append(cache.acquire(tenant=tenant, expected_len=n))
        _retry(lambda s=slots[-1], n=n: cache.step({s: n}))
    cache.wait()
    cache.release(slots[0])
    s = cache.acquire(tenant="c", expected_len=per)
    _retry(lambda: cache.ensure({s: 4 * per}))
    _retry(lambda: cache.reclaim())
    for slot in (s, slots[1], slots[2]):
        cache.release(slot)


def _retry(fn, attempts=3):
    for _ in range(attempts):
        try:
            return fn()
        except InjectedFault:
            continue
    raise AssertionError("an injected fault repeated")


@pytest.mark.parametrize("op", ["create", "map", "set_access", "unmap", "release", "zero", "reserve"])
@pytest.mark.parametrize("nth", [1, 2, 3, 5, 8, 13])
def test_fault_at_every_call(op, nth):
    host = HostDriver(granularity=SMALL_PAGE)
    drv = FaultInjector(host, fail={op: nth})
    cfg = small_config(page_budget=30 * SMALL_PAGE, map_ahead_tokens=64, max_context=1500)
    try:
        cache = VirtualKVCache(cfg, driver=drv)
    except (InjectedFault, ConfigError) as exc:          # failed while building: nothing may remain
        assert isinstance(exc, InjectedFault) or isinstance(exc.__cause__, DriverError)
        assert not host._live and not host._mapped and not host._reserved
        return
    _workload(cache)
    cache.audit()
    for _ in range(3):
        try:
            cache.close()
            break
        except InjectedFault:
            continue
    assert not host._mapped and not host._live and not host._reserved, "pages or VA leaked"


def test_fault_in_worker_is_counted_and_recovered_on_demand():
    host = HostDriver(granularity=SMALL_PAGE)
    drv = FaultInjector(host, fail={"map": [5, 6]})
    with VirtualKVCache(small_config(map_ahead_tokens=300), driver=drv) as cache:
        s = cache.acquire()
        cache.step({s: 10})
        cache.wait()
        assert _retry(lambda: cache.ensure({s: 300})) == []
        assert cache.metrics()["driver_faults"] >= 1
        cache.audit()
