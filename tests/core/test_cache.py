import os
import threading

import numpy as np
import pytest
import torch

from tests.conftest import devices
from tests.core._util import SMALL_PAGE, make_cache
from vattn.core import ConfigError, ContextLengthError, SlotError


class ManualFence:
    def __init__(self):
        self.finished = False
        self.waited = 0

    def done(self):
        return self.finished

    def wait(self):
        self.waited += 1
        self.finished = True


@pytest.mark.parametrize("device", devices())
def test_views_read_back_what_was_written_across_pages(device):
    with make_cache(device) as cache:
        a, b = cache.acquire(tenant="a"), cache.acquire(tenant="b")
        assert cache.ensure({a: 650, b: 97}) == []
        k = cache.k(3)
        assert k.shape == (7, cache.layout.rows_per_slot, 2, 32) and k.stride(-1) == 1
        data = torch.randn(650, 2, 32, device=device).half()
        k[a, :650] = data
        cache.v(3)[b, :97] = 1
        rows = cache.k_rows(3)
        assert torch.equal(rows[a * cache.layout.rows_per_slot:][:650], data)
        assert torch.equal(cache.k(3)[a, :650], data)                 # V of b did not touch K of a
        assert cache.mapped_tokens(a) >= 650 and cache.length(a) == 650
        cache.audit()


@pytest.mark.parametrize("device", devices())
def test_warm_slot_reused_without_remapping_and_scrubbed_for_new_tenant(device):
    with make_cache(device) as cache:
        s = cache.acquire(tenant="a", expected_len=300)
        cache.ensure({s: 300})
        cache.k(0)[s, :300] = 5
        mapped = cache.metrics()["map_calls"]
        cache.release(s)
        again = cache.acquire(tenant="b", expected_len=250)
        assert again == s and cache.metrics()["warm_hits"] == 1
        assert cache.ensure({s: 250}) == [] and cache.metrics()["map_calls"] == mapped
        assert cache.k(0)[s, :300].abs().sum().item() == 0              # scrubbed: tenant changed
        cache.k(0)[s, :250] = 3
        cache.release(s)
        same = cache.acquire(tenant="b", expected_len=10)
        assert same == s and bool((cache.k(0)[s, :250] == 3).all())   # same tenant: kept


def test_scrub_never_and_always():
    with make_cache(scrub="never") as cache:
        s = cache.acquire(tenant="a"); cache.ensure({s: 100}); cache.k(0)[s, :100] = 2; cache.release(s)
        assert cache.acquire(tenant="b") == s and cache.k(0)[s, :100].float().mean().item() == 2
    with make_cache(scrub="always") as cache:
        s = cache.acquire(tenant="a"); cache.ensure({s: 100}); cache.k(0)[s, :100] = 2; cache.release(s)
        assert cache.acquire(tenant="a") == s and cache.k(0)[s, :100].abs().sum().item() == 0


def test_best_fitting_warm_slot_is_preferred():
    with make_cache() as cache:
        small, big = cache.acquire(), cache.acquire()
        cache.ensure({small: 40, big: 600})
        cache.release(small); cache.release(big)
        assert cache.acquire(expected_len=550) == big
        assert cache.acquire(expected_len=30) == small


def test_out_of_pages_is_reported_not_raised_and_reclaims_idle_first():
    with make_cache(page_budget=24 * (64 << 10), max_context=2000) as cache:      # 24 pages: padding + 11 page-sets
        per = cache.layout.tokens_per_page
        a, b = cache.acquire(), cache.acquire()
        assert cache.ensure({a: int(6 * per)}) == []
        fence = ManualFence()
        cache.release(a, fence=fence)
        assert cache.ensure({b: int(10 * per)}) == []             # needs a's pages: waits on its fence
        assert fence.waited == 1 and cache.metrics()["pages_reclaimed"] > 0
        c = cache.acquire()                                       # a's slot: what is left of it
        had = cache.mapped_tokens(c)
        assert cache.ensure({c: int(5 * per)}) == [c]             # nothing left: shortfall
        assert cache.metrics()["shortfalls"] == 1 and cache.mapped_tokens(c) == had < 5 * per
        assert not cache.can_fit(int(5 * per))
        cache.audit()


