"""Prefix sharing: page-sets named by the engine's block keys (the work behind
:meth:`~vattn.core.cache.VirtualKVCache.bind` and its neighbours).

A hit maps the page-set a key names into a slot (or finds it there already); a fresh key is
bound to the page-set at its position, after moving another key's block out of the way (one
device copy into a loose page-set) or mapping new pages there.
"""

from __future__ import annotations

import numpy as np

from .errors import SlotError
from .growth import Growth
from .loose import LooseSets
from .space import AddressSpace
from .state import CacheState

__all__ = ["Binding", "hits_waiting"]


def hits_waiting(pending: list[tuple]) -> list[bool]:
    """For each ``(slot, start, keys, hits)`` of one step: whether it hits a key another item
    binds fresh (it is bound after that item). ``SlotError`` if every item waits."""
    fresh = [set(keys[hits:]) for _, _, keys, hits in pending]
    everyone = set().union(*fresh)
    wait = [not everyone.isdisjoint(set(keys[:hits]) - own)
            for (_, _, keys, hits), own in zip(pending, fresh)]
    if all(wait):
        raise SlotError(f"prefix hits wait on each other's fresh blocks: "
                        f"{[keys[:hits] for _, _, keys, hits in pending]}")
    return wait


class Binding:
    """The binding part of a cache (runs under the cache lock)."""

    def __init__(self, state: CacheState, growth: Growth, loose: LooseSets, space: AddressSpace):
        self.state, self.growth, self.loose, self.space = state, growth, loose, space
        #: fresh key -> the cached key whose block was moved out of its page-set in this engine
        #: step (the bytes there are still that block's): a copy-on-write between the two is
        #: already done (see :meth:`copy`); cleared at every :meth:`new_step`
        self.twins: dict = {}
        self.pending_twin = None   # _fresh_set -> _bind_fresh: the key moved out, bytes intact

    def new_step(self) -> None:
        """An engine step's binds begin: what earlier steps moved out may have been written since."""
        self.twins.clear()

    def bind(self, slot: int, start: int, keys: list, hits: int) -> bool:
        """:meth:`VirtualKVCache.bind` with checked arguments."""
        st, table = self.state, self.state.slots
        st.settle(slot)                               # the worker is appending to this slot
        if st.pages.usable(slot) < start and not self.growth.grow(slot, start, {slot: start}, False)[0]:
            return False
        end = start + len(keys)
        fresh = end > start + hits
        if hits:
            st.pages.defer_access = fresh             # granted with the fresh run above it
            try:
                self._bind_hits(slot, start, keys[:hits])
            finally:
                st.pages.defer_access = False
            table.bound_sets[slot] = max(table.bound_sets[slot], start + hits)
        if fresh and st.pages.usable(slot) < end:
            # the fresh page-sets above the slot's mapped ones in one growth (one reclaim, one
            # access call per range for them and the hit below) rather than one each; a short
            # pool leaves them to the loop
            self.growth.grow(slot, end, {slot: end}, False)
        st.pages.grant(slot)                          # the hit's run, where the growth did not
        for index, key in enumerate(keys[hits:], start=start + hits):
            if not self._bind_fresh(slot, index, key, end):
                return False
            table.bound_sets[slot] = max(table.bound_sets[slot], index + 1)
        return True

    def holds(self, key) -> bool:
        return self.state.keys.get(key) is not None

    def active_home(self, keys) -> list[int | None]:
        st = self.state
        homes = [st.keys.home.get(key) for key in keys]
        return [h[0] if h is not None and h[0] < st.config.max_slots and st.slots.active[h[0]]
                else None for h in homes]

    def forget(self, keys) -> int:
        """Drop the known ``keys``; their page-sets become loose. Returns the pages freed."""
        held = self.state.keys
        keys = [key for key in keys if held.get(key) is not None]
        self.loose.add(h for h in map(held.home.get, keys) if h is not None)
        return sum(map(held.drop, keys))

    def released(self, slot: int) -> None:
        """``slot``'s request ended: its page-sets it did not bind are loose from now on."""
        if len(self.state.keys):
            self.loose.note(slot, int(self.state.slots.bound_sets[slot]))

    def _bind_hits(self, slot: int, start: int, keys: list) -> None:
        """Map the page-sets ``keys`` name at ``start ..`` of ``slot``; those already there (a
        request back in the slot it ran in) cost nothing, the rest is one run of mappings."""
        st = self.state
        sets = [st.keys.get(key) for key in keys]
        if None in sets:
            key = keys[sets.index(None)]
            raise SlotError(f"prefix hit on block key {key!r}, which no page-set holds (never bound "
                            "by this cache, or dropped since)")
        st.counters.prefix_hits += len(keys)
        if self._in_place(slot, start, sets):        # back in its own slot: nothing to map
            return
        first = 0
        while first < len(sets) and st.pages.at(slot, start + first) == sets[first]:
            first += 1
        st.settle(slot)
        if st.pages.usable(slot) > start + first:     # something is replaced: the last reader is done
            st.wait_fence(slot)
        st.pages.put(slot, start + first, sets[first:])
        st.slots.mixed.add(slot)                      # the shared pages carry their writer's tag
        home = st.keys.home
        for index, key in enumerate(keys[first:], start=start + first):
            home[key] = (slot, index)                 # the latest mapping: where a request runs next

    def _in_place(self, slot: int, start: int, sets: list[tuple[int, ...]]) -> bool:
        """Whether page-sets ``sets`` are mapped (and accessible) at ``start ..`` of ``slot``: one
        list comparison per range instead of one :meth:`~.paging.SlotPages.at` per page-set."""
        pages = self.state.pages
        end = start + len(sets)
        if pages.usable(slot) < end:
            return False
        return all(row[start:end] == list(col) for row, col in zip(pages.mapped[slot], zip(*sets)))

    def claim(self, slot: int, index: int) -> bool:
        """:meth:`VirtualKVCache.claim` with checked arguments."""
        self.state.settle(slot)
        return self._fresh_set(slot, index, index + 1) is not None

    def _bind_fresh(self, slot: int, index: int, key, end: int) -> bool:
        st = self.state
        held = st.keys
        if held.get(key) is not None:                 # reused by the engine: its content is dead
            home = held.home.get(key)
            held.drop(key)
            if home is not None and home != (slot, index):
                self.loose.add([home])
        self.twins.pop(key, None)
        cur = self._fresh_set(slot, index, end)
        if cur is None:
            return False
        st.pool.rewrite(cur)                          # new content: packs of the old go stale
        held.bind(key, cur, (slot, index))
        if self.pending_twin is not None:
            self.twins[key] = self.pending_twin
        st.counters.keys_bound += 1
        return True

    def _fresh_set(self, slot: int, index: int, end: int) -> tuple[int, ...] | None:
        """The page-set at ``index`` of ``slot``, mapped, holding no bound block and scrubbed
        for the slot's tenant (``None``: the pool ran short)."""
        st = self.state
        pages = st.pages
        if index < pages.usable(slot):                # a pack maps there: its own pages first
            self._unpack_for_write(slot, index)
        cur = pages.at(slot, index)
        if cur is None:                               # the next page-set: map it from the pool
            if not self.growth.grow(slot, index + 1, {slot: index + 1}, False)[0]:
                return None
            cur = pages.at(slot, index)
        moved = None
        if any(pages.bound[p] for p in cur):          # another block's content: keep it (also when
            #                                           growing re-granted access to a hit whose
            #                                           access call failed, or a remap failed
            #                                           half-way and left one range's page bound)
            moved = st.keys.key_of.get(cur[0])
            if not self._move_out(slot, index, cur, end):  # then map new pages here
                moved = None
                cur = self._replace(slot, index, cur)
                if cur is None:
                    return None
        scrubbed, tenant, bound = False, st.slots.tenant[slot], pages.bound
        if any(not bound[p] and pages.needs_scrub(p, tenant) for p in cur):
            for rng in range(len(cur)):               # pages of another tenant are scrubbed first
                scrubbed |= pages.scrub_pages(slot, rng, (index,), tenant)
        self.pending_twin = None if scrubbed else moved
        return cur

    def _replace(self, slot: int, index: int, cur: tuple[int, ...]) -> tuple[int, ...] | None:
        """Map new pool pages at ``index`` of ``slot`` in the ranges whose page another block
        holds (bound) or another mapping shares; a range whose page is this mapping's alone keeps
        it (after a remap that failed half-way, only the ranges it did not reach are replaced,
        so a retry needs no more free pages than the first try). ``None``: the pool is short."""
        st = self.state
        bound, refs = st.pages.bound, st.pool.refs
        replace = [rng for rng, p in enumerate(cur) if bound[p] or refs[p] != 1]
        pids = self.growth.take_set(slot, index, len(replace))
        if pids is None:
            return None
        new = list(cur)
        for rng, pid in zip(replace, pids):
            st.driver.reuse(pid, rng)
            new[rng] = pid
        st.settle(slot)
        st.wait_fence(slot)
        try:
            st.pages.put(slot, index, [tuple(new)])
        finally:
            st.pool.give(pids)                        # the mapping holds them now
        return tuple(new)

    def copy(self, src, dst) -> bool:
        """:meth:`VirtualKVCache.copy_block` with checked arguments."""
        st = self.state
        sets = [st.keys.get(key) for key in (src, dst)]
        for key, pids in zip((src, dst), sets):
            if pids is None:
                raise SlotError(f"copy of block key {key!r}, which no page-set holds (never bound "
                                "by this cache, or dropped since)")
        to = self._mapped_at(dst, sets[1])
        if to is None:
            raise SlotError(f"block key {dst!r} is not mapped where it was bound: bind it (fresh) "
                            "in the request that writes it before copying into it")
        if self.twins.get(dst) == src:                # src was moved out of dst's pages this step:
            st.counters.copies_elided += 1            # its bytes are still there
            return True
        at = self._mapped_at(src, sets[0])
        if at is None:                                # mapped nowhere known: map it on top of a slot
            at = self._park(src, sets[0], avoid=to[0])
            if at is None:
                return False
        self._unpack_for_write(*to)
        self.space.copy_set(at, to, (st.pages.at(*at), st.pages.at(*to)))
        st.copied(at, to)
        st.counters.blocks_copied += 1
        return True

    def _unpack_for_write(self, slot: int, index: int) -> None:
        """A copy writes page-set ``index`` of ``slot``: its own pages, not a pack, mapped there
        (an unpack waits until the device is done with what reads the pack there)."""
        st = self.state
        if st.pages.packed_at(slot, index):
            st.settle(slot)
            st.wait_fence(slot)
            st.pages.unpack_at(slot, index)

    def _mapped_at(self, key, pids: tuple[int, ...]) -> tuple[int, int] | None:
        """Where ``key``'s page-set is mapped: its home if the mapping there is still its own,
        else any slot that maps it (a scan; the key's home is moved there), else ``None``."""
        st = self.state
        pages, n = st.pages, st.config.max_slots
        home = st.keys.home.get(key)
        if home is not None and home[0] < n:
            st.settle(home[0])
            if st.home(key) is not None:
                return home
        for slot in range(n):                         # a replaced home: another sharer's mapping
            bottom = pages.mapped[slot][0]
            if slot in st.slots.inflight or pids[0] not in bottom:
                continue
            index = bottom.index(pids[0])
            if pages.at(slot, index) == pids:
                st.keys.home[key] = (slot, index)
                return slot, index
        return None

    def _park(self, key, pids: tuple[int, ...], avoid: int) -> tuple[int, int] | None:
        """Map ``key``'s page-set on top of a slot (see :meth:`_spare_slot`; when none has room,
        in place of a page-set no request reads: :meth:`_borrow_place`) and make it the key's
        home; ``None`` when no slot can take it."""
        st = self.state
        spare = self._spare_slot(avoid)
        if spare is not None:
            place = spare, st.pages.usable(spare)
        else:
            place = self._borrow_place(avoid)
            if place is None:
                return None
            st.wait_fence(place[0])                   # the slot's previous request may read it
        st.pages.put(*place, [pids])
        st.slots.mixed.add(place[0])
        st.keys.home[key] = place
        return place

    def _borrow_place(self, avoid: int) -> tuple[int, int] | None:
        """With every slot mapped to its end: the top page-set of a slot that its request (if
        any) does not read (in :meth:`_candidates` order), preferring one no key and no other
        mapping holds; ``None`` if there is none. Mapping there replaces it (one unmap + map per
        range)."""
        st = self.state
        table, pages = st.slots, st.pages
        places = [(slot, pages.usable(slot) - 1) for slot in self._candidates(avoid)]
        places = [(slot, top) for slot, top in places
                  if top >= 0 and not (table.active[slot] and top < table.num_read_sets(slot))]
        refs, bound = st.pool.refs, pages.bound
        free = (p for p in places if all(refs[q] == 1 and not bound[q] for q in pages.at(*p)))
        return next(free, places[0] if places else None)

    def _spare_place(self, avoid: int) -> tuple[int, int] | None:
        """A loose page-set made of free pool pages, mapped on top of a slot (see
        :meth:`_spare_slot`): one map per range, no unmap and no fence. ``None`` when the pool
        is short of a page-set or no evenly mapped slot has room."""
        st = self.state
        if st.pool.num_free < st.layout.num_ranges:
            return None
        spare = self._spare_slot(avoid)
        if spare is None:
            return None
        index = st.pages.usable(spare)
        if not st.pages.grow(spare, index + 1, st.slots.tenant[spare], ahead=False):
            return None
        return spare, index

    def _spare_slot(self, avoid: int) -> int | None:
        """The first of :meth:`_candidates` with room on top for one more page-set (nothing reads
        above a slot's top), ``None`` if none has."""
        room = self.state.pages.usable_n < self.state.layout.pages_per_slot
        return next(self._candidates(avoid, room), None)

    def _candidates(self, avoid: int, where=None):
        """Slots to put a page-set on (among ``where``, a bool mask, if given), best first: idle
        ones (the one released longest ago first), then active ones; never ``avoid``, one being
        mapped or with old mappings on a fence, or one mapped unevenly (after a failed driver
        call a range may hold pages above the usable top — another block's, or a request's own —
        which a page-set put there would replace)."""
        st = self.state
        table, pages, n = st.slots, st.pages, st.config.max_slots
        busy = {*table.inflight, *pages.retired, avoid}
        pick = np.arange(n) if where is None else np.flatnonzero(where[:n])
        order = pick[np.lexsort((table.released_at[pick], table.active[pick]))]
        for slot in order.tolist():
            if slot not in busy and pages.mapped_evenly(slot):
                yield slot

    def _move_out(self, slot: int, index: int, cur: tuple[int, ...], end: int) -> bool:
        """Move the cached block in page-set ``cur`` (at ``index`` of ``slot``) into a loose
        page-set mapped in an idle slot, so this position keeps its pages for a new block: one
        device copy on the current stream (ordered after every kernel queued so far, before
        every later one), no VMM call. False if ``cur`` is mapped elsewhere too or no loose
        page-set is at hand (the caller then maps new pages here)."""
        st = self.state
        refs = st.pool.refs
        if any(refs[p] != 2 for p in cur):            # shared with another region: leave it
            return False
        key = st.keys.key_of.get(cur[0])
        if key is None or st.keys.get(key) != cur:    # not one whole bound page-set: leave it
            return False
        dst = self.loose.take(avoid=(slot, end))
        if dst is None:
            dst = self._spare_place(slot)
        if dst is None:
            return False
        self._unpack_for_write(*dst)
        to = st.pages.at(*dst)
        self.space.copy_set((slot, index), dst, (cur, to))
        st.copied((slot, index), dst)
        tags = st.pool.tenant
        for src_page, dst_page in zip(cur, to):
            tags[dst_page] = tags[src_page]           # the content's tenant moves with it
        st.slots.mixed.add(dst[0])
        st.keys.move(key, to, dst)                    # cur keeps its mapping here (no page freed)
        st.counters.page_sets_moved += 1
        return True
