"""Prefix sharing: page-sets named by block keys, one physical page-set mapped into several slots."""

import pytest

from vattn.core import ContextLengthError, SlotError
from vattn.core.driver import FaultInjector
from vattn.core.driver.host import HostDriver
from vattn.core.errors import InjectedFault

from tests.conftest import devices
from tests.core._util import make_cache

T = 128   # tokens per page-set of the small cache (64 KiB pages, 512 bytes per token and range)


def fill(cache, slot, first, last, value):
    """Write ``value`` into K and V of every layer for tokens ``first .. last - 1`` of ``slot``."""
    for layer in range(cache.config.num_layers):
        cache.k(layer)[slot, first:last] = value
        cache.v(layer)[slot, first:last] = -value


def read(cache, slot, first, last):
    return [(cache.k(layer)[slot, first:last].unique().tolist(), cache.v(layer)[slot, first:last].unique().tolist())
            for layer in range(cache.config.num_layers)]


def same(cache, slot, first, last, value):
    return read(cache, slot, first, last) == [([float(value)], [float(-value)])] * cache.config.num_layers


@pytest.fixture
def cache():
    c = make_cache()
    yield c
    c.audit()
    c.close()


def test_a_hit_maps_the_same_physical_pages_and_fresh_blocks_stay_private(cache):
    a = cache.acquire()
    assert cache.bind(a, 0, ["k0", "k1", "k2"])
    cache.ensure({a: 3 * T})
    fill(cache, a, 0, 3 * T, 7)
    b = cache.acquire()
    assert cache.bind(b, 0, ["k0", "k1", "k9"], hits=2)
    cache.ensure({b: 3 * T})
    assert cache._pages.at(b, 0) == cache._pages.at(a, 0) and cache._pages.at(b, 1) == cache._pages.at(a, 1)
    assert cache._pages.at(b, 2) != cache._pages.at(a, 2)
    assert same(cache, b, 0, 2 * T, 7)                     # read through b's own addresses
    fill(cache, b, 2 * T, 3 * T, 3)                        # b's fresh block does not touch a's
    assert same(cache, a, 2 * T, 3 * T, 7) and same(cache, b, 2 * T, 3 * T, 3)
    m = cache.metrics()
    assert m["prefix_hits"] == 2 and m["keys_bound"] == 4 and m["keys_held"] == 4
    assert m["pages_aliased"] == 2 * cache.layout.num_ranges


def test_a_hit_and_the_fresh_blocks_of_one_bind_get_one_access_call_per_range(cache):
    """A request's fresh blocks above its hit grow the slot once, and one access call per range
    covers the hit's run and theirs, not one per block and one for the hit (an engine binds a
    request's blocks together when it admits it)."""
    a = cache.acquire()
    assert cache.bind(a, 0, ["k0", "k1"])
    b = cache.acquire()
    before = cache.counters.set_access_calls
    assert cache.bind(b, 0, ["k0", "k1", "f2", "f3", "f4"], hits=2)
    ranges = cache.layout.num_ranges
    assert cache.counters.set_access_calls - before == ranges
    cache.ensure({b: 5 * T})
    fill(cache, b, 2 * T, 5 * T, 4)
    assert same(cache, b, 2 * T, 5 * T, 4) and cache._pages.at(b, 1) == cache._pages.at(a, 1)


def test_cached_content_survives_its_slot_being_reused(cache):
    a = cache.acquire()
    cache.bind(a, 0, ["p0", "p1"])
    fill(cache, a, 0, 2 * T, 5)
    cache.release(a)
    # the slot is handed to a request with other (fresh) blocks: the cached page-sets move out
    c = cache.acquire()
    assert c == a            # the warmest idle slot
    cache.bind(c, 0, ["q0", "q1"])
    fill(cache, c, 0, 2 * T, 9)
    cache.audit()
    d = cache.acquire()
    cache.bind(d, 0, ["p0", "p1", "p2"], hits=2)           # a later hit still finds p0, p1
    assert same(cache, d, 0, 2 * T, 5) and same(cache, c, 0, 2 * T, 9)


