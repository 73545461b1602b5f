"""VirtualKVCache: every request's KV is virtually contiguous; pages are committed as it grows.

Host-side methods (``acquire``, ``ensure``, ``step``, ``release``, ``wait``, ...) may synchronize
and must not run inside a CUDA graph capture. The tensors returned by ``k``/``v``/``k_rows``/
``v_rows`` are fixed for the cache's lifetime, so kernels reading them can be captured.

The class is the public facade: it checks arguments, holds the lock and hands the work to its
parts, each built on one shared :class:`~vattn.core.state.CacheState`: admission (which slot a
request gets), growth (mapping pages as requests grow), binding (page-sets named by an engine's
block keys), reclaim (taking pages back), accounting (capacity, metrics, audit), the address
space (views and page-set copies) and the map-ahead worker.
"""

from __future__ import annotations

import contextlib
import threading
import time

import torch

from .accounting import Capacity, audit, capacity, gauges
from .admission import Admission
from .binding import Binding, hits_waiting
from .checks import batch_arrays, check_batch, check_bind, check_index, check_length, check_slot
from .config import KVCacheConfig
from .deferred import DeferredCalls
from .driver import get_driver
from .errors import ConfigError, DriverError, SlotError, VattnError
from .growth import Growth
from .keys import BlockKeys
from .layout import KVLayout, cache_layout_row
from .loose import LooseSets
from .mapahead import MapAhead
from .metrics import Counters, prometheus_collector
from .packs import Packs
from .pages import PagePool, budget_pages
from .paging import SlotPages
from .reclaim import Reclaim
from .space import AddressSpace
from .staging import Staging
from .state import CacheState

__all__ = ["VirtualKVCache", "Capacity"]


