"""Packs: a shared run hit twice is copied into one allocation per range; later hits map it with
one call per range, read the same bytes, and any write or trim inside it goes to the own pages."""

import pytest

from vattn.core import ConfigError
from vattn.core.driver import FaultInjector
from vattn.core.driver.host import HostDriver
from vattn.core.errors import InjectedFault

from tests.core._util import SMALL_PAGE, make_cache
from tests.core.test_sharing import T, fill, same


def _cache(driver=None, **over):
    cfg = dict(pack_pages=16, pack_sets=2, max_slots=8, max_context=4 * T, page_budget=160 * SMALL_PAGE)
    cfg.update(over)
    return make_cache(driver=driver, **cfg)


def _hit(cache, keys, value=None):
    slot = cache.acquire()
    assert cache.bind(slot, 0, list(keys), hits=len(keys) if value is None else 0)
    if value is not None:
        cache.ensure({slot: len(keys) * T})
        fill(cache, slot, 0, len(keys) * T, value)
    return slot


def _packed(cache, keys, value):
    """Write ``keys`` (``value``) and hit them twice (the second hit creates their packs), then
    end the engine step: the packs are filled at the next one."""
    _hit(cache, keys, value=value)
    for _ in range(2):
        _hit(cache, keys)
    cache.ensure({})


def test_the_second_hit_packs_a_run_written_before_and_later_hits_map_it_with_one_call_per_range():
    with _cache() as cache:
        ranges = cache.layout.num_ranges
        owner = _hit(cache, ["a0", "a1", "a2", "a3"], value=7)   # bound and written, a step ago
        first = _hit(cache, ["a0", "a1", "a2", "a3"])        # one-off so far: page by page
        assert cache.metrics()["packs_built"] == 0
        second = _hit(cache, ["a0", "a1", "a2", "a3"])       # hit again: 2 packs, filled at once
        assert cache.metrics()["packs_built"] == 2 and cache.metrics()["pages_packed"] == 0
        before = cache.metrics()["map_calls"]
        third = _hit(cache, ["a0", "a1", "a2", "a3"])
        m = cache.metrics()
        assert m["map_calls"] - before == 2 * ranges          # two packs, one call per range each
        assert m["pages_packed"] == 4 * ranges
        for slot in (owner, first, second, third):
            assert same(cache, slot, 0, 4 * T, 7)
        assert cache._pages.at(third, 1) == cache._pages.at(owner, 1)   # the record: the own pages
        cache.audit()


def test_packs_of_several_sizes_tile_a_hit_largest_first():
    """Sizes (4, 2): a 6-page-set hit is one pack of 4 and one of 2 (the run at 4 cannot start a
    pack of 4), mapped with one call per range each; a trim inside the 4 unpacks only it."""
    with _cache(pack_sets=(2, 4), pack_pages=32, max_context=6 * T) as cache:
        ranges, keys = cache.layout.num_ranges, [f"m{i}" for i in range(6)]
        packs = cache._pages.packs
        assert packs.runs(0, 6) == [(0, 4), (4, 2)] and packs.runs(1, 6) == [(2, 2), (4, 2)]
        owner = _hit(cache, keys, value=4)
        _hit(cache, keys)
        _hit(cache, keys)                                    # the second hit: both packs, filled
        assert sorted(p.size for p in packs.live) == [2, 4] and cache.metrics()["packs_built"] == 2
        before = cache.metrics()["map_calls"]
        slot = _hit(cache, keys)
        assert cache.metrics()["map_calls"] - before == 2 * ranges
        assert packs.span(slot, 0, 3) == (0, packs.spans[(slot, 0)][0]) and packs.span(slot, 0, 5)[0] == 4
        assert same(cache, slot, 0, 6 * T, 4) and same(cache, owner, 0, 6 * T, 4)
        with cache._cond:
            cache._pages.trim(slot, 3)                       # inside the pack of 4
        assert packs.span(slot, 0, 0) is None and cache._pages.usable(slot) == 3
        assert same(cache, slot, 0, 3 * T, 4)
        cache.audit()


def test_a_pack_size_the_budget_cannot_hold_evicts_nothing():
    """Sizes (2, 4) with room for one pack of 2 only: a pack of 4, which could never fit, is
    refused without dropping the pack of 2 already built."""
    with _cache(pack_sets=(2, 4), pack_pages=4) as cache:
        packs = cache._pages.packs
        assert cache.layout.num_ranges == 2                          # a pack of 2: 4 pages
        _packed(cache, ["p0", "p1"], 2)
        (small,) = packs.live
        assert packs.create(0, ((1, 2, 3, 4), (5, 6, 7, 8))) is None
        assert packs.live == {small}
        cache.audit()