def test_a_prefix_hit_gets_the_home_slot_so_a_hit_maps_nothing(cache):
    a = cache.acquire()
    cache.bind(a, 0, ["h0", "h1"])
    fill(cache, a, 0, 2 * T, 4)
    cache.release(a)
    other = cache.acquire()          # takes some idle slot (a is the warmest)
    cache.release(other)
    maps = cache.metrics()["map_calls"]
    b = cache.acquire(prefix=["h0"])
    assert b == a
    cache.bind(b, 0, ["h0", "h1"], hits=2)
    assert cache.metrics()["map_calls"] == maps and same(cache, b, 0, 2 * T, 4)


def test_a_reused_block_id_drops_its_old_content(cache):
    a = cache.acquire()
    cache.bind(a, 0, ["x0"])
    cache.release(a)
    b = cache.acquire()
    b2 = cache.acquire()
    cache.bind(b2, 0, ["y0"])
    cache.bind(b2, 1, ["x0"])         # the engine evicted x0 and hands it out fresh
    assert cache._keys.home["x0"] == (b2, 1)
    cache.release(b)
    cache.release(b2)
    assert cache.reclaim() > 0        # the old x0 page-set is loose now: reclaimable like any
    cache.audit()


def test_forget_frees_unmapped_page_sets(cache):
    a = cache.acquire()
    cache.bind(a, 0, ["f0", "f1"])
    cache.release(a)
    cache.reclaim()                    # unmaps them; the keys still hold the pages
    used = cache.metrics()["pages_mapped"]
    assert used >= 2 * cache.layout.num_ranges
    assert cache.forget(["f0", "f1", "never-bound"]) == 2 * cache.layout.num_ranges
    assert cache.metrics()["keys_held"] == 0


def test_bad_bind_input_is_refused(cache):
    a = cache.acquire()
    with pytest.raises(SlotError, match="no page-set holds"):
        cache.bind(a, 0, ["unknown"], hits=1)
    with pytest.raises(SlotError, match="listed twice"):
        cache.bind(a, 0, ["k", "k"])
    with pytest.raises(SlotError, match="hits"):
        cache.bind(a, 0, ["k"], hits=2)
    with pytest.raises(SlotError, match="start"):
        cache.bind(a, -1, ["k"])
    with pytest.raises(ContextLengthError, match="exceed"):
        cache.bind(a, cache.layout.pages_per_slot, ["k"])
    cache.release(a)
    with pytest.raises(SlotError, match="not acquired"):
        cache.bind(a, 0, ["k"])


def test_tenant_change_scrubs_loose_pages_but_never_shared_ones(cache):
    a = cache.acquire(tenant="t1")
    cache.bind(a, 0, ["s0"])
    cache.ensure({a: 2 * T})
    fill(cache, a, 0, 2 * T, 6)
    cache.release(a)
    b = cache.acquire(tenant="t2")
    assert b == a
    assert same(cache, b, 0, T, 6)                # the bound page-set is not scrubbed ...
    assert same(cache, b, T, 2 * T, 0)            # ... the loose one above it is
    cache.bind(b, 0, ["s0", "s1"], hits=1)
    assert same(cache, b, 0, T, 6)


def test_binding_under_memory_pressure_frees_loose_pages_first():
    cache = make_cache(page_budget=16 * (64 << 10))   # 8 page-sets: padding + 7
    try:
        slots = [cache.acquire() for _ in range(3)]
        for n, s in enumerate(slots):
            assert cache.bind(s, 0, [f"r{n}a", f"r{n}b"])
        cache.release(slots[0])
        cache.release(slots[1])
        s = slots[2]
        # 6 of 7 page-sets are bound; one is free: the 7th and later must come from keys that
        # the engine reuses (their content is dead)
        assert cache.bind(s, 2, ["n2"])
        assert not cache.bind(s, 3, ["n3"])           # every other page-set is held by a key
        assert cache.bind(s, 3, ["r0a"])              # the engine evicted r0a: it is reused
        cache.audit()
        assert cache.metrics()["shortfalls"] == 0
    finally:
        cache.close()


