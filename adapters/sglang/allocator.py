"""SGLang's own paged allocator over vattn's pool: page ids are SGLang's, page-sets are vattn's.

:class:`VattnTokenAllocator` *is* SGLang's ``PagedTokenToKVPoolAllocator`` (its free list of
page ids, ``alloc_extend`` / ``alloc_decode``, ``free`` / ``free_segment`` / free groups), so the
scheduler, the radix cache and SGLang's invariant checks see the allocator they know. What
differs:

* SGLang's page size is one vattn page-set, and ``num_pages`` is what the pool's page budget
  holds: ``available_size`` counts physical memory;
* a page id returning to the free list goes through :meth:`RowSlots.on_free_pages` (its key
  is forgotten; an id its writer still reads is held back until that request leaves). On the
  GPU the freed ids reach the host without waiting: SGLang frees while the next forward runs
  (its overlap scheduler), and a copy to the host there would wait for that forward. They are
  copied into pinned memory and settled when SGLang next asks for ``available_size`` or
  allocates, once the copy has landed (an allocation that needs them waits for it). Until then
  they are not counted free: SGLang sees them one scheduling round later, never an id that will
  be held back;
* on the CPU the allocation runs SGLang's reference (non-Triton) path.

Indices do not address rows: the attention backend maps each request's page ids into its own
virtually contiguous region before the forward (:mod:`.requests`).
"""

from __future__ import annotations

import numpy as np
import torch
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator, alloc_extend_naive

from vattn.core.errors import ConfigError, UnsupportedError

from .late_ids import Landing
from .metrics import metrics_file
from .pool import VattnMHATokenToKVPool


