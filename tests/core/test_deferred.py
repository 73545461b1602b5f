"""Deferred mapping: a window's VMM calls queued per range and made range by range.

The wrapper on its own (order, ranges, what makes the queue first, the worker's thread, a failed
call), then a cache on the host backend: nothing is mapped before ``issue`` reaches the range,
then exactly what the record says; copies (a block copy, a pack's fill) queue behind their
ranges' calls, fences and ``wait`` make the queue first; the
map-ahead worker waits for the queue; a failed deferred call is final and typed, and the cache
still closes (best effort: what the record lost track of goes with the driver).
"""

import threading
import time

import pytest
import torch

from tests.core._util import make_cache
from vattn.core.deferred import DeferredCallError, DeferredCalls, LaterFence
from vattn.core.driver import DoneFence, FaultInjector, HostDriver
from vattn.core.errors import DriverError, VattnError

BASE, RANGE = 1 << 30, 1 << 20
T = 32                                                  # tokens a page-set of the caches below


class Recorder:
    """A driver that records its calls (and fails the ones listed in ``fail``)."""

    granularity = 4096

    def __init__(self, fail=()):
        self.calls, self.fail = [], set(fail)

    def _rec(self, name, *args):
        if (name, *args) in self.fail:
            raise DriverError(name, {"va": args[0]}, "EFAULT")
        self.calls.append((name, *args))

    def map(self, va, size, handle):
        self._rec("map", va, size, handle)

    def set_access(self, va, size):
        self._rec("set_access", va, size)

    def unmap(self, va, size):
        self._rec("unmap", va, size)

    def zero(self, va, size):
        self._rec("zero", va, size)

    def copy(self, dst, src, nbytes):
        self._rec("copy", dst, src, nbytes)

    def copy_many(self, copies):
        self._rec("copy_many", tuple(copies))

    def record_fence(self):
        self._rec("record_fence")
        return DoneFence()

    def bind_thread(self):
        pass


def _calls(fail=()):
    drv = Recorder(fail)
    return drv, DeferredCalls(drv, base=BASE, range_bytes=RANGE, num_ranges=3)


def test_a_window_queues_per_range_and_issue_goes_range_by_range():
    drv, calls = _calls()
    calls.open_window()
    calls.map(BASE + 2 * RANGE, 4096, "h2")
    calls.map(BASE, 4096, "h0")
    calls.set_access(BASE, 4096)
    calls.unmap(BASE + RANGE + 8192, 4096)
    calls.close_window()
    assert drv.calls == [] and calls.pending == 4 and calls.counters.calls_deferred == 4
    assert calls.issue(0) == 2
    assert drv.calls == [("map", BASE, 4096, "h0"), ("set_access", BASE, 4096)]
    assert calls.issue(1) == 1 and drv.calls[-1] == ("unmap", BASE + RANGE + 8192, 4096)
    assert calls.issue() == 1 and drv.calls[-1] == ("map", BASE + 2 * RANGE, 4096, "h2")
    assert calls.pending == 0 and calls.issue() == 0 and calls.counters.issue_us.n == 3


def test_queued_copies_in_a_row_are_made_as_batches_of_independent_copies():
    """Copies queued one after another (across ranges too) go to the driver as one
    ``copy_many`` of copies that do not touch each other's destinations; a copy that reads or
    overwrites what the batch writes, one of another size, or any other call starts a new batch;
    a lone copy is a plain ``copy``."""
    drv, calls = _calls()
    P = 4096
    a, b, c, d, e, f, g = (BASE + i * P for i in range(7))
    r1 = BASE + RANGE
    calls.open_window()
    calls.copy_later(0, b, a, P)
    calls.copy_later(0, d, c, P)
    calls.copy_later(0, e, b, P)                    # reads b, which the batch writes
    calls.copy_later(1, r1 + P, r1, P)              # the next range: joins [e <- b]
    calls.copy_later(1, r1 + 3 * P, r1 + 2 * P, 2 * P)   # another size: alone
    calls.map(r1 + 8 * P, P, "h")
    calls.copy_later(1, g, f, P)                    # after the map: alone
    calls.copy_later(2, BASE + 2 * RANGE + 8, BASE + 2 * RANGE + P, P)   # not aligned: alone
    calls.copy_later(2, BASE + 2 * RANGE + 2 * P, BASE + 2 * RANGE + 3 * P, P)
    calls.close_window()
    assert drv.calls == [] and calls.pending == 9
    assert calls.issue() == 9
    assert drv.calls == [("copy_many", ((b, a, P), (d, c, P))),
                         ("copy_many", ((e, b, P), (r1 + P, r1, P))),
                         ("copy", r1 + 3 * P, r1 + 2 * P, 2 * P),
                         ("map", r1 + 8 * P, P, "h"),
                         ("copy", g, f, P),
                         ("copy", BASE + 2 * RANGE + 8, BASE + 2 * RANGE + P, P),
                         ("copy", BASE + 2 * RANGE + 2 * P, BASE + 2 * RANGE + 3 * P, P)]
    calls.copy_later(0, b, a, P)                    # no window: made now
    assert drv.calls[-1] == ("copy", b, a, P) and calls.pending == 0