def test_surplus_of_a_slot_in_the_same_call_is_reclaimable():
    """A warm slot reused for a short request gives up its surplus to a slot growing beside it."""
    with make_cache(page_budget=24 * (64 << 10), max_context=2000) as cache:      # 11 page-sets
        per = int(cache.layout.tokens_per_page)
        a = cache.acquire()
        assert cache.ensure({a: 10 * per}) == []                  # a holds 10 page-sets
        cache.release(a)
        warm = cache.acquire(expected_len=per)                   # best fit: the warm slot a
        other = cache.acquire()
        assert warm == a
        # one call: warm needs 1 set (holds 10), other needs 9 — only reachable through warm's surplus
        assert cache.ensure({warm: per, other: 9 * per}) == []
        assert cache.mapped_tokens(other) >= 9 * per and cache.mapped_tokens(warm) >= per
        cache.audit()


@pytest.mark.parametrize("spans", [True, False], ids=["one-call-per-run", "one-call-per-page"])
def test_reclaim_unmaps_an_idle_slots_run_in_one_call_per_range_where_the_driver_can(spans):
    """A slot that needs pages the pool lacks takes them from an idle one, only what it needs:
    where the driver unmaps several mappings in one call, the run of page-sets taken goes with
    one unmap per range; where it cannot, one unmap per page. The growing slot's KV reads back
    either way."""
    from vattn.core.driver import HostDriver
    drv = HostDriver(granularity=SMALL_PAGE)
    drv.unmap_spans = spans
    with make_cache(driver=drv, page_budget=24 * SMALL_PAGE, max_context=2000) as cache:   # 11 page-sets
        per, ranges = int(cache.layout.tokens_per_page), cache.layout.num_ranges
        a, b = cache.acquire(), cache.acquire()
        assert cache.ensure({a: 10 * per}) == []                  # a holds 10 of the 11
        cache.release(a)
        before = cache.counters.unmap_calls
        assert cache.ensure({b: 3 * per}) == []                   # 2 page-sets from a
        assert cache.mapped_tokens(a) == 8 * per
        assert cache.counters.unmap_calls - before == (1 if spans else 2) * ranges
        k = cache.k(0)[b]
        k[:3 * per] = 3
        assert bool((cache.k(0)[b][:3 * per] == 3).all())
        cache.audit()


def test_reclaim_prefers_finished_fences():
    with make_cache(page_budget=12 * (64 << 10)) as cache:
        per = int(cache.layout.tokens_per_page)
        a, b = cache.acquire(), cache.acquire()
        cache.ensure({a: 2 * per, b: 2 * per})
        busy, idle = ManualFence(), ManualFence()
        idle.finished = True
        cache.release(a, fence=busy); cache.release(b, fence=idle)
        c = cache.acquire(expected_len=0)
        assert cache.ensure({c: 3 * per}) == [] and busy.waited == 0
        assert cache.capacity().reclaimable_pages >= 0


def test_map_ahead_takes_mapping_off_the_critical_path():
    with make_cache(map_ahead_tokens=256) as cache:
        s = cache.acquire()
        cache.step({s: 10}); cache.wait()
        on_demand = cache.metrics()["pages_mapped_on_demand"]
        for n in range(11, 260):
            assert cache.step({s: n}) == []
            cache.wait()
        m = cache.metrics()
        assert m["pages_mapped_on_demand"] == on_demand and m["pages_mapped_ahead"] > 0
        assert cache.mapped_tokens(s) >= 259 + 1


def test_map_ahead_takes_a_running_slots_unread_surplus_when_nothing_is_idle():
    """A request that found no warm slot grows in the background from the pages a pre-warmed
    slot holds beyond what its request reads (plus that slot's own map-ahead margin), instead
    of on the step's path."""
    with make_cache(map_ahead_tokens=64, max_slots=3, page_budget=12 * SMALL_PAGE) as cache:
        per_set = cache.layout.tokens_for(1)
        ranges = cache.layout.num_ranges
        a = cache.acquire()
        cache.ensure({a: 4 * per_set})                     # 4 page-sets, then a shorter request
        cache.release(a)
        assert cache.acquire(expected_len=per_set) == a
        cache.ensure({a: per_set})
        b = cache.acquire()
        assert b != a and cache.ensure({b: per_set}) == [] and cache.capacity().free_pages == 0
        before = cache.metrics()
        assert cache.step({b: per_set}) == []              # the worker maps b's next page-set
        cache.wait()
        after = cache.metrics()
        assert cache.mapped_tokens(b) >= 2 * per_set
        assert after["pages_mapped_ahead"] - before["pages_mapped_ahead"] == ranges
        assert after["pages_mapped_on_demand"] == before["pages_mapped_on_demand"]
        assert cache._pages.usable(a) >= 2                   # a keeps what it reads + its margin
        cache.audit()


