"""The part of :class:`~vattn.core.paging.SlotPages` that maps pack runs (:mod:`.packs`): a
shared run mapped with one call per range, and every place a run goes back to its own pages
before a write, a scrub, a trim or a replacement inside it (docs/shared-prefix-packs.md)."""

from __future__ import annotations

from .errors import DriverError

__all__ = ["PackRuns"]


class PackRuns:
    """Pack-run methods of :class:`~vattn.core.paging.SlotPages` (a mixin: it uses its
    ``mapped``, ``num_accessible``, ``pool``, ``driver``, ``counters``, ``packs`` and helpers)."""

    def _span(self, slot: int, rng: int, index: int) -> int | None:
        """The start of the pack run covering position ``index`` of ``slot`` in ``rng``, if any."""
        if self.packs is None or not self.packs.spans:
            return None
        found = self.packs.span(slot, rng, index)
        return None if found is None else found[0]

    def _span_size(self, slot: int, rng: int, start: int) -> int:
        """The page-sets of the pack run that starts at ``start`` of ``slot`` in ``rng``."""
        return self.packs.spans[(slot, rng)][start].size

    def _pack_plan(self, index: int, sets: list) -> dict[int, tuple]:
        """Per whole packable run of ``sets`` (mapped at ``index ..``): ``start -> (pack,
        False)`` when a pack holds it, ``(its pages per range, True)`` when this hit should
        build one (its second hit), nothing when neither."""
        plan: dict[int, tuple] = {}
        if self.packs is None:
            return plan
        for start, size in self.packs.runs(index, len(sets)):
            run = sets[start - index:start - index + size]
            per_range = tuple(tuple(pids[rng] for pids in run) for rng in range(len(self.bases)))
            pack = self.packs.lookup(start, per_range)
            if pack is not None:
                if pack.ready:
                    plan[start] = (pack, False)
            elif self.packs.second_hit(start, per_range):
                plan[start] = (per_range, True)
        return plan

    def _put_segments(self, slot: int, rng: int, index: int, sets: list, plan: dict) -> int:
        """:meth:`_put_range` for the run, with the runs a pack holds mapped from it."""
        pos, freed = index, 0
        for start in sorted(plan):
            pack, build = plan[start]
            if build:                           # mapped page by page, then copied (_build)
                continue
            if pos < start:
                freed += self._put_range(slot, rng, pos, [pids[rng] for pids in sets[pos - index:start - index]])
            freed += self._put_pack(slot, rng, start, pack)
            pos = start + pack.size
        if pos < index + len(sets):
            freed += self._put_range(slot, rng, pos, [pids[rng] for pids in sets[pos - index:]])
        return freed

    def _put_pack(self, slot: int, rng: int, start: int, pack) -> int:
        """Map ``pack`` at ``start ..`` of ``slot`` in ``rng`` (one map and one access call),
        replacing what is there; the record names the run's own pages, each gaining a reference."""
        size, nbytes = pack.size, self.layout.page_bytes
        found = self.packs.span(slot, rng, start)
        if found is not None and found[1] is pack:   # already there: a retry after its access
            self._restore_access(slot, rng)          # call failed grants it (else no call)
            return 0
        pages = self.mapped[slot][rng]
        prev = self.num_accessible[slot][rng]
        self.num_accessible[slot][rng] = min(prev, start)
        freed = self._clear(slot, rng, start, min(start + size, len(pages)))
        va = self.va(rng, slot, start)
        self.counters.map_calls += 1
        try:
            self.driver.map(va, size * nbytes, pack.handles[rng])
        except DriverError:
            self.counters.driver_faults += 1
            if -1 in pages[start:]:
                self.holes.add(slot)
            raise
        pids = pack.pids[rng]
        self.pool.refs[list(pids)] += 1         # shared: referenced elsewhere already (distinct)
        inside = max(0, min(len(pages) - start, size))
        pages[start:start + inside] = pids[:inside]
        if inside < size:                       # beyond the slot's pages: appended
            pages.extend(pids[inside:])
            self.held_n[slot] += size - inside
        self.packs.mapped(slot, rng, start, pack)
        self.counters.pages_aliased += size
        self.counters.pages_packed += size
        if self.defer_access:                   # granted with what is mapped above (grant())
            return freed
        self.counters.set_access_calls += 1
        self.call("set_access", va, size * nbytes)
        self.num_accessible[slot][rng] = max(prev, start + size)
        self._restore_access(slot, rng)
        return freed

    def _clear(self, slot: int, rng: int, lo: int, hi: int) -> int:
        """Unmap positions ``lo .. hi - 1`` of ``slot`` in ``rng`` (a pack run among them as a
        whole), give their pages back and leave holes (-1) there; returns the pages freed. A
        failed call leaves the holes made so far recorded (:meth:`heal`)."""
        pages, nbytes, freed = self.mapped[slot][rng], self.layout.page_bytes, 0
        try:
            i = lo
            while i < hi:
                span = self._span(slot, rng, i)
                if span is not None:
                    end = span + self._span_size(slot, rng, span)
                    freed += self._unpack(slot, rng, span, i, hi)
                    i = end
                    continue
                if pages[i] >= 0:
                    self.counters.unmap_calls += 1
                    self.call("unmap", self.va(rng, slot, i), nbytes)
                    freed += self.pool.give([pages[i]])
                    pages[i] = -1
                i += 1
        finally:
            if -1 in pages[lo:hi]:
                self.holes.add(slot)
        return freed

    def _unpack(self, slot: int, rng: int, start: int, lo: int, hi: int) -> int:
        """Unmap the pack run at ``start`` of ``slot`` in ``rng`` (one call); its positions in
        ``lo .. hi - 1`` become holes (pages given back), the others map their own pages again,
        one call each. Returns the pages freed.

        Raises
        ------
        DriverError
            The unmap failed (nothing changed), or a remap did (that position is a hole now).
        """
        size, nbytes = self._span_size(slot, rng, start), self.layout.page_bytes
        pages = self.mapped[slot][rng]
        self.counters.unmap_calls += 1
        self.call("unmap", self.va(rng, slot, start), size * nbytes)
        self.packs.unmapped(slot, rng, start)
        self.counters.pack_unpacks += 1
        accessible = self.num_accessible[slot][rng]
        self.num_accessible[slot][rng] = min(accessible, start)
        lo, hi = max(lo, start), min(max(hi, lo), start + size)
        freed, failed = 0, None
        for i in range(start, start + size):
            if lo <= i < hi:
                freed += self.pool.give([pages[i]])
                pages[i] = -1
                continue
            try:
                self.counters.map_calls += 1
                self.driver.map(self.va(rng, slot, i), nbytes, self.pool.handles[pages[i]])
            except DriverError as exc:
                self.counters.driver_faults += 1
                freed += self.pool.give([pages[i]])
                pages[i], failed = -1, exc
        while pages and pages[-1] == -1 and len(pages) - 1 >= start:   # holes on top: dropped
            pages.pop()
            self.held_n[slot] -= 1
        if -1 in pages[start:start + size]:
            self.holes.add(slot)
        granted = True
        for a, b in ((start, lo), (hi, min(start + size, len(pages)))):   # the kept positions
            if a < b and -1 not in pages[a:b]:
                self.counters.set_access_calls += 1
                self.call("set_access", self.va(rng, slot, a), (b - a) * nbytes)
            elif a < b:
                granted = False
        if granted and failed is None:          # as accessible as before, but for the holes
            self.num_accessible[slot][rng] = min(accessible, lo if lo < hi else accessible)
        self.refresh(slot)
        if failed is not None:
            raise failed
        return freed

    def packed_at(self, slot: int, index: int) -> bool:
        """Whether a pack maps position ``index`` of ``slot`` in some range."""
        packs = self.packs
        if packs is None or index >= packs.end_of.get(slot, 0):
            return False
        return any(packs.span(slot, rng, index) is not None for rng in range(len(self.bases)))

    def unpack_at(self, slot: int, index: int) -> None:
        """Map position ``index`` of ``slot`` to its own pages in every range (a pack run there
        is unpacked, its pages kept): before anything writes there."""
        for rng in range(len(self.bases)):
            span = self._span(slot, rng, index)
            if span is not None:
                self._unpack(slot, rng, span, index, index)
                self._restore_access(slot, rng)

    def _build(self, slot: int, start: int, per_range: tuple) -> None:
        """Create a pack for the run just mapped page by page at ``start ..`` of ``slot`` and fill
        it from there: now when the run's blocks were bound in an earlier step, else at the next
        step (:meth:`fill_packs`). Best effort: no room, or a failed driver call, leaves it
        unbuilt."""
        packs, size = self.packs, len(per_range[0])
        if any(self.at(slot, i) is None for i in range(start, start + size)):
            return                              # not all mapped (a failed call part way)
        try:
            pack = packs.create(start, per_range)
        except DriverError:
            self.counters.driver_faults += 1
            return
        if pack is None:
            return
        if packs.written(per_range):            # written by queued steps: filled now
            self._fill(pack, slot)
        else:
            packs.queue(pack, slot)

    def fill_packs(self) -> None:
        """Fill the packs queued in earlier steps (their runs are written now), from the slots
        they were built from if those still map the run (else the pack is dropped); from now on
        hits map them."""
        if self.packs is not None and self.packs.pending:
            for pack, slot in self.packs.due():
                self._fill(pack, slot)

    def _fill(self, pack, slot: int) -> None:
        """Copy ``pack``'s run from ``slot`` into it (best effort: a slot that no longer maps the
        run, or a failed driver call, drops the pack)."""
        packs, size, start = self.packs, pack.size, pack.start
        here = tuple(tuple(pages[start:start + size]) for pages in self.mapped[slot])
        if here != pack.pids or self.usable(slot) < start + size or not packs.intact(pack):
            packs.discard(pack)                 # the slot moved on: nothing to copy from
            return
        try:
            packs.fill(pack, lambda rng: self.run_bytes(rng, slot, start, size))
        except DriverError:
            self.counters.driver_faults += 1
            try:
                packs.discard(pack)
            except DriverError:
                self.counters.driver_faults += 1
            return
        self.counters.packs_built += 1
