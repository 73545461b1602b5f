"""Mapping physical pages into slot regions: grow, trim and scrub, one slot at a time.

Every map of a pool page into a slot region goes through here: :meth:`SlotPages.grow` (under
the cache lock), :meth:`SlotPages.put` (prefix sharing), and the map-ahead worker's
:class:`PendingSet` (driver calls without the lock, recorded under it).

Not thread-safe on its own: :class:`~vattn.core.cache.VirtualKVCache` serialises access.
Bookkeeping is per range, so a driver failure part way leaves an exact record of what is
mapped (pages that were mapped stay owned by the slot; the page whose call failed goes back
to the pool) and a later call simply continues.
"""

from __future__ import annotations

import time
from operator import itemgetter
from dataclasses import dataclass

import numpy as np

from .config import KVCacheConfig
from .errors import DriverError
from .layout import KVLayout
from .metrics import Counters
from .pack_runs import PackRuns
from .pages import PagePool
from .retired import RetiredMappings

__all__ = ["SlotPages", "PendingSet"]


@dataclass(slots=True)
class PendingSet:
    """One page-set the map-ahead worker maps at the top of a slot: planned under the cache
    lock (:meth:`SlotPages.pending`), mapped without it (:meth:`SlotPages.map_pending`: the
    slot is in flight, nothing else maps there), recorded under it (:meth:`SlotPages.commit`)."""

    slot: int
    index: int          # page-set index inside the slot region, the same in every range
    pids: list[int]     # one pool page per range
    zero: list[bool]    # whether each page must be scrubbed first
    tenant: object
    done: int = 0       # ranges mapped so far
    accessible: bool = False
    error: DriverError | None = None
    shared: bool = False  # pages another mapping or key holds (prefix staging): not retagged


