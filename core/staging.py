"""Staging: a shared prefix mapped into idle slots ahead of the requests that will hit it.

A burst of requests sharing a prefix (a system prompt) makes each of them map the prefix's
page-sets into its own region when it is admitted, on the step's critical path: one map call and
one access grant per page, and the grant costs ~30 µs per physical allocation on the CUDA driver
(one per page in the pool) whatever the call covers (BENCHMARKS.md, "what one mapping costs").
Staging maps the prefix into *empty* idle
slots beforehand (no page of their own to unmap, no fence to wait for), one page-set at a time
— on the map-ahead worker while the device computes, when the cache has one — and admission
hands those slots to the next requests that hit it: their prefix is in place, so binding it
costs no VMM call.
"""

from __future__ import annotations

from collections import deque
from itertools import islice

import numpy as np

from .errors import SlotError
from .paging import PendingSet
from .state import CacheState

__all__ = ["Staging", "PrefixBursts"]


class PrefixBursts:
    """Which prefixes an engine step's new requests hit are worth staging (an engine adapter's
    policy for :meth:`VirtualKVCache.stage_prefix`): a prefix (named by its last hit key) hit by
    two or more new requests of a step, or by one again after one hit it in the previous step
    observed — a burst, or a stream, of requests sharing a system prompt — with the number that
    hit it now (the idle copies to keep ready). A prompt repeated once (each request hits its
    own) stages nothing."""

    def __init__(self):
        self._last: set = set()

    def observe(self, items) -> list[tuple[list, int]]:
        """``items``: the step's ``(slot, start, keys, hits)`` binds (:meth:`bind_many`'s); new
        requests are those binding from 0 with hits. Returns ``[(prefix keys, copies)]``."""
        groups: dict = {}
        for _, start, keys, hits in items:
            if start == 0 and hits:
                group = groups.setdefault(keys[hits - 1], [list(keys[:hits]), 0])
                group[1] += 1
        burst = [(keys, n) for last, (keys, n) in groups.items() if n > 1 or last in self._last]
        self._last = set(groups)
        return burst


class Staging:
    """The staging jobs of one cache: ``[slot, keys, next index]``. Each page-set is planned
    under the cache lock (:meth:`plan_step`: the slot goes in flight, the pages gain a
    reference), mapped without it (:meth:`SlotPages.map_pending`) and recorded under it
    (:meth:`commit`), as the map-ahead worker maps a running slot's next page-set: the engine
    thread never waits behind a staging call."""

    def __init__(self, state: CacheState):
        self.state = state
        self.jobs: deque[list] = deque()

    def plan(self, keys: list, copies: int) -> int:
        """Queue jobs so that ``copies`` idle slots hold the page-sets ``keys`` name at positions
        ``0 ..`` (idle slots that already start with them count); returns the jobs queued.
        Caller holds the lock."""
        st = self.state
        table, pages, n = st.slots, st.pages, st.config.max_slots
        sets = [st.keys.get(key) for key in keys]
        if None in sets:
            key = keys[sets.index(None)]
            raise SlotError(f"staging block key {key!r}, which no page-set holds (never bound by "
                            "this cache, or dropped since)")
        idle = np.flatnonzero(~table.active[:n])
        queued = {job[0] for job in self.jobs}
        holding = int(np.count_nonzero(pages.head[idle] == sets[0][0]))
        holding += sum(1 for job in self.jobs if job[1][0] == keys[0])
        want = copies - holding
        if want <= 0:
            return 0
        busy = {*table.inflight, *pages.retired, *queued}
        empty = idle[(pages.usable_n[idle] == 0)]
        order = empty[np.argsort(table.released_at[empty], kind="stable")]
        free = (s for s in order.tolist() if s not in busy and not any(pages.mapped[s]))
        picked = list(islice(free, want))                 # stop at the ones wanted
        for slot in picked:
            self.jobs.append([slot, list(keys), 0])
        return len(picked)

    def plan_step(self) -> PendingSet | None:
        """The next page-set of the first job, planned (caller holds the lock), or ``None`` when
        that job ended: its slot was acquired, changed or taken meanwhile, or its next key was
        dropped (what it mapped stays: an idle slot holding part of the prefix)."""
        st = self.state
        slot, keys, index = self.jobs[0]
        pids = st.keys.get(keys[index])
        if (pids is None or st.slots.active[slot] or slot in st.slots.inflight
                or slot in st.pages.retired or st.pages.usable(slot) != index
                or not st.pages.mapped_evenly(slot)):
            self.jobs.popleft()
            return None
        st.pool.ref(pids)                             # held while mapped without the lock
        st.slots.inflight.add(slot)
        return PendingSet(slot, index, list(pids), [False] * len(pids), None, shared=True)

    def commit(self, p: PendingSet) -> None:
        """Record a page-set :meth:`plan_step` planned and the driver mapped (caller holds the
        lock). A failed driver call ends its job (counted; the record stays exact)."""
        st = self.state
        ok = st.pages.commit(p)
        st.slots.inflight.discard(p.slot)
        job = self.jobs[0] if self.jobs else None
        if p.done:
            st.slots.mixed.add(p.slot)                # the shared pages carry their writer's tag
        if ok:
            st.counters.page_sets_staged += 1
            key = job[1][p.index] if job is not None and job[0] == p.slot else None
            if key is not None:
                st.keys.home[key] = (p.slot, p.index)
        if job is None or job[0] != p.slot:           # dropped meanwhile (the slot was acquired)
            return
        job[2] = p.index + 1
        if not ok or job[2] == len(job[1]):
            self.jobs.popleft()

    def step(self) -> None:
        """One page-set of the first job, all under the caller's lock (no map-ahead worker)."""
        plan = self.plan_step()
        if plan is not None:
            self.state.pages.map_pending(plan)
            self.commit(plan)

    def drop(self, slot: int) -> None:
        """Forget the jobs of ``slot`` (it was acquired)."""
        if any(job[0] == slot for job in self.jobs):
            self.jobs = deque(job for job in self.jobs if job[0] != slot)
