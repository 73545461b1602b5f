"""Prefix sharing with driver calls failing in the middle of ``bind``, driven as vLLM's runner
drives it: the same ``bind`` retried (``retries`` times), then the request killed — preempted,
its fresh blocks forgotten (their KV is never written), its slot released, the blocks it had
computed before left cached.

The invariants are :class:`SharingMachine`'s: every request still running reads what its blocks
were written with, shared ones included, and the audit holds. A bind that failed half-way must
leave no other request's KV touched and nothing a later hit would read wrong.
"""

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from vattn.core.driver import HostDriver
from vattn.core.driver.faults import FaultInjector
from vattn.core.errors import DriverError

from tests.core.test_sharing_machine import PAGE, SLOTS, SharingMachine, run_machine

RETRIES = 2


class FaultySharingMachine(SharingMachine):
    def make_driver(self):
        self.driver = FaultInjector(HostDriver(granularity=PAGE))
        self.kills = 0
        return self.driver

    def _bind_or_kill(self, slot, start, blocks, hits, kinds, rate, seed) -> bool:
        """``bind`` with ``kinds`` failing at ``rate``, retried as the runner does; False after a
        kill (nothing of the request is left: the caller leaves it out)."""
        for kind in kinds:
            self.driver.arm_rate(kind, rate, seed=seed)
        try:
            for attempt in range(RETRIES + 1):
                try:
                    if self.cache.bind(slot, start, blocks, hits=hits):
                        return True
                    # short: a failed try left pages where a retry cannot use them; the
                    # runner kills the request as for a dry pool (the rules without faults
                    # check that nothing stays short for good)
                    SharingMachine.totals["short"] = SharingMachine.totals.get("short", 0) + 1
                    break
                except DriverError:
                    if attempt == RETRIES:
                        break
        finally:
            self.driver.disarm()
        self.kills += 1
        SharingMachine.totals["kills"] = SharingMachine.totals.get("kills", 0) + 1
        return False

    def _kill(self, slot, kept: list[int], lost: list[int]) -> None:
        """Preempt: the slot goes, ``lost`` (this step's fresh blocks) are forgotten and free,
        ``kept`` (computed before this step) stay cached."""
        self.cache.forget(lost)
        for b in lost:
            self.value.pop(b, None)
            self.never_used.append(b)
        self.cache.release(slot)
        in_use = self._in_use()
        for b in reversed(kept):
            if b not in in_use and b in self.value:
                self.cached[b] = self.value[b]

    @precondition(lambda self: len(self.running) < SLOTS)
    @rule(choice=st.integers(0, 50), hit_len=st.integers(0, 4), fresh=st.integers(1, 3),
          kinds=st.sampled_from([("map",), ("set_access",), ("map", "set_access"), ("unmap",),
                                 ("zero",), ("map", "set_access", "unmap", "zero")]),
          rate=st.sampled_from([0.1, 0.3, 0.6]), seed=st.integers(0, 1 << 16))
    def admit_faulty(self, choice, hit_len, fresh, kinds, rate, seed):
        got = self._admission(choice, hit_len, fresh)
        if got is None:
            return
        slot, blocks, hit = got
        if self._bind_or_kill(slot, 0, blocks, len(hit), kinds, rate, seed):
            self._admitted(slot, blocks, hit)
        else:
            self._kill(slot, hit, blocks[len(hit):])

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, SLOTS - 1), n=st.integers(1, 2),
          kinds=st.sampled_from([("map",), ("set_access",), ("map", "set_access", "unmap")]),
          rate=st.sampled_from([0.3, 0.6]), seed=st.integers(0, 1 << 16))
    def grow_faulty(self, pick, n, kinds, rate, seed):
        slot, blocks, n = self._growth(pick, n)
        if n <= 0:
            return
        new = self._fresh(n)
        if self._bind_or_kill(slot, len(blocks), new, 0, kinds, rate, seed):
            self._grown(slot, blocks, new)
        else:
            del self.running[slot]
            self._kill(slot, blocks, new)


def test_sharing_with_driver_faults_in_bind():
    t = run_machine(FaultySharingMachine, steps=80)
    assert t["kills"] > 20 and t["page_sets_moved"] > 10 and t["prefix_hits"] > 50, t


#: a run that a random search found (2026-12-05): after repeated faults in bind, a later claim
#: with no fault at all ran short of pages although the engine's block count said they existed
#: (the pages sat above ``keep`` in the longer range of the slot being grown, whose total looked
#: like no surplus: reclaim now looks at each range of an unevenly mapped slot)
_SHORT_AFTER_FAULTS = [
    ("admit", dict(choice=37, fresh=2, hit_len=4)), ("grow", dict(late=False, n=2, pick=1)),
    ("grow_faulty", dict(kinds=("map", "set_access", "unmap"), n=2, pick=1, rate=0.3, seed=1315)),
    ("finish", dict(pick=1)),
    ("admit_faulty", dict(choice=26, fresh=3, hit_len=2, kinds=("map",), rate=0.6, seed=21008)),
    ("grow_faulty", dict(kinds=("map", "set_access", "unmap"), n=2, pick=1, rate=0.6, seed=580)),
    ("admit_faulty", dict(choice=18, fresh=1, hit_len=4, kinds=("map", "set_access"), rate=0.6, seed=208)),
    ("evict", dict(n=1)),
    ("admit_faulty", dict(choice=6, fresh=2, hit_len=2, kinds=("map", "set_access", "unmap", "zero"),
                          rate=0.3, seed=490)),
    ("evict", dict(n=2)), ("evict", dict(n=1)),
    ("admit_faulty", dict(choice=9, fresh=1, hit_len=0, kinds=("map", "set_access"), rate=0.6, seed=926)),
    ("finish", dict(pick=1)),
    ("admit_faulty", dict(choice=9, fresh=1, hit_len=0, kinds=("set_access",), rate=0.3, seed=986)),
    ("grow", dict(late=True, n=2, pick=2)), ("grow", dict(late=True, n=2, pick=3)),
]


def test_repeated_faults_leave_no_page_out_of_reach():
    machine = FaultySharingMachine()
    try:
        for name, kwargs in _SHORT_AFTER_FAULTS:
            getattr(machine, name)(**kwargs)
            machine.shared_content_and_accounting()
    finally:
        machine.teardown()