@pytest.mark.parametrize("method", ["map", "unmap", "set_access"])
def test_a_driver_fault_while_aliasing_leaves_an_exact_record(method):
    drv = FaultInjector(HostDriver(granularity=64 << 10))
    cache = make_cache(driver=drv)
    try:
        a = cache.acquire()
        cache.bind(a, 0, ["d0", "d1"])
        fill(cache, a, 0, 2 * T, 2)
        b = cache.acquire()
        cache.ensure({b: 2 * T})                       # b's own pages: the hit replaces them
        drv.arm(method, drv.calls[method] + 1)
        with pytest.raises(InjectedFault):
            cache.bind(b, 0, ["d0", "d1"], hits=2)
        cache.audit()
        assert cache.bind(b, 0, ["d0", "d1"], hits=2)  # the retry completes
        assert same(cache, b, 0, 2 * T, 2)
        cache.audit()
    finally:
        cache.close()


def test_a_fresh_block_after_a_failed_hit_never_writes_into_the_cached_block():
    """The hit's access call fails and the engine gives up on it: a fresh block later bound at
    that position must not take the cached block's page-set as its own."""
    drv = FaultInjector(HostDriver(granularity=64 << 10))
    cache = make_cache(driver=drv)
    try:
        a = cache.acquire()
        cache.bind(a, 0, ["K"])
        fill(cache, a, 0, T, 7)
        b = cache.acquire()
        drv.arm("set_access", drv.calls["set_access"] + 1)
        with pytest.raises(InjectedFault):
            cache.bind(b, 0, ["K"], hits=1)
        assert cache.bind(b, 0, ["K2"])                # fresh instead
        fill(cache, b, 0, T, 3)
        assert same(cache, a, 0, T, 7)                 # K's content untouched
        cache.audit()
    finally:
        cache.close()


@pytest.mark.parametrize("device", devices())
def test_a_new_block_where_a_cached_one_sits_moves_it_by_one_copy_not_by_remapping(device):
    over = {} if device == "cpu" else {"max_context": 3 * 4096}   # 2 MiB pages: 4,096 tokens a set
    with make_cache(device, **over) as cache:
        _move_by_copy(cache, cache.layout.tokens_for(1))
        cache.audit()


def _move_by_copy(cache, T):
    cache.prewarm(T)                                   # loose page-sets mapped in idle slots
    a = cache.acquire()
    cache.bind(a, 0, ["m0", "m1"])
    fill(cache, a, 0, 2 * T, 8)
    cache.release(a)
    b = cache.acquire(prefix=["m0"])                     # back in its slot: m0 in place
    assert b == a
    maps, unmaps = cache.metrics()["map_calls"], cache.metrics()["unmap_calls"]
    cache.bind(b, 0, ["m0", "n1"], hits=1)             # n1 is fresh where m1 sits
    m = cache.metrics()
    assert m["page_sets_moved"] == 1 and m["map_calls"] == maps and m["unmap_calls"] == unmaps
    fill(cache, b, T, 2 * T, 1)
    c = cache.acquire()
    cache.bind(c, 0, ["m0", "m1"], hits=2)             # m1's content moved, still readable
    assert same(cache, c, 0, T, 8) and same(cache, c, T, 2 * T, 8) and same(cache, b, T, 2 * T, 1)


def test_with_no_loose_page_set_a_displaced_block_is_parked_on_a_slots_top_by_copy(cache):
    """No pre-warm, so nothing is loose: the cached block a fresh one displaces is copied into
    free pool pages mapped on top of another slot (one map per range, no unmap), not unmapped
    from under its position; a later hit reads it there."""
    a = cache.acquire()
    cache.bind(a, 0, ["m0", "m1"])
    fill(cache, a, 0, 2 * T, 8)
    cache.release(a)
    b = cache.acquire(prefix=["m0"])
    assert b == a
    before = cache.metrics()
    cache.bind(b, 0, ["m0", "n1"], hits=1)             # n1 is fresh where m1 sits
    m = cache.metrics()
    assert m["page_sets_moved"] - before["page_sets_moved"] == 1
    assert m["unmap_calls"] == before["unmap_calls"]
    assert m["map_calls"] - before["map_calls"] == cache.layout.num_ranges
    fill(cache, b, T, 2 * T, 1)
    c = cache.acquire()
    cache.bind(c, 0, ["m0", "m1"], hits=2)
    assert same(cache, c, 0, 2 * T, 8) and same(cache, b, T, 2 * T, 1)


