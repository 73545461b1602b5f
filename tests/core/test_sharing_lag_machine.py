"""Prefix sharing with the device trailing the host (``LaggingFences``: a released slot's fence
completes only some engine steps later, as under vLLM's async scheduling) and
``stream_ordered=True``: reclaim hands a released slot's pages to another request without
waiting for the fence and unmaps their old mapping once it completes (``SlotPages.retire`` /
``flush``).

Besides :class:`SharingMachine`'s invariants (audit, every running request reads its blocks'
values), after every rule the host driver maps exactly what the record says: each recorded page
at its address, each retired position still mapped (its fence pending), nothing else; the map-
ahead worker never takes a page whose old mapping may still be read; nothing is unmapped at an
address a device copy queued in a step the device has not finished yet reads or writes (a copy-on-
write of a partial hit, a cached block moved out of the way: on a GPU, an illegal address). With
driver faults too (an unmap failing while the old mappings are flushed): retried, nothing leaked
or corrupted.
"""

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule

from vattn.core.driver import HostDriver
from vattn.core.driver.faults import FaultInjector
from vattn.core.driver.lag import LaggingFences

from tests.core.test_sharing_faults_machine import FaultySharingMachine
from tests.core.test_sharing_machine import PAGE, SharingMachine, TwoPackSizes, run_machine


def _check_driver(cache, host: HostDriver) -> None:
    pages, pool = cache._pages, cache._pool
    want = {}
    for slot, ranges in enumerate(pages.mapped):
        for rng, pids in enumerate(ranges):
            for index, pid in enumerate(pids):
                if pid >= 0:
                    want[pages.va(rng, slot, index)] = pool.handles[pid]
    packs = pages.packs                 # a pack's run: the pack's allocation, page by page
    for (slot, rng), spans in (packs.spans.items() if packs is not None else ()):
        for start, pack in spans.items():
            for index in range(start, start + pack.size):
                want[pages.va(rng, slot, index)] = pack.handles[rng]
    scratch = packs.scratch_pages() if packs is not None else set()   # builds' copies, until reused
    retired = {pages.va(rng, slot, index) for slot, (_, spots) in pages.retired.items()
               for rng, index in spots}
    assert not retired & set(want), "a retired position is recorded as mapped too"
    assert all(host.mapped_handle(va) == h for va, h in want.items()), "the driver maps other pages"
    extra = set(host._mapped) - set(want) - scratch
    assert extra == retired, f"mapped but neither recorded nor retired: {len(extra - retired)}, " \
                             f"retired but not mapped: {len(retired - extra)}"


class _Lagging:
    stream_ordered = True

    def __init__(self):
        super().__init__()
        self._guard_copies()

    def teardown(self):
        for _ in range(self.device.lag):   # close() synchronizes the device first (on a GPU)
            self.device.tick()
        super().teardown()

    def _admitted(self, slot, blocks, hit):
        """Before the machine reads a bound request's blocks: each is mapped and accessible (the
        host backend would end the process on the read: a segfault hypothesis cannot shrink)."""
        pages = self.cache._pages
        for index in range(len(blocks)):
            for rng in range(self.cache.layout.num_ranges):
                va = pages.va(rng, slot, index)
                assert self.host.mapped_handle(va) is not None and va in self.host._access, \
                    f"block {index} of slot {slot} (range {rng}) is not mapped and accessible after its bind"
        super()._admitted(slot, blocks, hit)

    def _lagging(self, inner) -> LaggingFences:
        self.device = LaggingFences(inner, lag=2)
        return self.device

    def _guard_copies(self) -> None:
        """Record the page addresses each device copy touches until the device has run it, and
        fail an unmap of one of them before then."""
        cache, device, host = self.cache, self.device, self.host
        space, pages = cache._space, cache._pages
        pending: dict[int, int] = {}               # page address -> the step its copy runs in
        copy_set, unmap = space.copy_set, host.unmap

        def copy_set_guarded(src, dst, sets):
            copy_set(src, dst, sets)
            for slot, index in (src, dst):
                for rng in range(cache.layout.num_ranges):
                    pending[pages.va(rng, slot, index)] = device.now + device.lag

        def unmap_guarded(va, size):
            for a in [a for a, due in pending.items() if due <= device.now]:
                del pending[a]                     # run by the device: free to unmap
            racing = [a for a in pending if va <= a < va + size]
            assert not racing, (f"unmap of {len(racing)} page(s) a copy queued at step "
                                f"{pending[racing[0]] - device.lag} still touches (the device is at "
                                f"step {device.now})")
            unmap(va, size)
        space.copy_set, host.unmap = copy_set_guarded, unmap_guarded

    @rule(n=st.integers(1, 3))
    def device_step(self, n):
        """The device finishes ``n`` more engine steps."""
        for _ in range(n):
            self.device.tick()

    @invariant()
    def driver_maps_the_record(self):
        _check_driver(self.cache, self.host)


