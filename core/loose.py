"""Loose page-sets: mapped page-sets that may be held by nothing but their one mapping.

When a fresh block takes a position that holds another key's cached block, binding moves that
block by one device copy into a loose page-set instead of unmapping it. Candidates are noted
cheaply (a released slot's unbound page-sets, a pre-warmed slot's, the old place of a dropped or
rebound key) and checked only when one is taken.
"""

from __future__ import annotations

from .state import CacheState

__all__ = ["LooseSets"]


class LooseSets:
    """Candidate ``(slot, index)`` places for a moved-out block (runs under the cache lock)."""

    def __init__(self, state: CacheState):
        self.state = state
        self.candidates: list[tuple[int, int]] = []

    def note(self, slot: int, first: int) -> None:
        """Remember ``slot``'s page-sets from ``first`` up (the list is pruned when it outgrows
        the pool)."""
        st = self.state
        self.candidates.extend((slot, i) for i in range(first, st.pages.usable(slot)))
        if len(self.candidates) > 4 * st.pool.num_pages:
            self.candidates = [(s, i) for s, i in set(self.candidates) if not st.slots.active[s]]

    def add(self, places) -> None:
        """Remember these ``(slot, index)`` places."""
        self.candidates.extend(places)

    def take(self, *, avoid: tuple[int, int]) -> tuple[int, int] | None:
        """A page-set that nothing else holds (no key, no other mapping), mapped in an idle slot
        or beyond what an active one has bound and ensured (its request reads no row there
        before binding it); ``avoid = (slot, end)``: not below ``end`` in that slot (the
        positions the current call binds)."""
        st = self.state
        refs, n, table = st.pool.refs, st.config.max_slots, st.slots
        while self.candidates:
            slot, index = self.candidates.pop()
            if slot >= n or (slot == avoid[0] and index < avoid[1]) or slot in table.inflight:
                continue
            if table.active[slot] and index < table.read_sets(slot):
                continue
            pids = st.pages.at(slot, index)
            if pids is not None and all(refs[p] == 1 for p in pids):
                return slot, index
        return None
