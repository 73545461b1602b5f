"""VirtualKVCache: every request's KV is virtually contiguous; pages are committed as it grows.

Host-side methods (``acquire``, ``ensure``, ``step``, ``release``, ``wait``, ...) may synchronize
and must not run inside a CUDA graph capture. The tensors returned by ``k``/``v``/``k_rows``/
``v_rows`` are fixed for the cache's lifetime, so kernels reading them can be captured.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from .config import KVCacheConfig
from .driver import get_driver
from .errors import ConfigError, ContextLengthError, DriverError, SlotError, VattnError
from .keys import BlockKeys
from .layout import KVLayout, cache_layout_row
from .mapahead import MapAhead
from .metrics import Counters, prometheus_collector
from .pages import PagePool
from .paging import SlotPages

__all__ = ["VirtualKVCache", "Capacity"]

_MAX_VA_BYTES = 1 << 46  # 64 TiB: inside both the x86-64 user space and the CUDA VA limits


@dataclass(frozen=True, slots=True)
class Capacity:
    """What a scheduler may still admit."""

    free_pages: int          # in the pool, unmapped
    reclaimable_pages: int   # mapped to idle slots or beyond active slots' needs
    free_page_sets: int      # (free + reclaimable) // ranges
    free_tokens: int         # tokens those page-sets hold
    idle_slots: int


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
            self._pool = PagePool(self.driver, page_bytes=page, num_pages=self._budget_pages(page))
        except BaseException:
            self._close_driver()
            raise
        self._base = None
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
        self.layout = lay = KVLayout.from_config(cfg, page)
        self._va_bytes = lay.num_ranges * lay.range_bytes
        if self._va_bytes > _MAX_VA_BYTES:
            raise ConfigError(f"the cache needs {self._va_bytes / 2**40:.1f} TiB of virtual address "
                              f"space, more than {_MAX_VA_BYTES >> 40} TiB; lower max_slots or max_context")
        return page

    def _setup(self) -> None:
        cfg, lay = self.config, self.layout
        try:
            self._base = self.driver.reserve(self._va_bytes)
        except DriverError as exc:
            raise ConfigError(f"could not reserve {self._va_bytes} bytes of virtual address space: "
                              f"{exc}") from exc
        bases = [self._base + r * lay.range_bytes for r in range(lay.num_ranges)]
        self._counters = Counters()
        self._pages = SlotPages(cfg, lay, self.driver, self._pool, bases, self._counters)
        self._keys = BlockKeys(self._pool, self._pages.bound)
        self._elems = self.driver.view(self._base, self._va_bytes).view(cfg.dtype)
        self._views: dict[tuple[int, str], torch.Tensor] = {}
        n = lay.num_va_slots
        self._active = np.zeros(n, dtype=bool)
        self._tenant: list = [None] * n
        self._one_tenant = True     # every slot has only ever had the tenant None (the common case)
        self._length = np.zeros(n, dtype=np.int64)
        self._bound_sets = np.zeros(n, dtype=np.int64)   # page-sets bind() gave the current request
        self._loose: list[tuple[int, int]] = []           # candidates for _loose_set()
        self._mixed: set[int] = set()    # slots that may map pages tagged with another tenant
        self._fence: list = [None] * n
        self._released_at = np.zeros(n, dtype=np.int64)
        self._clock = 0
        self._inflight: set[int] = set()
        self._cond = threading.Condition(threading.RLock())
        self._worker: MapAhead | None = None
        self._closed = False
        self.padding_slot = cfg.max_slots
        self._active[self.padding_slot] = True
        if not self._pages.grow(self.padding_slot, 1, None, ahead=False):
            raise ConfigError("page budget too small for the padding slot")

    def _abandon(self) -> None:
        """Undo a half-built cache: unmap, free the VA and the pages (best effort, then raise)."""
        pages = getattr(self, "_pages", None)
        if pages is not None:
            for slot in range(self.layout.num_va_slots):
                pages.trim(slot, 0)
        if self._base is not None:
            self.driver.free_va(self._base, self._va_bytes)
            self._base = None
        self._pool.close()
        self._close_driver()

    def _close_driver(self) -> None:
        """Close the driver if this cache created it (its fds and handles go with it)."""
        if self._owns_driver and hasattr(self.driver, "close"):
            self.driver.close()

    def _budget_pages(self, page: int) -> int:
        budget = self.config.page_budget
        if isinstance(budget, float):
            budget = int(self.driver.free_memory() * budget)
        need = 2 * self.layout.num_ranges
        pages = budget // page
        if pages < need:
            raise ConfigError(f"page_budget of {budget} bytes gives {pages} pages of {page} bytes; at "
                              f"least {need} are needed (padding slot plus one page-set)")
        return pages

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
        key = (layer, which)
        if key not in self._views:
            place = self.layout.place(layer)
            rng, off = (place.k_range, place.k_offset) if which == "k" else (place.v_range, place.v_offset)
            elems = self._elems[rng * self.layout.range_bytes // self._elems.element_size():]
            self._views[key] = self.layout.slot_view(elems, off)
        return self._views[key]

    # -- slot lifecycle --------------------------------------------------------------------------
    def acquire(self, *, tenant=None, expected_len: int = 0, prefer=None) -> int:
        """Hand out an idle slot, preferring the warm one whose pages best fit ``expected_len``.

        ``prefer``: the block key of the last page-set of the request's prefix-cache hit
        (:meth:`bind`); the idle slot where that page-set was last mapped is handed out first:
        a request that ran there before (a repeated prompt, the next turn of a conversation)
        finds its whole prefix in place and needs no mapping at all.

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
            need = self.layout.pages_for(expected_len)
            idle = np.flatnonzero(~self._active[:self.config.max_slots])
            if not idle.size:
                raise SlotError(f"all {self.config.max_slots} slots are in use")
            if self._inflight:
                ready = idle[~np.isin(idle, list(self._inflight))]
                idle = ready if ready.size else idle
            slot = self._home_slot(prefer)
            if slot is None:
                slot = self._best_fit(idle, need, tenant)
            self._settle(slot)
            previous = self._tenant[slot]
            self._one_tenant &= tenant is None
            self._active[slot], self._tenant[slot], self._length[slot] = True, tenant, 0
            self._bound_sets[slot] = 0
            if self._pages.usable(slot):
                self._counters.warm_hits += 1
                # a slot's pages all carry its last tenant (tagged when mapped or retagged); the
                # same tenant again needs no pass over them unless every reuse is scrubbed
                if self.config.scrub == "always" or previous is not tenant or slot in self._mixed:
                    self._pages.retag(slot, tenant)
            self._mixed.discard(slot)
            return slot

    def _home_slot(self, key) -> int | None:
        """The idle slot where the page-set ``key`` names was last mapped, if it still is."""
        home = self._keys.home.get(key) if key is not None else None
        if home is None:
            return None
        slot, index = home
        if slot >= self.config.max_slots or self._active[slot] or slot in self._inflight:
            return None
        return slot if self._pages.at(slot, index) == self._keys.get(key) else None

    def _best_fit(self, idle: np.ndarray, need: int, tenant) -> int:
        """The idle slot to hand out: one holding at least ``need`` page-sets first, the warmest
        of those (a request grows past its prompt: surplus pages spare it mapping as it decodes,
        and stay reclaimable), then the same tenant, then the longest idle (vectorised: one call
        per admission)."""
        have = self._pages.usable_n[idle]
        if self._one_tenant and tenant is None:     # no slot has another tenant: skip the loop
            other = np.zeros(idle.size, dtype=bool)
        else:
            other = np.fromiter((self._tenant[s] != tenant for s in idle.tolist()), dtype=bool,
                                count=idle.size)
        order = np.lexsort((self._released_at[idle], other, -have, have < need))
        return int(idle[order[0]])

    def release(self, slot: int, *, fence=None) -> None:
        """Finish the request in ``slot``; its pages stay mapped until memory pressure.

        ``fence`` (default: recorded now on the current stream) must complete before any of
        the slot's pages may be unmapped.
        """
        self._check_active(slot)
        with self._cond:
            self._fence[slot] = fence if fence is not None else self.driver.record_fence()
            self._active[slot] = False
            self._clock += 1
            self._released_at[slot] = self._clock
            if len(self._keys):                      # its unbound page-sets: loose from now on
                self._note_loose(slot, int(self._bound_sets[slot]))
            if self._worker is not None:
                self._worker.jobs.pop(slot, None)

    # -- paging ------------------------------------------------------------------------------------
    def prewarm(self, tokens_per_slot: int | None = None) -> int:
        """Map page-sets to the idle slots now, so the requests that take them start warm.

        Every idle slot is topped up to ``tokens_per_slot`` (default: an even share of the free
        pool over the idle slots), until the pool runs out. The pages stay reclaimable like any
        warm slot's (:meth:`reclaim`, or a slot that needs more). For engines whose pool is sized
        up front (vLLM, SGLang): the mapping then happens once, at start, instead of on the step's
        critical path. Returns the pages mapped.

        Raises
        ------
        ContextLengthError
            ``tokens_per_slot`` exceeds ``max_context``.
        """
        self._check_open()
        if tokens_per_slot is not None:
            self._check_length(tokens_per_slot)
        with self._cond:
            idle = [s for s in range(self.config.max_slots) if not self._active[s] and s not in self._inflight]
            if not idle:
                return 0
            ranges = len(self._pages.bases)
            sets = (self._pool.num_free // (ranges * len(idle)) if tokens_per_slot is None else
                    self.layout.pages_for(tokens_per_slot))
            sets = min(sets, self.layout.pages_per_slot)   # a slot's region holds no more
            before = self._pool.num_free
            for slot in idle:
                if not self._pages.grow(slot, sets, self._tenant[slot], ahead=True):
                    break
                self._note_loose(slot, 0)
            return before - self._pool.num_free

    def ensure(self, lengths, lengths_seq=None) -> list[int]:
        """Map pages so every listed slot holds its length; return the slots that could not grow.

        ``lengths`` is ``{slot: num_tokens}``, or pass two sequences (lists, numpy arrays or CPU
        tensors) ``ensure(slots, lengths)``. A slot that fails keeps what it had; the engine should
        preempt it. When every slot already has its pages (the steady state with map-ahead) this
        is a few vectorised comparisons and makes no driver call.
        """
        start = time.perf_counter()
        slots, lens = self._arrays(lengths, lengths_seq)
        with self._cond:
            self._check_batch(slots, lens)
            short = lens > self._pages.cap_tokens[slots]
            failed = []
            if short.any():
                # every listed slot keeps what this call needs; its surplus stays reclaimable
                need = dict(zip(slots.tolist(), map(self.layout.pages_for, lens.tolist())))
                failed = self._ensure_slow(slots[short].tolist(), lens[short].tolist(), need)
            keep = ~np.isin(slots, failed) if failed else slice(None)
            ok = slots[keep]
            self._length[ok] = np.maximum(self._length[ok], lens[keep])   # slots are distinct
            self._counters.shortfalls += len(failed)
        self._counters.ensure_us.observe((time.perf_counter() - start) * 1e6)
        return failed

    def _ensure_slow(self, slots: list[int], lens: list[int], protect: dict[int, int]) -> list[int]:
        failed, exhausted = [], False
        for slot, n in zip(slots, lens):
            ok, exhausted = self._grow(slot, self.layout.pages_for(n), protect, exhausted)
            if not ok:
                failed.append(slot)
        return failed

    def step(self, lengths, lengths_seq=None) -> list[int]:
        """:meth:`ensure`, then map each ok slot ``map_ahead_tokens`` further in the background."""
        slots, lens = self._arrays(lengths, lengths_seq)
        failed = self.ensure(slots, lens)
        ahead = self.config.map_ahead_tokens
        if not ahead:
            return failed
        want = np.minimum(lens + ahead, self.layout.rows_per_slot)
        need = want > self._pages.cap_tokens[slots]
        if failed:
            need &= ~np.isin(slots, failed)
        if need.any():
            targets = {s: self.layout.pages_for(n) for s, n in zip(slots[need].tolist(), want[need].tolist())}
            with self._cond:
                if self._worker is None:
                    self._worker = MapAhead(self)
                self._worker.submit(targets)
        return failed

    def _arrays(self, lengths, lengths_seq) -> tuple[np.ndarray, np.ndarray]:
        if lengths_seq is None:
            if not isinstance(lengths, Mapping):
                raise SlotError(f"ensure expects {{slot: length}} or (slots, lengths), got "
                                f"{type(lengths).__name__}")
            keys, values = list(lengths.keys()), list(lengths.values())
        else:
            keys, values = lengths, lengths_seq
        slots = _int_array(keys, "slots")
        lens = _int_array(values, "lengths", error=ContextLengthError)
        if slots.shape != lens.shape:
            raise SlotError(f"slots and lengths need equal sizes, got {slots.size} and {lens.size}")
        return slots, lens

    def _check_batch(self, slots: np.ndarray, lens: np.ndarray) -> None:
        self._check_open()
        if slots.size and (slots.min() < 0 or slots.max() >= self.config.max_slots):
            bad = slots[(slots < 0) | (slots >= self.config.max_slots)][0]
            raise SlotError(f"slot must be an int in [0, {self.config.max_slots}), got {int(bad)}")
        if slots.size and not self._active[slots].all():
            bad = slots[~self._active[slots]][0]
            raise SlotError(f"slot {int(bad)} is not acquired (released or never acquired)")
        if lens.size and (lens.min() < 0 or lens.max() > self.config.max_context):
            bad = lens[(lens < 0) | (lens > self.config.max_context)][0]
            raise ContextLengthError(f"length {int(bad)} is outside [0, max_context={self.config.max_context}]")
        if slots.size > 1 and np.bincount(slots).max() > 1:
            raise SlotError("a slot is listed twice in one ensure() call")

    def wait(self) -> None:
        """Block until the map-ahead worker has nothing left to do."""
        with self._cond:
            while self._worker is not None and not self._worker.idle():
                self._cond.wait()

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
        self._check_active(slot)
        keys = list(keys)
        if not isinstance(start, int) or isinstance(start, bool) or start < 0:
            raise SlotError(f"start must be an int >= 0, got {start!r}")
        if not isinstance(hits, int) or isinstance(hits, bool) or not 0 <= hits <= len(keys):
            raise SlotError(f"hits must be an int in [0, {len(keys)}], got {hits!r}")
        if start + len(keys) > self.layout.pages_per_slot:
            raise ContextLengthError(f"page-sets {start}..{start + len(keys) - 1} exceed the slot's "
                                     f"{self.layout.pages_per_slot}")
        if len(set(keys)) != len(keys):
            raise SlotError(f"a block key is listed twice in one bind() call: {keys}")
        with self._cond:
            self._settle(slot)                        # the worker is appending to this slot
            if self._pages.usable(slot) < start and not self._grow(slot, start, {slot: start}, False)[0]:
                return False
            if hits:
                self._bind_hits(slot, start, keys[:hits])
                self._bound_sets[slot] = max(self._bound_sets[slot], start + hits)
            end = start + len(keys)
            for index, key in enumerate(keys[hits:], start=start + hits):
                if not self._bind_fresh(slot, index, key, end):
                    return False
                self._bound_sets[slot] = max(self._bound_sets[slot], index + 1)
        return True

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
        while pending:
            fresh = [set(keys[hits:]) for _, _, keys, hits in pending]
            everyone = set().union(*fresh)
            wait = [not everyone.isdisjoint(set(keys[:hits]) - own)
                    for (_, _, keys, hits), own in zip(pending, fresh)]
            if all(wait):
                raise SlotError(f"prefix hits wait on each other's fresh blocks: "
                                f"{[keys[:hits] for _, _, keys, hits in pending]}")
            for (slot, start, keys, hits), later in zip(pending, wait):
                if not later and not self.bind(slot, start, keys, hits=hits):
                    failed.append(slot)
            pending = [item for item, later in zip(pending, wait) if later]
        return failed

    def holds(self, key) -> bool:
        """Whether a page-set is bound to ``key`` (a hit on it would be honoured)."""
        with self._cond:
            return self._keys.get(key) is not None

    def forget(self, keys) -> int:
        """The engine evicted these blocks: drop their keys (unknown keys are ignored). Their
        page-sets stay where they are mapped, as plain warm pages. Returns the pages freed."""
        with self._cond:
            keys = [key for key in keys if self._keys.get(key) is not None]
            self._loose.extend(h for h in map(self._keys.home.get, keys) if h is not None)
            return sum(map(self._keys.drop, keys))

    def _bind_hits(self, slot: int, start: int, keys: list) -> None:
        """Map the page-sets ``keys`` name at ``start ..`` of ``slot``; those already there (a
        request back in the slot it ran in) cost nothing, the rest is one run of mappings."""
        sets = [self._keys.get(key) for key in keys]
        if None in sets:
            key = keys[sets.index(None)]
            raise SlotError(f"prefix hit on block key {key!r}, which no page-set holds (never bound "
                            "by this cache, or dropped since)")
        self._counters.prefix_hits += len(keys)
        first = 0
        while first < len(sets) and self._pages.at(slot, start + first) == sets[first]:
            first += 1
        if first == len(sets):
            return
        self._settle(slot)
        if self._pages.usable(slot) > start + first:  # something is replaced: the last reader is done
            self._wait_fence(slot)
        self._pages.put(slot, start + first, sets[first:])
        self._mixed.add(slot)                          # the shared pages carry their writer's tag
        home = self._keys.home
        for index, key in enumerate(keys[first:], start=start + first):
            home[key] = (slot, index)                  # the latest mapping: where a request runs next

    def _bind_fresh(self, slot: int, index: int, key, end: int) -> bool:
        cur, old = self._pages.at(slot, index), self._keys.get(key)
        if old is not None:                           # reused by the engine: its content is dead
            home = self._keys.home.get(key)
            self._keys.drop(key)
            if home is not None and home != (slot, index):
                self._loose.append(home)
        if cur is None:                               # the next page-set: map it from the pool
            if not self._grow(slot, index + 1, {slot: index + 1}, False)[0]:
                return False
            cur = self._pages.at(slot, index)
        elif self._pages.bound[cur[0]]:               # another block's content: keep it
            if not self._move_out(slot, index, cur, end):  # then map new pages here
                pids = self._take_set(slot, index)
                if pids is None:
                    return False
                self._settle(slot)
                self._wait_fence(slot)
                try:
                    self._pages.put(slot, index, [pids])
                finally:
                    self._pool.give(pids)             # the mapping holds them now
                cur = tuple(pids)
        for rng in range(len(cur)):                   # pages of another tenant are scrubbed first
            self._pages.scrub_pages(slot, rng, (index,), self._tenant[slot])
        self._keys.bind(key, cur, (slot, index))
        self._counters.keys_bound += 1
        return True

    def _move_out(self, slot: int, index: int, cur: tuple[int, ...], end: int) -> bool:
        """Move the cached block in page-set ``cur`` (at ``index`` of ``slot``) into a loose
        page-set mapped in an idle slot, so this position keeps its pages for a new block: one
        device copy on the current stream (ordered after every kernel queued so far, before
        every later one), no VMM call. False if ``cur`` is mapped elsewhere too or no loose
        page-set is at hand (the caller then maps new pages here)."""
        refs = self._pool.refs
        if any(refs[p] != 2 for p in cur):            # shared with another region: leave it
            return False
        dst = self._loose_set(avoid=(slot, end))
        if dst is None:
            return False
        key = self._keys.key_of[cur[0]]
        self._copy_set((slot, index), dst)
        tags = self._pool.tenant
        for src_page, dst_page in zip(cur, self._pages.at(*dst)):
            tags[dst_page] = tags[src_page]           # the content's tenant moves with it
        self._mixed.add(dst[0])
        self._keys.drop(key)                          # cur keeps its mapping here (no page freed)
        self._keys.bind(key, self._pages.at(*dst), dst)
        self._counters.page_sets_moved += 1
        return True

    def _loose_set(self, *, avoid: tuple[int, int]) -> tuple[int, int] | None:
        """A page-set that nothing else holds (no key, no other mapping), mapped in an idle slot
        or beyond what an active one has bound and ensured (its request reads no row there
        before binding it); ``avoid = (slot, end)``: not below ``end`` in that slot (the
        positions the current call binds)."""
        refs, n, lay = self._pool.refs, self.config.max_slots, self.layout
        while self._loose:
            slot, index = self._loose.pop()
            if slot >= n or (slot == avoid[0] and index < avoid[1]) or slot in self._inflight:
                continue
            if self._active[slot] and index < max(int(self._bound_sets[slot]),
                                                   lay.pages_for(int(self._length[slot]))):
                continue
            pids = self._pages.at(slot, index)
            if pids is not None and all(refs[p] == 1 for p in pids):
                return slot, index
        return None

    def _note_loose(self, slot: int, first: int) -> None:
        """Remember ``slot``'s page-sets from ``first`` up as candidates for :meth:`_loose_set`
        (checked when taken; the list is pruned when it outgrows the pool)."""
        self._loose.extend((slot, i) for i in range(first, self._pages.usable(slot)))
        if len(self._loose) > 4 * self._pool.num_pages:
            self._loose = [(s, i) for s, i in set(self._loose) if not self._active[s]]

    def _copy_set(self, src: tuple[int, int], dst: tuple[int, int]) -> None:
        """Copy page-set ``src`` to ``dst`` (``(slot, index)`` each), every range, in one launch."""
        lay, elems = self.layout, self._elems
        size = elems.element_size()
        page, stride = lay.page_bytes // size, lay.range_bytes // size

        def view(slot, index):
            offset = elems.storage_offset() + lay.page_offset(slot, index) // size
            return elems.as_strided((lay.num_ranges, page), (stride, 1), offset)
        if elems.device.type == "cuda":
            view(*dst).copy_(view(*src))             # one strided copy: one launch
        else:                                        # the host: one memcpy per range is faster
            for d, s in zip(view(*dst), view(*src)):
                d.copy_(s)

    def _take_set(self, slot: int, index: int) -> list[int] | None:
        """One free page per range, reclaiming (never from ``slot`` below ``index + 1``)."""
        ranges = self.layout.num_ranges
        while (short := ranges - self._pool.num_free) > 0:
            if self._reclaim(short, {slot: index + 1}) >= short:
                break
            if not self._inflight:
                return None
            self._cond.wait()
        return self._pool.take(ranges)

    def _wait_fence(self, slot: int) -> None:
        """Wait until the device is done with what ``slot``'s previous request read."""
        fence = self._fence[slot]
        if fence is not None and not fence.done():
            self._counters.fence_waits += 1
            fence.wait()

    def _grow(self, slot: int, num_sets: int, protect: dict[int, int], exhausted: bool) -> tuple[bool, bool]:
        """Grow one slot; ``exhausted`` says an earlier reclaim found nothing left to take.

        Pages the map-ahead worker is mapping into another slot are not reclaimable until it
        commits them; when only they would close the gap, this waits for the worker, so a
        shortfall is reported only when the pool is truly short (an engine that counts its
        own blocks, like vLLM, must never see a spurious one).
        """
        while True:
            self._settle(slot)                        # a page we may need is being mapped
            if self._pages.usable(slot) >= num_sets:
                return True, exhausted
            short = self._pages.missing(slot, num_sets) - self._pool.num_free
            if short <= 0 or exhausted or self._reclaim(short, protect) >= short:
                break                                 # (reclaim keeps the lock: nothing moved)
            if not self._inflight:
                return False, True
            self._cond.wait()                         # the worker may take up this slot again
        if self._pages.missing(slot, num_sets) > self._pool.num_free:
            return False, True
        return self._pages.grow(slot, num_sets, self._tenant[slot], ahead=False), exhausted

    def _settle(self, slot: int) -> None:
        """Wait until the map-ahead worker is not mapping into ``slot`` (it appends at the top;
        whoever maps there next must see its pages recorded first). Call before mapping into a
        slot after anything that may have waited on the condition."""
        while slot in self._inflight:
            self._cond.wait()

    def reclaim(self, num_pages: int | None = None) -> int:
        """Unmap pages of idle slots (oldest first, fence permitting); returns pages freed."""
        with self._cond:
            return self._reclaim(num_pages if num_pages is not None else self._pool.num_pages, {})

    def _reclaim(self, want: int, protect: dict[int, int], *, idle_only: bool = False,
                 block: bool = True) -> int:
        """Free at least ``want`` pages from :meth:`_victims`, taking from each victim only the
        page-sets still needed; ``block=False`` skips victims whose fence has not completed.

        With block keys bound, a first pass unmaps only page-sets whose pages nothing else holds
        (unmapping a bound page-set frees nothing); a second pass unmaps through bound ones to
        reach free-able page-sets below them."""
        freed = 0
        slots, keeps = self._victims(protect, idle_only=idle_only)
        for only_free in ((True, False) if len(self._keys) else (False,)):
            for wait in ((False, True) if block else (False,)):   # finished fences first, then wait
                for slot, keep in zip(slots.tolist(), keeps.tolist()):
                    if freed >= want:
                        return freed
                    fence = self._fence[slot]
                    if not wait and fence is not None and not fence.done():
                        continue
                    self._wait_fence(slot)
                    if only_free:
                        keep = max(keep, self._shared_top(slot))
                    freed += self._trim_for(slot, keep, want - freed)
        return freed

    def _trim_for(self, slot: int, keep: int, want: int) -> int:
        """Unmap ``slot``'s page-sets from the top, not below ``keep``, until ``want`` pages are
        freed; returns the pages freed."""
        freed, ranges = 0, self.layout.num_ranges
        held_sets = max(map(len, self._pages.mapped[slot]))
        while freed < want and held_sets > keep:
            held_sets = max(keep, held_sets - -(-(want - freed) // ranges))
            freed += self._pages.trim(slot, held_sets)
        return freed

    def _shared_top(self, slot: int) -> int:
        """1 + the highest page-set of ``slot`` that some key or other mapping also holds (0 if
        none): unmapping above it frees every page."""
        refs, ranges = self._pool.refs, self._pages.mapped[slot]
        for index in range(max(map(len, ranges)) - 1, -1, -1):
            if any(index < len(pages) and refs[pages[index]] != 1 for pages in ranges):
                return index + 1
        return 0

    def _victims(self, protect: dict[int, int], *, idle_only: bool = False
                 ) -> tuple[np.ndarray, np.ndarray]:
        """``(slots, page-sets to keep)``: idle slots oldest first (keep 0), then the surplus of
        active slots (vectorised over the slots).

        ``protect`` maps a slot to the page-sets the current call needs it to keep (beyond its
        own length); only what lies above both may be taken. Slots being mapped in the
        background are never victims.
        """
        n, lay = self.config.max_slots, self.layout
        held = self._pages.held_n[:n]
        takeable = np.ones(n, dtype=bool)
        if self._inflight:
            takeable[list(self._inflight)] = False
        active = self._active[:n]
        idle = np.flatnonzero(~active & takeable & (held > 0))
        idle = idle[np.argsort(self._released_at[idle], kind="stable")]
        if idle_only:
            return idle, np.zeros(idle.size, dtype=np.int64)
        keep = np.maximum(-(-self._length[:n] * lay.token_bytes // lay.page_bytes), self._bound_sets[:n])
        if protect:
            ps = np.fromiter(protect.keys(), dtype=np.int64, count=len(protect))
            pk = np.fromiter(protect.values(), dtype=np.int64, count=len(protect))
            inside = ps < n
            keep[ps[inside]] = np.maximum(keep[ps[inside]], pk[inside])
        surplus = np.flatnonzero(active & takeable & (held > keep * lay.num_ranges))
        return (np.concatenate([idle, surplus]),
                np.concatenate([np.zeros(idle.size, dtype=np.int64), keep[surplus]]))

    def _reclaimable(self) -> int:
        """Pages :meth:`reclaim` could free now: what :meth:`_victims` lists, summed (with block
        keys bound, only the pages nothing else holds)."""
        slots, keep = self._victims({})
        if not len(self._keys):
            return int((self._pages.held_n[slots] - keep * self.layout.num_ranges).sum())
        refs = self._pool.refs
        return sum(int((refs[pages[k:]] == 1).sum()) for s, k in zip(slots.tolist(), keep.tolist())
                   for pages in self._pages.mapped[s] if len(pages) > k)

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
            reclaimable = self._reclaimable()
            sets = (self._pool.num_free + reclaimable) // self.layout.num_ranges
            idle = int(self.config.max_slots - self._active[:self.config.max_slots].sum())
            tokens = sets * self.layout.page_bytes // self.layout.token_bytes
            return Capacity(self._pool.num_free, reclaimable, sets, tokens, idle)

    def can_fit(self, num_tokens: int) -> bool:
        """Whether a new request of ``num_tokens`` could be admitted now."""
        self._check_open()
        self._check_length(num_tokens)
        cap = self.capacity()
        return cap.idle_slots > 0 and cap.free_page_sets >= self.layout.pages_for(num_tokens)

    def metrics(self) -> dict:
        """Gauges and counters as a plain dict (see :func:`prometheus_collector`)."""
        with self._cond:
            lay, n = self.layout, self.config.max_slots
            active, held = self._active[:n], self._pages.held_n[:n]
            used = int(self._length[:n][active].sum()) * lay.token_bytes * lay.num_ranges
            held_active = int(held[active].sum()) * lay.page_bytes
            warm = int(held[~active].sum()) * lay.page_bytes
            gauges = {"pages_total": self._pool.num_pages, "pages_free": self._pool.num_free,
                      "pages_mapped": self._pool.num_used, "active_slots": int(active.sum()),
                      "warm_bytes": warm, "waste_bytes": held_active - used,
                      "mapped_bytes": self._pool.num_used * lay.page_bytes,
                      "keys_held": len(self._keys), "pages_bound": int(self._pages.bound.sum())}
            return gauges | self._counters.as_dict()

    def summary(self, *, prewarm_s: float | None = None) -> str:
        """One line for an engine's start-up log: layout, tokens per page-set, slots, pages,
        pre-warm and the worst waste per request (what engines log of their KV cache size)."""
        cfg, lay, m = self.config, self.layout, self.metrics()
        row = cache_layout_row(cfg, lay.page_bytes)
        warm = f", {m['pages_mapped']} pre-warmed" + (f" in {prewarm_s:.2f} s" if prewarm_s else "")
        return (f"vattn KV cache: {row['layout']} ({lay.num_ranges} VA ranges of {lay.page_bytes >> 20} "
                f"MiB pages), {lay.tokens_for(1)} tokens per page-set, {cfg.max_slots} slots of "
                f"{cfg.max_context} tokens, {m['pages_total']} pages "
                f"({m['pages_total'] * lay.page_bytes / 2**30:.2f} GiB){warm}, map-ahead "
                f"{cfg.map_ahead_tokens} tokens, worst waste {row['worst_waste_MiB']:.2f} MiB per request")

    def prometheus_collector(self, *, prefix: str = "vattn"):
        """A Prometheus collector for this cache (needs ``prometheus_client``)."""
        return prometheus_collector(self, prefix=prefix)

    def audit(self) -> None:
        """Check the page accounting; raise :class:`VattnError` on any inconsistency.

        Every page's reference count equals its mappings plus its block key (if bound); a page
        is free exactly when nothing references it; a page no key holds is mapped at most once;
        every slot's page count matches its page lists; keys and bound flags agree. O(mapped
        pages) with numpy; a page-by-page pass runs only to name the culprit of a failure.
        Waits for the map-ahead worker first (its pages in flight are in no record yet).
        """
        with self._cond:
            self.wait()
            pages, pool = self._pages, self._pool
            mapped = np.fromiter((pid for ranges in pages.mapped for pids in ranges for pid in pids),
                                 dtype=np.int64)
            if mapped.size and mapped.min() < 0:
                raise VattnError("a slot's page list has a hole (a remap failed and was not undone)")
            count = np.bincount(mapped, minlength=pool.num_pages)
            bound = np.zeros(pool.num_pages, dtype=bool)
            for pids in self._keys.pids.values():
                bound[list(pids)] = True
            for what, bad in (("the bound flags disagree with the keys", bound != pages.bound),
                              ("its references are not its mappings plus its key",
                               pool.refs != count + bound),
                              ("it is mapped twice but no key shares it", ~bound & (count > 1))):
                if bad.any():
                    pid = int(np.flatnonzero(bad)[0])
                    raise VattnError(f"page {pid}: {what} (mapped {int(count[pid])}x, refs "
                                     f"{int(pool.refs[pid])}, bound {bool(bound[pid])}, at "
                                     f"{self._where(pid)})")
            held = [sum(map(len, ranges)) for ranges in pages.mapped]
            if held != pages.held_n.tolist():
                slot = next(s for s, (n, m) in enumerate(zip(pages.held_n.tolist(), held)) if n != m)
                raise VattnError(f"slot {slot} is counted as holding {pages.held_n[slot]} "
                                 f"pages but holds {held[slot]}")
            if int((pool.refs > 0).sum()) + pool.num_free != pool.num_pages:
                raise VattnError(f"{int((pool.refs > 0).sum())} used + {pool.num_free} free pages != "
                                 f"{pool.num_pages} in the pool")

    def _where(self, pid: int) -> list[tuple[int, int, int]]:
        """Every (slot, range, index) that maps pool page ``pid`` (for error messages)."""
        return [(slot, rng, i) for slot, ranges in enumerate(self._pages.mapped)
                for rng, pids in enumerate(ranges) for i, p in enumerate(pids) if p == pid]

    # -- teardown and checks ---------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the worker, wait for every fence, unmap and release everything: pages, the
        address reservation, and the driver (with its file descriptors) if the cache created it."""
        if self._closed:
            return
        if self._worker is not None:
            self._worker.stop()
        with self._cond:
            for slot in range(self.layout.num_va_slots):
                if self._fence[slot] is not None:
                    self._fence[slot].wait()
            if self.driver.device.type == "cuda":
                torch.cuda.synchronize(self.driver.device)
            self._views.clear()
            self._elems = None
            self._keys.clear()
            for slot in range(self.layout.num_va_slots):
                self._pages.trim(slot, 0)
            if self._base is not None:
                self.driver.free_va(self._base, self._va_bytes)
                self._base = None
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
        if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < self.config.max_slots:
            raise SlotError(f"slot must be an int in [0, {self.config.max_slots}), got {slot!r}")

    def _check_active(self, slot) -> None:
        self._check_slot(slot)
        if not self._active[slot]:
            raise SlotError(f"slot {slot} is not acquired (released or never acquired)")

    def _check_length(self, n) -> None:
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ContextLengthError(f"length must be an int >= 0, got {n!r}")
        if n > self.config.max_context:
            raise ContextLengthError(f"length {n} exceeds max_context={self.config.max_context}")


def _int_array(xs, name: str, *, error: type[VattnError] = SlotError) -> np.ndarray:
    if isinstance(xs, torch.Tensor):
        if xs.device.type != "cpu" or xs.dtype.is_floating_point:
            raise error(f"{name} must be integers on the CPU, got {xs.dtype} on {xs.device}")
        xs = xs.numpy()
    arr = np.asarray(xs)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise error(f"{name} must be a 1-D sequence of ints, got {arr.dtype} with shape {arr.shape}")
    return arr.astype(np.int64, copy=False)
