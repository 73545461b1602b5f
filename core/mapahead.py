"""Map-ahead: a background thread maps each running slot's next page-set while the GPU computes.

Pages come from the free pool, else from idle slots (oldest released first, finished fences
only): moving warm pages to the requests that grow happens here, off the critical path.

Two phases per page-set so the engine thread is never blocked behind a VMM call it does not need:
``plan`` (under the cache lock: take pages from the pool, mark the slot in flight), ``execute``
(no lock: map, grant access, scrub, wait for the scrub), ``commit`` (under the lock: record).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from .errors import DriverError

__all__ = ["MapAhead"]


@dataclass(slots=True)
class _Plan:
    slot: int
    page: int           # page index inside the slot region, the same in every range
    pids: list[int]     # one pool page per range
    zero: list[bool]    # whether each page must be scrubbed first
    tenant: object
    done: int = 0       # ranges mapped so far
    accessible: bool = False


class MapAhead:
    """The worker thread of one cache. ``submit`` never blocks on driver calls."""

    def __init__(self, cache):
        self.cache = cache
        self.jobs: dict[int, int] = {}       # slot -> target page-sets
        self.busy = False
        self.stopping = False
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="vattn-map-ahead", daemon=True)
        self.thread.start()

    def submit(self, targets: dict[int, int]) -> None:
        """Ask for these page-set targets (caller holds the cache lock)."""
        for slot, target in targets.items():
            if target > self.jobs.get(slot, 0):
                self.jobs[slot] = target
        self.cache._cond.notify_all()

    def idle(self) -> bool:
        return not self.jobs and not self.busy

    def stop(self) -> None:
        with self.cache._cond:
            self.stopping = True
            self.cache._cond.notify_all()
        self.thread.join()

    def _run(self) -> None:
        cache = self.cache
        cache.driver.bind_thread()
        while True:
            with cache._cond:
                while not self.jobs and not self.stopping:
                    cache._cond.wait()
                if self.stopping:
                    return
                plan = self._plan_next()
                self.busy = plan is not None
                if plan is None:
                    cache._cond.notify_all()
                    continue
            self._execute(plan)
            with cache._cond:
                self._commit(plan)
                self.busy = False
                cache._cond.notify_all()

    def _plan_next(self) -> _Plan | None:
        cache, pages = self.cache, self.cache._pages
        while self.jobs:
            slot = next(iter(self.jobs))
            target = self.jobs[slot]
            counts = {len(p) for p in pages.mapped[slot]}
            have = pages.usable(slot)
            if not cache._active[slot] or have >= target or len(counts) != 1 or max(counts) != have:
                del self.jobs[slot]            # done, gone, or left half-mapped by a fault
                continue
            pids = self._take(len(pages.bases))
            if pids is None:                   # nothing free, nothing idle to take: stop guessing
                self.jobs.clear()
                return None
            if have + 1 >= target:
                del self.jobs[slot]
            tenant, policy = cache._tenant[slot], cache.config.scrub
            zero = [policy == "always" or (policy == "tenant" and cache._pool.tenant[p] != tenant)
                    for p in pids]
            cache._inflight.add(slot)
            return _Plan(slot, have, pids, zero, tenant)
        return None

    def _take(self, num: int) -> list[int] | None:
        """``num`` free pool pages; when the pool is dry, first unmap them from the idle slot
        released longest ago (never from a running request, never waiting on a fence), so a
        growing request takes the pages an even pre-warm left on slots nobody uses, here rather
        than on the step's critical path."""
        cache = self.cache
        pids = cache._pool.take(num)
        if pids is None and cache._reclaim(num - cache._pool.num_free, {}, idle_only=True,
                                           block=False):
            pids = cache._pool.take(num)
        return pids

    def _execute(self, plan: _Plan) -> None:
        cache, pages = self.cache, self.cache._pages
        nbytes = cache.layout.page_bytes
        try:
            for rng, pid in enumerate(plan.pids):
                start = time.perf_counter()
                cache.driver.map(pages.va(rng, plan.slot, plan.page), nbytes, cache._pool.handles[pid])
                cache._counters.map_page_us.observe((time.perf_counter() - start) * 1e6)
                plan.done += 1
            for rng in range(len(plan.pids)):
                cache.driver.set_access(pages.va(rng, plan.slot, plan.page), nbytes)
            plan.accessible = True
            if any(plan.zero):
                for rng, zero in enumerate(plan.zero):
                    if zero:
                        cache.driver.zero(pages.va(rng, plan.slot, plan.page), nbytes)
                cache.driver.record_fence().wait()   # scrub lands before anyone reads
        except DriverError as exc:
            self.error = exc

    def _commit(self, plan: _Plan) -> None:
        cache, pages, counters = self.cache, self.cache._pages, self.cache._counters
        counters.map_calls += plan.done
        counters.set_access_calls += len(plan.pids) if plan.accessible else 0
        counters.pages_mapped_ahead += plan.done
        counters.pages_scrubbed += sum(plan.zero) if plan.accessible else 0
        if self.error is not None:
            counters.driver_faults += 1
            self.error = None
            self.jobs.pop(plan.slot, None)
        for rng, pid in enumerate(plan.pids):
            if rng < plan.done:
                pages.add_page(plan.slot, rng, pid)
                if plan.accessible:
                    pages.access[plan.slot][rng] += 1
                    cache._pool.tenant[pid] = plan.tenant
            else:
                cache._pool.give([pid])
        pages.refresh(plan.slot)
        cache._inflight.discard(plan.slot)
