"""Random acquire / ensure / step / release / reclaim sequences against a model of the cache.

Invariants after every step: page accounting exact (no page mapped twice, mapped + free = pool),
every active slot reads back exactly its own data, a slot handed to another tenant reads zero.
"""

import os

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from tests.core._util import SMALL_PAGE, make_cache

TENANTS = (1, 2, 3)


class CacheMachine(RuleBasedStateMachine):
    steps_run = 0

    def __init__(self):
        super().__init__()
        self.cache = make_cache(page_budget=40 * SMALL_PAGE, max_context=1200, max_slots=5,
                                map_ahead_tokens=96)
        self.active: dict[int, list] = {}     # slot -> [tenant, length, stamp]
        self.stamp = 0

    def teardown(self):
        self.cache.close()

    def _rows(self, slot, n):
        return self.cache.k(1)[slot, :n], self.cache.v(2)[slot, :n]

    @precondition(lambda self: len(self.active) < 5)
    @rule(tenant=st.sampled_from(TENANTS), expected=st.integers(0, 1200))
    def acquire(self, tenant, expected):
        slot = self.cache.acquire(tenant=tenant, expected_len=expected)
        assert slot not in self.active
        k, v = self._rows(slot, self.cache.mapped_tokens(slot))
        owners = torch.cat([k.flatten(), v.flatten()]).float().div(1000).floor().unique().tolist()
        assert set(owners) <= {0.0, float(tenant)}, f"tenant {tenant} sees data of {owners}"
        self.stamp = self.stamp % 999 + 1
        self.active[slot] = [tenant, 0, tenant * 1000 + self.stamp]

    @precondition(lambda self: self.active)
    @rule(data=st.data(), grow=st.integers(0, 400), ahead=st.booleans())
    def extend(self, data, grow, ahead):
        slot = data.draw(st.sampled_from(sorted(self.active)))
        tenant, length, stamp = self.active[slot]
        target = min(1200, length + grow)
        failed = (self.cache.step if ahead else self.cache.ensure)({slot: target})
        self.cache.wait()          # keep runs deterministic: the worker finishes before the next rule
        if failed:
            assert failed == [slot] and self.cache.mapped_tokens(slot) >= length
            return
        assert self.cache.mapped_tokens(slot) >= target
        k, v = self._rows(slot, target)
        k[length:] = stamp
        v[length:] = stamp
        self.active[slot][1] = target

    @precondition(lambda self: self.active)
    @rule(data=st.data())
    def release(self, data):
        slot = data.draw(st.sampled_from(sorted(self.active)))
        self.cache.release(slot)
        del self.active[slot]

    @rule(pages=st.integers(0, 20))
    def reclaim(self, pages):
        self.cache.reclaim(pages)

    @invariant()
    def accounting_and_isolation(self):
        CacheMachine.steps_run += 1
        self.cache.audit()
        for slot, (_, length, stamp) in self.active.items():
            k, v = self._rows(slot, length)
            assert bool((k == stamp).all()) and bool((v == stamp).all()), f"slot {slot} data changed"
        m = self.cache.metrics()
        assert m["pages_free"] + m["pages_mapped"] == m["pages_total"]
        # capacity() agrees with a plain count: idle slots' pages, and active slots' pages
        # beyond what their length needs (nothing is in flight: the worker has finished)
        c, ranges = self.cache, self.cache.layout.num_ranges
        want = sum(c._pages.held(s) - (c.layout.pages_for(self.active[s][1]) * ranges
                                       if s in self.active else 0)
                   for s in range(c.config.max_slots))
        assert c.capacity().reclaimable_pages == want


def _run(examples: int, steps: int) -> int:
    CacheMachine.steps_run = 0
    run_state_machine_as_test(CacheMachine, settings=settings(
        max_examples=examples, stateful_step_count=steps, deadline=None, derandomize=True,
        suppress_health_check=list(HealthCheck)))
    return CacheMachine.steps_run


def test_state_machine_1e5_operations():
    n = int(os.environ.get("VATTN_SM_STEPS", 100_000))
    ran = _run(examples=n * 3 // 200 + 1, steps=100)  # hypothesis ends some runs early
    assert ran >= n, f"only {ran} operations ran"


@pytest.mark.slow
def test_state_machine_1e6_operations():
    assert _run(examples=15_001, steps=100) >= 1_000_000