def test_a_pack_never_copies_a_run_before_the_step_that_writes_it():
    """vLLM caches a block, and other requests hit it, in the step that computes it: a pack made
    then must copy the run only after that step's forward (here: the bytes written after the
    hits, before the step ends)."""
    with _cache() as cache:
        owner = cache.acquire()
        assert cache.bind(owner, 0, ["w0", "w1"])            # scheduled, not computed yet
        for _ in range(3):
            _hit(cache, ["w0", "w1"])                        # hits in the same step
        assert cache.metrics()["packs_built"] == 0 and cache.metrics()["pages_packed"] == 0
        cache.ensure({owner: 2 * T})
        fill(cache, owner, 0, 2 * T, 11)                     # the forward writes the run
        late = _hit(cache, ["w0", "w1"])                     # the next step: filled, then mapped
        assert cache.metrics()["packs_built"] == 1 and cache.metrics()["pages_packed"] > 0
        assert same(cache, late, 0, 2 * T, 11)
        cache.audit()


def test_writes_inside_a_packed_run_go_to_the_own_pages_and_leave_the_pack():
    with _cache() as cache:
        _packed(cache, ["b0", "b1"], 5)                     # the second hit builds the pack
        reader = _hit(cache, ["b0", "b1"])                   # and mapped here
        writer = _hit(cache, ["b0", "b1"])
        assert cache.metrics()["pages_packed"] == 2 * 2 * cache.layout.num_ranges
        cache.release(writer)
        again = cache.acquire(prefix=["b0", "b1"])           # the idle slot holding them: the writer's
        assert again == writer
        assert cache.bind(again, 0, ["c0", "c1"])            # fresh blocks where the pack was
        fill(cache, again, 0, 2 * T, 9)
        assert cache.metrics()["pack_unpacks"] >= 1
        assert same(cache, again, 0, 2 * T, 9) and same(cache, reader, 0, 2 * T, 5)
        late = _hit(cache, ["b0", "b1"])                     # the pack still holds b's bytes
        assert same(cache, late, 0, 2 * T, 5)
        cache.audit()


def test_a_trim_inside_a_pack_keeps_the_positions_below_it():
    with _cache() as cache:
        _packed(cache, ["d0", "d1"], 3)
        slot = _hit(cache, ["d0", "d1"])
        assert cache._pages.packs.span(slot, 0, 1) is not None
        with cache._cond:
            cache._pages.trim(slot, 1)                       # the pack's second position goes
        assert cache._pages.packs.span(slot, 0, 0) is None and cache._pages.usable(slot) == 1
        assert same(cache, slot, 0, T, 3)
        cache.audit()


def test_a_page_taken_again_never_matches_an_old_pack():
    with _cache() as cache:
        packs, pool = cache._pages.packs, cache._pool
        owner = cache.acquire()
        assert cache.bind(owner, 0, ["e0", "e1"])            # hit in the step that writes them
        for _ in range(2):
            _hit(cache, ["e0", "e1"])
        (pending,) = packs.live
        assert not pending.ready
        pool.gen[pending.pids[0][0]] += 1                    # as if freed and taken for new content
        assert packs.lookup(pending.start, pending.pids) is None
        cache.ensure({})
        cache.ensure({})                                     # its fill finds other content: dropped
        assert not packs.live and packs.held == 0 and cache.metrics()["packs_built"] == 0
        _packed(cache, ["e2", "e3"], 5)                      # written a step before: filled at once
        (ready,) = packs.live
        assert ready.ready and cache.metrics()["packs_built"] == 1
        pool.gen[ready.pids[1][1]] += 1
        assert packs.lookup(ready.start, ready.pids) is None
        assert not packs.live and packs.held == 0            # stale and unused: released


def _faulty(keys, value):
    """A cache over a fault-injecting host driver whose ``keys`` were written and hit once."""
    drv = FaultInjector(HostDriver(granularity=SMALL_PAGE))
    cache = _cache(driver=drv)
    _hit(cache, keys, value=value)
    _hit(cache, keys)
    return drv, cache


def _step(cache) -> None:
    cache.ensure({})


def test_a_failed_pack_map_leaves_an_exact_record_and_the_bind_can_be_retried():
    drv, cache = _faulty(["f0", "f1"], 6)
    with cache:
        _hit(cache, ["f0", "f1"])                            # creates and fills the pack
        assert cache.metrics()["packs_built"] == 1
        slot = cache.acquire()
        drv.arm("map", drv.calls["map"] + 1)                 # the pack's map call
        with pytest.raises(InjectedFault):
            cache.bind(slot, 0, ["f0", "f1"], hits=2)
        cache.audit()
        assert cache.bind(slot, 0, ["f0", "f1"], hits=2)
        assert same(cache, slot, 0, 2 * T, 6)
        cache.audit()


def test_a_failed_pack_build_is_skipped():
    drv, cache = _faulty(["g0", "g1"], 2)
    with cache:
        drv.arm("create", drv.calls["create"] + 1)            # the pack's first allocation
        slot = _hit(cache, ["g0", "g1"])                     # mapped page by page, no pack
        _step(cache)
        m = cache.metrics()
        assert m["packs_built"] == 0 and m["driver_faults"] == 1
        assert same(cache, slot, 0, 2 * T, 2)
        cache.audit()


