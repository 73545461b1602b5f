"""What every part of a cache shares: the record of each slot's request, and the page holders.

:class:`~vattn.core.cache.VirtualKVCache` builds one :class:`CacheState` and hands it explicitly
to each of its parts (admission, growth, binding, reclaim, accounting). Not thread-safe on its
own: every part runs under ``cond``, the cache's lock.
"""

from __future__ import annotations

import threading

import numpy as np

from .config import KVCacheConfig
from .errors import VattnError
from .keys import BlockKeys
from .layout import KVLayout
from .metrics import Counters
from .pages import PagePool
from .paging import SlotPages

__all__ = ["SlotTable", "CacheState", "SharedFence"]


class SlotTable:
    """Per slot (``layout.num_va_slots`` of them, the padding slot last): its request, if any."""

    def __init__(self, layout: KVLayout):
        n = layout.num_va_slots
        self.layout = layout
        self.active = np.zeros(n, dtype=bool)            # acquired (the padding slot always is)
        self.tenant: list = [None] * n                   # the tenant of the latest request
        self.one_tenant = True     # every slot has only ever had the tenant None (the common case)
        self.length = np.zeros(n, dtype=np.int64)        # tokens ensure() guaranteed the request
        self.bound_sets = np.zeros(n, dtype=np.int64)    # page-sets bind() gave the current request
        self.mixed: set[int] = set()    # slots that may map pages tagged with another tenant
        self.fence: list = [None] * n   # completes when the device is done with the last request
        self.released_at = np.zeros(n, dtype=np.int64)   # the clock at release (oldest first)
        #: advances at every acquire and ensure, not at a release: the slots one run of releases
        #: frees tie (then the lower slot first), whatever order the engine released them in —
        #: engines hand finished requests over as sets, whose order differs from process to
        #: process, and tensor-parallel ranks must place the same blocks alike
        self.clock = 0
        self.inflight: set[int] = set()  # slots the map-ahead worker is mapping into right now

    def read_sets(self, slot: int) -> int:
        """:meth:`num_read_sets` of one slot, in plain ints (the per-bind checks)."""
        return max(self.layout.pages_for(int(self.length[slot])), int(self.bound_sets[slot]))

    def num_read_sets(self, slots):
        """Page-sets the requests in ``slots`` (one slot, a slice or an index array) read: those
        below their ensured length or their bound page-sets, whichever reach higher."""
        lay = self.layout
        need = -(-self.length[slots] * lay.token_bytes // lay.page_bytes)   # pages_for, vectorised
        return np.maximum(need, self.bound_sets[slots])


class CacheState:
    """The objects the parts of one cache share (see the module docstring)."""

    def __init__(self, config: KVCacheConfig, layout: KVLayout, driver, pool: PagePool,
                 pages: SlotPages, keys: BlockKeys, counters: Counters, cond: threading.Condition):
        self.config, self.layout, self.driver = config, layout, driver
        self.pool, self.pages, self.keys, self.counters = pool, pages, keys, counters
        self.cond = cond
        self.slots = SlotTable(layout)
        self._copy_fence: SharedFence | None = None   # the copies' fence not recorded yet

    def settle(self, slot: int) -> None:
        """Wait until the map-ahead worker is not mapping into ``slot`` (it appends at the top;
        whoever maps there next must see its pages recorded first). Call before mapping into a
        slot after anything that may have waited on the condition."""
        while slot in self.slots.inflight:
            self.wait_cond()

    def wait_cond(self) -> None:
        """Wait on the cache's condition (the lock is released meanwhile): the copies' fence is
        recorded first, on this thread's stream (another thread must not record it)."""
        self.seal_fence()
        self.cond.wait()

    def home(self, key) -> tuple[int, int] | None:
        """``(slot, index)`` where ``key``'s page-set was last mapped for a request, if the
        mapping there is still that page-set (a later bind may have replaced it), else ``None``."""
        home = self.keys.home.get(key)
        if home is None or home[0] >= self.config.max_slots:
            return None
        return home if self.pages.at(*home) == self.keys.get(key) else None

    def copied(self, *places: tuple[int, int]) -> None:
        """A device copy reading or writing page-sets at ``places`` (``(slot, index)`` each) was
        just queued on the current stream: each slot gets a fence recorded after it (it
        replaces the slot's fence, recorded earlier on the same stream; the copies until
        :meth:`seal_fence` share one, a :class:`SharedFence`), so the pages there are
        not unmapped or replaced (reclaim, a bind) before the device ran the copy — on a GPU
        under async scheduling, it runs after the forward in flight. Not for a page-set a
        running request reads: it stays mapped until its release, which records a later fence."""
        table = self.slots
        for slot, index in places:
            if table.active[slot] and index < table.read_sets(slot):
                continue
            if self._copy_fence is None or self._copy_fence.recorded:
                self._copy_fence = SharedFence(self.driver)
            table.fence[slot] = self._copy_fence

    def seal_fence(self) -> None:
        """Record the fence the copies queued since the last call share (one event for a
        step's copies rather than one each; it would be recorded at its first ``done`` or
        ``wait`` anyway)."""
        if self._copy_fence is not None:
            self._copy_fence.record()
            self._copy_fence = None

    def wait_fence(self, slot: int) -> None:
        """Wait until the device is done with what ``slot``'s previous request read."""
        fence = self.slots.fence[slot]
        if fence is not None and not fence.done():
            self.counters.fence_waits += 1
            fence.wait()


class SharedFence:
    """A fence several copies share, recorded once after all of them (so it completes after
    each) by :meth:`CacheState.seal_fence` — at the end of the cache call that queued them, and
    before that thread waits on the cache's condition — or at its first :meth:`done` /
    :meth:`wait` on that thread (on its current stream, the copies' stream). A copy queued once it is
    recorded gets a new one. Another thread (the map-ahead worker) never records it: for it an
    unrecorded fence is not done."""

    __slots__ = ("driver", "fence", "owner")

    def __init__(self, driver):
        self.driver, self.fence, self.owner = driver, None, threading.get_ident()

    @property
    def recorded(self) -> bool:
        return self.fence is not None

    def record(self) -> None:
        if self.fence is None:
            if threading.get_ident() != self.owner:
                raise VattnError("a copy's fence was to be recorded by a thread other than the one "
                                 "that queued the copy (its stream may differ); expected it sealed "
                                 "before the cache's lock was let go")
            self.fence = self.driver.record_fence()

    def done(self) -> bool:
        if self.fence is None and threading.get_ident() != self.owner:
            return False
        self.record()
        return self.fence.done()

    def wait(self) -> None:
        self.record()
        self.fence.wait()
