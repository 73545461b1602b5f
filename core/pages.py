"""Physical page pool: every handle is created once, up front, within a memory budget."""

from __future__ import annotations

from collections import deque

from .errors import ConfigError, DriverError

__all__ = ["PagePool", "FRESH"]

FRESH = object()  # tenant tag of a page that was never handed to anyone


class PagePool:
    """A fixed set of physical pages with a free list and a tenant tag per page.

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
        self._is_free = [True] * num_pages

    @property
    def num_pages(self) -> int:
        return len(self.handles)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    def take(self, n: int) -> list[int] | None:
        """Take ``n`` free pages (all or none); ``None`` when fewer are free."""
        if n > len(self._free):
            return None
        ids = [self._free.popleft() for _ in range(n)]
        for i in ids:
            self._is_free[i] = False
        return ids

    def give(self, ids) -> None:
        """Return pages to the free list (most recently used first out: warm in caches)."""
        for i in ids:
            if self._is_free[i]:
                raise ConfigError(f"page {i} returned to the pool twice")
            self._is_free[i] = True
            self._free.appendleft(i)

    def is_free(self, page: int) -> bool:
        return self._is_free[page]

    def close(self) -> None:
        self._release_all()
        self._free.clear()

    def _release_all(self) -> None:
        while self.handles:                 # one at a time: a failed release can be retried
            self.driver.release(self.handles[-1])
            self.handles.pop()
