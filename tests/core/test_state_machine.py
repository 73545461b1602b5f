"""Random acquire / ensure / step / release / reclaim sequences against a model of the cache.

Invariants after every operation: page accounting exact (no page mapped twice, mapped + free =
pool), capacity() agrees with a plain count, every active slot reads back exactly its own data,
and a slot handed to a tenant holds no other tenant's data.

Cheap enough for 10^6 operations: the cache is small (pages of the OS page size holding 128
tokens each, as in the other tests) and its one layer keeps K and V in ranges of their own, so a
slot's data is contiguous and checked with one numpy comparison over an int16 view; capacity()
and the gauges are checked whenever the page state they depend on changes.

Deterministic, so derandomize=True replays the same operations on every run: each example builds
its own cache; only step() starts background work (the map-ahead worker) and the step rule waits
for it before returning, so no thread changes the cache while hypothesis draws the next rule (the
invariant asserts the worker is idle); acquire, ensure, release, reclaim, capacity, metrics and
audit run on the calling thread; nothing depends on time (no deadline, no health checks). The
sequence itself can differ between pytest invocations that import different modules: hypothesis
also draws integers from the constants in the project's loaded modules.
"""

import gc
import mmap
import os

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from tests.core._util import make_cache

SLOTS, MAX_CONTEXT, PAGE = 5, 1200, mmap.PAGESIZE
PICK = st.integers(0, SLOTS - 1)        # an active slot, by its rank among the active ones
GROW = st.integers(0, 400)
TENANT_SHIFT = 12                       # a request writes tenant << 12 | serial (an int16)


class CacheMachine(RuleBasedStateMachine):
    machines = checks = 0

    def __init__(self):
        super().__init__()
        CacheMachine.machines += 1
        # a token takes PAGE / 128 bytes in each of the 2 ranges (K, V): a slot spans 10 pages
        # per range, the pool holds 40
        self.cache = make_cache(num_layers=1, group_size=1, split_kv=True, num_kv_heads=1,
                                head_dim=PAGE // 256, page_bytes=PAGE, page_budget=40 * PAGE,
                                max_context=MAX_CONTEXT, max_slots=SLOTS, map_ahead_tokens=96)
        # K and V as one [2, slot, token, H, D] int16 view: both ranges lie in one reservation
        k, v = self.cache.k(0).view(torch.int16), self.cache.v(0).view(torch.int16)
        self.kv = k.as_strided((2, *k.shape), (v.storage_offset() - k.storage_offset(), *k.stride())).numpy()
        self.active: dict[int, list] = {}     # slot -> [tenant, length, value]
        self.serial = 0                       # numbers the requests, so values differ
        self.checked_state = None

    def teardown(self):
        self.kv = None
        self.cache.close()

    def _pick(self, pick):
        return sorted(self.active)[pick % len(self.active)]

    @precondition(lambda self: len(self.active) < SLOTS)
    @rule(tenant=st.integers(1, 3), expected=st.integers(0, MAX_CONTEXT))
    def acquire(self, tenant, expected):
        slot = self.cache.acquire(tenant=tenant, expected_len=expected)
        assert slot not in self.active
        rows = self.kv[:, slot, :self.cache.mapped_tokens(slot)]
        foreign = rows[(rows != 0) & (rows >> TENANT_SHIFT != tenant)]
        assert not foreign.size, f"tenant {tenant} sees data of {set((foreign >> TENANT_SHIFT).tolist())}"
        self.serial = self.serial % 4095 + 1
        self.active[slot] = [tenant, 0, tenant << TENANT_SHIFT | self.serial]

    @precondition(lambda self: self.active)
    @rule(pick=PICK, grow=GROW)
    def ensure(self, pick, grow):
        self._extend(self._pick(pick), grow, ahead=False)

    @precondition(lambda self: self.active)
    @rule(pick=PICK, grow=GROW)
    def step(self, pick, grow):
        self._extend(self._pick(pick), grow, ahead=True)

    def _extend(self, slot, grow, ahead):
        _, length, value = self.active[slot]
        target = min(MAX_CONTEXT, length + grow)
        if ahead:
            failed = self.cache.step({slot: target})
            self.cache.wait()          # the map-ahead worker finishes before the next rule
        else:
            failed = self.cache.ensure({slot: target})
        if failed:
            assert failed == [slot] and self.cache.mapped_tokens(slot) >= length
            return
        assert self.cache.mapped_tokens(slot) >= target
        self.kv[:, slot, length:target] = value
        self.active[slot][1] = target

    @precondition(lambda self: self.active)
    @rule(pick=PICK)
    def release(self, pick):
        slot = self._pick(pick)
        self.cache.release(slot)
        del self.active[slot]

    @rule(pages=st.integers(0, 20))
    def reclaim(self, pages):
        self.cache.reclaim(pages)

    @invariant()
    def accounting_and_isolation(self):
        CacheMachine.checks += 1
        c = self.cache
        assert not c._inflight and (c._worker is None or c._worker.idle()), "map-ahead still running"
        c.audit()
        for slot, (_, length, value) in self.active.items():
            assert (self.kv[:, slot, :length] == value).all(), f"slot {slot} data changed"
        # the page gauges and capacity() are functions of the page state (pages per slot, the
        # active slots and their lengths, the free count; nothing is in flight): checked each
        # time it changes, which most operations (no-op reclaims, failed growth) do not
        state = (c._pages.held_n.tobytes(), c._active.tobytes(), c._length.tobytes(), c._pool.num_free)
        if state == self.checked_state:
            return
        self.checked_state = state
        m = c.metrics()
        assert m["pages_free"] + m["pages_mapped"] == m["pages_total"]
        # capacity() agrees with a plain count: idle slots' pages, and active slots' pages
        # beyond what their length needs
        need = sum(c.layout.pages_for(length) for _, length, _ in self.active.values())
        want = int(c._pages.held_n[:SLOTS].sum()) - need * c.layout.num_ranges
        assert c.capacity().reclaimable_pages == want


def _run(operations: int) -> int:
    """Run about ``operations`` rules (each followed by the invariant); return how many ran."""
    CacheMachine.machines = CacheMachine.checks = 0
    # young-generation collections are frequent under hypothesis's allocations, and each one
    # calls hypothesis's GC-timing hooks: collect less often for the run (a fifth of its time)
    threshold = gc.get_threshold()
    gc.set_threshold(50_000, *threshold[1:])
    try:
        # examples of up to 500 steps (long ones spread hypothesis's per-example work); hypothesis
        # cuts some short, so the examples run 430-480 operations on average
        run_state_machine_as_test(CacheMachine, settings=settings(
            max_examples=operations // 430 + 10, stateful_step_count=500, deadline=None,
            derandomize=True, suppress_health_check=list(HealthCheck)))
    finally:
        gc.set_threshold(*threshold)
    return CacheMachine.checks - CacheMachine.machines   # the invariant also runs before the first rule


def test_state_machine_1e5_operations():
    n = int(os.environ.get("VATTN_SM_STEPS", 100_000))
    ran = _run(n)
    assert ran >= n, f"only {ran} operations ran"


@pytest.mark.slow
def test_state_machine_1e6_operations():
    ran = _run(1_000_000)
    assert ran >= 1_000_000, f"only {ran} operations ran"
