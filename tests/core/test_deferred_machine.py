"""The prefix-sharing engines of :mod:`tests.core.test_sharing_machine` and
:mod:`tests.core.test_sharing_lag_machine` (packs on) with every rule's cache calls in a
deferral window, as vLLM's GPU runner makes its step's calls: a call is made only when the
engine writes or reads KV (``issue``, as the backend does before a layer), or when a fence
wait, a map outside the ranges or ``wait`` needs it first; block copies, pack fills and fences
inside the window queue behind their ranges (copies in every other window only behind calls
already waiting, as ``deferred(copies=False)`` does). After every rule the host driver's mappings equal
the record, and every request reads its own blocks; with the device trailing, no unmap lands
under a copy still in flight."""

from hypothesis.stateful import invariant

from tests.core.test_deferred import _record_matches
from tests.core.test_sharing_lag_machine import PackedLaggingSharingMachine
from tests.core.test_sharing_machine import PackedMachine, SharingMachine, run_machine


class _Deferred:
    def __init__(self):
        super().__init__()
        copy_block = self.cache.copy_block

        def copied_then_issued(src, dst):     # the rule reads the copy at once: a forward would
            done = copy_block(src, dst)        # issue the layers before reading them
            self.cache.issue()
            return done
        self.cache.copy_block = copied_then_issued
        self._open()

    def _open(self):
        """A new window; every other one queues copies only behind waiting calls (as a step that
        replays a full CUDA graph opens it)."""
        self.copies = not getattr(self, "copies", False)
        self.window = self.cache.deferred(copies=self.copies)
        self.window.__enter__()

    def _issued(self, check):
        """``check()`` with the window closed and everything queued made, then a new window."""
        self.window.__exit__(None, None, None)
        self.cache.issue()
        try:
            check()
        finally:
            self._open()

    def _write(self, slot, index, block):
        self.cache.issue(layer=0)       # the forward's store: its range first
        super()._write(slot, index, block)

    def _admitted(self, slot, blocks, hit):
        self.cache.issue()
        super()._admitted(slot, blocks, hit)

    def teardown(self):
        SharingMachine.totals["deferred"] = (SharingMachine.totals.get("deferred", 0)
                                             + self.cache.metrics()["calls_deferred"])
        self.window.__exit__(None, None, None)
        super().teardown()

    @invariant()
    def shared_content_and_accounting(self):
        def check():
            if not self.stream_ordered:        # (retired mappings: the lag machine's own check)
                _record_matches(self.cache)
            super(_Deferred, self).shared_content_and_accounting()
        self._issued(check)


class DeferredMachine(_Deferred, PackedMachine):
    pass


class DeferredLaggingMachine(_Deferred, PackedLaggingSharingMachine):
    def _guard_copies(self) -> None:
        """The lag machine's guard, with each copy's pages recorded when the copy is launched:
        inside a window, where the queue reaches it (an unmap queued before the copy is made
        before it)."""
        cache, device, host = self.cache, self.device, self.host
        space, pages, calls = cache._space, cache._pages, cache._calls
        pending: dict[int, int] = {}               # page address -> the step its copy runs in
        copy_set, unmap = space.copy_set, host.unmap

        def launched(src, dst):
            for slot, index in (src, dst):
                for rng in range(cache.layout.num_ranges):
                    pending[pages.va(rng, slot, index)] = device.now + device.lag

        def copy_set_guarded(src, dst, sets):
            queued = calls.copies_later()
            copy_set(src, dst, sets)
            if queued:
                calls.later(cache.layout.num_ranges - 1, lambda: launched(src, dst))
            else:
                launched(src, dst)

        def unmap_guarded(va, size):
            for a in [a for a, due in pending.items() if due <= device.now]:
                del pending[a]
            racing = [a for a in pending if va <= a < va + size]
            assert not racing, f"unmap of {len(racing)} page(s) a copy in flight touches"
            unmap(va, size)
        space.copy_set, host.unmap = copy_set_guarded, unmap_guarded

    @invariant()
    def driver_maps_the_record(self):
        self._issued(super().driver_maps_the_record)


def test_sharing_state_machine_with_deferred_calls():
    t = run_machine(DeferredMachine, steps=120)
    assert t["deferred"] > 1000 and t["packs_built"] > 10 and t["pages_packed"] > 10, t
    assert t["prefix_hits"] > 100 and t["page_sets_moved"] > 10 and t["copied"] > 50, t


def test_sharing_with_deferred_calls_and_a_lagging_device():
    t = run_machine(DeferredLaggingMachine, steps=120)
    assert t["deferred"] > 1000 and t["packs_built"] > 10 and t["pages_retired"] > 10, t
    assert t["prefix_hits"] > 500 and t["copied"] > 100, t


def test_a_page_that_moves_to_a_lower_range_waits_for_the_work_queued_on_it():
    """Found by the lagging machine (2026-12-07): a copy-on-write queued in range 1 read a page
    that the same window then freed and handed to range 0, where a copy into it was queued.
    Issued range by range, the range-0 copy ran first and the range-1 copy read its bytes.
    A page taken for a lower range than queued work still uses now makes that work first."""
    m = DeferredLaggingMachine()
    try:
        for rule, kw in [("admit", dict(choice=0, fresh=1, hit_len=0)), ("finish", dict(pick=0)),
                         ("admit", dict(choice=0, fresh=1, hit_len=0)),
                         ("admit_copy_on_write", dict(choice=0, fresh=0, hit_len=1)),
                         ("admit_copy_on_write", dict(choice=0, fresh=1, hit_len=1)),
                         ("grow", dict(late=False, n=1, pick=0)), ("reclaim", dict(pages=5)),
                         ("finish", dict(pick=1)), ("grow", dict(late=False, n=2, pick=0)),
                         ("grow", dict(late=False, n=2, pick=0)),
                         ("admit_copy_on_write", dict(choice=0, fresh=1, hit_len=1))]:
            getattr(m, rule)(**kw)
            m.driver_maps_the_record()
            m.shared_content_and_accounting()
    finally:
        m.teardown()
