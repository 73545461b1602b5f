"""SGLang request rows -> vattn slots, and SGLang page ids -> the page-sets they name.

SGLang's KV indices are *names*: ``page_id * page_size + offset``, handed out by its own paged
allocator and kept in ``req_to_token`` and the radix tree. One SGLang page is one vattn page-set
(``page_size`` = the tokens of one page-set), so a page id is a block key of the core
(:meth:`VirtualKVCache.bind`): the page-set that holds the page's KV. Each request row
(``req_pool_idx``) gets a vattn slot, a virtually contiguous region whose page-set ``i`` is the
one its ``i``-th page id names; a radix-tree hit maps the cached page-sets into the new region
(shared, never copied). SGLang's allocator, radix tree, eviction and preemption decide
everything; this table follows them:

* before each forward (:meth:`RowSlots.prepare`, from the attention backend, which has the
  batch's rows and lengths): requests whose row was freed release their slot (fenced on the
  forward stream); a new row acquires a slot (the idle one where its cached prefix is still
  mapped, if any) and maps its prefix hits; a page a request starts writing is *claimed*
  (:meth:`VirtualKVCache.claim`) and its page id, gathered on the device into pinned host
  memory, is bound one forward later, or at once before anything else can use it (a prefix hit,
  a free, a release). The rows come from the batch's request ids (learnt when
  ``ReqToTokenPool.alloc`` hands a row out) and the page ids of prefix hits from the radix nodes
  matched (copied to the host at that same moment, :class:`.late_ids.HitIds`), so nothing is read
  from the device: SGLang's overlap scheduler keeps the GPU busy only if the host does not wait
  for it between two steps;
* a page id returns to SGLang's free list (:meth:`RowSlots.on_free_pages`, from the
  allocator): its key is forgotten; if the request that wrote it still runs and reads it (SGLang
  frees a request's duplicate of a page another request inserted into the tree first, then points
  its row at the tree's page) the id is held back until that request's row is freed, so SGLang's
  free count stays what the pool physically holds;
* a row is freed (``ReqToTokenPool.free``, wrapped on the instance by :meth:`attach`): its held
  back ids return to SGLang, its slot is released at the next forward.

Host-side; a forward reads from the device only what was not learnt ahead (the rows of a batch
whose request ids are unknown, hit page ids not copied at row allocation: ``device_reads``).
"""

from __future__ import annotations

import contextlib
import time
from operator import itemgetter

import numpy as np
import torch

from vattn.core import step_trace
from vattn.core.config import DRIVER_RETRIES_ENV, driver_retries
from vattn.core.config import defer_mapping as defer_mapping_env
from vattn.core.config import stage_prefixes as stage_prefixes_env
from vattn.core.device_wait import DeviceWait
from vattn.core.errors import ConfigError, DriverRetry, SlotError, VattnError
from vattn.core.metrics import Histogram
from vattn.core.staging import PrefixBursts

from .late_ids import HitIds, LateIds, page_cells

#: Slot reserved for SGLang's padding row 0 and CUDA-graph padding (held by the pool).
PAD_SLOT = 0


#: the parts of :meth:`RowSlots.prepare` timed apart (``phase_ms``): binding the page ids that
#: landed, releasing departed rows, prefix hits (ids, the wait for them, mapping them), new
#: rows' slots, claiming the pages given since the last forward, the core's step
PHASES = ("resolve", "release", "hits", "acquire", "claim", "step")


class _Laps:
    """Adds the time since the last lap to ``into[name]`` (milliseconds)."""

    __slots__ = ("into", "last")

    def __init__(self, into: dict, start: float):
        self.into, self.last = into, start

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.into[name] += (now - self.last) * 1e3
        self.last = now