def test_content_moved_into_another_slot_is_scrubbed_before_that_slot_is_handed_out():
    """A cached block moved (copied) into a loose page-set of another slot carries its tenant
    with it: once its key is gone, that slot's next request (another tenant) reads zeros."""
    with make_cache(page_budget=8 * 2 * (64 << 10), max_slots=3) as cache:   # padding + 7 page-sets
        cache.prewarm(T)                               # one loose page-set in each idle slot
        a = cache.acquire(tenant="t1")
        cache.bind(a, 0, ["k0"])
        fill(cache, a, 0, T, 5)
        cache.release(a)
        again = cache.acquire(tenant="t1", prefix=["k0"])
        assert again == a
        cache.bind(a, 0, ["n0"])                       # k0 is moved out, into another slot's page-set
        assert cache.metrics()["page_sets_moved"] == 1
        (dst_slot, dst_index) = cache._keys.home["k0"]
        assert dst_slot != a and same(cache, dst_slot, 0, T, 5)
        cache.forget(["k0"])                           # the engine evicted k0
        cache.release(a)
        slots = [cache.acquire() for _ in range(3)]    # tenant None: the slots' own previous tenant
        assert dst_slot in slots and same(cache, dst_slot, dst_index * T, (dst_index + 1) * T, 0)
        cache.audit()


def test_bind_many_binds_a_hit_after_the_request_that_gets_its_block_fresh(cache):
    a, b = cache.acquire(), cache.acquire()
    cache.bind(a, 0, ["g0"])
    calls = []
    bind = cache._bind
    cache._bind = lambda slot, start, keys, hits: calls.append(slot) or bind(slot, start, keys, hits)
    # b is listed first and hits g1, which a is given fresh in the same step
    assert cache.bind_many([(b, 0, ["g0", "g1", "h2"], 2), (a, 1, ["g1"], 0)]) == []
    assert calls == [a, b]
    assert cache._pages.at(b, 1) == cache._pages.at(a, 1)
    c, d = cache.acquire(), cache.acquire()
    with pytest.raises(SlotError, match="wait on each other"):
        cache.bind_many([(c, 0, ["x", "y"], 1), (d, 0, ["y", "x"], 1)])


def test_a_failed_replacement_whose_undo_fails_too_leaves_a_healable_hole():
    """A hit mapped over a warm slot's own page: the new map fails, mapping the old page back
    fails, and the unmap that would drop the hole fails as well. The record stays exact (a hole
    above the accessible pages, counted in ``undo_faults``), and the retried bind heals it and
    reads the cached block."""
    from vattn.core.driver import FaultInjector, HostDriver
    from vattn.core.errors import DriverError
    from tests.core._util import SMALL_PAGE
    drv = FaultInjector(HostDriver(granularity=SMALL_PAGE))
    cache = make_cache(driver=drv)
    try:
        T = int(cache.layout.tokens_per_page)
        a = cache.acquire()
        cache.bind(a, 0, ["x0"])
        fill(cache, a, 0, T, 5)
        b = cache.acquire()                    # another slot, with three page-sets of its own
        assert cache.ensure({b: 3 * T}) == []
        maps, unmaps = drv.calls["map"], drv.calls["unmap"]
        drv.arm("map", {maps + 1, maps + 2})   # the new page, then the old one mapped back
        drv.arm("unmap", {unmaps + 2})          # the first unmap of the trim that drops the hole
        with pytest.raises(DriverError):
            cache.bind(b, 0, ["x0"], hits=1)
        drv.disarm()
        assert cache.metrics()["undo_faults"] == 2
        assert any(-1 in pages for pages in cache._state.pages.mapped[b])
        cache.audit()                          # exact: the hole lies above the accessible pages
        assert cache.bind(b, 0, ["x0"], hits=1)
        assert not any(-1 in pages for ranges in cache._state.pages.mapped for pages in ranges)
        assert same(cache, b, 0, T, 5) and same(cache, a, 0, T, 5)
        cache.audit()
    finally:
        cache.close()