def test_slot_errors():
    with make_cache() as cache:
        with pytest.raises(SlotError, match=r"in \[0, 6\)"):
            cache.release(6)
        with pytest.raises(SlotError, match="not acquired"):
            cache.ensure({2: 5})
        s = cache.acquire()
        cache.release(s)
        with pytest.raises(SlotError, match="not acquired"):
            cache.release(s)
        with pytest.raises(SlotError, match="not acquired"):
            cache.ensure({s: 5})
        s = cache.acquire()
        with pytest.raises(ContextLengthError, match="max_context=700"):
            cache.ensure({s: 701})
        with pytest.raises(ContextLengthError):
            cache.acquire(expected_len=10_000)
        with pytest.raises(SlotError, match="listed twice"):
            cache.ensure(np.array([s, s]), np.array([1, 2]))
        with pytest.raises(ContextLengthError, match="lengths must be a 1-D sequence of ints"):
            cache.ensure([s], [1.5])                        # a bad length is a length error
        with pytest.raises(SlotError, match="equal sizes"):
            cache.ensure([s], [1, 2])
        for _ in range(5):
            cache.acquire()
        with pytest.raises(SlotError, match="all 6 slots are in use"):
            cache.acquire()
    with pytest.raises(SlotError, match="closed"):
        cache.acquire()


def test_config_that_cannot_fit():
    with pytest.raises(ConfigError, match="virtual address"):
        make_cache(max_slots=4096, max_context=1 << 24)
    with pytest.raises(ConfigError, match="at least"):
        make_cache(page_budget=2 * (64 << 10))


def test_metrics_and_prometheus():
    prometheus_client = pytest.importorskip("prometheus_client")
    with make_cache() as cache:
        s = cache.acquire(); cache.ensure({s: 100})
        m = cache.metrics()
        assert m["pages_mapped"] == cache.layout.num_ranges * (1 + cache.layout.pages_for(100))
        assert m["waste_bytes"] == cache.layout.waste_bytes(100)
        assert m["map_page_us"]["count"] == m["map_calls"]
        reg = prometheus_client.CollectorRegistry()
        reg.register(cache.prometheus_collector())
        assert reg.get_sample_value("vattn_pages_mapped") == m["pages_mapped"]


@pytest.mark.parametrize("device", devices())
def test_churn_under_map_ahead_reads_back_exactly(device):
    """Many requests come and go while the worker maps ahead; kernels read back what was written."""
    gen = torch.Generator().manual_seed(0)
    with make_cache(device, map_ahead_tokens=64, max_context=600, num_kv_heads=8, head_dim=128,
                    page_budget=(120 if device == "cpu" else 40) * (64 << 10 if device == "cpu" else 2 << 20)) as cache:
        rows_per, want = cache.layout.rows_per_slot, {}
        live: dict[int, int] = {}
        for step in range(300):
            if len(live) < 6 and torch.rand(1, generator=gen).item() < 0.3:
                live[cache.acquire(tenant=step % 3)] = 0
            grow = {s: min(600, n + int(torch.randint(1, 40, (1,), generator=gen))) for s, n in live.items()}
            failed = cache.step(grow)
            for s, n in grow.items():
                if s in failed:
                    continue
                rows = torch.arange(s * rows_per + live[s], s * rows_per + n, device=device)
                vals = torch.randn(len(rows), 8, 128, generator=gen).half().to(device)
                cache.k_rows(0).index_copy_(0, rows, vals)       # a kernel writes through the view
                want[s] = torch.cat([want.get(s, vals[:0]), vals])
                live[s] = n
            for s in [s for s, n in live.items() if n >= 600 or s in failed]:
                got = cache.k_rows(0).index_select(0, torch.arange(s * rows_per, s * rows_per + live[s], device=device))
                assert torch.equal(got, want.pop(s, got[:0])), f"slot {s} read back wrong data"
                cache.release(s)
                del live[s]
        for s, n in live.items():
            got = cache.k_rows(0).index_select(0, torch.arange(s * rows_per, s * rows_per + n, device=device))
            assert torch.equal(got, want[s])
        cache.audit()
        assert cache.metrics()["pages_mapped_ahead"] > 0


