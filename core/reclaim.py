"""Taking mapped pages back: from idle slots (oldest released first), then from the surplus of
running ones, never below what a request reads and never from a slot being mapped in the
background. :meth:`Reclaim.reclaimable` counts what :meth:`Reclaim.reclaim` would free, from
the same list of victims.
"""

from __future__ import annotations

import numpy as np

from .state import CacheState

__all__ = ["Reclaim"]


class Reclaim:
    """The reclaim part of a cache (runs under the cache lock)."""

    def __init__(self, state: CacheState):
        self.state = state

    def victims(self, protect: dict[int, int], *, idle_only: bool = False, margin: int = 0
                ) -> tuple[np.ndarray, np.ndarray]:
        """``(slots, page-sets to keep)``: idle slots oldest first (keep 0), then the surplus of
        active slots (vectorised over the slots).

        ``protect`` maps a slot to the page-sets the current call needs it to keep (beyond what
        its request reads); only what lies above both may be taken. ``margin``: page-sets every
        active slot keeps above what its request reads (what map-ahead gives it). Slots being
        mapped in the background are never victims.
        """
        st, table = self.state, self.state.slots
        n = st.config.max_slots
        held = st.pages.held_n[:n]
        takeable = np.ones(n, dtype=bool)
        if table.inflight:
            takeable[list(table.inflight)] = False
        active = table.active[:n]
        idle = np.flatnonzero(~active & takeable & (held > 0))
        idle = idle[np.argsort(table.released_at[idle], kind="stable")]
        if idle_only:
            return idle, np.zeros(idle.size, dtype=np.int64)
        keep = table.num_read_sets(slice(0, n)) + margin
        if protect:
            ps = np.fromiter(protect.keys(), dtype=np.int64, count=len(protect))
            pk = np.fromiter(protect.values(), dtype=np.int64, count=len(protect))
            inside = ps < n
            keep[ps[inside]] = np.maximum(keep[ps[inside]], pk[inside])
        surplus = np.flatnonzero(active & takeable & (held > keep * st.layout.num_ranges))
        # a slot whose ranges differ in length (a driver call failed part way) can hold pages
        # above ``keep`` in one range while another lacks some: its total says nothing then
        ranges = st.layout.num_ranges   # evenly mapped: every range holds usable_n pages
        cand = np.flatnonzero(active & takeable & (held != st.pages.usable_n[:n] * ranges))
        uneven = [s for s in cand.tolist() if max(map(len, st.pages.mapped[s])) > keep[s]]
        if uneven:
            surplus = np.union1d(surplus, uneven).astype(np.int64)
        return (np.concatenate([idle, surplus]),
                np.concatenate([np.zeros(idle.size, dtype=np.int64), keep[surplus]]))

    def reclaimable(self) -> int:
        """Pages :meth:`reclaim` could free now: what each of :meth:`victims` holds above what it
        keeps (with block keys bound, only the pages nothing else holds)."""
        st = self.state
        slots, keep = self.victims({})
        if not len(st.keys):
            return int((st.pages.held_n[slots] - keep * st.layout.num_ranges).sum())
        refs = st.pool.refs
        return sum(int((refs[[p for p in pages[k:] if p >= 0]] == 1).sum())   # -1: a hole
                   for s, k in zip(slots.tolist(), keep.tolist())
                   for pages in st.pages.mapped[s] if len(pages) > k)

    def reclaim(self, want: int, protect: dict[int, int], *, idle_only: bool = False,
                block: bool = True, margin: int = 0, free_only: bool = False) -> int:
        """Free at least ``want`` pages from :meth:`victims`, taking from each victim only the
        page-sets still needed; ``block=False`` skips victims whose fence has not completed.

        With block keys bound, a first pass unmaps only page-sets whose pages nothing else holds
        (unmapping a bound page-set frees nothing); a second pass unmaps through bound ones to
        reach free-able page-sets below them (``free_only``: not that pass)."""
        st, freed = self.state, 0
        slots, keeps = self.victims(protect, idle_only=idle_only, margin=margin)
        retire = block and st.config.stream_ordered
        for only_free in ((True,) if free_only else (True, False)) if len(st.keys) else (False,):
            for wait in ((False, True) if block else (False,)):   # finished fences first, then wait
                for slot, keep in zip(slots.tolist(), keeps.tolist()):
                    if freed >= want:
                        return freed
                    fence = st.slots.fence[slot]
                    pending = fence is not None and not fence.done()
                    if pending and not wait:
                        continue
                    if pending and not retire:
                        st.wait_fence(slot)
                    if only_free:
                        keep = max(keep, self._shared_top(slot))
                    freed += self._trim_for(slot, keep, want - freed, fence if pending and retire else None)
        return freed

    def take_unfenced(self, num: int) -> list[int] | None:
        """``num`` free pool pages; when the pool is dry, first unmap them from the idle slots
        released longest ago, then from what running requests hold beyond what they read plus
        their map-ahead margin (a pre-warmed slot deeper than its request; never waiting on a
        fence): how the map-ahead worker takes the pages a pre-warm left where nobody reads them,
        so a request that found no warm slot grows in the background, not on the step's path."""
        pool, st = self.state.pool, self.state
        pids = pool.take(num, unfenced=True)
        if pids is None and self.reclaim(num - pool.num_unfenced, {}, idle_only=True, block=False):
            pids = pool.take(num, unfenced=True)
        margin = st.layout.pages_for(st.config.map_ahead_tokens)
        if pids is None and self.reclaim(num - pool.num_unfenced, {}, block=False, margin=margin):
            pids = pool.take(num, unfenced=True)
        return pids

    def _trim_for(self, slot: int, keep: int, want: int, fence=None) -> int:
        """Unmap ``slot``'s page-sets from the top, not below ``keep``, until ``want`` pages are
        freed (``fence``: a pending one, see :meth:`SlotPages.trim`); returns the pages freed."""
        pages, ranges, freed = self.state.pages, self.state.layout.num_ranges, 0
        held_sets = max(map(len, pages.mapped[slot]))
        while freed < want and held_sets > keep:
            held_sets = max(keep, held_sets - -(-(want - freed) // ranges))
            freed += pages.trim(slot, held_sets, fence=fence)
        return freed

    def _shared_top(self, slot: int) -> int:
        """1 + the highest page-set of ``slot`` that some key or other mapping also holds (0 if
        none): unmapping above it frees every page."""
        refs, ranges = self.state.pool.refs, self.state.pages.mapped[slot]
        for index in range(max(map(len, ranges)) - 1, -1, -1):
            if any(index < len(pages) and pages[index] >= 0 and refs[pages[index]] != 1 for pages in ranges):
                return index + 1
        return 0