def test_a_window_without_copies_still_queues_them_over_a_driver_that_batches():
    """``copies=False`` (a step replaying a full graph) makes copies at once one by one, unless
    the driver makes a batch in one call: then they are queued, to go as one batch."""
    drv, calls = _calls()
    calls.open_window(copies=False)
    assert calls.in_window() and not calls.copies_later()
    calls.close_window()
    drv.batch_copies = True
    batching = DeferredCalls(drv, base=BASE, range_bytes=RANGE, num_ranges=3)
    batching.open_window(copies=False)
    assert batching.copies_later()
    batching.close_window()
    assert not batching.copies_later()                # no window: made now


def test_a_failed_batch_of_copies_is_final_and_names_its_first_copy():
    drv, calls = _calls()
    drv.fail = {("copy_many", ((BASE + 4096, BASE, 4096), (BASE + 3 * 4096, BASE + 2 * 4096, 4096)))}
    calls.open_window()
    calls.copy_later(0, BASE + 4096, BASE, 4096)
    calls.copy_later(0, BASE + 3 * 4096, BASE + 2 * 4096, 4096)
    calls.close_window()
    with pytest.raises(DeferredCallError, match=r"copy\(dst=.*src=.*nbytes=4096"):
        calls.issue()
    with pytest.raises(DeferredCallError):
        calls.copy_later(0, BASE, BASE + 4096, 4096)


def test_calls_outside_the_ranges_and_ordered_calls_make_the_queue_first():
    drv, calls = _calls()
    calls.open_window()
    calls.map(BASE + RANGE, 4096, "h1")
    calls.map(BASE - 4096, 4096, "scratch")           # not a range of the cache: made now, after
    assert drv.calls == [("map", BASE + RANGE, 4096, "h1"), ("map", BASE - 4096, 4096, "scratch")]
    calls.map(BASE, 4096, "h0")
    calls.zero(BASE, 4096)                             # a scrub: queued behind the map
    copied = []
    calls.later(1, lambda: copied.append(len(drv.calls)))   # a copy reading range 1: queued
    fence = calls.record_fence()                       # inside the window: recorded where it stands
    assert isinstance(fence, LaterFence) and not fence.done() and not copied
    calls.set_access(BASE, 4096)
    calls.issue(1)                                     # ranges 0-1: not the fence (last range's)
    assert drv.calls[-3:] == [("map", BASE, 4096, "h0"), ("zero", BASE, 4096), ("set_access", BASE, 4096)]
    assert copied == [len(drv.calls)] and not fence.done()
    fence.wait()                                       # makes the queue, then waits
    assert fence.done() and drv.calls[-1] == ("record_fence",)
    calls.map(BASE, 4096, "h0 again")
    calls.close_window()
    calls.record_fence()                               # after the window: the queue first
    assert drv.calls[-2:] == [("map", BASE, 4096, "h0 again"), ("record_fence",)]
    assert calls.granularity == 4096                   # plain attributes pass through


def test_only_the_window_thread_is_deferred_and_the_worker_thread_bypasses():
    drv, calls = _calls()
    calls.open_window()
    calls.map(BASE, 4096, "mine")

    def worker():
        calls.bind_thread()
        calls.map(BASE + RANGE, 4096, "worker's")      # straight through, the queue stays

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert drv.calls == [("map", BASE + RANGE, 4096, "worker's")] and calls.pending == 1
    with pytest.raises(VattnError, match="open already"):
        calls.open_window()
    calls.close_window()
    calls.open_window()                                # a new window makes the old queue first
    assert drv.calls[-1] == ("map", BASE, 4096, "mine") and calls.pending == 0


