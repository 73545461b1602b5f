"""Map-ahead: a background thread maps each running slot's next page-set while the GPU computes.

Pages come from the free pool, else from idle slots (oldest released first, finished fences
only), else from what running slots hold beyond what their requests read plus their own
map-ahead margin: moving warm pages to the requests that grow happens here, off the critical
path. When no running slot waits for a page-set, the worker maps staged prefixes into idle slots
(:mod:`.staging`).

Three phases per page-set so the engine thread is never blocked behind a VMM call it does not
need: plan (under the cache lock: take pages, mark the slot in flight), map (no lock:
:meth:`~vattn.core.paging.SlotPages.map_pending`), commit (under the lock: record).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from .errors import DriverError
from .paging import PendingSet, SlotPages
from .staging import Staging
from .state import SlotTable

__all__ = ["MapAhead"]


class MapAhead:
    """The worker thread of one cache. ``submit`` never blocks on driver calls.

    Parameters
    ----------
    cond : threading.Condition
        The cache's lock: held to plan and to commit, released while the driver maps; notified
        whenever the worker goes idle or commits.
    driver : DeferredCalls
        The cache's (over its driver): bound to the worker thread once (``bind_thread``: its
        calls go straight through); ``pending`` says a deferral window's calls wait.
    slots : SlotTable
        Read: ``active`` and ``tenant``. Written: ``inflight`` holds the slot whose page-set is
        being mapped here (nobody else maps into it or takes its pages meanwhile).
    pages : SlotPages
        Where the page-sets are planned, mapped and recorded (the one mapping path).
    take : callable
        ``take(n)`` -> ``n`` pool pages, or ``None``; may unmap idle slots' pages, never waits
        on a fence.
    staging : Staging, optional
        Prefixes to map into idle slots (:meth:`VirtualKVCache.stage_prefix`): one page-set per
        turn, planned and recorded under the lock and mapped without it, whenever no running
        slot waits for a page-set.
    refill : callable, optional
        ``refill(n)`` -> pages freed (at most ``n``) toward the cache's free reserve, under the
        lock (unmaps of idle page-sets that hold nothing); called a page-set at a time when
        nothing else waits, after :meth:`poke`, until it frees nothing (then not before the
        next :meth:`poke`).
    """

    def __init__(self, cond: threading.Condition, *, driver, slots: SlotTable, pages: SlotPages,
                 take: Callable[[int], list[int] | None], staging: Staging | None = None,
                 refill: Callable[[int], int] | None = None):
        self.cond, self.driver, self.slots, self.pages, self.take = cond, driver, slots, pages, take
        self.staging = staging
        self.refill = refill
        self._refilling = False              # poked: refill until it frees nothing
        self.jobs: dict[int, int] = {}       # slot -> target page-sets
        self.busy = False
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="vattn-map-ahead", daemon=True)
        self.thread.start()

    def submit(self, targets: dict[int, int]) -> None:
        """Ask for these page-set targets (caller holds the cache lock)."""
        for slot, target in targets.items():
            if target > self.jobs.get(slot, 0):
                self.jobs[slot] = target
        self.cond.notify_all()

    def poke(self) -> None:
        """An engine step went by: refill the free reserve, if there is one (caller holds the
        cache lock)."""
        if self.refill is not None and not self._refilling:
            self._refilling = True
            self.cond.notify_all()

    def cancel(self, slot: int) -> None:
        """Drop ``slot``'s target (its request ended; caller holds the cache lock)."""
        self.jobs.pop(slot, None)

    def idle(self) -> bool:
        return not self.jobs and not self.busy and not self._staged() and not self._refilling

    def _held(self) -> bool:
        """Calls a deferral window queued wait to be made: plan nothing (a page-set planned now
        could land where a queued unmap has not been made yet)."""
        return self.driver.pending > 0

    def _staged(self) -> bool:
        return self.staging is not None and bool(self.staging.jobs)

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        self.thread.join()

    def _run(self) -> None:
        self.driver.bind_thread()
        while True:
            with self.cond:
                while ((not self.jobs and not self._staged() and not self._refilling) or self._held()) \
                        and not self.stopping:
                    self.cond.wait()
                if self.stopping:
                    return
                try:
                    plan = self._plan_next()
                except DriverError:                    # an unmap of its reclaim failed: counted,
                    self.jobs.clear()                  # the record exact; the next step asks again
                    plan = None
                if plan is None and self._staged():    # running slots first, then staging
                    plan = self.staging.plan_step()
                    if plan is None:                   # that job ended: the next one
                        continue
                if plan is None and self._refilling:   # then the free reserve, a page-set a turn
                    try:
                        self._refilling = self.refill(self.pages.num_ranges) > 0
                    except DriverError:                # counted; the record stays exact: try
                        self._refilling = False        # again at the next poke
                    self.cond.notify_all()
                    continue
                self.busy = plan is not None
                if plan is None:
                    self.cond.notify_all()
                    continue
            self.pages.map_pending(plan)
            with self.cond:
                if plan.shared:
                    self.staging.commit(plan)
                elif not self.pages.commit(plan):
                    self.jobs.pop(plan.slot, None)
                self.slots.inflight.discard(plan.slot)
                self.busy = False
                self.cond.notify_all()

    def _plan_next(self) -> PendingSet | None:
        pages, slots = self.pages, self.slots
        while self.jobs:
            slot = next(iter(self.jobs))
            target = self.jobs[slot]
            have = pages.usable(slot)
            if (not slots.active[slot] or have >= target or not pages.mapped_evenly(slot)
                    or slot in pages.retired):
                del self.jobs[slot]            # done, gone, left half-mapped by a fault, or its
                continue                       # old mappings wait on a fence (ensure flushes them)
            pids = self.take(pages.num_ranges)
            if pids is None:                   # nothing free, nothing idle to take: stop guessing
                self.jobs.clear()
                return None
            if have + 1 >= target:
                del self.jobs[slot]
            plan = pages.pending(slot, pids, slots.tenant[slot])
            slots.inflight.add(slot)
            return plan
        return None
