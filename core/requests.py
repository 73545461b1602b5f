"""Requests to slots: the one binding every adapter keeps between an engine's request keys
(vLLM's request ids or batch indices, TGI's request ids, transformers' request ids) and the
cache's slots.

A request takes a slot when it first gets KV (:meth:`RequestSlots.take`), keeps it while it
runs, and gives it back when it finishes, is aborted or preempted (:meth:`RequestSlots.drop`):
the release is fenced on the current stream, so its pages are unmapped only after the kernels
already queued have read them. Token ``p`` of a request is row ``base_row(key) + p`` of every
layer view (:func:`vattn.core.ops.rows_for` for a batch).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Sequence

import numpy as np

from .cache import VirtualKVCache
from .errors import SlotError

__all__ = ["RequestSlots"]


class RequestSlots:
    """The slot of each running request of one cache.

    Parameters
    ----------
    cache : VirtualKVCache
        The cache the slots belong to; only this object acquires and releases them for the
        adapter that owns it.
    """

    def __init__(self, cache: VirtualKVCache):
        self.cache = cache
        self._slot: dict[Hashable, int] = {}

    def take(self, key: Hashable, *, expected_len: int = 0, tenant=None, prefix=(), home=None) -> int:
        """Give ``key`` an idle slot (:meth:`VirtualKVCache.acquire`) and return it.

        Raises
        ------
        SlotError
            ``key`` already holds a slot, or every slot is in use.
        """
        if key in self._slot:
            raise SlotError(f"request {key!r} already holds slot {self._slot[key]}")
        slot = self._slot[key] = self.cache.acquire(tenant=tenant, expected_len=expected_len,
                                                    prefix=prefix, home=home)
        return slot

    def drop(self, key: Hashable) -> int | None:
        """Release ``key``'s slot, fenced (``None``: it held none)."""
        slot = self._slot.pop(key, None)
        if slot is not None:
            self.cache.release(slot)
        return slot

    def drop_many(self, keys: Iterable[Hashable]) -> list[int]:
        """Release the slots of ``keys`` that hold one; returns those slots."""
        return [s for s in (self.drop(k) for k in list(keys)) if s is not None]

    def drop_all(self) -> list[int]:
        """Release every slot (engine reset or shutdown)."""
        return self.drop_many(list(self._slot))

    def get(self, key: Hashable) -> int | None:
        return self._slot.get(key)

    def __getitem__(self, key: Hashable) -> int:
        try:
            return self._slot[key]
        except KeyError:
            raise SlotError(f"request {key!r} holds no vattn slot") from None

    def array(self, keys: Sequence[Hashable]) -> np.ndarray:
        """The slots of ``keys`` as ``int64[len(keys)]``, in one C-level pass (a step's hot path:
        no Python call per request).

        Raises
        ------
        SlotError
            A key holds no slot.
        """
        try:
            return np.fromiter(map(self._slot.__getitem__, keys), dtype=np.int64, count=len(keys))
        except KeyError as exc:
            raise SlotError(f"request {exc.args[0]!r} holds no vattn slot") from None

    def base_row(self, key: Hashable) -> int:
        """Row of ``key``'s token 0 in every layer view (``slot * rows_per_slot``)."""
        return self[key] * self.cache.layout.rows_per_slot

    def __contains__(self, key: Hashable) -> bool:
        return key in self._slot

    def __len__(self) -> int:
        return len(self._slot)

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._slot)

    def as_dict(self) -> dict:
        """A copy of the map, ``{key: slot}``."""
        return dict(self._slot)