def test_a_failed_deferred_call_is_final():
    drv, calls = _calls(fail={("map", BASE + RANGE, 4096, "bad")})
    calls.open_window()
    calls.map(BASE, 4096, "ok")
    calls.map(BASE + RANGE, 4096, "bad")
    calls.set_access(BASE + RANGE, 4096)
    calls.close_window()
    with pytest.raises(DeferredCallError, match="record no longer matches") as err:
        calls.issue()
    assert err.value.call == "map" and isinstance(err.value.__cause__, DriverError)
    for again in (calls.issue, lambda: calls.map(BASE, 4096, "x"), lambda: calls.zero(BASE, 1)):
        with pytest.raises(DeferredCallError, match="earlier deferred call failed"):
            again()
    calls.abandon()
    calls.map(BASE, 4096, "after")                     # teardown may go on, best effort
    assert drv.calls[-1] == ("map", BASE, 4096, "after")


# -- a cache on the host backend -----------------------------------------------------------------
def _cache(driver=None, **over):
    # 4 layers in groups of 2: ranges 0 and 1 (K and V of a group share one)
    # (32 tokens a page-set of 4 KiB pages, 4 page-sets a slot)
    return make_cache(num_layers=4, group_size=2, num_kv_heads=1, head_dim=16, max_slots=3,
                      max_context=4 * T, page_budget=64 * 4096, page_bytes=4096, driver=driver, **over)


def _host(cache):
    drv = cache.driver
    return drv.inner if isinstance(drv, FaultInjector) else drv


def _record_matches(cache):
    """Every position the record maps is mapped (and accessible where the record says so) on
    the host driver, and nothing above it is."""
    host, pages = _host(cache), cache._pages
    for slot in range(cache.layout.num_va_slots):
        for rng, mapped in enumerate(pages.mapped[slot]):
            for i in range(cache.layout.pages_per_slot):
                va = pages.va(rng, slot, i)
                want = i < len(mapped) and mapped[i] >= 0
                assert host.is_mapped(va) == want, (slot, rng, i)
                if want and i < pages.num_accessible[slot][rng]:
                    assert va in host._access, (slot, rng, i)


def test_the_cache_maps_a_range_only_when_its_layers_are_ready():
    with _cache() as cache:
        host = _host(cache)
        with cache.deferred():
            slot = cache.acquire()
            assert cache.ensure({slot: 3 * T - 8}) == []   # 3 page-sets
        assert cache.layout.tokens_for(1) == T
        va0, va1 = cache._pages.va(0, slot, 2), cache._pages.va(1, slot, 2)
        assert cache.calls_queued > 0 and cache.metrics()["pages_mapped"] > 0
        assert not host.is_mapped(va0) and not host.is_mapped(va1)
        assert cache.issue(layer=1) > 0                # layers 0-1: range 0 only
        assert host.is_mapped(va0) and not host.is_mapped(va1)
        assert cache.issue(layer=3) > 0 and cache.calls_queued == 0
        _record_matches(cache)
        cache.k(3)[slot, :3 * T] = 7.0                 # the views work through the new pages
        assert (cache.k(3)[slot, :3 * T] == 7.0).all()
        assert cache.metrics()["calls_deferred"] > 0 and cache.metrics()["issue_us"]["count"] == 2


def test_copies_queue_behind_their_ranges_and_fences_and_wait_make_the_queue_first():
    with _cache(map_ahead_tokens=T) as cache:
        a = cache.acquire()
        cache.bind(a, 0, ["x", "y"])
        cache.k(0)[a, :2 * T] = 3.0
        cache.v(2)[a, :2 * T] = 4.0
        with cache.deferred():
            b = cache.acquire()
            cache.bind(b, 0, ["x", "z"], hits=1)        # "x" mapped into b: queued
            queued = cache.calls_queued
            assert queued > 0
            assert cache.copy_block("y", "z")           # a device copy: queued per range behind them
            assert cache.calls_queued == queued + cache.layout.num_ranges
            cache.issue()
            assert (cache.k(0)[b, :2 * T] == 3.0).all() and (cache.v(2)[b, :2 * T] == 4.0).all()
            assert cache.step({b: 2 * T}) == []         # map-ahead held while calls wait
        cache.wait()                                    # makes them, then the worker goes on
        assert cache.calls_queued == 0 and cache.metrics()["pages_mapped"] > 0
        with cache.deferred():
            cache.ensure({b: 4 * T})
        queued = cache.calls_queued
        cache.release(b)                                # records a fence: the queue first
        assert queued > 0 and cache.calls_queued == 0
        _record_matches(cache)
        cache.audit()


