"""Packs: a shared run of page-sets copied once into one multi-page allocation per range.

The driver charges per physical allocation mapped (~30 µs of access grant on an H100 whatever
its size), and the pool holds one 2 MiB allocation per page, so a prefix hit costs one grant per
page per request. A pack holds ``size`` page-sets of a hit run (positions ``start ..``, ``start``
a multiple of ``size``; with several sizes a run is tiled largest first) in one allocation per range; every later region that maps the same run
maps the pack instead: one call per range. The slot record does not change: each position still
names the key's own pool page (referenced as a mapping), which keeps that page, and so the
bytes the pack copied, alive while any region maps the pack. A pack is found by its pages and
their pool generations (:attr:`~.pages.PagePool.gen`), so a page taken again for other content
never matches a stale pack. See docs/shared-prefix-packs.md.

Building one: the run's second hit (the first may be a one-off repeat) maps its pages as usual
and creates the pack, mapped at a scratch address, and copies the run into it from that slot on
the current stream — at once when the run's blocks were bound in earlier engine steps (their
forwards are queued before the copy), else from the next step on (a block is cached, and hit,
in the step that computes it: its bytes are final only after that step's forward). Only a
filled pack is mapped by hits. A scratch area is unmapped when the ring of
them comes round to it again, after its copy's fence. Not thread-safe: the cache lock
serialises it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from .errors import DriverError, VattnError

__all__ = ["Pack", "Packs", "SCRATCH_AREAS"]

#: scratch areas (one pack each) a build copies through, reused round robin
SCRATCH_AREAS = 8


@dataclass(eq=False, slots=True)
class Pack:
    """``size`` page-sets at positions ``start ..`` in one allocation per range."""

    start: int
    pids: tuple          # per range: the run's pool pages, in position order
    gens: tuple          # per range: their pool generations when copied
    handles: list        # one allocation of ``size`` pages per range
    users: int = 0       # (slot, range) spans that map it
    used_at: int = 0     # for dropping the least recently used idle pack
    ready: bool = False  # filled: hits may map it

    @property
    def size(self) -> int:
        return len(self.pids[0])


class Packs:
    """The packs of one cache, within ``budget_pages`` pages (0: off).

    Parameters
    ----------
    driver, pool
        The cache's driver (its :class:`~.deferred.DeferredCalls`: packs queue their copies in a
        deferral window) and page pool.
    sizes : tuple[int, ...]
        Page-sets per pack, largest first (powers of two >= 2; a run of one size is matched at
        multiples of it): a hit is tiled with the largest that fits each aligned start.
    budget_pages : int
        Physical pages the packs may hold in all (each pack: ``size`` per range), on top of the
        pool.
    num_ranges, page_bytes : int
        The layout's.
    """

    def __init__(self, driver, pool, *, sizes: tuple[int, ...], budget_pages: int, num_ranges: int,
                 page_bytes: int):
        self.driver, self.pool = driver, pool
        self.sizes = tuple(sorted(sizes, reverse=True))
        self.size = self.sizes[0]                               # the largest (scratch areas)
        self.budget, self.num_ranges, self.page_bytes = budget_pages, num_ranges, page_bytes
        self.by_key: dict[tuple, Pack] = {}                     # (start, range 0's pages) -> pack
        self.live: set[Pack] = set()                            # every pack not released yet
        self.spans: dict[tuple[int, int], dict[int, Pack]] = {}  # (slot, range) -> {start: pack}
        self.end_of: dict[int, int] = {}        # slot -> end of its last pack span (any range)
        self.hits: dict[tuple, int] = {}                        # runs hit without a pack yet
        self._clock = 0
        self._scratch: int | None = None                        # VA of the scratch areas
        self._view = None                                       # uint8 tensor over them
        self._areas: list[dict] = []                            # per area: mapped VAs, fence, pack
        self._next_area = 0
        #: engine steps seen (:meth:`next_step`); a pack whose run was bound in this step is
        #: filled from the next one on, so its copy is ordered after the forward that wrote the
        #: run (vLLM caches a block, and other requests hit it, in the step that computes it)
        self.epoch = 0
        self.pending: list[tuple[Pack, int, int]] = []          # (pack, source slot, epoch)
        #: pages bound to a block key in this step: their bytes are written by its forward
        self.fresh: set[int] = set()

    @property
    def held(self) -> int:
        """Physical pages the live packs hold."""
        return sum(pack.size for pack in self.live) * self.num_ranges

    @property
    def enabled(self) -> bool:
        return self.budget >= self.sizes[-1] * self.num_ranges

    # -- finding ---------------------------------------------------------------------------------
    def runs(self, index: int, count: int) -> list[tuple[int, int]]:
        """``(start, size)`` of the whole packable runs inside positions ``index .. index + count
        - 1``: from each position on, the largest size that starts there (a multiple of it) and
        fits, else the next multiple of the smallest size."""
        if not self.enabled:
            return []
        out, pos, end, step = [], index, index + count, self.sizes[-1]
        pos = -(-pos // step) * step
        while pos + step <= end:
            size = next((n for n in self.sizes if pos % n == 0 and pos + n <= end), step)
            out.append((pos, size))
            pos += size
        return out

    def lookup(self, start: int, per_range: tuple) -> Pack | None:
        """The pack holding the run ``per_range`` (per range, its pages) at ``start``, if its
        pages still hold what it copied; a stale idle one is released."""
        pack = self.by_key.get((start, per_range[0]))
        if pack is None:
            return None
        if pack.pids == per_range and self.intact(pack):
            self._clock += 1
            pack.used_at = self._clock
            return pack
        if not pack.ready:                      # pending with other pages: a later fill drops it
            return None
        del self.by_key[(start, per_range[0])]
        if not pack.users:
            self._release(pack)
        return None

    def second_hit(self, start: int, per_range: tuple) -> bool:
        """Count a hit of a run no pack holds; True from its second hit on (worth a pack)."""
        key = (start, per_range, self._gens(per_range))
        if len(self.hits) > 1 << 16:                            # bounded: forget old runs
            self.hits.clear()
        self.hits[key] = self.hits.get(key, 0) + 1
        return self.hits[key] >= 2

    def intact(self, pack: Pack) -> bool:
        """Whether every page ``pack`` copied still holds that content (not taken again since)."""
        return pack.gens == self._gens(pack.pids)

    def _gens(self, per_range: tuple) -> tuple:
        """Per range, the pool generations of the run's pages (one index over every range)."""
        return tuple(map(tuple, self.pool.gen[np.asarray(per_range)].tolist()))

    # -- building ---------------------------------------------------------------------------------
    def create(self, start: int, per_range: tuple) -> Pack | None:
        """A new pack for the run (allocations made, nothing copied yet: :meth:`fill`), dropping
        least recently used idle packs for room; ``None`` when the budget is held by packs in use."""
        size = len(per_range[0])
        need = size * self.num_ranges
        if need > self.budget:                  # a size the budget never holds: evict nothing
            return None
        while self.held + need > self.budget:
            idle = [p for p in self.live if not p.users]
            if not idle:
                return None
            self._release(min(idle, key=lambda p: p.used_at))
        handles: list = []
        try:
            for _ in range(self.num_ranges):
                handles.append(self.driver.create(size * self.page_bytes))
        except DriverError:
            for handle in handles:
                self.driver.release(handle)
            raise
        self._clock += 1
        pack = Pack(start, per_range, self._gens(per_range), handles, used_at=self._clock)
        old = self.by_key.get((start, per_range[0]))
        if old is not None and not old.users:
            self._release(old)
        self.by_key[(start, per_range[0])] = pack
        self.live.add(pack)
        self.hits.pop((start, per_range, pack.gens), None)
        return pack

    def queue(self, pack: Pack, slot: int) -> None:
        """Fill ``pack`` from ``slot`` (which maps the run now) at a later step (:meth:`due`)."""
        self.pending.append((pack, slot, self.epoch))

    def due(self) -> list[tuple[Pack, int]]:
        """The queued fills whose run was written by a step already queued on the device (taken
        off the queue)."""
        ready = [(p, slot) for p, slot, epoch in self.pending if epoch < self.epoch]
        self.pending = [entry for entry in self.pending if entry[2] >= self.epoch]
        return ready

    def next_step(self) -> None:
        """The engine's step was prepared (``ensure`` / ``step`` returned): later fills are
        ordered after its forward."""
        self.epoch += 1
        self.fresh.clear()

    def written(self, per_range: tuple) -> bool:
        """Whether the run's bytes were written by steps already queued (no page of it bound in
        this step): a copy queued now reads them."""
        return not any(pid in self.fresh for pids in per_range for pid in pids)

    def fill(self, pack: Pack, source) -> None:
        """Copy the run into ``pack``: per range, from ``source(rng)`` (a ``uint8`` tensor over
        where a slot maps the run's pages now) through a scratch mapping of the pack, on the
        current stream. The scratch areas are a ring (:data:`SCRATCH_AREAS`): an area is unmapped
        when it comes round again, after its copy's fence, so builds in one step never wait. A
        failed call leaves the pack unfilled: the caller drops it (:meth:`discard`)."""
        nbytes, room = pack.size * self.page_bytes, self.size * self.page_bytes
        if self._scratch is None:
            total = SCRATCH_AREAS * self.num_ranges * room
            self._scratch = self.driver.reserve(total)
            self._view = self.driver.view(self._scratch, total)
            self._areas = [{"mapped": [], "fence": None, "pack": None} for _ in range(SCRATCH_AREAS)]
        index = self._next_area
        self._next_area = (index + 1) % SCRATCH_AREAS
        area = self._areas[index]
        self._clear_area(area)
        area["pack"] = pack
        base = index * self.num_ranges * room
        area["fence"] = None
        # each range's copy runs where that range's queued VMM calls are made (a deferral window:
        # as the forward reaches the range; else now)
        queued = self.driver.in_window()
        try:
            for rng, handle in enumerate(pack.handles):
                if queued:                      # the copy reads the run's pool pages
                    self.driver.touch(pack.pids[rng], rng)
                self.driver.later(rng, functools.partial(self._fill_range, area, base + rng * room, nbytes, handle,
                                           source, rng))
        finally:                                # one fence after the copies queued (all, or some)
            self.driver.later(self.num_ranges - 1, functools.partial(self._fence, area))
        pack.ready = True

    def _fill_range(self, area: dict, at: int, nbytes: int, handle, source, rng: int) -> None:
        self.driver.map(self._scratch + at, nbytes, handle)
        area["mapped"].append((self._scratch + at, nbytes))
        self.driver.set_access(self._scratch + at, nbytes)
        self._view[at:at + nbytes].copy_(source(rng))

    def _fence(self, area: dict) -> None:
        if area["mapped"]:
            area["fence"] = self.driver.record_fence()

    def discard(self, pack: Pack) -> None:
        """Forget a pack nothing maps (a failed fill)."""
        if self.by_key.get((pack.start, pack.pids[0])) is pack:
            del self.by_key[(pack.start, pack.pids[0])]
        self._release(pack)

    def scratch_pages(self) -> set[int]:
        """Page addresses the scratch areas map now (for the driver checks of the tests)."""
        return {va + i * self.page_bytes for area in self._areas for va, nbytes in area["mapped"]
                for i in range(nbytes // self.page_bytes)}

    def _clear_area(self, area: dict) -> None:
        """Unmap an area's scratch mappings once its copy completed (waiting for it if needed;
        a copy still queued in a deferral window is made first)."""
        if area["pack"] is None and not area["mapped"]:
            return
        self.driver.issue()
        if area["fence"] is not None and not area["fence"].done():
            area["fence"].wait()
        while area["mapped"]:
            self.driver.unmap(*area["mapped"][-1])
            area["mapped"].pop()
        area["pack"] = None

    def _release(self, pack: Pack) -> None:
        if self.by_key.get((pack.start, pack.pids[0])) is pack:   # (an LRU drop: no lookup finds it)
            del self.by_key[(pack.start, pack.pids[0])]
        self.pending = [entry for entry in self.pending if entry[0] is not pack]
        for area in self._areas:                # a scratch mapping of it: gone first
            if area["pack"] is pack:
                self._clear_area(area)
        for handle in pack.handles:
            self.driver.release(handle)
        self.live.discard(pack)

    # -- spans: where slots map packs --------------------------------------------------------------
    def span(self, slot: int, rng: int, index: int) -> tuple[int, Pack] | None:
        """``(start, pack)`` if position ``index`` of ``slot`` in ``rng`` is a pack's."""
        if index >= self.end_of.get(slot, 0):
            return None
        spans = self.spans.get((slot, rng))
        if not spans:
            return None
        for size in self.sizes:
            start = index - index % size
            pack = spans.get(start)
            if pack is not None and index < start + pack.size:
                return start, pack
        return None

    def mapped(self, slot: int, rng: int, start: int, pack: Pack) -> None:
        self.spans.setdefault((slot, rng), {})[start] = pack
        pack.users += 1
        if start + pack.size > self.end_of.get(slot, 0):
            self.end_of[slot] = start + pack.size

    def unmapped(self, slot: int, rng: int, start: int) -> Pack:
        spans = self.spans[(slot, rng)]
        pack = spans.pop(start)
        if not spans:
            del self.spans[(slot, rng)]
        if start + pack.size == self.end_of[slot]:     # the last span went: the slot's next end
            end = max((b + p.size for r in range(len(pack.pids))
                       for b, p in self.spans.get((slot, r), {}).items()), default=0)
            if end:
                self.end_of[slot] = end
            else:
                del self.end_of[slot]
        pack.users -= 1
        if not pack.users and self.by_key.get((pack.start, pack.pids[0])) is not pack:
            self._release(pack)                 # stale and no longer mapped
        return pack

    def check(self, mapped: list) -> None:
        """Every span's positions record the pack's pages; users count the spans (the audit).

        Raises
        ------
        VattnError
            The first disagreement, named.
        """
        users: dict[int, int] = {}
        for (slot, rng), spans in self.spans.items():
            for start, pack in spans.items():
                have = tuple(mapped[slot][rng][start:start + pack.size])
                if have != pack.pids[rng]:
                    raise VattnError(f"slot {slot} range {rng}: pack span at {start} records "
                                     f"{list(have)}, the pack holds {list(pack.pids[rng])}")
                users[id(pack)] = users.get(id(pack), 0) + 1
        ends: dict[int, int] = {}
        for (slot, _), spans in self.spans.items():
            for start, pack in spans.items():
                ends[slot] = max(ends.get(slot, 0), start + pack.size)
        if ends != self.end_of:
            raise VattnError(f"packs: the end of each slot's last span is {ends}, recorded {self.end_of}")
        for pack in self.live:
            if pack.users != users.get(id(pack), 0):
                raise VattnError(f"pack at {pack.start} counts {pack.users} users, "
                                 f"{users.get(id(pack), 0)} spans map it")

    def close(self) -> None:
        """Release every pack and the scratch reservation (nothing may map a pack any more)."""
        for area in self._areas:
            self._clear_area(area)
        for pack in list(self.live):
            self._release(pack)
        self.by_key.clear()
        if self._scratch is not None:
            self._view = None
            self.driver.free_va(self._scratch, SCRATCH_AREAS * self.num_ranges * self.size * self.page_bytes)
            self._scratch = None