@pytest.mark.parametrize("over, match", [({"pack_pages": -1}, "pack_pages"), ({"pack_sets": 3}, "pack_sets"),
                                         ({"pack_sets": (2, 2)}, "distinct"), ({"pack_sets": (4, 6)}, "pack_sets"),
                                         ({"pack_sets": ()}, "pack_sets"),
                                         ({"pack_sets": 1}, "pack_sets"), ({"pack_pages": True}, "pack_pages")])
def test_pack_config_is_checked(over, match):
    with pytest.raises(ConfigError, match=match):
        make_cache(**over)


def _written_then_hit_three_times(cache, keys, value):
    """An owner binds and writes ``keys`` in one step; two hits in it (the second makes the
    packs, filled once the step ends), one more hit in the next. Returns (owner, the three)."""
    t = cache.layout.tokens_for(1)
    owner = cache.acquire()
    assert cache.bind(owner, 0, keys)
    cache.ensure({owner: len(keys) * t})
    fill(cache, owner, 0, len(keys) * t, value)
    slots = [_hit(cache, keys) for _ in range(2)]
    cache.ensure({})                                     # the step ends: the next fills the packs
    return owner, slots + [_hit(cache, keys)]


@pytest.mark.gpu
def test_on_cuda_a_pack_reads_the_same_bytes_and_a_write_beside_it_stays_private():
    """The CUDA driver's side: K-page allocations mapped whole, the copy on the stream."""
    import torch
    with make_cache("cuda", pack_pages=64, pack_sets=2, max_slots=6, max_context=32768,
                    page_budget=64 * (2 << 20)) as cache:
        t = cache.layout.tokens_for(1)
        owner, slots = _written_then_hit_three_times(cache, ["h0", "h1"], 8)
        assert cache.metrics()["packs_built"] == 1 and cache.metrics()["pages_packed"] > 0
        torch.cuda.synchronize()
        for slot in [owner, *slots]:
            assert same(cache, slot, 0, 2 * t, 8)
        assert cache.bind(slots[-1], 2, ["own"])
        cache.ensure({slots[-1]: 3 * t})
        fill(cache, slots[-1], 2 * t, 3 * t, 1)
        assert same(cache, owner, 0, 2 * t, 8) and same(cache, slots[-1], 2 * t, 3 * t, 1)
        cache.audit()


@pytest.mark.gpu
def test_on_cuda_packs_of_two_sizes_tile_a_hit_and_read_the_same_bytes():
    """The CUDA driver's side of several sizes: allocations of 4 and of 2 pages mapped whole into
    one region, each filled through the scratch areas sized for the largest, and a trim inside
    the pack of 4 going back to the own pages."""
    import torch
    with make_cache("cuda", pack_pages=64, pack_sets=(2, 4), max_slots=6, max_context=32768,
                    page_budget=96 * (2 << 20)) as cache:
        t = cache.layout.tokens_for(1)
        owner, slots = _written_then_hit_three_times(cache, [f"q{i}" for i in range(6)], 6)
        assert sorted(p.size for p in cache._pages.packs.live) == [2, 4]
        torch.cuda.synchronize()
        for slot in [owner, *slots]:
            assert same(cache, slot, 0, 6 * t, 6)
        with cache._cond:
            cache._pages.trim(slots[-1], 3)
        torch.cuda.synchronize()
        assert same(cache, slots[-1], 0, 3 * t, 6) and same(cache, owner, 0, 6 * t, 6)
        cache.audit()


def test_the_start_up_line_names_the_pack_budget():
    with _cache() as cache:
        assert "packs of 2 page-sets up to 1 MiB beside the pool" in cache.summary()   # 16 x 64 KiB
    with _cache(pack_sets=(4, 2)) as cache:
        assert "packs of 2/4 page-sets" in cache.summary()
    with _cache(pack_pages=0) as cache:
        assert "packs" not in cache.summary()


@pytest.mark.parametrize("raw, want", [("", 8), ("16", 16), ("8,16,32", (8, 16, 32))])
def test_pack_sets_env_takes_one_size_or_a_comma_list(monkeypatch, raw, want):
    from vattn.core.config import pack_sets
    monkeypatch.setenv("VATTN_PACK_SETS", raw)
    assert pack_sets() == want


@pytest.mark.parametrize("raw", ["8,x", "1,8", "8,,16"])
def test_pack_sets_env_refuses_a_bad_list(monkeypatch, raw):
    from vattn.core.config import pack_sets
    monkeypatch.setenv("VATTN_PACK_SETS", raw)
    with pytest.raises(ConfigError, match=r"VATTN_PACK_SETS must be an integer >= 2 or a comma list"):
        pack_sets()