@pytest.mark.parametrize("copies", [True, False])
def test_a_copy_with_nothing_queued_waits_for_its_range_unless_the_window_says_not(copies):
    """A copy-on-write in a window where nothing waits yet: queued per range (made where the
    forward reaches the range, before its layers write) with ``copies=True``; made at once with
    ``copies=False`` (a step that replays a full graph issues every range before it starts)."""
    with _cache() as cache:
        a = cache.acquire()
        cache.bind(a, 0, ["x", "y"])
        cache.k(0)[a, :2 * T] = 3.0
        cache.v(2)[a, :2 * T] = 4.0
        b = cache.acquire()
        cache.bind(b, 0, ["x", "z"], hits=1)            # made now: no window
        assert cache.calls_queued == 0
        with cache.deferred(copies=copies):
            assert cache.copy_block("y", "z")
        queued = cache.calls_queued
        assert queued == (cache.layout.num_ranges if copies else 0)
        assert (cache.k(0)[b, T:2 * T] == 3.0).all() != copies      # not there before issue
        assert cache.issue(layer=1) == (1 if copies else 0)         # range 0's copy
        assert (cache.k(0)[b, :2 * T] == 3.0).all()
        cache.issue()
        assert (cache.v(2)[b, :2 * T] == 4.0).all() and cache.calls_queued == 0
        _record_matches(cache)
        cache.audit()


def test_a_failed_deferred_call_stops_the_cache_loudly_and_it_still_closes():
    injector = FaultInjector(HostDriver(granularity=4096))
    cache = _cache(driver=injector)
    try:
        injector.arm("set_access", injector.calls["set_access"] + 2)
        with cache.deferred():
            slot = cache.acquire()
            cache.ensure({slot: 3 * T})
        with pytest.raises(DeferredCallError, match="set_access"):
            cache.issue()
        with pytest.raises(DeferredCallError):
            cache.issue(layer=0)
        with pytest.raises(DeferredCallError):
            cache.ensure({slot: 4 * T})
    finally:
        cache.close()                                   # best effort: nothing raised
        injector.inner.close()


def test_no_window_no_queue():
    with _cache() as cache:
        slot = cache.acquire()
        cache.ensure({slot: 3 * T})
        assert cache.calls_queued == 0 and cache.issue() == 0
        assert cache.metrics()["calls_deferred"] == 0
        _record_matches(cache)
        assert isinstance(cache.k(0), torch.Tensor)


def test_the_map_ahead_worker_plans_nothing_while_calls_wait():
    """A queued unmap of a running slot's surplus, then a map-ahead target over the same
    position: the worker must wait for the queue (else its map lands on an address still mapped)."""
    with _cache(map_ahead_tokens=T) as cache:
        cache.prewarm(4 * T)
        a = cache.acquire(expected_len=T)
        assert cache.ensure({a: T}) == [] and cache._pages.usable(a) == 4
        with cache.deferred():
            assert cache.reclaim(10**6) >= 3 * cache.layout.num_ranges   # idle slots, then a's surplus
            assert cache._pages.usable(a) == 1 and cache.calls_queued > 0
            assert cache.step({a: T}) == []                # the worker's target: 2 page-sets
            time.sleep(0.3)                                # it would have mapped by now
            assert cache._pages.usable(a) == 1
        cache.wait()
        assert cache._pages.usable(a) == 2 and cache.metrics()["driver_faults"] == 0
        _record_matches(cache)


