"""Page-sets a request writes before vattn knows the SGLang page ids that name them.

SGLang's paged allocator hands out page ids on the device (its free list is a device tensor).
Copying them to the host before a forward would make the host wait for the GPU and cost SGLang's
overlap scheduler its overlap, so :class:`LateIds` *claims* each new page-set
(:meth:`VirtualKVCache.claim`: mapped, any cached block moved out, scrubbed; the request may
write it at once), gathers the page ids on the device into pinned host memory, and binds them
(:meth:`VirtualKVCache.bind`) once that copy has landed: at the next forward, or at once, waiting
for the copy, before anything else can use them (a prefix hit, a free, a release).
"""

from __future__ import annotations

import weakref
from collections import deque

import numpy as np
import torch

from vattn.core.errors import VattnError
from vattn.core.uploads import HostUploads

__all__ = ["LateIds", "Landing", "HitIds", "page_cells", "copy_to_host"]


def copy_to_host(t: torch.Tensor) -> tuple[torch.Tensor, object]:
    """Start copying ``t`` into pinned host memory without waiting: ``(host, event)``; the copy
    has landed once ``event`` has (``None``: ``t`` was on the host, copied already)."""
    if t.device.type == "cpu":
        return t.clone(), None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event


def _spans(first: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(counts, indices)``: ``first[i] .. end[i] - 1`` of every ``i``, flat."""
    counts = end - first
    flat = np.repeat(first, counts) + np.arange(int(counts.sum())) \
        - np.repeat(np.cumsum(counts) - counts, counts)
    return counts, flat


def page_cells(req_to_token: torch.Tensor, page_size: int, rows: np.ndarray, first: np.ndarray,
               end: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
    """``req_to_token`` at the first token of pages ``first[i] .. end[i] - 1`` of row
    ``rows[i]``, flat (one device gather, nothing copied to the host), and the counts per row."""
    counts, pages = _spans(first, end)
    # (a device read, rare: torch's pinned copy, HostUploads without a driver)
    at_rows, at_cols = HostUploads(req_to_token.device).to_device(np.repeat(rows, counts), pages * page_size)
    cells = req_to_token[at_rows, at_cols]
    return cells, counts


class Landing:
    """Device tensors on their way to the host (:func:`copy_to_host`), handed over in order."""

    def __init__(self):
        self._queue: deque[tuple] = deque()     # (payload, host copy, event)

    def __len__(self) -> int:
        return len(self._queue)

    def push(self, payload, t: torch.Tensor) -> None:
        """Start copying ``t``; ``payload`` goes with it."""
        self._queue.append((payload, *copy_to_host(t)))

    def drain(self, wait: bool, handle) -> None:
        """``handle(payload, host)`` for each copy that has landed, oldest first (``wait``: for
        every copy, waiting for those in flight); an item leaves once handled."""
        while self._queue:
            payload, host, event = self._queue[0]
            if event is not None:
                if not wait and not event.query():
                    return
                event.synchronize()
            handle(payload, host)
            self._queue.popleft()


class LateIds:
    """Claimed page-sets waiting for their page ids, oldest first.

    Parameters
    ----------
    cache : VirtualKVCache
        The pool's cache.
    page_size : int
        SGLang's page size (a token index ``// page_size`` is its page id).
    retry : callable, optional
        ``retry(call)``: runs a cache call, retrying it while a driver call fails.
    """

    def __init__(self, cache, page_size: int, retry=None):
        self.cache, self.page_size = cache, page_size
        self.retry = retry or (lambda call: call())
        self._landing = Landing()               # payload: (slots, page-set indices)

    def __len__(self) -> int:
        return len(self._landing)

    def claim(self, req_to_token: torch.Tensor, rows: np.ndarray, slots: np.ndarray,
              low: np.ndarray, high: np.ndarray) -> None:
        """Claim page-sets ``low[i] .. high[i] - 1`` of ``slots[i]`` (request row ``rows[i]``
        writes them in the coming forward) and start copying their page ids to the host.

        Raises
        ------
        VattnError
            The pool ran short although SGLang allocated the pages (a bug, not memory pressure).
        """
        counts, index = _spans(low, high)
        slot_rep = np.repeat(slots, counts)
        for slot, i in zip(slot_rep.tolist(), index.tolist()):
            if not self.retry(lambda: self.cache.claim(slot, i)):
                raise VattnError(f"vattn could not map page-set {i} of slot {slot} although SGLang "
                                 f"allocated its page; capacity: {self.cache.capacity()}")
        ids, _ = page_cells(req_to_token, self.page_size, rows, low, high)
        self._landing.push((slot_rep, index), ids)

    def resolve(self, wait: bool) -> None:
        """Bind the claimed page-sets to their page ids, oldest first; ``wait=False`` stops at
        the first copy still in flight (SGLang's next forward: normally none is)."""
        self._landing.drain(wait, self._bind)

    def _bind(self, where, host: torch.Tensor) -> None:
        slots, index = where
        ids = (host.to(torch.int64).numpy() // self.page_size).tolist()
        items = [(s, i, [pid], 0) for s, i, pid in zip(slots.tolist(), index.tolist(), ids)]
        failed = self.retry(lambda: self.cache.bind_many(items))
        if failed:
            raise VattnError(f"vattn could not bind the claimed page-sets of slots {failed}")


class HitIds:
    """The page ids of a new request's radix-cache hit, on the host before its extend.

    When SGLang hands a request its row (``ReqToTokenPool.alloc``), the request's prefix match
    is known: ``req.last_node`` and the path of radix nodes above it (SGLang's ``TreeNode``:
    ``parent``, ``value``, a tensor of the node's token indices, whole pages). :meth:`note` starts copying
    each node's page ids to pinned host memory, once per node (kept while the node lives, and
    made again when a split gives it a new value), so the extend finds them on the host: for a
    prefix many requests share, only the first extend that hits a new node can wait for its copy,
    instead of every extend reading its hits from the device and waiting for the forward in
    flight. ``waits`` counts the copies that had not landed when needed.

    Parameters
    ----------
    page_size : int
        SGLang's page size (node values are token indices, whole pages).
    """

    def __init__(self, page_size: int):
        self.page_size = page_size
        self._nodes = weakref.WeakKeyDictionary()   # node -> (its value, host copy, event)
        self._paths: dict = {}                      # request id -> nodes of its hit, root first
        self.waits = 0

    def note(self, req) -> None:
        """Request ``req`` got its row: start copying the page ids of its hit's nodes."""
        node, rid = getattr(req, "last_node", None), getattr(req, "rid", None)
        self._paths.pop(rid, None)
        if node is None or rid is None or not len(getattr(req, "prefix_indices", ())):
            return
        path = []
        while getattr(node, "parent", None) is not None:    # the root holds nothing
            value = node.value
            if not isinstance(value, torch.Tensor):          # evicted meanwhile: read the device
                return
            known = self._nodes.get(node)
            if known is None or known[0] is not value:
                self._nodes[node] = (value, *copy_to_host(value[::self.page_size]))
            path.append(node)
            node = node.parent
        self._paths[rid] = path[::-1]

    def take(self, rid, count: int) -> list[int] | None:
        """The first ``count`` page ids of request ``rid``'s hit (``None``: not noted, or its
        nodes changed since; read them from the device)."""
        path = self._paths.pop(rid, None)
        if path is None:
            return None
        ids: list[int] = []
        for node in path:
            known = self._nodes.get(node)
            if known is None or known[0] is not node.value:
                return None
            _, host, event = known
            if event is not None and not event.query():
                self.waits += 1
                event.synchronize()
            ids.extend((host.to(torch.int64) // self.page_size).tolist())
            if len(ids) >= count:
                return ids[:count]
        return None

    def forget(self, rid) -> None:
        """Request ``rid`` left before its extend."""
        self._paths.pop(rid, None)
