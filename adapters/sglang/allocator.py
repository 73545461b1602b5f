"""SGLang token allocator backed by vattn slots: ``index = slot * C + position``.

SGLang's scheduler allocates KV through its *paged* allocator interface whenever
``page_size > 1`` (``alloc_for_extend`` → ``alloc_extend``, ``alloc_for_decode`` →
``alloc_decode``); those calls carry each request's prefix/sequence lengths and ``last_loc``
(the index of its last stored token), which is all vattn needs: a request continuing from
``last_loc`` lives in slot ``last_loc // C``; a fresh one (``last_loc == -1``) acquires a slot.
Allocating maps the pages covering the new tokens (``VirtualKVCache.step``: what the call needs
now, and ``map_ahead_tokens`` more in the background while the GPU runs the batch).
``free`` releases a request's slot when its position 0 is freed (the core records a fence: pages
are unmapped only after the device finished with them, and only under memory pressure).
``available_size`` reports what the *physical* page pool can still hold, so admission control
sees real capacity, not the virtual reservation.

All methods are host-side and may synchronize (they read ``last_loc`` / indices on the host).
Each call's host time is kept in a histogram; :mod:`.metrics` reports them with the core's counters.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator

from vattn.core.errors import ConfigError, SlotError, UnsupportedError
from vattn.core.metrics import Histogram

from .metrics import write_if_asked
from .pool import PAD_SLOT, VattnMHATokenToKVPool


class VattnTokenAllocator(BaseTokenToKVPoolAllocator):
    """SGLang ``BaseTokenToKVPoolAllocator`` over a :class:`VattnMHATokenToKVPool`.

    The constructor takes exactly what SGLang 0.5.17's ``KVCacheConfigurator`` passes to an
    out-of-tree platform's paged allocator class; :meth:`for_pool` is the short form.

    Parameters
    ----------
    size : int
        SGLang's token budget (``max_total_num_tokens``); ``available_size()`` never exceeds it.
    page_size : int
        SGLang's page size; must equal the pool's and be > 1 (the paged interface carries the
        request lengths vattn maps by).
    dtype, device
        Must match the pool's.
    kvcache : VattnMHATokenToKVPool
        The KV pool.
    need_sort : bool
        Passed to SGLang's base class (disaggregation sorts free pages).
    tenant_of : callable, optional
        ``() -> tenant`` of a request being admitted, for scrubbing on slot reuse (SGLang's
        allocator calls carry no request object; default: one tenant).
    """

    def __init__(self, size, page_size, dtype, device, kvcache, need_sort=False, *,
                 tenant_of=None):
        pool = kvcache
        if not isinstance(pool, VattnMHATokenToKVPool):
            raise ConfigError(f"VattnTokenAllocator needs a VattnMHATokenToKVPool, got "
                              f"{type(pool).__name__} (is the vattn platform active? "
                              "VATTN_SGLANG=1)")
        if page_size < 2 or page_size != pool.page_size:
            raise ConfigError("VattnTokenAllocator needs SGLang page_size > 1 (its paged "
                              "interface carries request lengths) equal to the pool's "
                              f"{pool.page_size}, got {page_size}")
        if dtype != pool.dtype or torch.device(device) != torch.device(pool.device):
            raise ConfigError(f"VattnTokenAllocator: dtype/device {dtype}/{device} differ from "
                              f"the pool's {pool.dtype}/{pool.device}")
        if size < 1:
            raise ConfigError(f"VattnTokenAllocator: size must be >= 1, got {size}")
        super().__init__(int(size), page_size, pool.dtype, pool.device, pool,
                         need_sort=need_sort)
        self.cache = pool.vattn_cache
        self.rows_per_slot = pool.rows_per_slot
        self._tenant_of = tenant_of
        self._live: set[int] = set()
        self._is_live = np.zeros(self.cache.layout.num_va_slots, dtype=bool)   # == _live, vectorised
        self.prewarmed_pages = pool.prewarmed_pages
        #: host time of each allocator call (``vattn.adapters.sglang.metrics``)
        self.extend_us, self.decode_us, self.free_us = Histogram(), Histogram(), Histogram()
        self.clear()

    @classmethod
    def for_pool(cls, pool: VattnMHATokenToKVPool, *, tenant_of=None) -> "VattnTokenAllocator":
        """An allocator over ``pool`` with the pool's token budget."""
        return cls(pool.token_budget, pool.page_size, pool.dtype, pool.device, pool,
                   tenant_of=tenant_of)

    # -- queries -------------------------------------------------------------------------------
    def available_size(self) -> int:
        """Tokens the free + reclaimable physical pages can still hold (page-aligned).

        A page-set serves one slot, so it counts at most ``max_context`` tokens; capped by
        ``size`` (SGLang's budget), so an idle allocator reports exactly ``size``.
        """
        cap = self.cache.capacity()
        free = min(int(cap.free_tokens), cap.free_page_sets * self.cache.config.max_context,
                   self.size)
        return free - free % self.page_size

    def live_slots(self) -> frozenset:
        """vattn slots held by running requests."""
        return frozenset(self._live)

    # -- SGLang's allocator interface ----------------------------------------------------------
    def clear(self) -> None:
        """Release every request's slot (SGLang calls this on flush/reset)."""
        for slot in list(getattr(self, "_live", ())):
            self._release(slot)
        self.free_pages = torch.empty(0, dtype=torch.int64)
        self.release_pages = torch.empty(0, dtype=torch.int64)
        self.is_not_in_free_group, self.free_group = True, []

    def alloc(self, need_size: int):
        raise UnsupportedError("vattn allocates per request: SGLang must run with page_size > 1 "
                               "(alloc_extend / alloc_decode), not the token allocator")

    def alloc_extend(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc,
                     extend_num_tokens, **kwargs) -> torch.Tensor | None:
        """Indices for positions ``prefix_lens[i] .. seq_lens[i]-1`` of each request.

        Parameters
        ----------
        prefix_lens, seq_lens : torch.Tensor
            ``[B]`` device copies (unused: the host copies are read).
        prefix_lens_cpu, seq_lens_cpu : torch.Tensor
            ``[B]`` int64 host tensors.
        last_loc : torch.Tensor
            ``[B]`` index of each request's last stored token, ``-1`` for a new request.
        extend_num_tokens : int
            ``sum(seq_lens - prefix_lens)``.

        Returns
        -------
        torch.Tensor or None
            ``[extend_num_tokens]`` int64 on the pool device, requests concatenated; ``None``
            when pages ran out (SGLang's convention); slots acquired by this call are then
            released again.
        """
        t0 = time.perf_counter()
        prefix, seq = _host_ints(prefix_lens_cpu), _host_ints(seq_lens_cpu)
        slots = np.empty(seq.size, dtype=np.int64)
        cont = prefix > 0
        if cont.any():
            last = _host_ints(last_loc)
            slots[cont] = self._slots_at(last[cont], prefix[cont] - 1)
        fresh = []
        for i in np.flatnonzero(~cont).tolist():
            tenant = self._tenant_of() if self._tenant_of else None
            slots[i] = slot = self.cache.acquire(tenant=tenant, expected_len=int(seq[i]))
            self._hold(slot)
            fresh.append(slot)
        if self.cache.step(slots, seq):           # the decode pages after these mapped ahead
            for slot in fresh:
                self._release(slot)
            return None
        counts = seq - prefix
        starts = slots * self.rows_per_slot + prefix - (np.cumsum(counts) - counts)
        locs = np.repeat(starts, counts) + np.arange(int(counts.sum()), dtype=np.int64)
        return self._timed(self.extend_us, t0, torch.from_numpy(locs).to(self.device))

    def alloc_decode(self, seq_lens, seq_lens_cpu, last_loc, **kwargs) -> torch.Tensor | None:
        """Index of position ``seq_lens[i] - 1`` (the new token) of each request.

        ``seq_lens_cpu`` already counts the new token; ``last_loc`` is the index of position
        ``seq_lens[i] - 2``, so the new token's index is ``last_loc + 1`` (computed on the
        device; the host reads ``last_loc`` once to find the slots to map). Returns ``[B]``
        int64, or ``None`` when pages ran out.
        """
        t0 = time.perf_counter()
        seq = _host_ints(seq_lens_cpu)
        slots = self._slots_at(_host_ints(last_loc), seq - 2)
        if self.cache.step(slots, seq):
            return None
        return self._timed(self.decode_us, t0, last_loc.to(torch.int64) + 1)

    def free(self, free_index: torch.Tensor) -> None:
        """Free token indices; a request's slot is released when its position 0 is freed.

        Freeing only a tail (speculative over-allocation) keeps the slot and its pages.
        """
        if free_index.numel() == 0:
            return
        if not self.is_not_in_free_group:
            self.free_group.append(free_index)
            return
        t0 = time.perf_counter()
        idx = free_index.long().cpu()
        heads = idx[idx % self.rows_per_slot == 0] // self.rows_per_slot
        released = sorted(set(heads.tolist()) - {PAD_SLOT})
        for slot in released:
            if slot not in self._live:
                raise SlotError(f"free of slot {slot}'s position 0, but it holds no request "
                                "(double free?)")
            self._release(slot)
        self._timed(self.free_us, t0, None)
        if released and not self._live:
            write_if_asked(self)        # idle after a batch: benchmarks read the counters here

    # -- helpers -------------------------------------------------------------------------------
    def _slots_at(self, locs: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Slots of token indices ``locs``, each checked to be ``positions`` of a live slot."""
        slots, rows = np.divmod(locs, self.rows_per_slot)
        inside = (slots >= 0) & (slots < self._is_live.size)
        ok = inside & (rows == positions)
        ok[inside] &= self._is_live[slots[inside]]
        if not ok.all():
            i = int(np.flatnonzero(~ok)[0])
            raise SlotError(f"token index {int(locs[i])} is not position {int(positions[i])} of a "
                            f"live vattn slot (C={self.rows_per_slot}, live={sorted(self._live)})")
        return slots

    @staticmethod
    def _timed(hist: Histogram, t0: float, result):
        hist.observe((time.perf_counter() - t0) * 1e6)
        return result

    def _hold(self, slot: int) -> None:
        self._live.add(slot)
        self._is_live[slot] = True

    def _release(self, slot: int) -> None:
        self._live.discard(slot)
        self._is_live[slot] = False
        self.cache.release(slot)


def _host_ints(t) -> np.ndarray:
    """A 1-D integer tensor as an int64 numpy array on the host (one copy if on a device)."""
    return t.detach().to("cpu", torch.int64).numpy()