class SlotPages(PackRuns):
    """Which pool pages back which slot pages, in every range (pack runs: :class:`PackRuns`).
    ``driver`` is the cache's :class:`~.deferred.DeferredCalls` (a deferral window queues what
    this maps)."""

    def __init__(self, cfg: KVCacheConfig, layout: KVLayout, driver, pool: PagePool,
                 bases: list[int], counters: Counters):
        self.cfg, self.layout, self.driver, self.pool = cfg, layout, driver, pool
        self.bases, self.counters = bases, counters
        #: whether one unmap call may cover several adjacent mappings (the driver says so)
        self.unmap_spans = bool(getattr(driver, "unmap_spans", False))
        self._region = layout.region_bytes               # (va(): computed once)
        n = layout.num_va_slots
        self.mapped: list[list[list[int]]] = [[[] for _ in bases] for _ in range(n)]
        #: per slot and range, how many pages from the bottom are accessible (mapped + access granted)
        self.num_accessible: list[list[int]] = [[0] * len(bases) for _ in range(n)]
        self.cap_tokens = np.zeros(n, dtype=np.int64)   # tokens backed by usable page-sets
        self.held_n = np.zeros(n, dtype=np.int64)       # pool pages per slot (== held(slot))
        self.usable_n = np.zeros(n, dtype=np.int64)     # == usable(slot), for vectorised queries
        #: pool page at the bottom of range 0 (-1: none): which prefix a slot starts with, for
        #: admission (a hint only: nothing else reads it)
        self.head = np.full(n, -1, dtype=np.int64)
        self.bound = np.zeros(pool.num_pages, dtype=bool)  # page held by a block key (shared)
        self.holes: set[int] = set()    # slots with a -1 left by a failed replacement (heal())
        #: old mappings of pages reclaimed before their fence completed (unmapped once it has)
        self.retired = RetiredMappings(self)
        #: shared runs held in one allocation per range (:mod:`.packs`; the cache sets it, with
        #: ``run_bytes(rng, slot, index, count)``: a ``uint8`` tensor over those positions)
        self.packs = None
        self.run_bytes = None
        #: while set, :meth:`put` maps without granting access: the caller maps more above the
        #: run and grants the whole with one call per range (:meth:`grant`)
        self.defer_access = False

    def refresh(self, slot: int) -> None:
        """Recompute ``cap_tokens[slot]`` / ``usable_n[slot]`` / ``head[slot]`` after its pages changed."""
        self.usable_n[slot] = min(self.num_accessible[slot])
        self.cap_tokens[slot] = self.layout.tokens_for(int(self.usable_n[slot]))
        bottom = self.mapped[slot][0]
        self.head[slot] = bottom[0] if bottom and self.usable_n[slot] else -1

    def usable(self, slot: int) -> int:
        """Page-sets of ``slot`` that are mapped and accessible in every range."""
        return min(self.num_accessible[slot])

    def held(self, slot: int) -> int:
        """Pool pages ``slot`` holds (mapped, accessible or not)."""
        return int(self.held_n[slot])

    def add_page(self, slot: int, rng: int, pid: int) -> None:
        """Record that pool page ``pid`` is now mapped as the next page of ``slot`` in ``rng``."""
        self.mapped[slot][rng].append(pid)
        self.held_n[slot] += 1

    def missing(self, slot: int, num_sets: int) -> int:
        """Pool pages still to map so ``slot`` has ``num_sets`` page-sets in every range."""
        return sum(max(0, num_sets - len(pages)) for pages in self.mapped[slot])

    @property
    def num_ranges(self) -> int:
        return len(self.bases)

    def mapped_evenly(self, slot: int) -> bool:
        """Whether every range of ``slot`` maps exactly its usable page-sets (none left half
        mapped or without access by a failed call)."""
        have = self.usable(slot)
        return all(len(pages) == have for pages in self.mapped[slot])

    def va(self, rng: int, slot: int, page: int) -> int:
        return self.bases[rng] + slot * self._region + page * self.layout.page_bytes

    def _map(self, rng: int, slot: int, page: int, pid: int) -> None:
        """Map pool page ``pid`` as page ``page`` of ``slot`` in ``rng`` (one timed driver call;
        no record touched)."""
        start = time.perf_counter()
        self.driver.map(self.va(rng, slot, page), self.layout.page_bytes, self.pool.handles[pid])
        self.counters.map_page_us.observe((time.perf_counter() - start) * 1e6)

    def grow(self, slot: int, num_sets: int, tenant, *, ahead: bool) -> bool:
        """Map page-sets until ``slot`` has ``num_sets`` usable ones; False if the pool is short.

        Raises
        ------
        DriverError
            A VMM call failed; the record stays exact and the call can be retried.
        """
        if not 0 <= num_sets <= self.layout.pages_per_slot:   # beyond: another slot's region
            raise ValueError(f"slot {slot} can hold at most {self.layout.pages_per_slot} page-sets, "
                             f"asked to grow to {num_sets}")
        self.retired.flush(slot, wait=True)
        self.heal(slot)
        need = self.missing(slot, num_sets)
        if need > self.pool.num_free:
            return False
        for rng in range(len(self.bases)):
            self._grow_range(slot, rng, num_sets, tenant, ahead=ahead)
        return True

    def _grow_range(self, slot: int, rng: int, num_sets: int, tenant, *, ahead: bool) -> None:
        pages = self.mapped[slot][rng]
        pids = self.pool.take(num_sets - len(pages)) if len(pages) < num_sets else []
        for k, pid in enumerate(pids):            # taken at once (grow checked the pool has them)
            self.driver.reuse(pid, rng)
            try:
                self.counters.map_calls += 1
                self._map(rng, slot, len(pages), pid)
            except DriverError:
                self.pool.give(pids[k:])
                self.counters.driver_faults += 1
                raise
            self.add_page(slot, rng, pid)
            if ahead:
                self.counters.pages_mapped_ahead += 1
            else:
                self.counters.pages_mapped_on_demand += 1
        first = self._restore_access(slot, rng)
        if first < len(pages):
            self.refresh(slot)
            self.scrub_pages(slot, rng, range(first, len(pages)), tenant)

    def trim(self, slot: int, num_sets: int, *, fence=None) -> int:
        """Unmap page-sets beyond ``num_sets`` (the GPU must be done with them); returns pages
        freed (a page shared with another mapping or held by a block key stays allocated).
        ``fence``: a pending one the device may still read them under; their old mappings are
        retired instead (:class:`~.retired.RetiredMappings`: off the record, the pages back in the
        pool fenced, unmapped once it completes)."""
        freed = 0
        for rng in range(len(self.bases)):
            freed += self._trim_range(slot, rng, num_sets, fence)
        self.counters.pages_reclaimed += freed
        return freed

    def _trim_range(self, slot: int, rng: int, num_sets: int, fence=None) -> int:
        pages, freed = self.mapped[slot][rng], 0
        while len(pages) > num_sets:
            lo = self._plain_top(slot, rng, num_sets) if fence is None else len(pages)
            if lo < len(pages) - 1:             # several pages of its own on top: one call
                self.unmap_at(rng, slot, lo, len(pages) - lo)
                freed += self.pool.give(pages[lo:])
                self.held_n[slot] -= len(pages) - lo
                del pages[lo:]
                self.num_accessible[slot][rng] = min(self.num_accessible[slot][rng], lo)
                self.refresh(slot)
                continue
            span = self._span(slot, rng, len(pages) - 1)
            if span is not None:                # a pack's run: unmapped whole, never retired
                if fence is not None and not fence.done():
                    self.counters.fence_waits += 1
                    fence.wait()
                freed += self._unpack(slot, rng, span, max(num_sets, span), span + self._span_size(slot, rng, span))
                continue                        # its positions from num_sets on are holes now
            if pages[-1] >= 0:                  # -1: a hole left by a failed remap, not mapped
                if fence is None:
                    self.unmap_at(rng, slot, len(pages) - 1)
                else:
                    self.retired.add(slot, rng, len(pages) - 1, fence)
                freed += self.pool.give([pages[-1]], fence=fence)
            pages.pop()
            self.held_n[slot] -= 1
            self.num_accessible[slot][rng] = min(self.num_accessible[slot][rng], len(pages))
            self.refresh(slot)
        return freed

    def _plain_top(self, slot: int, rng: int, num_sets: int) -> int:
        """The lowest position, not below ``num_sets``, from which ``slot``'s pages in ``rng``
        are all mapped pages of its own (no hole, no pack run) up to the top: a run one unmap
        call may take when the driver unmaps several mappings at once (``len`` if it cannot)."""
        pages = self.mapped[slot][rng]
        lo = len(pages)
        if not self.unmap_spans:
            return lo
        while lo > num_sets and pages[lo - 1] >= 0 and self._span(slot, rng, lo - 1) is None:
            lo -= 1
        return lo

    def unmap_at(self, rng: int, slot: int, index: int, count: int = 1) -> None:
        """Unmap pages ``index .. index + count - 1`` of ``slot`` in ``rng`` (one timed, counted
        driver call; no record touched)."""
        start = time.perf_counter()
        self.counters.unmap_calls += 1
        self.call("unmap", self.va(rng, slot, index), count * self.layout.page_bytes)
        self.counters.unmap_page_us.observe((time.perf_counter() - start) * 1e6 / count)

    # -- one page-set at a given index (prefix sharing) ---------------------------------------
    def at(self, slot: int, index: int) -> tuple[int, ...] | None:
        """The pool pages of page-set ``index`` of ``slot`` (one per range), or ``None`` unless
        it is mapped and accessible in every range."""
        if index >= self.usable(slot):
            return None
        return tuple(map(itemgetter(index), self.mapped[slot]))

    def put(self, slot: int, index: int, sets: list[tuple[int, ...]]) -> int:
        """Map the page-sets ``sets`` (each one pool page per range, already referenced
        elsewhere: every page gains one reference) as page-sets ``index, index + 1, ...`` of
        ``slot``, replacing what is mapped there; ``index`` is at most the slot's usable
        page-sets (the region stays contiguous). One access call per range covers the run.
        Nothing is scrubbed: the pages hold content shared with other mappings. The caller has
        waited for the fence of whatever is replaced. Returns the pages freed by the replacement.

        Raises
        ------
        DriverError
            A VMM call failed; the record stays exact (a position either keeps its old page or
            has the new one; access is re-granted on retry) and the call can be retried.
        """
        self.retired.flush(slot, wait=True)
        self.heal(slot)
        end = index + len(sets)
        if not 0 <= index <= self.usable(slot) or end > self.layout.pages_per_slot:
            raise ValueError(f"page-sets {index}..{end - 1} of slot {slot} do not start at a mapped or "
                             f"the next one (usable {self.usable(slot)}, at most {self.layout.pages_per_slot})")
        self.fill_packs()
        plan = self._pack_plan(index, sets)
        freed = 0
        try:
            for rng in range(len(self.bases)):
                freed += self._put_segments(slot, rng, index, sets, plan)
        finally:
            self.refresh(slot)
        builds = [(start, per_range) for start, (per_range, build) in plan.items() if build]
        if builds and self.defer_access:        # a pack is filled from accessible pages
            self.grant(slot)
        for start, per_range in builds:
            self._build(slot, start, per_range)
        return freed

    def _put_range(self, slot: int, rng: int, index: int, pids: list[int]) -> int:
        pages, page_bytes, freed = self.mapped[slot][rng], self.layout.page_bytes, 0
        prev = self.num_accessible[slot][rng]
        self.num_accessible[slot][rng] = min(prev, index)   # until the run is accessible again
        for i, pid in enumerate(pids, start=index):
            if i < len(pages) and pages[i] == pid:      # already there (a hit in place, a retry)
                continue
            span = self._span(slot, rng, i)
            if span is not None:                # a pack's run: its other positions map their own
                freed += self._unpack(slot, rng, span, i, min(span + self._span_size(slot, rng, span),
                                                               index + len(pids)))
            va = self.va(rng, slot, i)
            old = pages[i] if i < len(pages) else -1
            if old >= 0:
                self.counters.unmap_calls += 1
                self.call("unmap", va, page_bytes)
                pages[i] = -1                   # unmapped: a failure below leaves no stale id
            self.counters.map_calls += 1
            try:
                self.driver.map(va, page_bytes, self.pool.handles[pid])
            except DriverError:
                self.counters.driver_faults += 1
                if old >= 0:
                    self._undo_unmap(slot, rng, i, old)
                raise
            if old >= 0:
                freed += self.pool.give([old])
            self.pool.refs[pid] += 1            # shared: referenced elsewhere already
            self.counters.pages_aliased += 1
            if i == len(pages):
                self.add_page(slot, rng, pid)
            else:
                pages[i] = pid
        if self.defer_access:                   # granted with what is mapped above (grant())
            return freed
        self.counters.set_access_calls += 1
        self.call("set_access", self.va(rng, slot, index), len(pids) * page_bytes)
        self.num_accessible[slot][rng] = max(prev, index + len(pids))
        self._restore_access(slot, rng)         # mapped but never accessible pages above
        return freed

    def _undo_unmap(self, slot: int, rng: int, i: int, old: int) -> None:
        """A replacement at ``i`` failed after ``old`` was unmapped: map ``old`` back (its access
        is re-granted by the next grow or put: ``num_accessible`` stays below ``i``). If that
        fails too, ``old`` goes back to the pool and the hole stays, marked ``-1``, above the
        accessible pages: :meth:`heal` drops it (and what is above it in that range) before the
        slot's pages change next."""
        try:
            self.counters.map_calls += 1
            self.driver.map(self.va(rng, slot, i), self.layout.page_bytes, self.pool.handles[old])
            self.mapped[slot][rng][i] = old
        except DriverError:
            self.counters.driver_faults += 1
            self.counters.undo_faults += 1
            self.pool.give([old])
            try:
                self._trim_range(slot, rng, i)   # drop the hole now if the driver lets us
            except DriverError:
                self.counters.undo_faults += 1   # exact as it is: heal() finishes it later
                self.holes.add(slot)

    def heal(self, slot: int) -> None:
        """Drop the holes a failed replacement left in ``slot`` (with the pages above them in
        their range: unmapped, given back); a no-op without holes.

        Raises
        ------
        DriverError
            An unmap failed; what is left is exact (a hole stays until a later call).
        """
        if slot not in self.holes:
            return
        for rng, pages in enumerate(self.mapped[slot]):
            if -1 in pages:
                self._trim_range(slot, rng, pages.index(-1))
        self.holes.discard(slot)

    def grant(self, slot: int) -> None:
        """Grant access to every mapped page of ``slot`` that lacks it (one call per range that
        has such pages)."""
        accessible = self.num_accessible[slot]
        for rng, pages in enumerate(self.mapped[slot]):
            if accessible[rng] < len(pages):
                self._restore_access(slot, rng)
        self.refresh(slot)

    def _restore_access(self, slot: int, rng: int) -> int:
        """Grant access to ``slot``'s mapped pages in ``rng`` that lack it (one call); returns
        the first page that lacked it (``len`` of the range if none did)."""
        pages, first = self.mapped[slot][rng], self.num_accessible[slot][rng]
        if first < len(pages):
            self.counters.set_access_calls += 1
            self.call("set_access", self.va(rng, slot, first), (len(pages) - first) * self.layout.page_bytes)
            self.num_accessible[slot][rng] = len(pages)
        return first

    def call(self, name: str, *args) -> None:
        """One driver call; a failure is counted and re-raised (the caller's record stays exact)."""
        try:
            getattr(self.driver, name)(*args)
        except DriverError:
            self.counters.driver_faults += 1
            raise

    def needs_scrub(self, pid: int, tenant) -> bool:
        """Whether pool page ``pid`` is zeroed before ``tenant`` gets it (the scrub policy)."""
        policy, tag = self.cfg.scrub, self.pool.tenant[pid]
        return policy == "always" or (policy == "tenant" and tag is not tenant and tag != tenant)

    def scrub_pages(self, slot: int, rng: int, indices, tenant) -> bool:
        """Zero the listed accessible pages whose tenant differs (policy permitting); tag them.
        Returns whether any page was zeroed."""
        pages, zeroed = self.mapped[slot][rng], False
        for i in indices:
            pid = pages[i]
            if self.bound[pid]:                 # shared content: never scrubbed, never retagged
                continue
            if self.needs_scrub(pid, tenant):
                span = self._span(slot, rng, i)
                if span is not None:            # zero the page, not the pack other slots map
                    self._unpack(slot, rng, span, i, i)
                    self._restore_access(slot, rng)
                self.driver.reuse(pid, rng)
                if self.driver.in_window():     # the zero below is queued
                    self.driver.touch((pid,), rng)
                self.driver.zero(self.va(rng, slot, i), self.layout.page_bytes)
                self.counters.pages_scrubbed += 1
                zeroed = True
            self.pool.tenant[pid] = tenant
        return zeroed

    def retag(self, slot: int, tenant) -> None:
        """Hand every accessible page of ``slot`` to ``tenant`` (scrubbing per policy)."""
        for rng in range(len(self.bases)):
            self.scrub_pages(slot, rng, range(self.num_accessible[slot][rng]), tenant)

    # -- the map-ahead worker's page-set: planned and recorded under the lock, mapped without it --
    def pending(self, slot: int, pids: list[int], tenant) -> PendingSet:
        """The next page-set of ``slot`` (evenly mapped) from ``pids``, one pool page per range."""
        zero = [self.needs_scrub(pid, tenant) for pid in pids]
        return PendingSet(slot, self.usable(slot), pids, zero, tenant)

    def map_pending(self, p: PendingSet) -> None:
        """The driver calls of ``p``: map every range, grant access, scrub, wait for the scrub.
        Touches no record (safe without the cache lock); a failure is kept in ``p.error``."""
        nbytes = self.layout.page_bytes
        try:
            for rng, pid in enumerate(p.pids):
                self._map(rng, p.slot, p.index, pid)
                p.done += 1
            for rng in range(len(p.pids)):
                self.driver.set_access(self.va(rng, p.slot, p.index), nbytes)
            p.accessible = True
            if any(p.zero):
                for rng, zero in enumerate(p.zero):
                    if zero:
                        self.driver.zero(self.va(rng, p.slot, p.index), nbytes)
                self.driver.record_fence().wait()   # scrub lands before anyone reads
        except DriverError as exc:
            p.error = exc

    def commit(self, p: PendingSet) -> bool:
        """Record what :meth:`map_pending` did: the mapped pages join the slot (accessible and
        tagged if access was granted; shared pages keep their writer's tag), the others drop the
        reference the plan took (back to the pool if it was the last). False if a call failed."""
        counters = self.counters
        counters.map_calls += p.done
        counters.set_access_calls += len(p.pids) if p.accessible else 0
        if p.shared:
            counters.pages_aliased += p.done
        else:
            counters.pages_mapped_ahead += p.done
        counters.pages_scrubbed += sum(p.zero) if p.accessible else 0
        if p.error is not None:
            counters.driver_faults += 1
        for rng, pid in enumerate(p.pids):
            if rng < p.done:
                self.add_page(p.slot, rng, pid)
                if p.accessible:
                    self.num_accessible[p.slot][rng] += 1
                    if not p.shared:
                        self.pool.tenant[pid] = p.tenant
            else:
                self.pool.give([pid])
        self.refresh(p.slot)
        return p.error is None
