"""Pages reclaimed before the device is done with them, for a stream-ordered engine.

Under memory pressure the pages a growing request needs often belong to a slot released this
very step: the forward in flight still reads them through that slot's addresses. Unmapping them
means a host wait for that forward. With ``KVCacheConfig.stream_ordered`` the engine promises
that all KV work it enqueues later is ordered after the release's fence on one stream, so the
pages can be handed on at once: they leave the slot's record and go back to the pool (fenced,
see :meth:`~.pages.PagePool.give`), mapped elsewhere as usual, while their old mapping — one
physical page at two addresses for a while — stays until the fence completes and is then
unmapped. Nothing maps at a retired position before that (:meth:`RetiredMappings.flush` runs
first, waiting if it must).

Not thread-safe on its own: :class:`~vattn.core.cache.VirtualKVCache` serialises access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .paging import SlotPages

__all__ = ["RetiredMappings"]


class RetiredMappings:
    """Per slot: the fence to wait for and the ``(range, index)`` positions still mapped."""

    def __init__(self, pages: SlotPages):
        self.pages = pages
        self._by_slot: dict[int, list] = {}      # slot -> [fence, [(range, index), ...]]

    def __bool__(self) -> bool:
        return bool(self._by_slot)

    def __contains__(self, slot: int) -> bool:
        return slot in self._by_slot

    def __iter__(self):
        return iter(self._by_slot)

    def items(self):
        """``(slot, (fence, [(range, index), ...]))`` of every slot with retired positions."""
        return ((slot, tuple(entry)) for slot, entry in self._by_slot.items())

    def count(self) -> int:
        """Positions still mapped, waiting on a fence."""
        return sum(len(spots) for _, spots in self._by_slot.values())

    def add(self, slot: int, rng: int, index: int, fence) -> None:
        """Page ``index`` of ``slot`` in ``rng`` left the record (:meth:`SlotPages.trim` with a
        pending ``fence``) but stays mapped until :meth:`flush`."""
        entry = self._by_slot.setdefault(slot, [fence, []])
        entry[0] = fence                           # the newest: it completes after older ones
        entry[1].append((rng, index))
        self.pages.counters.pages_retired += 1

    def flush(self, slot: int, *, wait: bool) -> bool:
        """Unmap ``slot``'s retired positions once its fence completes (``wait``: block for it,
        a counted fence wait). False if they stay (the fence is pending and ``wait`` is off).

        Raises
        ------
        DriverError
            An unmap failed; the positions not yet unmapped stay recorded, a later call retries.
        """
        entry = self._by_slot.get(slot)
        if entry is None:
            return True
        fence, spots = entry
        pg = self.pages
        if not fence.done():
            if not wait:
                return False
            pg.counters.fence_waits += 1
            fence.wait()
        while spots:                               # trimmed top down: the last is the lowest
            rng, index = spots[-1]
            n = 1
            if pg.unmap_spans:                     # the run above it in its range: one call
                while n < len(spots) and spots[-1 - n] == (rng, index + n):
                    n += 1
            pg.unmap_at(rng, slot, index, n)
            del spots[-n:]
        del self._by_slot[slot]
        return True

    def flush_done(self) -> None:
        """:meth:`flush` every slot whose fence has completed (no wait)."""
        for slot in list(self._by_slot):
            self.flush(slot, wait=False)