def test_prewarm_maps_an_even_share_that_requests_then_use_without_driver_calls():
    with make_cache(page_budget=24 * (64 << 10), max_context=2000) as cache:   # padding + 11 page-sets
        ranges = cache.layout.num_ranges
        mapped = cache.prewarm(min_tokens=0)                                    # no minimum depth
        per_slot = 11 // cache.config.max_slots                                 # 6 slots -> 1 set each
        assert mapped == per_slot * ranges * cache.config.max_slots
        assert cache.metrics()["pages_mapped_ahead"] == mapped
        calls = cache.metrics()["map_calls"]
        a = cache.acquire(expected_len=10)
        assert cache.metrics()["warm_hits"] == 1
        assert cache.ensure({a: cache.mapped_tokens(a)}) == []
        assert cache.metrics()["map_calls"] == calls                              # nothing mapped now
        # a slot that needs more than its share takes idle slots' warm pages (and the free rest)
        per = int(cache.layout.tokens_per_page)
        assert cache.ensure({a: 9 * per}) == [] and cache.mapped_tokens(a) >= 9 * per
        assert cache.metrics()["pages_reclaimed"] > 0
        cache.audit()


def test_prewarm_goes_deep_into_fewer_slots_when_an_even_share_would_be_thin():
    # 11 page-sets over 6 slots is 1 each; at least 3 deep: slots 0-2 get 3, slots 3-5 none
    with make_cache(page_budget=24 * (64 << 10), max_context=2000) as cache:
        per = int(cache.layout.tokens_per_page)
        cache.prewarm(min_tokens=3 * per)
        assert [cache.mapped_tokens(s) for s in range(6)] == [3 * per] * 3 + [0] * 3
        calls = cache.metrics()["map_calls"]
        first = [cache.acquire(expected_len=2 * per) for _ in range(3)]  # the deep ones, no call
        assert sorted(first) == [0, 1, 2]
        assert cache.ensure({s: 3 * per for s in first}) == [] and cache.metrics()["map_calls"] == calls
        with pytest.raises(ConfigError, match="min_tokens must be an int >= 0"):
            cache.prewarm(min_tokens=-1)
        cache.audit()


def test_prewarm_leaves_cold_slots_empty_for_hits_and_their_share_free():
    """``cold_slots``: the last idle slots stay empty at the same per-slot depth for the others,
    so a request whose hit is mapped in takes one (no pages of its own to unmap where the hit
    goes) and maps its fresh page-sets from the free pool, not from another slot's."""
    with make_cache(page_budget=24 * (64 << 10), max_context=2000) as cache:    # 11 page-sets, 6 slots
        per, ranges = int(cache.layout.tokens_per_page), cache.layout.num_ranges
        mapped = cache.prewarm(min_tokens=0, cold_slots=2)
        assert [cache.mapped_tokens(s) for s in range(6)] == [per] * 4 + [0] * 2
        assert mapped == 4 * ranges and cache._pool.num_free >= 7 * ranges - ranges
        a = cache.acquire(expected_len=per)
        assert cache.bind(a, 0, ["s0"])
        cache.release(a)
        unmaps = cache.metrics()["unmap_calls"]
        b = cache.acquire(expected_len=3 * per, prefix=["x0"])      # a hit elsewhere: a cold slot
        assert b in (4, 5) and cache.metrics()["unmap_calls"] == unmaps
        for bad in (-1, 1.5, True):
            with pytest.raises(ConfigError, match="cold_slots must be an int >= 0"):
                cache.prewarm(cold_slots=bad)
        cache.audit()


def test_a_prefix_hit_takes_the_slot_that_costs_the_fewest_calls():
    # a deep slot would unmap its own pages where the shared ones go; an empty one unmaps none,
    # and a slot that starts with the same prefix needs nothing
    with make_cache(page_budget=24 * (64 << 10), max_context=2000) as cache:
        per = int(cache.layout.tokens_per_page)
        cache.prewarm(min_tokens=3 * per)                     # slots 0-2 hold 3 page-sets
        a = cache.acquire(expected_len=2 * per)
        assert cache.bind(a, 0, ["s0", "s1"])
        cache.release(a)
        b = cache.acquire(expected_len=per)                   # no hit: a deep slot (not a)
        assert b in (0, 1, 2) and b != a
        c = cache.acquire(expected_len=3 * per, prefix=["s0", "s1"])   # the home slot: a
        assert c == a
        cache.release(c)
        cache._keys.home.pop("s1")                            # forget where s1 was mapped last
        d = cache.acquire(expected_len=3 * per, prefix=["s0", "s1"])
        assert d == a                                         # still: it starts with s0
        cache.release(d)
        cache.release(b)
        e = cache.acquire(expected_len=3 * per, prefix=["x0", "x1"])   # no idle slot starts so
        assert cache.mapped_tokens(e) == 0                    # an empty slot: nothing to unmap
        cache.audit()