class RowSlots:
    """The request-row -> slot table of one vattn SGLang pool.

    Parameters
    ----------
    cache : VirtualKVCache
        The pool's cache; one SGLang page = one page-set (``layout.tokens_for(1)`` tokens).
    page_size : int
        SGLang's page size.
    retries : int, optional
        Times a cache call whose driver call failed is retried within a forward (default
        ``$VATTN_DRIVER_RETRIES`` or 2); past that the :class:`DriverError` propagates: SGLang
        has no way for the attention backend to preempt one request, so the step fails.
    stage_prefixes : bool, optional
        Map a prefix that new requests keep hitting into empty idle slots ahead of the next
        ones (:meth:`VirtualKVCache.stage_prefix`, :class:`~vattn.core.staging.PrefixBursts`);
        default ``$VATTN_STAGE_PREFIXES``, else on without packs and off with them. Only with
        map-ahead on (the GPU default): the worker maps while the device computes.
    defer_mapping : bool, optional
        Queue the VMM calls of :meth:`prepare` per VA range (:meth:`VirtualKVCache.deferred`)
        and make them as the forward reaches each range (:meth:`ready`, from the attention
        backend), so the device computes the layers before while the host maps; default
        ``$VATTN_DEFER_MAPPING`` (0 until a GPU run measures it here).
    """

    def __init__(self, cache, *, page_size: int, retries: int | None = None,
                 stage_prefixes: bool | None = None, defer_mapping: bool | None = None):
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
        self._row_of_rid: dict[str, int] = {}        # request id -> row (learnt at its extend)
        self._rid_of_row: dict[int, str] = {}
        #: runs a cache call, retried while a driver call fails (``retried``: a metric)
        self.retry = DriverRetry(driver_retries(retries),
                                 f"{DRIVER_RETRIES_ENV}; SGLang cannot preempt one request from the "
                                 "attention backend")
        self.late = LateIds(cache, page_size, self.retry)   # page-sets claimed, ids not bound yet
        # with packs, off unless asked for: staging maps a burst's prefix page by page into idle
        # slots, so the packs never serve it (`vattn bench radix`: 3.2x the maps, 5.9x the
        # access calls of packs alone)
        wanted = stage_prefixes_env(not cache.config.pack_pages) if stage_prefixes is None else stage_prefixes
        self.staging = bool(wanted) and cache.config.map_ahead_tokens > 0
        self._bursts = PrefixBursts()
        self.defer_mapping = bool(defer_mapping_env(False) if defer_mapping is None else defer_mapping)
        self.hit_ids = HitIds(page_size)             # radix hits' page ids, copied at alloc
        #: reads from the device that waited for it: the rows of a batch with an unknown request
        #: id, hit page ids not copied ahead (with SGLang's request ids: none)
        self.device_reads = 0
        self.return_pages = None                     # the allocator's ``ids -> None``
        #: host time per forward (prepare) and per free, microseconds
        self.extend_us, self.decode_us, self.free_us = Histogram(), Histogram(), Histogram()
        #: host ms per part of :meth:`prepare`, summed, for extends and decodes apart (the
        #: histograms above give each call's total)
        self.phase_ms = {mode: dict.fromkeys(PHASES, 0.0) for mode in ("extend", "decode")}
        self.on_idle = None                          # called when the last running request leaves
        self.on_step = None                          # called after each forward's preparation
        #: ``$VATTN_STEP_TRACE``: one row per forward's preparation (host ms, the device's idle
        #: ms behind it, requests admitted, driver calls), written whenever the engine goes idle
        self.trace = step_trace.from_env(lambda: cache.counters)
        cuda = torch.device(cache.config.torch_device).type == "cuda"
        self.device_wait = DeviceWait(self.trace is not None and cuda,
                                      sink=None if self.trace is None else self.trace.idle,
                                      make_event=getattr(cache.driver, "timing_event", None))

    # -- wiring ------------------------------------------------------------------------------------
    def attach(self, req_to_token_pool) -> None:
        """Follow ``req_to_token_pool`` (SGLang's ``ReqToTokenPool``): size the table to its rows
        and wrap its ``alloc`` / ``free`` / ``clear`` on the instance, so each row's request id is
        known when SGLang hands the row out (forwards then name rows by request id, nothing read
        from the device) and a freed row is seen when it happens.

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
        alloc, free, clear = req_to_token_pool.alloc, req_to_token_pool.free, req_to_token_pool.clear

        def alloc_rows(reqs, *args, **kwargs):
            out = alloc(reqs, *args, **kwargs)
            if out is not None:
                for req in reqs:
                    self._learn(getattr(req, "rid", None), req.req_pool_idx)
                    self.hit_ids.note(req)
            return out

        def free_row(req):
            row = req.req_pool_idx
            free(req)
            self.on_free_row(row)

        def clear_rows():
            clear()
            for row in np.flatnonzero(self.slot_of >= 0).tolist():
                self.on_free_row(row)

        req_to_token_pool.alloc = alloc_rows
        req_to_token_pool.free, req_to_token_pool.clear = free_row, clear_rows

    def _learn(self, rid, row) -> None:
        """Request ``rid`` holds row ``row`` now."""
        if rid is None or row is None:
            return
        old = self._rid_of_row.get(row)
        if old is not None and self._row_of_rid.get(old) == row:
            del self._row_of_rid[old]
        self._row_of_rid[rid], self._rid_of_row[row] = int(row), rid

    # -- SGLang's frees ------------------------------------------------------------------------------
    def on_free_row(self, row: int) -> None:
        """Row ``row``'s request left: return the ids held back for it; release at next forward."""
        rid = self._rid_of_row.pop(row, None)
        if rid is not None and self._row_of_rid.get(rid) == row:
            del self._row_of_rid[rid]
        self.hit_ids.forget(rid)
        if row is None or not 0 <= row < self.slot_of.size or self.slot_of[row] < 0:
            return
        self._departed[row] = None
        held = self._held.pop(int(self.slot_of[row]), None)
        if held:
            self.return_pages(np.asarray(held, dtype=np.int64))
        if len(self._departed) == len(self._row_of):  # the last running request left
            if self.trace is not None:
                self.trace.write()
            if self.on_idle is not None:
                self.on_idle()

    def on_free_pages(self, ids: np.ndarray) -> np.ndarray:
        """SGLang freed page ids ``ids``: forget their keys; returns the ids SGLang may hand out
        again now (the others come back when the request still reading them leaves)."""
        start = time.perf_counter()
        self.late.resolve(wait=True)                 # a claimed page may be among them
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
        self.late.resolve(wait=True)
        for row in np.flatnonzero(self.slot_of >= 0).tolist():
            self._departed[row] = None
        self._release_departed()
        self._held.clear()
        self._row_of_rid.clear()
        self._rid_of_row.clear()
        self.hit_ids = HitIds(self.page_size)        # SGLang's flush drops its radix tree too

    # -- before each forward ------------------------------------------------------------------------
    def _rows_of_rids(self, rids) -> np.ndarray | None:
        if rids is None:
            return None
        if not rids:
            return np.empty(0, dtype=np.int64)
        try:       # one C-level lookup of every id (a generator costs ~7x as much per decode step)
            return np.array(itemgetter(*rids)(self._row_of_rid), dtype=np.int64, ndmin=1)
        except KeyError:
            return None

    def prepare(self, rows, seq_lens, prefix_lens=None, *, rids=None) -> np.ndarray:
        """Slots of the batch's requests: departed rows released, new rows given slots with their
        prefix hits mapped, and every page they were given since the last forward claimed (its
        id is bound later, :class:`.late_ids.LateIds`).

        Nothing is read from the device unless ``rids`` does not name every row (then the rows,
        and the hit page ids; ``device_reads`` counts them), and the host waits for the device
        only before binding prefix hits (a hit may name a page claimed by an earlier forward
        whose id is still on its way): SGLang's overlap scheduler prepares the next step while
        this one runs, and a wait would cost it that.

        Parameters
        ----------
        rows : sequence of int or torch.Tensor
            ``req_pool_indices`` of the batch; read only when ``rids`` does not name every row
            (a device tensor is then copied to the host).
        seq_lens : sequence of int
            Tokens of each request after this forward.
        prefix_lens : sequence of int, optional
            Extend: tokens already cached (``extend_prefix_lens``); a new row's are prefix hits
            (page-aligned: SGLang matches whole pages). ``None``: decode.
        rids : sequence of str, optional
            The batch's request ids (rows were learnt when SGLang allocated them, :meth:`attach`).

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
        if self.req_to_token is None:
            raise ConfigError("RowSlots.prepare before attach(req_to_token_pool)")
        with step_trace.section(self.trace, self.device_wait, steps=len(seq_lens),
                                binds=len(seq_lens) if prefix_lens is not None else 0):
            with self.cache.deferred() if self.defer_mapping else contextlib.nullcontext():
                return self._prepare(rows, seq_lens, prefix_lens, rids)

    def ready(self, layer: int | None = None) -> None:
        """Make the VMM calls :meth:`prepare` deferred for the ranges ``layer`` reads (and those
        before them; every range with ``None``): from the attention backend before a layer's
        store and attention, and before a CUDA-graph replay. Cheap when none wait; a failed
        call is final (:class:`~vattn.core.deferred.DeferredCallError`)."""
        self.cache.issue(layer)

    def _prepare(self, rows, seq_lens, prefix_lens, rids) -> np.ndarray:
        start = time.perf_counter()
        lap = _Laps(self.phase_ms["decode" if prefix_lens is None else "extend"], start)
        self.late.resolve(wait=False)                # bind what has landed
        lap("resolve")
        self._release_departed()
        lap("release")
        known = self._rows_of_rids(rids)
        if known is None:
            self.device_reads += isinstance(rows, torch.Tensor)
            known = rows.tolist() if isinstance(rows, torch.Tensor) else rows
            for row, rid in zip(known, rids if rids is not None else ()):
                self._learn(rid, row)
        rows = np.asarray(known, dtype=np.int64).reshape(-1)
        seq = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
        if not rows.size:
            return rows
        ps = self.page_size
        want = -(-seq // ps)
        new = self.slot_of[rows] < 0
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
        hit_at = np.flatnonzero(hits)            # the only page ids needed before the forward
        hit_ids = self._hits(rows[hit_at], hits[hit_at],
                             None if rids is None else [rids[i] for i in hit_at.tolist()])
        if hit_at.size:
            self.late.resolve(wait=True)         # a hit may name a page claimed earlier
        lap("hits")
        if new.any():
            self._acquire(rows, seq, new, dict(zip(hit_at.tolist(), hit_ids)))
        lap("acquire")
        slots = self.slot_of[rows]
        if hit_at.size:
            items = [(int(slots[i]), 0, ids, len(ids)) for i, ids in zip(hit_at.tolist(), hit_ids)]
            failed = self.retry(lambda: self.cache.bind_many(items))
            if failed:
                raise VattnError(f"vattn could not map the page-sets of slots {failed} although "
                                 f"SGLang allocated their pages; capacity: {self.cache.capacity()}")
            if self.staging:                    # queued for the map-ahead worker
                for keys, copies in self._bursts.observe(items):
                    self.cache.stage_prefix(keys, copies)
        lap("hits")
        low = np.where(new, hits, self.bound[rows])
        need = np.flatnonzero(want > low)
        if need.size:
            self.late.claim(self.req_to_token, rows[need], slots[need], low[need], want[need])
        self.bound[rows[need]] = want[need]
        lap("claim")
        self.retry(lambda: self.cache.step(slots, seq))   # lengths; pages mapped ahead in the background
        lap("step")
        hist = self.decode_us if prefix_lens is None else self.extend_us
        hist.observe((time.perf_counter() - start) * 1e6)
        if self.on_step is not None:
            self.on_step()
        return slots

    def _hits(self, rows: np.ndarray, counts: np.ndarray, rids) -> list[list[int]]:
        """The hit page ids of new rows: copied to the host when SGLang handed out their rows
        (:class:`.late_ids.HitIds`), else read from the device (one gather for those left)."""
        found = [self.hit_ids.take(rid, int(n)) for rid, n in zip(rids, counts)] if rids \
            else [None] * rows.size
        left = [j for j, ids in enumerate(found) if ids is None]
        if left:
            for j, ids in zip(left, self._page_ids(rows[left], counts[left])):
                found[j] = ids
        return found

    def _page_ids(self, rows: np.ndarray, want: np.ndarray) -> list[list[int]]:
        """Page ids ``0 .. want - 1`` of each row, from ``req_to_token`` (one gather, one copy to
        the host, waiting for the device)."""
        self.device_reads += 1
        flat, counts = page_cells(self.req_to_token, self.page_size, rows, np.zeros_like(want), want)
        ids = (flat.to("cpu", torch.int64) // self.page_size).numpy()
        return [part.tolist() for part in np.split(ids, np.cumsum(counts)[:-1])]

    def _acquire(self, rows, seq, new, hit_ids: dict) -> None:
        """Slots for the new rows; a row with prefix hits prefers the idle slot where the last
        hit page was mapped (a repeated prompt, the next turn of a conversation)."""
        for i in np.flatnonzero(new).tolist():
            ids = hit_ids.get(i)
            slot = self.retry(lambda: self.cache.acquire(expected_len=int(seq[i]),
                                                         prefix=ids or ()))
            self.slot_of[rows[i]] = slot
            self.bound[rows[i]] = 0
            self._row_of[slot] = int(rows[i])

    def _release_departed(self) -> None:
        if not self._departed:
            return
        self.late.resolve(wait=True)                 # a released slot's pages keep their names
        for row in self._departed:
            slot = int(self.slot_of[row])
            if slot >= 0:
                self._held.pop(slot, None)
                self.cache.release(slot)
                self.slot_of[row], self.bound[row] = -1, 0
                del self._row_of[slot]
        self._departed.clear()
