"""Engine block keys -> the physical page-set that holds the block's KV (prefix sharing).

An engine with a prefix cache (vLLM's automatic prefix caching, SGLang's radix tree) names the
KV of a full block by its own id. When a new request hits a cached prefix, vattn maps the
page-set that already holds that block into the new request's region: one physical page-set at
several virtual addresses, never copied. A bound page-set carries one extra reference per page
(:class:`~.pages.PagePool`), so it outlives every mapping until its key is dropped: when the
engine hands the block out again as a fresh one (its old content is dead) or says it evicted it.

Not thread-safe on its own: :class:`~vattn.core.cache.VirtualKVCache` serialises access.
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

from .errors import VattnError
from .pages import PagePool

__all__ = ["BlockKeys"]


class BlockKeys:
    """Which page-set (one pool page per range) each bound key names, and where it was written.

    Parameters
    ----------
    pool : PagePool
        The pages' owner (references are taken and dropped here).
    bound : numpy.ndarray
        ``bool[num_pages]``, shared with :class:`~.paging.SlotPages`: set for a page held by a key
        (such pages are never scrubbed or retagged).
    """

    def __init__(self, pool: PagePool, bound: np.ndarray):
        self.pool, self.bound = pool, bound
        self.pids: dict[Hashable, tuple[int, ...]] = {}
        #: key -> (slot, page-set index) where its page-set was last mapped for a request
        self.home: dict[Hashable, tuple[int, int]] = {}
        #: the first page of a bound page-set -> its key
        self.key_of: dict[int, Hashable] = {}
        #: called with the pages of every page-set bound (packs: content written this step)
        self.on_bind = None

    def __len__(self) -> int:
        return len(self.pids)

    def get(self, key) -> tuple[int, ...] | None:
        return self.pids.get(key)

    def bind(self, key, pids: tuple[int, ...], home: tuple[int, int]) -> None:
        """``key`` now names the page-set ``pids`` (mapped at ``home``); one reference per page."""
        self.pool.ref(pids)
        self.bound[list(pids)] = True
        self.pids[key] = pids
        self.home[key] = home
        self.key_of[pids[0]] = key
        if self.on_bind is not None:
            self.on_bind(pids)

    def move(self, key, pids: tuple[int, ...], home: tuple[int, int]) -> None:
        """``key``'s block now lives in page-set ``pids`` at ``home`` (a device copy moved it):
        :meth:`drop` then :meth:`bind` without a page freed (the old pages keep their mapping)."""
        old = self.pids[key]
        refs = self.pool.refs
        if any(refs[p] < 2 for p in old):
            raise VattnError(f"block key {key!r}: its old pages would be freed by a move")
        for p in old:
            refs[p] -= 1
        del self.key_of[old[0]]
        self.bound[list(old)] = False
        self.home.pop(key, None)
        self.pids.pop(key)
        self.bind(key, pids, home)

    def drop(self, key) -> int:
        """Forget ``key``; its pages lose the key's reference. Returns the pages freed (those no
        slot maps any more)."""
        pids = self.pids.pop(key)
        self.home.pop(key, None)
        del self.key_of[pids[0]]
        self.bound[list(pids)] = False
        return self.pool.give(pids)

    def clear(self) -> None:
        for key in list(self.pids):
            self.drop(key)