class LaggingSharingMachine(_Lagging, SharingMachine):
    def make_driver(self):
        self.host = HostDriver(granularity=PAGE)
        return self._lagging(self.host)


class LaggingFaultySharingMachine(_Lagging, FaultySharingMachine):
    def make_driver(self):
        self.host = HostDriver(granularity=PAGE)
        self.driver = FaultInjector(self.host)
        self.kills = 0
        return self._lagging(self.driver)


def test_sharing_with_a_lagging_device_retires_instead_of_waiting():
    t = run_machine(LaggingSharingMachine, steps=120)
    assert t["pages_retired"] > 100 and t["prefix_hits"] > 100 and t["page_sets_moved"] > 10, t


def test_sharing_with_a_lagging_device_and_driver_faults():
    t = run_machine(LaggingFaultySharingMachine, steps=80)
    assert t["pages_retired"] > 50 and t["kills"] > 20, t


class PackedLaggingSharingMachine(LaggingSharingMachine):
    """Packs on with the device trailing (vLLM's GPU runner by default with prefix caching): a
    pack's run maps the pack's allocation (checked against the driver), is never retired (a trim
    over it waits for the fence), and no unmap or unpack lands under a copy in flight."""
    pack_pages = 8


def test_sharing_with_packs_and_a_lagging_device():
    t = run_machine(PackedLaggingSharingMachine, steps=200)
    assert t["packs_built"] > 20 and t["pages_packed"] > 10 and t["pack_unpacks"] > 0, t
    assert t["prefix_hits"] > 1000 and t["copied"] > 500, t


class PackedLaggingFaultySharingMachine(LaggingFaultySharingMachine):
    """All of the above with driver faults too: builds, maps and unpacks of packs fail."""
    pack_pages = 8


def test_sharing_with_packs_a_lagging_device_and_driver_faults():
    t = run_machine(PackedLaggingFaultySharingMachine, steps=120)
    assert t["packs_built"] > 5 and t["pages_packed"] > 10, t
    assert t["prefix_hits"] > 50 and t["kills"] > 20, t


class MultiPackedLaggingFaultySharingMachine(TwoPackSizes, LaggingFaultySharingMachine):
    """Packs of two sizes (4 and 2 page-sets) with the device trailing and driver faults."""


def test_sharing_with_packs_of_two_sizes_a_lagging_device_and_driver_faults():
    t = run_machine(MultiPackedLaggingFaultySharingMachine, steps=120)
    assert t["packs_built"] > 5 and t.get("big_packs", 0) > 0 and t["pages_packed"] > 10, t   # packs of 4 made
    assert t["prefix_hits"] > 50 and t["kills"] > 20, t


def test_a_pack_whose_access_call_failed_gets_it_on_the_retry():
    """Found by 120-rule runs (2026-12-06): a hit mapped a pack, its access call failed, the
    bind's retry found the pack in place and returned without granting access; the request then
    read memory it could not (a segfault on the host, an illegal address on a GPU)."""
    m = PackedLaggingFaultySharingMachine()
    try:
        m.admit(choice=0, fresh=1, hit_len=0)
        m.grow(late=False, n=1, pick=0)
        m.finish(pick=0)
        m.admit(choice=0, fresh=1, hit_len=2)
        m.finish(pick=0)
        for hit_len in (0, 2, 2):
            m.admit(choice=0, fresh=1, hit_len=hit_len)
        m.admit_faulty(choice=1, fresh=1, hit_len=3, kinds=("set_access",), rate=0.1, seed=3774)
        assert m.driver.injected["set_access"] == 2 and m.cache.metrics()["pages_packed"] > 0
        m.driver_maps_the_record()
        m.shared_content_and_accounting()
    finally:
        m.teardown()


@pytest.mark.slow
@pytest.mark.parametrize("machine", [PackedLaggingSharingMachine, PackedLaggingFaultySharingMachine,
                                     LaggingFaultySharingMachine, MultiPackedLaggingFaultySharingMachine],
                         ids=lambda m: m.__name__)
def test_sharing_machines_300_rules(machine):
    """Longer runs than CI's (they found the packs' bugs of 2026-12-06): ``VATTN_SLOW=1``."""
    t = run_machine(machine, steps=300)
    assert t["prefix_hits"] > 1000, t