def test_copy_on_write_gives_the_request_its_own_copy_and_leaves_the_cached_block_as_it_was(cache):
    """A hit ending inside block ``c1`` (vLLM's partial hit): the request shares ``c0`` and gets
    ``x1`` fresh, holding a copy of ``c1``; what it writes into ``x1`` never reaches ``c1``."""
    a = cache.acquire()
    assert cache.bind(a, 0, ["c0", "c1"])
    fill(cache, a, 0, T, 4)
    fill(cache, a, T, 2 * T, 6)
    cache.release(a)
    b = cache.acquire()
    b = b if b != a else cache.acquire()                  # not where c1 sits: a real copy
    assert cache.bind(b, 0, ["c0", "x1"], hits=1)
    assert cache.copy_block("c1", "x1")
    assert same(cache, b, 0, T, 4) and same(cache, b, T, 2 * T, 6)
    keys = cache._state.keys
    assert set(keys.get("x1")).isdisjoint(keys.get("c1")) and cache.metrics()["blocks_copied"] == 1
    fill(cache, b, T + T // 2, 2 * T, 9)                  # the request goes on writing its copy
    c = cache.acquire()
    assert cache.bind(c, 0, ["c0", "c1"], hits=2)         # the cached block is as it was
    assert same(cache, c, T, 2 * T, 6) and same(cache, b, T, T + T // 2, 6)


def _cow_in_place(cache, tenant=None) -> tuple[int, int]:
    """Blocks c0, c1 written by a request that left; the next one (``tenant``) returns to its
    slot, hits c0 and gets x1 fresh where c1 sits (c1 is moved out), then copies c1 into x1
    (vLLM's copy-on-write of a partial hit): ``(its slot, the moved c1's slot)``."""
    a = cache.acquire()
    assert cache.bind(a, 0, ["c0", "c1"])
    fill(cache, a, 0, T, 4)
    fill(cache, a, T, 2 * T, 6)
    cache.release(a)
    b = cache.acquire(prefix=["c0"], tenant=tenant)
    assert b == a and cache.bind_many([(b, 0, ["c0", "x1"], 1)]) == []
    assert cache.metrics()["page_sets_moved"] == 1
    assert cache.copy_block("c1", "x1")
    return b, cache._state.keys.home["c1"][0]


def test_a_copy_on_write_from_the_block_just_moved_out_of_the_same_pages_is_not_made(cache):
    """The request's fresh x1 took the pages c1 was moved out of in the same engine step: they
    hold c1's bytes still, so the copy-on-write is already done (no second device copy)."""
    b, _ = _cow_in_place(cache)
    m = cache.metrics()
    assert m["copies_elided"] == 1 and m["blocks_copied"] == 0
    assert same(cache, b, 0, T, 4) and same(cache, b, T, 2 * T, 6)
    fill(cache, b, T + T // 2, 2 * T, 9)                  # the request writes its copy ...
    c = cache.acquire()
    assert cache.bind(c, 0, ["c0", "c1"], hits=2)         # ... never the cached block
    assert same(cache, c, T, 2 * T, 6) and same(cache, b, T, T + T // 2, 6)


def test_a_copy_on_write_into_pages_scrubbed_for_another_tenant_is_made(cache):
    """The returning request is another tenant's: x1's pages were zeroed after c1 moved out,
    so the copy is made."""
    b, _ = _cow_in_place(cache, tenant="t2")
    m = cache.metrics()
    assert m["copies_elided"] == 0 and m["blocks_copied"] == 1 and m["pages_scrubbed"] > 0
    assert same(cache, b, T, 2 * T, 6)


def test_a_copy_on_write_in_a_later_step_than_the_move_is_made(cache):
    """Between the step that moved c1 out and the copy, the request may have written its pages:
    the twin is forgotten at the next step's binds."""
    a = cache.acquire()
    assert cache.bind(a, 0, ["c0", "c1"])
    fill(cache, a, 0, 2 * T, 6)
    cache.release(a)
    b = cache.acquire(prefix=["c0"])
    assert cache.bind_many([(b, 0, ["c0", "x1"], 1)]) == []
    fill(cache, b, T, 2 * T, 2)                           # the step's forward wrote x1
    d = cache.acquire()
    assert cache.bind_many([(d, 0, ["z0"], 0)]) == []     # the next step
    assert cache.copy_block("c1", "x1")
    assert cache.metrics()["blocks_copied"] == 1 and same(cache, b, T, 2 * T, 6)


def _cached_then_unmapped(cache, value) -> int:
    """Blocks c0, c1 written with ``value`` by a request that left, then every idle page
    unmapped (the keys keep theirs): returns the request's slot."""
    a = cache.acquire()
    assert cache.bind(a, 0, ["c0", "c1"])
    fill(cache, a, 0, 2 * T, value)
    cache.release(a)
    cache.reclaim()
    return a


def _copy_into_fresh(cache) -> tuple[int, int, int]:
    """A new request's fresh block y0 gets a copy of c1: ``(its slot, map calls, unmap calls)``."""
    b = cache.acquire()
    assert cache.bind(b, 0, ["y0"])
    before = cache.metrics()
    assert cache.copy_block("c1", "y0")
    m = cache.metrics()
    return b, m["map_calls"] - before["map_calls"], m["unmap_calls"] - before["unmap_calls"]


def test_a_copy_from_a_block_mapped_nowhere_maps_it_on_top_of_a_slot_first(cache):
    """Its pages unmapped everywhere (reclaimed) but still held by its key, the source block
    is mapped on top of another slot (one map per range, no unmap) and copied from there."""
    a = _cached_then_unmapped(cache, 3)
    assert cache.mapped_tokens(a) == 0
    b, maps, unmaps = _copy_into_fresh(cache)
    assert maps == cache.layout.num_ranges and unmaps == 0
    assert same(cache, b, 0, T, 3)
    d = cache.acquire()
    assert cache.bind(d, 0, ["c0", "c1"], hits=2)         # both still hit, c1 from its new home
    assert same(cache, d, 0, 2 * T, 3)


def test_a_copy_finds_its_block_where_another_request_maps_it():
    """The block's home position was replaced (it was shared, so it stayed mapped in the other
    request's region): the copy reads it there, with no VMM call."""
    with make_cache(max_slots=3) as cache:
        a = cache.acquire()
        assert cache.bind(a, 0, ["c0", "c1"])
        fill(cache, a, 0, 2 * T, 5)
        b = cache.acquire()
        assert cache.bind(b, 0, ["c0", "c1"], hits=2)     # shared: home of c1 is now (b, 1)
        cache.release(b)
        c = cache.acquire(prefix=["c0"])
        assert c == b and cache.bind(c, 0, ["c0", "n1"], hits=1)   # n1 replaces c1 at (b, 1)
        assert cache._pages.at(b, 1) != cache._pages.at(a, 1)
        d = cache.acquire()
        assert cache.bind(d, 0, ["z0"])
        before = cache.metrics()
        assert cache.copy_block("c1", "z0")
        m = cache.metrics()
        assert m["map_calls"] == before["map_calls"] and same(cache, d, 0, T, 5)
        cache.audit()


def test_with_every_slot_full_a_copy_from_an_unmapped_block_borrows_an_idle_slots_top():
    """Every slot mapped to its end (an engine's pre-warm of a large pool) and the source block
    unmapped everywhere: it is mapped in place of the top page-set of the idle slot released
    longest ago (one unmap + map per range), then copied."""
    with make_cache(max_slots=3, max_context=2 * T) as cache:
        _cached_then_unmapped(cache, 6)                    # c0, c1 now mapped nowhere
        cache.prewarm(2 * T)                               # every slot full again
        assert all(cache.mapped_tokens(s) == 2 * T for s in range(3))
        b, maps, unmaps = _copy_into_fresh(cache)
        assert maps == unmaps == cache.layout.num_ranges
        assert same(cache, b, 0, T, 6)
        cache.audit()


def test_with_every_slot_active_and_full_the_copy_borrows_a_page_set_no_request_reads():
    """No idle slot and no room: the block is mapped in place of the top page-set of an active
    slot whose request does not read that far (as an engine's pre-warm leaves them); the
    request later grows into that position without touching the block."""
    with make_cache(max_slots=2, max_context=3 * T) as cache:
        _cached_then_unmapped(cache, 2)
        cache.prewarm(3 * T)
        b, d = cache.acquire(), cache.acquire()
        assert cache.bind(b, 0, ["y0"]) and cache.bind(d, 0, ["z0", "z1"])
        cache.ensure({b: T, d: 2 * T})
        fill(cache, d, 0, 2 * T, 9)
        assert cache.copy_block("c1", "y0")
        assert same(cache, b, 0, T, 2) and same(cache, d, 0, 2 * T, 9)
        cache.audit()
        assert cache.bind(d, 2, ["z2"])                    # d grows into the borrowed place
        cache.ensure({d: 3 * T})
        fill(cache, d, 2 * T, 3 * T, 4)
        assert same(cache, b, 0, T, 2) and same(cache, d, 0, 2 * T, 9)
        cache.release(b)
        f = cache.acquire()
        assert cache.bind(f, 0, ["c0", "c1"], hits=2)      # c1 still holds its content
        assert same(cache, f, T, 2 * T, 2)
        cache.audit()


def test_the_moves_of_one_step_share_one_fence_recorded_after_them(cache):
    """Two requests back in their slots each move a cached block out (one device copy each):
    the slots get one fence, recorded once, after both copies; a copy queued later gets its own."""
    slots = []
    for n in range(2):
        s = cache.acquire()
        assert cache.bind(s, 0, [f"a{n}", f"b{n}"])
        fill(cache, s, 0, 2 * T, n + 1)
        slots.append(s)
    for s in slots:
        cache.release(s)
    back = [cache.acquire(prefix=[f"a{n}"]) for n in range(2)]
    assert back == slots
    drv = cache._state.driver
    recorded, record = [], drv.record_fence
    drv.record_fence = lambda: recorded.append(1) or record()
    assert cache.bind_many([(s, 0, [f"a{n}", f"x{n}"], 1) for n, s in enumerate(back)]) == []
    assert cache.metrics()["page_sets_moved"] == 2 and len(recorded) == 1
    fences = {id(cache._state.slots.fence[s]) for s in back}
    assert len(fences) == 1 and cache._state.slots.fence[back[0]].recorded
    c = cache.acquire()
    assert cache.bind(c, 0, ["a0", "b0"], hits=2)          # the moved blocks still read back
    assert same(cache, c, T, 2 * T, 1)


def test_moving_a_key_whose_pages_only_it_holds_is_refused_and_changes_nothing(cache):
    """``BlockKeys.move`` is for a block copied out of a position that keeps its pages mapped:
    on pages only the key holds (unmapped everywhere) it would free them, so it refuses."""
    from vattn.core.errors import VattnError
    _cached_then_unmapped(cache, 3)
    keys = cache._state.keys
    before = keys.get("c1")
    with pytest.raises(VattnError, match="would be freed"):
        keys.move("c1", keys.get("c0"), (0, 0))
    assert keys.get("c1") == before and all(keys.bound[p] for p in before)


def test_an_unrecorded_copy_fence_is_not_done_for_another_thread_and_never_recorded_there(cache):
    """A step's copies share a fence recorded on the thread (the stream) that queued them; the
    map-ahead worker meeting it before that (the lock let go while bind_many waits) sees it
    pending rather than recording it on its own stream."""
    import threading
    from vattn.core.errors import VattnError
    from vattn.core.state import SharedFence
    fence = SharedFence(cache._state.driver)
    seen = {}

    def other():
        seen["done"] = fence.done()
        try:
            fence.wait()
        except VattnError as exc:
            seen["wait"] = str(exc)
    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen["done"] is False and "other than the one that queued" in seen["wait"]
    assert not fence.recorded
    assert fence.done() and fence.recorded                # the owner records it (the host: done)