@pytest.mark.gpu
def test_on_cuda_each_layer_reads_its_range_once_issued_while_kernels_are_queued():
    """The CUDA driver's side: a window's maps made range by range between kernel launches (as
    the backend does before each layer, with the layers before it queued on the stream), then
    every layer reads what it wrote; and a hit mapped in a window reads its owner's bytes."""
    with make_cache("cuda", num_layers=8, group_size=2, max_slots=4, max_context=4 * 4096,
                    page_budget=64 * (2 << 20)) as cache:
        t = cache.layout.tokens_for(1)
        a = cache.acquire()
        assert cache.bind(a, 0, ["p0", "p1"])
        cache.k(0)[a, :2 * t] = 5.0
        with cache.deferred():
            b = cache.acquire()
            assert cache.bind(b, 0, ["p0", "p1", "own"], hits=2)
            assert cache.ensure({b: 3 * t}) == []
        assert cache.calls_queued > 0
        spin = torch.ones(4096, 4096, device="cuda")
        for layer in range(8):
            spin = spin @ spin / 4096                   # queued work the issue overlaps
            cache.issue(layer)
            cache.k(layer)[b, 2 * t:3 * t] = float(layer)
            cache.v(layer)[b, 2 * t:3 * t] = float(layer + 1)
        assert cache.calls_queued == 0
        torch.cuda.synchronize()
        assert (cache.k(0)[b, :2 * t] == 5.0).all()
        for layer in range(8):
            assert (cache.k(layer)[b, 2 * t:3 * t] == layer).all()
            assert (cache.v(layer)[b, 2 * t:3 * t] == layer + 1).all()
        cache.audit()


def test_a_pack_build_in_a_window_waits_for_its_ranges():
    """The second hit of a run written a step ago builds its pack inside a window: the pack's
    allocations are made, its copies queued behind each range's calls (no scratch mapped yet);
    the window's record is as if they were made. Issued, every hit reads the owner's bytes, and
    the third hit maps the pack."""
    from tests.core.test_packs import _cache as packed_cache, _hit
    from tests.core.test_sharing import T as ST, fill, same
    with packed_cache() as cache:
        _hit(cache, ["a0", "a1", "a2", "a3"], value=7)        # bound and written, a step ago
        _hit(cache, ["a0", "a1", "a2", "a3"])
        with cache.deferred():
            second = _hit(cache, ["a0", "a1", "a2", "a3"])    # builds 2 packs: queued copies
            assert cache.metrics()["packs_built"] == 2 and cache.calls_queued > 0
            assert not cache._pages.packs.scratch_pages()
            third = _hit(cache, ["a0", "a1", "a2", "a3"])
            mover = cache.acquire()                           # and a fresh block beside them
            assert cache.bind(mover, 0, ["m0"])
            cache.ensure({mover: ST})
            queued = cache.calls_queued
        assert queued > 0
        cache.issue()
        assert cache._pages.packs.scratch_pages()
        for slot in (second, third):
            assert same(cache, slot, 0, 4 * ST, 7)
        assert cache.metrics()["pages_packed"] > 0
        fill(cache, mover, 0, ST, 3)
        assert same(cache, mover, 0, ST, 3)
        _record_matches(cache)
        cache.audit()


def _in_thread(fn):
    out = {}

    def run():
        try:
            out["value"] = fn()
        except Exception as exc:        # noqa: BLE001 - handed back to the test
            out["error"] = exc
    t = threading.Thread(target=run)
    t.start()
    t.join(10)
    return out


def test_a_thread_beside_the_engine_never_makes_its_queued_calls():
    """A metrics watcher's idle audit found a window's calls queued (an engine warming up for
    seconds between steps) and made them on its own thread, where CUDA has no context and another
    current stream: the engine died at start. Now only the thread that queued them makes them;
    the watcher's audit says it skipped, a stray issue is a typed error, close() still tears down."""
    cache = _cache()
    host = _host(cache)
    try:
        with cache.deferred():
            slot = cache.acquire()
            cache.ensure({slot: 3 * T - 8})
        queued = cache.calls_queued
        assert queued > 0
        out = _in_thread(cache.audit_when_quiet)
        assert out["value"].startswith("skipped") and cache.calls_queued == queued
        out = _in_thread(cache.issue)
        assert isinstance(out["error"], VattnError) and "must be made by it" in str(out["error"])
        assert cache.calls_queued == queued and not host.is_mapped(cache._pages.va(0, slot, 2))
        assert cache.issue() == queued                   # the engine's thread makes them
        assert _in_thread(cache.audit_when_quiet) == {"value": None}
        _record_matches(cache)
        with cache.deferred():
            cache.ensure({slot: 4 * T})
        assert cache.calls_queued > 0
    finally:
        _in_thread(cache.close)                          # from another thread: best effort, no raise
    assert cache._closed