def test_prewarm_tops_up_to_a_length_and_checks_it():
    with make_cache() as cache:
        cache.prewarm(100)
        assert all(cache.mapped_tokens(s) >= 100 for s in range(cache.config.max_slots))
        assert cache.prewarm(100) == 0                                            # already there
        with pytest.raises(ContextLengthError):
            cache.prewarm(cache.config.max_context + 1)
        for s in range(cache.config.max_slots):
            cache.acquire()
        assert cache.prewarm() == 0                                               # no idle slot
        cache.audit()


def test_prewarm_never_maps_past_a_slot_region():
    """A pool far larger than slots x region: each slot is filled to its region, no further."""
    with make_cache(max_context=100, page_budget=200 * (64 << 10)) as cache:
        per_slot = cache.layout.pages_per_slot
        mapped = cache.prewarm()
        assert mapped == per_slot * cache.layout.num_ranges * cache.config.max_slots
        for s in range(cache.config.max_slots):
            assert cache._pages.usable(s) == per_slot
        cache.audit()
        with pytest.raises(ValueError, match="at most"):
            cache._pages.grow(0, per_slot + 1, None, ahead=False)


def test_tenant_preference_and_scrub_when_tenants_start_to_differ():
    with make_cache() as cache:
        x, y = cache.acquire(), cache.acquire()                 # tenant None (single-tenant so far)
        cache.ensure({x: 100, y: 100})
        cache.k(0)[x, :100] = 4
        cache.k(0)[y, :100] = 4
        cache.release(x); cache.release(y)
        again = cache.acquire(expected_len=100)                  # same tenant None: data kept
        assert bool((cache.k(0)[again, :100] == 4).all())
        cache.release(again)
        a = cache.acquire(tenant="a", expected_len=100)          # a new tenant: scrubbed
        assert a in (x, y) and cache.k(0)[a, :100].abs().sum().item() == 0
        cache.k(0)[a, :100] = 6
        cache.release(a)
        other = ({x, y} - {a}).pop()
        assert cache.acquire(tenant="a", expected_len=100) == a  # its own warm slot first
        assert bool((cache.k(0)[a, :100] == 6).all())
        assert cache.acquire(expected_len=100) == other          # None's slot for None
        assert bool((cache.k(0)[other, :100] == 4).all())
        cache.audit()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_close_releases_fds_and_the_worker_thread():
    """20 caches created, used with map-ahead and closed leave no fd and no thread behind;
    a cache whose config is refused after its driver opened leaves none either."""
    fds, threads = _open_fds(), threading.active_count()
    for _ in range(20):
        cache = make_cache(map_ahead_tokens=64)
        s = cache.acquire()
        cache.step({s: 10})
        cache.wait()
        cache.close()
    with pytest.raises(ConfigError):
        make_cache(page_budget=SMALL_PAGE)                    # too small: refused after the driver opened
    with pytest.raises(ConfigError):
        make_cache(max_slots=10**6, max_context=10**7)        # too much address space
    assert _open_fds() == fds and threading.active_count() == threads


def test_a_driver_passed_in_stays_open():
    from vattn.core.driver.host import HostDriver
    drv = HostDriver(granularity=SMALL_PAGE)
    make_cache(driver=drv).close()
    with make_cache(driver=drv) as cache:                     # the same driver serves a second cache
        assert cache.ensure({cache.acquire(): 10}) == []
    drv.close()


def test_one_run_of_releases_ties_whatever_its_order_and_older_runs_go_first():
    """Releases between two acquire / ensure calls share a clock stamp (the lower slot first), so an
    engine's set-ordered releases place requests alike on every rank; an earlier run stays older."""
    def place(order):
        with make_cache() as cache:
            per = int(cache.layout.tokens_per_page)
            slots = [cache.acquire() for _ in range(4)]
            cache.ensure({s: per for s in slots})
            cache.release(slots[3])                          # an earlier run: the oldest idle slot
            cache.ensure({s: per for s in slots[:3]})
            for i in order:
                cache.release(slots[i])
            return slots, [cache.acquire(expected_len=per) for _ in range(4)]
    slots, got = place([0, 1, 2])
    assert got == [slots[3], slots[0], slots[1], slots[2]]
    assert place([2, 0, 1])[1] == got
