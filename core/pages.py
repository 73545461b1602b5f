"""Physical page pool: every handle is created once, up front, within a memory budget.

Pages are reference-counted: each mapping of a page counts one reference, and so does a block
key bound to it (prefix sharing: one physical page mapped at several addresses). A page returns
to the free list when its last reference goes.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from .errors import ConfigError, DriverError

__all__ = ["PagePool", "FRESH", "budget_pages"]

FRESH = object()  # tenant tag of a page that was never handed to anyone


def budget_pages(driver, budget: int | float, page_bytes: int, num_ranges: int) -> int:
    """Pages of ``page_bytes`` a ``page_budget`` gives (a float: that fraction of the driver's
    free memory); ``ConfigError`` below the padding slot's page-set plus one more."""
    if isinstance(budget, float):
        budget = int(driver.free_memory() * budget)
    need = 2 * num_ranges
    pages = budget // page_bytes
    if pages < need:
        raise ConfigError(f"page_budget of {budget} bytes gives {pages} pages of {page_bytes} bytes; at "
                          f"least {need} are needed (padding slot plus one page-set)")
    return pages


class PagePool:
    """A fixed set of physical pages with a free list, a reference count and a tenant tag per page.

    Parameters
    ----------
    driver : Driver
        Creates and finally releases the handles.
    page_bytes : int
        Size of each page (a multiple of the driver's granularity).
    num_pages : int
        Pages to create now. A driver failure part way releases what was created and re-raises.
    """

    def __init__(self, driver, *, page_bytes: int, num_pages: int):
        if num_pages <= 0:
            raise ConfigError(f"the page pool needs at least one page, got num_pages={num_pages}")
        self.driver, self.page_bytes = driver, page_bytes
        self.handles: list = []
        try:
            for _ in range(num_pages):
                self.handles.append(driver.create(page_bytes))
        except DriverError:
            self._release_all()
            raise
        self.tenant: list = [FRESH] * num_pages
        self._free = deque(range(num_pages))
        #: free pages whose old mapping the device may still read: ``(page, fence)``, usable only
        #: by work ordered after the fence (the engine thread's stream), see ``give(fence=)``
        self._fenced: deque = deque()
        #: used pages an old mapping of which the device may still read: page -> that fence (a
        #: page freed later, while it is pending, goes to ``_fenced`` too)
        self._until: dict[int, object] = {}
        self.refs = np.zeros(num_pages, dtype=np.int32)   # mappings + bound keys; 0 <=> free
        #: times each page was taken from the free list or rewritten in place (:meth:`rewrite`): a
        #: page with the same generation still holds the content it held (what a pack copied
        #: from it, :mod:`.packs`)
        self.gen = np.zeros(num_pages, dtype=np.int64)

    @property
    def num_pages(self) -> int:
        return len(self.handles)

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._fenced)

    @property
    def num_unfenced(self) -> int:
        """Free pages nothing may still read (after moving those whose fence completed)."""
        self._settle()
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    def take(self, n: int, *, unfenced: bool = False) -> list[int] | None:
        """Take ``n`` free pages (all or none), one reference each; ``None`` when fewer are free.
        ``unfenced``: only pages nothing may still read (for work not ordered after the fences
        of ``give(fence=)``, e.g. another thread's stream)."""
        if unfenced:
            self._settle()
        if n > (len(self._free) if unfenced else self.num_free):
            return None
        ids = [self._free.popleft() if self._free else self._fenced.popleft()[0] for _ in range(n)]
        self.refs[ids] = 1
        self.gen[ids] += 1
        return ids

    def rewrite(self, ids) -> None:
        """Pages about to take new content where they are (a fresh block bound to pages a slot
        kept mapped): their generation moves on, so a pack copied from them no longer matches."""
        self.gen[list(ids)] += 1

    def ref(self, ids) -> None:
        """One more reference to each page in ``ids`` (none may be free)."""
        for i in ids:
            if self.refs[i] <= 0:
                raise ConfigError(f"page {i} is free: it cannot gain a reference")
            self.refs[i] += 1

    def give(self, ids, *, fence=None) -> int:
        """Drop one reference to each page; a page whose last reference goes returns to the free
        list (most recently used first out: warm in caches). ``fence``: the device may read the
        page through an old mapping until it completes (see :meth:`take`). Returns the pages
        freed."""
        freed = 0
        if fence is not None and fence.done():
            fence = None
        for i in ids:
            if self.refs[i] <= 0:
                raise ConfigError(f"page {i} returned to the pool twice")
            self.refs[i] -= 1
            older = self._until.pop(i, None)
            until = older if fence is None else fence     # a newer fence completes after an older one
            if self.refs[i]:
                if until is not None:
                    self._until[i] = until         # still used elsewhere: the fence stays with it
                continue
            if until is not None and not until.done():
                self._fenced.append((i, until))
            else:
                self._free.appendleft(i)
            freed += 1
        return freed

    def _settle(self) -> None:
        while self._fenced and self._fenced[0][1].done():
            self._free.append(self._fenced.popleft()[0])

    def is_free(self, page: int) -> bool:
        return not self.refs[page]

    def close(self) -> None:
        self._release_all()
        self._free.clear()
        self._fenced.clear()
        self._until.clear()

    def _release_all(self) -> None:
        while self.handles:                 # one at a time: a failed release can be retried
            self.driver.release(self.handles[-1])
            self.handles.pop()
