"""SGLang request rows -> vattn slots, and SGLang page ids -> the page-sets they name.

SGLang's KV indices are *names*: ``page_id * page_size + offset``, handed out by its own paged
allocator and kept in ``req_to_token`` and the radix tree. One SGLang page is one vattn page-set
(``page_size`` = the tokens of one page-set), so a page id is a block key of the core
(:meth:`VirtualKVCache.bind`): the page-set that holds the page's KV. Each request row
(``req_pool_idx``) gets a vattn slot, a virtually contiguous region whose page-set ``i`` is the
one its ``i``-th page id names; a radix-tree hit maps the cached page-sets into the new region
(shared, never copied). SGLang's allocator, radix tree, eviction and preemption decide
everything; this table follows them:

* before each forward (:meth:`RequestSlots.prepare`, from the attention backend, which has the
  batch's rows and lengths): requests whose row was freed release their slot (fenced on the
  forward stream); a new row acquires a slot (the idle one where its cached prefix is still
  mapped, if any) and binds its prefix hits; every request binds the page ids it received since
  the last forward;
* a page id returns to SGLang's free list (:meth:`RequestSlots.on_free_pages`, from the
  allocator): its key is forgotten; if the request that wrote it still runs and reads it (SGLang
  frees a request's duplicate of a page another request inserted into the tree first, then points
  its row at the tree's page) the id is held back until that request's row is freed, so SGLang's
  free count stays what the pool physically holds;
* a row is freed (``ReqToTokenPool.free``, wrapped on the instance by :meth:`attach`): its held
  back ids return to SGLang, its slot is released at the next forward.

Host-side; reads ``req_to_token`` (one small device gather + copy per forward that needs page
ids, and the batch's rows).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from vattn.core.errors import ConfigError, SlotError, VattnError
from vattn.core.metrics import Histogram

#: Slot reserved for SGLang's padding row 0 and CUDA-graph padding (held by the pool).
PAD_SLOT = 0


class RequestSlots:
    """The request-row -> slot table of one vattn SGLang pool.

    Parameters
    ----------
    cache : VirtualKVCache
        The pool's cache; one SGLang page = one page-set (``layout.tokens_for(1)`` tokens).
    page_size : int
        SGLang's page size.
    """

    def __init__(self, cache, *, page_size: int):
        if cache.layout.tokens_for(1) != page_size:
            raise ConfigError(f"SGLang page_size {page_size} must equal the tokens of one vattn "
                              f"page-set ({cache.layout.tokens_for(1)})")
        self.cache, self.page_size = cache, page_size
        self.rows_per_slot = cache.layout.rows_per_slot
        self.req_to_token: torch.Tensor | None = None
        self._r2t = None
        self.slot_of = np.zeros(0, dtype=np.int64)   # row -> slot, -1: none
        self.bound = np.zeros(0, dtype=np.int64)     # row -> page-sets bound
        self._row_of: dict[int, int] = {}            # slot -> row, for rows holding a slot
        self._departed: dict[int, None] = {}         # rows freed since the last forward (ordered)
        self._held: dict[int, list[int]] = {}        # slot -> page ids held back from SGLang
        self.return_pages = None                     # the allocator's ``ids -> None``
        #: host time per forward (prepare) and per free, microseconds
        self.extend_us, self.decode_us, self.free_us = Histogram(), Histogram(), Histogram()
        self.on_idle = None                          # called when the last request leaves

    # -- wiring ------------------------------------------------------------------------------------
    def attach(self, req_to_token_pool) -> None:
        """Follow ``req_to_token_pool`` (SGLang's ``ReqToTokenPool``): size the table to its rows
        and wrap its ``free`` / ``clear`` on the instance, so a freed row is seen when it happens.

        Raises
        ------
        ConfigError
            Another request pool was attached before.
        """
        if self._r2t is req_to_token_pool:
            return
        if self._r2t is not None:
            raise ConfigError("a vattn SGLang pool serves one ReqToTokenPool; a second one was "
                              "attached")
        rows = int(req_to_token_pool.req_to_token.shape[0])
        self._r2t, self.req_to_token = req_to_token_pool, req_to_token_pool.req_to_token
        self.slot_of = np.full(rows, -1, dtype=np.int64)
        self.bound = np.zeros(rows, dtype=np.int64)
        free, clear = req_to_token_pool.free, req_to_token_pool.clear

        def free_row(req):
            row = req.req_pool_idx
            free(req)
            self.on_free_row(row)

        def clear_rows():
            clear()
            for row in np.flatnonzero(self.slot_of >= 0).tolist():
                self.on_free_row(row)

        req_to_token_pool.free, req_to_token_pool.clear = free_row, clear_rows

    # -- SGLang's frees ------------------------------------------------------------------------------
    def on_free_row(self, row: int) -> None:
        """Row ``row``'s request left: return the ids held back for it; release at next forward."""
        if row is None or not 0 <= row < self.slot_of.size or self.slot_of[row] < 0:
            return
        self._departed[row] = None
        held = self._held.pop(int(self.slot_of[row]), None)
        if held:
            self.return_pages(np.asarray(held, dtype=np.int64))

    def on_free_pages(self, ids: np.ndarray) -> np.ndarray:
        """SGLang freed page ids ``ids``: forget their keys; returns the ids SGLang may hand out
        again now (the others come back when the request still reading them leaves)."""
        start = time.perf_counter()
        ids = np.asarray(ids, dtype=np.int64)
        keys = ids.tolist()
        readers = [h if h is not None and self._reads(h) else None
                   for h in self.cache.active_home(keys)]
        self.cache.forget(keys)
        for pid, slot in zip(keys, readers):
            if slot is not None:
                self._held.setdefault(slot, []).append(pid)
        keep = np.fromiter((slot is None for slot in readers), dtype=bool, count=len(readers))
        self.free_us.observe((time.perf_counter() - start) * 1e6)
        return ids[keep]

    def _reads(self, slot: int) -> bool:
        """Whether a request that has not left holds ``slot``."""
        row = self._row_of.get(slot)
        return row is not None and row not in self._departed

    @property
    def live(self) -> int:
        """Request rows holding a slot."""
        return len(self._row_of)

    def running_slots(self) -> frozenset:
        """Slots of requests that have not left."""
        return frozenset(s for s, row in self._row_of.items() if row not in self._departed)

    def held_pages(self) -> int:
        """Page ids held back from SGLang's free list (their writers still read them)."""
        return sum(map(len, self._held.values()))

    def reset(self) -> None:
        """Release every slot and forget every key (SGLang's flush: allocator ``clear``)."""
        for row in np.flatnonzero(self.slot_of >= 0).tolist():
            self._departed[row] = None
        self._release_departed()
        self._held.clear()

    # -- before each forward ------------------------------------------------------------------------
    def last_page_ids(self, rows: torch.Tensor, seq_lens) -> tuple[np.ndarray, np.ndarray]:
        """Host ``(rows, id of each request's last page)`` of a decode batch: one gather, one
        copy (``rows`` may live on the device)."""
        cols = (torch.as_tensor(seq_lens, dtype=torch.int64) - 1) // self.page_size * self.page_size
        rows = rows.to(torch.int64)
        last = self.req_to_token[rows, cols.to(rows.device)].to(torch.int64)
        host = torch.stack([rows, last]).cpu().numpy()
        return host[0], host[1] // self.page_size

    def prepare(self, rows, seq_lens, prefix_lens=None, *, last_pages=None) -> np.ndarray:
        """Slots of the batch's requests, with every page id they hold bound.

        Parameters
        ----------
        rows : sequence of int
            ``req_pool_indices`` of the batch (host).
        seq_lens : sequence of int
            Tokens of each request after this forward.
        prefix_lens : sequence of int, optional
            Extend: tokens already cached (``extend_prefix_lens``); a new row's are prefix hits
            (page-aligned: SGLang matches whole pages). ``None``: decode.
        last_pages : sequence of int, optional
            Decode: the page id of each request's last page (:meth:`last_page_ids`); spares the
            gather when each request needs at most that one.

        Returns
        -------
        numpy.ndarray
            ``int64[B]`` slots.

        Raises
        ------
        SlotError
            A new row whose prefix is not whole pages, a decode of a row that never had an
            extend, or a hit on a page id no page-set holds.
        VattnError
            The pool ran short although SGLang allocated the pages (vattn and SGLang disagree:
            a bug, not memory pressure).
        """
        start = time.perf_counter()
        if self.req_to_token is None:
            raise ConfigError("RequestSlots.prepare before attach(req_to_token_pool)")
        self._release_departed()
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        seq = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
        if not rows.size:
            return rows
        ps = self.page_size
        want = -(-seq // ps)
        new = self.slot_of[rows] < 0
        first = np.where(new, 0, self.bound[rows])
        need = np.flatnonzero(want > first)
        if last_pages is not None and (want[need] - first[need] == 1).all():
            ids = [[int(x)] for x in np.asarray(last_pages, dtype=np.int64)[need]]
        else:
            ids = self._page_ids(rows[need], first[need], want[need])
        hits = np.zeros(rows.size, dtype=np.int64)
        if new.any():
            if prefix_lens is None:
                raise SlotError(f"decode of request rows {rows[new].tolist()} that never had "
                                 "an extend forward")
            prefix = np.asarray(prefix_lens, dtype=np.int64).reshape(-1)
            if (prefix[new] % ps).any():
                raise SlotError(f"new request rows {rows[new].tolist()} start after prefixes "
                                 f"{prefix[new].tolist()}, not whole pages of {ps}")
            hits[new] = prefix[new] // ps
            self._acquire(rows, seq, new, hits, need, ids)
        items = [(int(self.slot_of[rows[i]]), int(first[i]), page_ids, int(hits[i]))
                 for i, page_ids in zip(need.tolist(), ids)]
        failed = self.cache.bind_many(items) if items else []
        if failed:
            raise VattnError(f"vattn could not map the page-sets of slots {failed} although SGLang "
                             f"allocated their pages; capacity: {self.cache.capacity()}")
        self.bound[rows[need]] = want[need]
        slots = self.slot_of[rows]
        self.cache.step(slots, seq)              # lengths, and pages mapped ahead in the background
        hist = self.decode_us if prefix_lens is None else self.extend_us
        hist.observe((time.perf_counter() - start) * 1e6)
        return slots

    def _page_ids(self, rows: np.ndarray, first: np.ndarray, want: np.ndarray) -> list[list[int]]:
        """Page ids ``first .. want - 1`` of each row, from ``req_to_token`` (one gather)."""
        if not rows.size:
            return []
        counts = want - first
        offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        cols = (np.repeat(first, counts) + offsets) * self.page_size
        dev = self.req_to_token.device
        flat = self.req_to_token[torch.from_numpy(np.repeat(rows, counts)).to(dev),
                                 torch.from_numpy(cols).to(dev)]
        ids = (flat.to("cpu", torch.int64) // self.page_size).numpy()
        return [part.tolist() for part in np.split(ids, np.cumsum(counts)[:-1])]

    def _acquire(self, rows, seq, new, hits, need, ids) -> None:
        """Slots for the new rows; a row with prefix hits prefers the idle slot where the last
        hit page was mapped (a repeated prompt, the next turn of a conversation)."""
        ids_of = dict(zip(need.tolist(), ids))
        for i in np.flatnonzero(new).tolist():
            h = int(hits[i])
            prefer = ids_of[i][h - 1] if h and i in ids_of else None
            slot = self.cache.acquire(expected_len=int(seq[i]), prefer=prefer)
            self.slot_of[rows[i]] = slot
            self.bound[rows[i]] = 0
            self._row_of[slot] = int(rows[i])

    def _release_departed(self) -> None:
        if not self._departed:
            return
        for row in self._departed:
            slot = int(self.slot_of[row])
            if slot >= 0:
                self._held.pop(slot, None)
                self.cache.release(slot)
                self.slot_of[row], self.bound[row] = -1, 0
                del self._row_of[slot]
        self._departed.clear()
        if not self.live and self.on_idle is not None:
            self.on_idle()