class VattnTokenAllocator(PagedTokenToKVPoolAllocator):
    """SGLang's paged allocator over a :class:`VattnMHATokenToKVPool`.

    The constructor takes exactly what SGLang 0.5.17's ``KVCacheConfigurator`` passes to an
    out-of-tree platform's paged allocator class; :meth:`for_pool` is the short form.

    Parameters
    ----------
    size : int
        SGLang's token budget (``max_total_num_tokens``); ``size // page_size`` page ids.
    page_size : int
        SGLang's page size: the tokens of one vattn page-set (> 1).
    dtype, device
        Must match the pool's.
    kvcache : VattnMHATokenToKVPool
        The KV pool.
    need_sort : bool
        Passed to SGLang's base class (disaggregation sorts free pages).
    """

    def __init__(self, size, page_size, dtype, device, kvcache, need_sort=False):
        pool = kvcache
        if not isinstance(pool, VattnMHATokenToKVPool):
            raise ConfigError(f"VattnTokenAllocator needs a VattnMHATokenToKVPool, got "
                              f"{type(pool).__name__} (is the vattn platform active? "
                              "VATTN_SGLANG=1)")
        if page_size < 2 or page_size != pool.page_size:
            raise ConfigError("VattnTokenAllocator needs SGLang page_size > 1 equal to the pool's "
                              f"{pool.page_size} (one vattn page-set), got {page_size}")
        if dtype != pool.dtype or torch.device(device) != torch.device(pool.device):
            raise ConfigError(f"VattnTokenAllocator: dtype/device {dtype}/{device} differ from "
                              f"the pool's {pool.dtype}/{pool.device}")
        if not page_size <= size <= pool.token_budget:
            raise ConfigError(f"VattnTokenAllocator: size must be in [{page_size}, "
                              f"{pool.token_budget}] (the pool's page budget), got {size}")
        self.cache = pool.vattn_cache
        self.requests = pool.requests
        self.requests.return_pages = self._return
        self.prewarmed_pages = pool.prewarmed_pages
        self.rows_per_slot = pool.rows_per_slot
        #: host time vattn adds per extend / decode forward and per free (microseconds)
        self.extend_us, self.decode_us = self.requests.extend_us, self.requests.decode_us
        self.free_us = self.requests.free_us
        self._limbo = Landing()                      # freed ids on their way to the host
        super().__init__(int(size), page_size, pool.dtype, pool.device, pool, need_sort)
        self._on_cpu = torch.device(pool.device).type == "cpu"
        #: settle frees at the next allocation (default on the GPU; the CPU tests turn it on)
        self.defer_frees = not self._on_cpu
        #: ``$VATTN_METRICS`` snapshots: while serving, and with the page audit when idle
        self.snapshots = metrics_file(self)
        if self.snapshots is not None:
            self.requests.on_idle, self.requests.on_step = self.snapshots.idle, self.snapshots.step

    @classmethod
    def for_pool(cls, pool: VattnMHATokenToKVPool) -> "VattnTokenAllocator":
        """An allocator over ``pool`` with the pool's token budget."""
        return cls(pool.token_budget, pool.page_size, pool.dtype, pool.device, pool)

    def live_slots(self) -> frozenset:
        """vattn slots of requests that have not left (a departed request's slot is released
        at the next forward: the batch in flight may still read it)."""
        return self.requests.running_slots()

    # -- SGLang's allocator interface ----------------------------------------------------------
    def clear(self) -> None:
        """SGLang's reset (start, flush): every slot released, every page id forgotten."""
        if hasattr(self, "requests"):
            self.drain_frees(wait=True)
            self.requests.reset()
            self.cache.forget(range(1, self.size // self.page_size + 1))
        super().clear()

    def alloc(self, need_size: int):
        raise UnsupportedError("vattn allocates per request: SGLang must run with page_size > 1 "
                               "(alloc_extend / alloc_decode), not the token allocator")

    def alloc_extend(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc,
                     extend_num_tokens, num_new_pages=None, **kwargs):
        """SGLang's ``alloc_extend`` (its reference path on the CPU)."""
        self._drain_for(int(extend_num_tokens) // self.page_size + len(prefix_lens_cpu) + 1)
        if not self._on_cpu:
            return super().alloc_extend(prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu,
                                        last_loc, extend_num_tokens, num_new_pages)
        ps = self.page_size
        new_pages = int((-(-seq_lens_cpu // ps) - -(-prefix_lens_cpu // ps)).sum())
        if new_pages > len(self.free_pages):
            return None
        out = torch.empty(extend_num_tokens, dtype=torch.int64)
        alloc_extend_naive(prefix_lens_cpu.long(), seq_lens_cpu.long(), last_loc.long().cpu(),
                           self.free_pages, out, ps, "cpu")
        self.free_pages = self.free_pages[new_pages:]
        return out

    def alloc_decode(self, seq_lens, seq_lens_cpu, last_loc, **kwargs):
        """SGLang's ``alloc_decode`` (on the CPU: a new page where the token starts one)."""
        self._drain_for(len(seq_lens_cpu))
        if not self._on_cpu:
            return super().alloc_decode(seq_lens, seq_lens_cpu, last_loc)
        starts = (seq_lens_cpu.long() - 1) % self.page_size == 0
        new_pages = int(starts.sum())
        if new_pages > len(self.free_pages):
            return None
        out = last_loc.long().cpu() + 1
        out[starts] = self.free_pages[:new_pages] * self.page_size
        self.free_pages = self.free_pages[new_pages:]
        return out

    def _release_page_ids(self, *page_ids: torch.Tensor) -> None:
        """Every page id SGLang frees passes here: forget its key, hold back what is still read."""
        ids = torch.cat([p.reshape(-1) for p in page_ids]) if page_ids else torch.empty(0)
        if not ids.numel():
            return
        if not self.defer_frees:
            self._settle(ids.to("cpu", torch.int64).numpy())
            return
        self._limbo.push(None, ids)

    def available_size(self) -> int:
        """SGLang's free tokens, after settling the freed ids whose copy has landed."""
        if self._limbo:
            self.drain_frees(wait=False)
        return super().available_size()

    def drain_frees(self, wait: bool) -> None:
        """Settle the freed ids whose copy to the host has landed (``wait``: all of them)."""
        self._limbo.drain(wait, lambda _, host: self._settle(host.to(torch.int64).numpy()))

    def _drain_for(self, pages: int) -> None:
        """Before an allocation of up to ``pages`` pages: settle what has landed, and wait for
        the rest only if SGLang's free list would fall short without it."""
        if self._limbo:
            self.drain_frees(wait=False)
            if self._limbo and len(self.free_pages) < pages:
                self.drain_frees(wait=True)

    def _settle(self, ids: np.ndarray) -> None:
        back = self.requests.on_free_pages(ids)
        if back.size:
            super()._release_page_ids(torch.from_numpy(back).to(self.device))

    def _return(self, ids: np.ndarray) -> None:
        """Page ids held back for a request that has now left: free again."""
        super()._release_page_ids(torch.from_numpy(ids).to(self.device))
