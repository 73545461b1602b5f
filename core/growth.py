"""Growing slots on the caller's thread: ensure's short slots, bind's positions, the pre-warm,
and the targets step() hands the map-ahead worker. Pages come from the pool, else from
:class:`~vattn.core.reclaim.Reclaim`; a shortfall is reported, never raised.
"""

from __future__ import annotations

import numpy as np

from .loose import LooseSets
from .reclaim import Reclaim
from .state import CacheState

__all__ = ["Growth"]


class Growth:
    """The growth part of a cache (runs under the cache lock)."""

    def __init__(self, state: CacheState, reclaim: Reclaim, loose: LooseSets):
        self.state, self.reclaim, self.loose = state, reclaim, loose

    def ensure(self, slots: np.ndarray, lens: np.ndarray) -> list[int]:
        """Grow every listed slot (checked, distinct) to its length; record the lengths of those
        that hold them; return the others."""
        st = self.state
        st.slots.clock += 1
        if st.pages.retired:                          # old mappings whose fence has completed
            st.pages.retired.flush_done()
        short = lens > st.pages.cap_tokens[slots]
        failed = []
        if short.any():
            # every listed slot keeps what this call needs; its surplus stays reclaimable
            need = dict(zip(slots.tolist(), map(st.layout.pages_for, lens.tolist())))
            failed = self._grow_short(slots[short].tolist(), lens[short].tolist(), need)
        keep = ~np.isin(slots, failed) if failed else slice(None)
        ok = slots[keep]
        st.slots.length[ok] = np.maximum(st.slots.length[ok], lens[keep])   # slots are distinct
        st.counters.shortfalls += len(failed)
        return failed

    def _grow_short(self, slots: list[int], lens: list[int], protect: dict[int, int]) -> list[int]:
        failed, exhausted = [], False
        for slot, n in zip(slots, lens):
            ok, exhausted = self.grow(slot, self.state.layout.pages_for(n), protect, exhausted)
            if not ok:
                failed.append(slot)
        return failed

    def grow(self, slot: int, num_sets: int, protect: dict[int, int], exhausted: bool) -> tuple[bool, bool]:
        """Grow one slot; ``exhausted`` says an earlier reclaim found nothing left to take.

        Pages the map-ahead worker is mapping into another slot are not reclaimable until it
        commits them; when only they would close the gap, this waits for the worker, so a
        shortfall is reported only when the pool is truly short (an engine that counts its
        own blocks, like vLLM, must never see a spurious one).
        """
        st = self.state
        pages, pool = st.pages, st.pool
        while True:
            st.settle(slot)                           # a page we may need is being mapped
            if pages.usable(slot) >= num_sets:
                return True, exhausted
            short = pages.missing(slot, num_sets) - pool.num_free
            if short <= 0 or exhausted or self.reclaim.reclaim(short, protect) >= short:
                break                                 # (reclaim keeps the lock: nothing moved)
            if not st.slots.inflight:
                return False, True
            st.wait_cond()                            # the worker may take up this slot again
        if pages.missing(slot, num_sets) > pool.num_free:
            return False, True
        return pages.grow(slot, num_sets, st.slots.tenant[slot], ahead=False), exhausted

    def take_set(self, slot: int, index: int, count: int | None = None) -> list[int] | None:
        """``count`` free pages (default one per range), reclaiming (never from ``slot`` below
        ``index + 1``); ``None`` when the pool stays short."""
        st = self.state
        ranges = st.layout.num_ranges if count is None else count
        while (short := ranges - st.pool.num_free) > 0:
            if self.reclaim.reclaim(short, {slot: index + 1}) >= short:
                break
            if not st.slots.inflight:
                return None
            st.wait_cond()
        return st.pool.take(ranges)

    def prewarm(self, tokens_per_slot: int | None, min_tokens: int, cold_slots: int = 0) -> int:
        """Top idle slots up to ``tokens_per_slot`` (``None``: an even share of the free pool
        over every idle slot, but at least ``min_tokens`` deep), lowest slot first, until the
        pool runs out (short of ``free_reserve``), leaving the last ``cold_slots`` idle slots
        empty (their share stays free in the pool); returns the pages mapped."""
        st = self.state
        table = st.slots
        idle = [s for s in range(st.config.max_slots) if not table.active[s] and s not in table.inflight]
        if not idle:
            return 0
        reserve = st.config.free_reserve
        spare = max(st.pool.num_free - reserve, 0)
        sets = (max(spare // (st.layout.num_ranges * len(idle)), st.layout.pages_for(min_tokens))
                if tokens_per_slot is None else st.layout.pages_for(tokens_per_slot))
        sets = min(sets, st.layout.pages_per_slot)   # a slot's region holds no more
        before = st.pool.num_free
        for slot in idle[:len(idle) - min(cold_slots, len(idle))]:
            if (st.pool.num_free - st.pages.missing(slot, sets) < reserve
                    or not st.pages.grow(slot, sets, table.tenant[slot], ahead=True)):
                break
            self.loose.note(slot, 0)
        return before - st.pool.num_free

    def refill(self, pages: int) -> int:
        """Free up to ``pages`` more pool pages toward ``free_reserve``, from idle slots' page-sets
        that hold nothing (no key, no other mapping; finished fences only: no wait); returns
        the pages freed (0: none left to take)."""
        st = self.state
        want = min(pages, st.config.free_reserve - st.pool.num_free)
        if want <= 0:
            return 0
        return self.reclaim.reclaim(want, {}, idle_only=True, block=False, free_only=True)

    def ahead_targets(self, slots: np.ndarray, lens: np.ndarray, failed: list[int]) -> dict[int, int]:
        """Page-set targets for the map-ahead worker: each slot not in ``failed`` mapped
        ``map_ahead_tokens`` beyond its length (within its region), where it is not yet."""
        st = self.state
        want = np.minimum(lens + st.config.map_ahead_tokens, st.layout.rows_per_slot)
        need = want > st.pages.cap_tokens[slots]
        if failed:
            need &= ~np.isin(slots, failed)
        if not need.any():
            return {}
        return {s: st.layout.pages_for(n) for s, n in zip(slots[need].tolist(), want[need].tolist())}