class VirtualKVCache:
    """A KV cache whose slots are virtually contiguous regions backed page by page.

    Parameters
    ----------
    config : KVCacheConfig
        Shape, layout, budget and policies.
    driver : Driver, optional
        Backend override (e.g. a :class:`~vattn.core.driver.FaultInjector`); default from
        ``config.device``.
    """

    def __init__(self, config: KVCacheConfig, *, driver=None):
        if not isinstance(config, KVCacheConfig):
            raise ConfigError(f"VirtualKVCache needs a KVCacheConfig, got {type(config).__name__}")
        self.config = cfg = config
        self._owns_driver = driver is None      # a driver we created is closed with the cache
        self.driver = driver or get_driver(cfg.torch_device, granularity=cfg.page_bytes)
        try:
            page = self._plan(cfg)
            num_pages = budget_pages(self.driver, cfg.page_budget, page, self.layout.num_ranges)
            self._pool = PagePool(self.driver, page_bytes=page, num_pages=num_pages)
        except BaseException:
            self._close_driver()
            raise
        try:
            self._setup()
        except BaseException:
            self._abandon()
            raise

    def _plan(self, cfg: KVCacheConfig) -> int:
        """Check the page size and the address space; set the layout; return the page bytes."""
        page = cfg.page_bytes or self.driver.granularity
        if page % self.driver.granularity:
            raise ConfigError(f"page_bytes must be a multiple of the driver granularity "
                              f"{self.driver.granularity}, got {page}")
        self.layout = KVLayout.from_config(cfg, page)
        self._space = AddressSpace(self.driver, self.layout)
        return page

    def _setup(self) -> None:
        """Reserve the address space, build the parts, map the padding slot's page-set."""
        cfg, lay = self.config, self.layout
        self._space.reserve(cfg.dtype)
        self._counters = Counters()
        # every part maps through this: a window (deferred()) queues the calls per range
        self._calls = calls = DeferredCalls(self.driver, base=self._space.base, range_bytes=lay.range_bytes,
                                            num_ranges=lay.num_ranges, counters=self._counters)
        self._space.driver = calls
        self._pages = SlotPages(cfg, lay, calls, self._pool, self._space.bases, self._counters)
        if cfg.pack_pages:
            self._pages.packs = Packs(calls, self._pool, sizes=cfg.pack_sizes, budget_pages=cfg.pack_pages,
                                      num_ranges=lay.num_ranges, page_bytes=lay.page_bytes)
            self._pages.run_bytes = self._space.run_bytes
        self._keys = BlockKeys(self._pool, self._pages.bound)
        if self._pages.packs is not None:
            self._keys.on_bind = self._pages.packs.fresh.update
        self._cond = threading.Condition(threading.RLock())
        calls.on_empty = self._cond.notify_all    # the map-ahead worker may plan again
        self._state = state = CacheState(cfg, lay, calls, self._pool, self._pages, self._keys,
                                         self._counters, self._cond)
        loose = LooseSets(state)
        self._admission = Admission(state)
        self._reclaim = Reclaim(state)
        self._growth = Growth(state, self._reclaim, loose)
        self._binding = Binding(state, self._growth, loose, self._space)
        self._staging = Staging(state)
        self._worker: MapAhead | None = None
        self._closed = False
        self.padding_slot = cfg.max_slots
        state.slots.active[self.padding_slot] = True
        if not self._pages.grow(self.padding_slot, 1, None, ahead=False):
            raise ConfigError("page budget too small for the padding slot")

    def _abandon(self) -> None:
        """Undo a half-built cache: unmap, free the VA and the pages (best effort, then raise)."""
        pages = getattr(self, "_pages", None)
        if pages is not None:
            for slot in range(self.layout.num_va_slots):
                pages.trim(slot, 0)
        self._space.free()
        self._pool.close()
        self._close_driver()

    def _close_driver(self) -> None:
        """Close the driver if this cache created it (its fds and handles go with it)."""
        if self._owns_driver and hasattr(self.driver, "close"):
            self.driver.close()

    # the slot records tests and tools inspect (owned by the shared state)
    _active = property(lambda self: self._state.slots.active)
    _length = property(lambda self: self._state.slots.length)
    _bound_sets = property(lambda self: self._state.slots.bound_sets)
    _inflight = property(lambda self: self._state.slots.inflight)

    # -- views (fixed for the cache's lifetime) ------------------------------------------------
    def k(self, layer: int) -> torch.Tensor:
        """K of ``layer``: ``[max_slots + 1, rows_per_slot, H, D]``, last dim contiguous."""
        return self._view(layer, "k")

    def v(self, layer: int) -> torch.Tensor:
        """V of ``layer``: ``[max_slots + 1, rows_per_slot, H, D]``."""
        return self._view(layer, "v")

    def k_rows(self, layer: int) -> torch.Tensor:
        """K of ``layer`` flattened: ``[(max_slots + 1) * rows_per_slot, H, D]``."""
        return self.k(layer).flatten(0, 1)

    def v_rows(self, layer: int) -> torch.Tensor:
        return self.v(layer).flatten(0, 1)

    def _view(self, layer: int, which: str) -> torch.Tensor:
        self._check_open()
        return self._space.view(layer, which)

    # -- slot lifecycle --------------------------------------------------------------------------
    def acquire(self, *, tenant=None, expected_len: int = 0, prefix=(), home=None) -> int:
        """Hand out an idle slot, preferring the warm one whose pages best fit ``expected_len``.

        ``prefix``: the block keys of the request's prefix-cache hit, in order (what it will
        :meth:`bind` as hits). The idle slot where the last of them was last mapped is handed out
        first: a request that ran there before (a repeated prompt, the next turn of a
        conversation) finds its whole prefix in place and needs no mapping at all. Else the idle
        slot needing the fewest VMM calls for the hit (one starting with the same prefix, or one
        with few pages where the shared page-sets go). ``home``: a block key whose slot to prefer
        before the last hit's, when the hit is in place there too (the cached block a
        copy-on-write reads, right after the hit: the request's fresh block goes in its place
        and the copy is elided).

        Raises
        ------
        SlotError
            Every slot is in use.
        ContextLengthError
            ``expected_len`` exceeds ``max_context``.
        """
        self._check_open()
        self._check_length(expected_len)
        with self._cond:
            slot = self._admission.acquire(tenant, expected_len, tuple(prefix), home)
            self._staging.drop(slot)
            return slot

    def release(self, slot: int, *, fence=None) -> None:
        """Finish the request in ``slot``; its pages stay mapped until memory pressure.

        ``fence`` (default: recorded now on the current stream) must complete before any of
        the slot's pages may be unmapped.
        """
        self._check_active(slot)
        with self._cond:
            self._admission.release(slot, fence if fence is not None else self._calls.record_fence())
            self._binding.released(slot)
            if self._worker is not None:
                self._worker.cancel(slot)

    # -- paging ------------------------------------------------------------------------------------
    def prewarm(self, tokens_per_slot: int | None = None, *, min_tokens: int = 2048,
                cold_slots: int = 0) -> int:
        """Map page-sets to the idle slots now, so the requests that take them start warm.

        Idle slots are topped up to ``tokens_per_slot``, lowest slot first, until the pool runs
        out. The default is an even share of the free pool over the idle slots, but at least
        ``min_tokens`` deep: a pool that would spread thinner (many slots, as an engine's default
        ``max_num_seqs`` gives) goes to fewer slots, which admission hands out first (the
        warmest), so a first batch finds its pages in place instead of moving them out of slots
        nobody uses; slots left empty suit a request whose prefix-cache hit is mapped in (no
        pages of its own to unmap there). The pages stay reclaimable like any warm slot's
        (:meth:`reclaim`, or a slot that needs more). For engines whose pool is sized up front
        (vLLM, SGLang): the mapping then happens once, at start, instead of on the step's
        critical path. ``cold_slots``: the last that many idle slots stay empty, their share
        left free in the pool — for requests whose prefix-cache hit is mapped in, which take an
        empty slot over a warm one (no pages of their own to unmap where the hit goes) and map
        their fresh page-sets from the free pool. Returns the pages mapped.

        Raises
        ------
        ContextLengthError
            ``tokens_per_slot`` exceeds ``max_context``.
        ConfigError
            ``min_tokens`` or ``cold_slots`` is not an int >= 0.
        """
        self._check_open()
        if tokens_per_slot is not None:
            self._check_length(tokens_per_slot)
        if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
            raise ConfigError(f"min_tokens must be an int >= 0, got {min_tokens!r}")
        if isinstance(cold_slots, bool) or not isinstance(cold_slots, int) or cold_slots < 0:
            raise ConfigError(f"cold_slots must be an int >= 0, got {cold_slots!r}")
        with self._cond:
            return self._growth.prewarm(tokens_per_slot, min(min_tokens, self.config.max_context),
                                        cold_slots)

    def ensure(self, lengths, lengths_seq=None) -> list[int]:
        """Map pages so every listed slot holds its length; return the slots that could not grow.

        ``lengths`` is ``{slot: num_tokens}``, or pass two sequences (lists, numpy arrays or CPU
        tensors) ``ensure(slots, lengths)``. A slot that fails keeps what it had; the engine should
        preempt it. When every slot already has its pages (the steady state with map-ahead) this
        is a few vectorised comparisons and makes no driver call.
        """
        start = time.perf_counter()
        slots, lens = batch_arrays(lengths, lengths_seq)
        with self._cond:
            self._check_open()
            check_batch(slots, lens, self._state.slots.active, self.config)
            self._pages.fill_packs()
            failed = self._growth.ensure(slots, lens)
            if self._pages.packs is not None:
                self._pages.packs.next_step()   # the engine's step is prepared: its forward next
            self._state.seal_fence()            # the step's copy-on-write copies
        self._counters.ensure_us.observe((time.perf_counter() - start) * 1e6)
        return failed

    def step(self, lengths, lengths_seq=None) -> list[int]:
        """:meth:`ensure`, then map each ok slot ``map_ahead_tokens`` further in the background
        (and, with ``free_reserve``, free the pool back up to it there)."""
        slots, lens = batch_arrays(lengths, lengths_seq)
        failed = self.ensure(slots, lens)
        if not self.config.map_ahead_tokens:
            return failed
        targets = self._growth.ahead_targets(slots, lens, failed)
        refill = self._pool.num_free < self.config.free_reserve
        if targets or refill:
            with self._cond:
                worker = self._started_worker()
                if targets:
                    worker.submit(targets)
                if refill:
                    worker.poke()              # the free reserve, refilled while the device computes
        return failed

    def _started_worker(self) -> MapAhead:
        """The map-ahead worker, started on first use (caller holds the lock)."""
        if self._worker is None:
            self._worker = MapAhead(self._cond, driver=self._calls, slots=self._state.slots,
                                    pages=self._pages, take=self._reclaim.take_unfenced,
                                    staging=self._staging,
                                    refill=self._growth.refill if self.config.free_reserve else None)
        return self._worker

    def wait(self) -> None:
        """Block until the map-ahead worker has nothing left to do."""
        with self._cond:
            self._calls.issue()                     # the worker plans nothing while calls wait
            while self._worker is not None and not self._worker.idle():
                self._cond.wait()

    # -- deferred mapping: a step's VMM calls made as the forward reaches each range --------------
    @contextlib.contextmanager
    def deferred(self, copies: bool = True):
        """Within the block, the calling thread's map, access and unmap calls on the cache's
        ranges are queued per range instead of made; the record changes as if they were made.
        :meth:`issue` makes them, range by range (an engine calls it before each layer's KV is
        written or read); any other call that touches memory or the stream (a scrub, a fence,
        :meth:`wait`, the next window) makes everything queued first. Nothing may read a page
        through the views between the window and the :meth:`issue` that covers its layer.
        The cache's page-set copies (a block moved out of a slot's way, a copy-on-write) are
        queued per range too; with ``copies=False`` they are queued only behind calls already
        waiting or where the driver batches copies, else made at once — for a step whose forward
        makes every range's calls before it starts (a replayed full CUDA graph), where queuing
        them one by one would only add host work.

        See :mod:`vattn.core.deferred` (``DeferredCallError``: a queued call failed when made).
        """
        self._check_open()
        with self._cond:
            self._calls.open_window(copies=copies)
        try:
            yield self
        finally:
            self._calls.close_window()

    def issue(self, layer: int | None = None) -> int:
        """Make the queued calls of the ranges ``layer`` reads and of every range before them
        (all of them with ``None``); returns the calls made. Cheap when nothing is queued.

        Raises
        ------
        DeferredCallError
            A queued call failed: the record no longer matches the mappings; every later call
            raises too (the engine must be restarted).
        """
        if not self._calls.pending and self._calls.failed is None:
            return 0
        upto = None
        if layer is not None:
            place = self.layout.place(layer)
            upto = max(place.k_range, place.v_range)
        with self._cond:
            return self._calls.issue(upto)

    @property
    def calls_queued(self) -> int:
        """VMM calls a :meth:`deferred` window queued that are not made yet."""
        return self._calls.pending

    # -- prefix sharing: page-sets named by the engine's block keys --------------------------------
    def bind(self, slot: int, start: int, keys, *, hits: int = 0) -> bool:
        """Name page-sets ``start .. start + len(keys) - 1`` of ``slot`` by the engine's block
        keys (e.g. vLLM block ids), mapping them first; returns False if the pool ran short (the
        page-sets bound so far stay bound).

        The first ``hits`` keys are prefix-cache hits: the page-set the key names already holds
        the block's KV, and it is mapped here as it is (one physical page-set at several virtual
        addresses; never copied, never scrubbed). The other keys are fresh blocks: the page-set
        at that index (the slot's own, or one from the pool) is bound to the key, and the key's
        previous page-set, if any, is dropped (the engine handed the block out again, so its old
        content is dead). A page-set stays allocated while its key or any mapping holds it.

        An engine that binds must bind every page-set its requests write (a hit is honoured only
        for a key that was bound), and must not hand out as fresh a block another running
        request still reads.

        Raises
        ------
        SlotError
            ``slot`` is not acquired, a key is listed twice, or a hit names a key no page-set holds.
        ContextLengthError
            The page-sets go beyond the slot's region.
        DriverError
            A VMM call failed; the record stays exact and the call can be retried.
        """
        with self._cond:
            self._binding.new_step()
        try:
            return self._bind(slot, start, keys, hits)
        finally:
            with self._cond:
                self._state.seal_fence()

    def _bind(self, slot: int, start: int, keys, hits: int) -> bool:
        self._check_active(slot)
        keys = list(keys)
        check_bind(start, keys, hits, self.layout.pages_per_slot)
        with self._cond:
            return self._binding.bind(slot, start, keys, hits)

    def bind_many(self, items) -> list[int]:
        """:meth:`bind` for the requests of one engine step; ``items`` are ``(slot, start, keys,
        hits)``. They are bound in their order, except that a hit on a key another item binds
        fresh waits for that item: an engine may cache a block when it schedules it, so a
        request admitted in the same step can hit a block another request is given now (the
        same forward pass writes its KV before attention reads it). Returns the slots that ran
        short.

        Raises
        ------
        SlotError
            Hits that wait on each other's fresh blocks in a cycle, or any error of :meth:`bind`.
        """
        pending = [(slot, start, list(keys), hits) for slot, start, keys, hits in items]
        failed: list[int] = []
        with self._cond:
            self._binding.new_step()
        try:
            while pending:
                wait = hits_waiting(pending)
                for (slot, start, keys, hits), later in zip(pending, wait):
                    if not later and not self._bind(slot, start, keys, hits):
                        failed.append(slot)
                pending = [item for item, later in zip(pending, wait) if later]
        finally:
            with self._cond:
                self._state.seal_fence()           # one fence for the step's moves
        return failed

    def claim(self, slot: int, index: int) -> bool:
        """Make page-set ``index`` of ``slot`` ready for a fresh block the engine names later:
        mapped, holding no bound block (moved out or replaced, as :meth:`bind` does) and
        scrubbed for the slot's tenant; returns False if the pool ran short. The request may
        write it at once; a later ``bind(slot, index, [key])`` then only records the name. For
        an engine that learns a block's key after the step that first writes it (SGLang's page
        ids come from a device allocator): it must bind the key before anything else can use it
        (a hit on it, a free of it, the slot's release).

        Raises
        ------
        SlotError
            ``slot`` is not acquired, or ``index`` is not an int >= 0.
        ContextLengthError
            ``index`` is beyond the slot's region.
        """
        self._check_active(slot)
        index = check_index(index, self.layout.pages_per_slot)
        with self._cond:
            try:
                return self._binding.claim(slot, index)
            finally:
                self._state.seal_fence()

    def copy_block(self, src, dst) -> bool:
        """Copy the KV of block ``src`` into block ``dst`` (both bound keys; ``dst`` bound fresh
        by the request that goes on writing it): copy-on-write for a prefix-cache hit that ends
        inside a block, whose cached block stays immutable while the request gets its own
        copy. One device copy of the whole page-set on the current stream, ordered after every
        kernel queued so far (so after the writes of ``src``) and before every later one. A
        ``src`` mapped nowhere known is first mapped on top of a slot; returns False when no
        slot has room for it (nothing copied).

        Raises
        ------
        SlotError
            A key no page-set holds, ``src == dst``, or ``dst`` not mapped where it was bound.
        DriverError
            Mapping ``src`` failed; the record stays exact and the call can be retried.
        """
        self._check_open()
        if src == dst:
            raise SlotError(f"copy of block key {src!r} onto itself")
        with self._cond:
            try:
                return self._binding.copy(src, dst)
            finally:
                self._state.seal_fence()

    def stage_prefix(self, keys, copies: int) -> int:
        """Map the page-sets ``keys`` name (a prefix-cache hit, in order, from position 0) into
        idle slots ahead of the requests that will hit it, until ``copies`` idle slots hold it
        (idle slots already starting with it count). The next requests :meth:`acquire` admits
        with that ``prefix`` are handed those slots and find it in place: binding it as hits then
        costs no VMM call. Only empty idle slots are used (no page of theirs to unmap, no fence to
        wait for); acquiring a slot ends its job. With map-ahead on (``map_ahead_tokens`` > 0)
        the mapping runs on its worker, one page-set at a time whenever no running slot waits for
        a page-set; else now. A failed driver call ends that slot's job (counted in
        ``driver_faults``; what it mapped stays, recorded). Returns the slots queued.

        Raises
        ------
        SlotError
            ``keys`` empty or listing a key twice, a key no page-set holds, or ``copies`` not an
            int >= 1.
        ContextLengthError
            More page-sets than a slot's region holds.
        """
        self._check_open()
        keys = list(keys)
        if not keys:
            raise SlotError("stage_prefix needs at least one block key, got none")
        if isinstance(copies, bool) or not isinstance(copies, int) or copies < 1:
            raise SlotError(f"copies must be an int >= 1, got {copies!r}")
        check_bind(0, keys, len(keys), self.layout.pages_per_slot)
        with self._cond:
            queued = self._staging.plan(keys, copies)
            if not queued:
                return 0
            if self.config.map_ahead_tokens:
                self._started_worker().cond.notify_all()
                return queued
            while self._staging.jobs:               # each step maps a page-set or ends a job
                self._staging.step()
            return queued

    def holds(self, key) -> bool:
        """Whether a page-set is bound to ``key`` (a hit on it would be honoured)."""
        with self._cond:
            return self._binding.holds(key)

    def active_home(self, keys) -> list[int | None]:
        """For each key, the slot where its page-set was last mapped for a request if that slot is
        still acquired (its request may still read the page-set there), else ``None`` (unknown
        key, or the slot is idle). An engine that frees a block while its writer still reads it
        (SGLang frees a request's duplicate of a block another request inserted first) holds the
        block's id back until that slot is released, so its count of free blocks stays physical."""
        with self._cond:
            return self._binding.active_home(keys)

    def forget(self, keys) -> int:
        """The engine evicted these blocks: drop their keys (unknown keys are ignored). Their
        page-sets stay where they are mapped, as plain warm pages. Returns the pages freed."""
        with self._cond:
            return self._binding.forget(keys)

    def reclaim(self, num_pages: int | None = None) -> int:
        """Unmap pages until ``num_pages`` are freed (whole page-sets, so perhaps a few more) or
        nothing is left to take (default: all): idle slots' pages, oldest released first, then
        what active slots hold beyond what their requests read; slots whose fence has completed
        first, then waiting for the others. Returns the pages freed."""
        with self._cond:
            return self._reclaim.reclaim(num_pages if num_pages is not None else self._pool.num_pages, {})

    # -- queries ------------------------------------------------------------------------------------
    def mapped_tokens(self, slot: int) -> int:
        """Tokens of ``slot`` currently backed by accessible pages."""
        self._check_slot(slot)
        return self.layout.tokens_for(self._pages.usable(slot))

    def length(self, slot: int) -> int:
        """The largest length :meth:`ensure` guaranteed for the slot's current request."""
        self._check_active(slot)
        return int(self._length[slot])

    def capacity(self) -> Capacity:
        with self._cond:
            return capacity(self._state, self._reclaim.reclaimable())

    def can_fit(self, num_tokens: int) -> bool:
        """Whether a new request of ``num_tokens`` could be admitted now."""
        self._check_open()
        self._check_length(num_tokens)
        cap = self.capacity()
        return cap.idle_slots > 0 and cap.free_page_sets >= self.layout.pages_for(num_tokens)

    @property
    def counters(self) -> Counters:
        """The live event counters (read them, never write; :meth:`metrics` copies them under
        the lock)."""
        return self._counters

    def metrics(self) -> dict:
        """Gauges and counters as a plain dict (see :func:`prometheus_collector`)."""
        with self._cond:
            return gauges(self._state) | self._counters.as_dict()

    def summary(self, *, prewarm_s: float | None = None) -> str:
        """One line for an engine's start-up log: layout, tokens per page-set, slots, pages,
        pre-warm and the worst waste per request (what engines log of their KV cache size)."""
        cfg, lay, m = self.config, self.layout, self.metrics()
        row = cache_layout_row(cfg, lay.page_bytes)
        warm = f", {m['pages_mapped']} pre-warmed" + (f" in {prewarm_s:.2f} s" if prewarm_s else "")
        packs = (f", packs of {'/'.join(map(str, cfg.pack_sizes[::-1]))} page-sets up to {cfg.pack_pages * lay.page_bytes / 2**20:.0f} MiB "
                 f"beside the pool" if cfg.pack_pages else "")
        return (f"vattn KV cache: {row['layout']} ({lay.num_ranges} VA ranges of {lay.page_bytes >> 20} "
                f"MiB pages), {lay.tokens_for(1)} tokens per page-set, {cfg.max_slots} slots of "
                f"{cfg.max_context} tokens, {m['pages_total']} pages "
                f"({m['pages_total'] * lay.page_bytes / 2**30:.2f} GiB){warm}, map-ahead "
                f"{cfg.map_ahead_tokens} tokens{packs}, worst waste {row['worst_waste_MiB']:.2f} MiB per request")

    def prometheus_collector(self, *, prefix: str = "vattn"):
        """A Prometheus collector for this cache (needs ``prometheus_client``)."""
        return prometheus_collector(self, prefix=prefix)

    def audit(self) -> None:
        """Check the page accounting; raise :class:`VattnError` on any inconsistency.

        Every page's reference count equals its mappings plus its block key (if bound); a page
        is free exactly when nothing references it; a page no key holds is read by at most one
        running request (mapped below the length or bound page-sets of at most one acquired
        slot: an engine dropped its key, so its content is dead to every other mapping, and each
        of those is rebound before it is written);
        every slot's page count matches its page lists; keys and bound flags agree. O(mapped
        pages) with numpy; a page-by-page pass runs only to name the culprit of a failure.
        Waits for the map-ahead worker first (its pages in flight are in no record yet).
        """
        with self._cond:
            self.wait()
            audit(self._state)

    def audit_when_quiet(self) -> str | None:
        """:meth:`audit` for a thread beside the engine's (a metrics watcher): ``None`` once it
        passed, or why it was skipped: calls the engine's thread queued in a deferral window
        wait for its next :meth:`issue`, and only that thread may make them."""
        with self._cond:
            if self._calls.foreign():
                return "skipped: a deferral window's calls wait for the engine's next issue()"
            self.audit()
            return None

    # -- teardown and checks ---------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the worker, wait for every fence, unmap and release everything: pages, the
        address reservation, and the driver (with its file descriptors) if the cache created it."""
        if self._closed:
            return
        if self._worker is not None:
            self._worker.stop()
        with self._cond:
            self._calls.close_window()
            # what a window queued, before anything goes (only its own thread may make it)
            with contextlib.suppress(VattnError):
                self._calls.issue()
            # a deferred call failed, or none could be made here: the record is wrong
            broken = self._calls.failed is not None or self._calls.pending > 0
            if broken:
                self._calls.abandon()
            tolerate = contextlib.suppress(DriverError) if broken else contextlib.nullcontext()
            for fence in self._state.slots.fence:
                if fence is not None:
                    fence.wait()
            if self.driver.device.type == "cuda":
                torch.cuda.synchronize(self.driver.device)
            for slot in list(self._pages.retired):
                with tolerate:
                    self._pages.retired.flush(slot, wait=True)
            self._space.drop_views()
            self._keys.clear()
            for slot in range(self.layout.num_va_slots):
                with tolerate:
                    self._pages.trim(slot, 0)
            if self._pages.packs is not None:
                with tolerate:
                    self._pages.packs.close()
            with tolerate:
                self._space.free()
            with tolerate:
                self._pool.close()
            self._close_driver()
            self._closed = True

    def __enter__(self) -> "VirtualKVCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise SlotError("the cache is closed")

    def _check_slot(self, slot) -> None:
        self._check_open()
        check_slot(slot, self.config.max_slots)

    def _check_active(self, slot) -> None:
        self._check_slot(slot)
        if not self._state.slots.active[slot]:
            raise SlotError(f"slot {slot} is not acquired (released or never acquired)")

    def _check_length(self, n) -> None:
        check_length(n, self.config.max_context)
