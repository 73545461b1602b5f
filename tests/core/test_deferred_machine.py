"""The prefix-sharing engine of :mod:`tests.core.test_sharing_machine` (packs on) with every
rule's cache calls in a deferral window, as vLLM's GPU runner makes its step's calls: a call is
made only when the engine writes or reads KV (``issue``, as the backend does before a layer),
or when a copy, a fence, a scrub or ``wait`` needs it first. After every rule the host driver's
mappings equal the record, and every request reads its own blocks."""

from hypothesis.stateful import invariant

from tests.core.test_deferred import _record_matches
from tests.core.test_sharing_machine import PackedMachine, SharingMachine, run_machine


class DeferredMachine(PackedMachine):
    def __init__(self):
        super().__init__()
        self._open()

    def _open(self):
        self.window = self.cache.deferred()
        self.window.__enter__()

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
        self.window.__exit__(None, None, None)
        self.cache.issue()
        _record_matches(self.cache)
        super().shared_content_and_accounting()
        self._open()


def test_sharing_state_machine_with_deferred_calls():
    t = run_machine(DeferredMachine, steps=120)
    assert t["deferred"] > 1000 and t["packs_built"] > 10 and t["pages_packed"] > 10, t
    assert t["prefix_hits"] > 100 and t["page_sets_moved"] > 10 and t["copied"] > 50, t
