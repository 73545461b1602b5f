"""Request-granular token allocator: SGLang token indices backed by vattn slots.

A request (SGLang ``req_pool_idx``) gets one vattn slot on its first extend; its token ``t`` has
index ``slot * C + t``. Allocating for extend/decode maps the pages that cover the new tokens
(``VirtualKVCache.ensure``/``step``); freeing a request releases its slot (the release records a
fence: pages are unmapped only after the GPU finished with them, and only under pressure).
``available_size`` reports what the physical page pool can still hold, so SGLang's admission
control sees real capacity, not the virtual reservation.
"""

from __future__ import annotations

import torch

from vattn.core.errors import ConfigError, SlotError

from .pool import PAD_SLOT, VattnMHATokenToKVPool


class VattnTokenAllocator:
    """Allocate SGLang token indices per request on a :class:`VattnMHATokenToKVPool`.

    Parameters
    ----------
    pool : VattnMHATokenToKVPool
        The pool whose ``req_slots`` table this allocator keeps current.
    tenant_of : callable, optional
        ``req_pool_idx -> tenant`` used for scrubbing on slot reuse (default: one tenant).
    """

    def __init__(self, pool: VattnMHATokenToKVPool, *, tenant_of=None):
        if not isinstance(pool, VattnMHATokenToKVPool):
            raise ConfigError(f"VattnTokenAllocator needs a VattnMHATokenToKVPool, got "
                              f"{type(pool).__name__}")
        self.pool = pool
        self.cache = pool.vattn_cache
        self.rows_per_slot = pool.rows_per_slot
        self.device = pool.req_slots.device
        self._tenant_of = tenant_of
        self._slot_of: dict[int, int] = {}

    # -- queries -------------------------------------------------------------------------------
    def available_size(self) -> int:
        """Tokens the free + reclaimable physical pages can still hold."""
        return int(self.cache.capacity().free_tokens)

    def slot_of(self, req_pool_idx: int) -> int:
        """vattn slot of a live request."""
        try:
            return self._slot_of[int(req_pool_idx)]
        except KeyError:
            raise SlotError(f"request {req_pool_idx} holds no vattn slot") from None

    # -- allocation (host side) ----------------------------------------------------------------
    def alloc_extend(self, req_pool_indices, prefix_lens, seq_lens) -> torch.Tensor | None:
        """Indices for positions ``prefix_lens[i] .. seq_lens[i]-1`` of each request.

        Parameters
        ----------
        req_pool_indices, prefix_lens, seq_lens : sequence of int
            One entry per request (host values).

        Returns
        -------
        torch.Tensor or None
            ``[sum(seq_lens - prefix_lens)]`` int64 token indices, requests concatenated; ``None``
            when pages ran out (SGLang's out-of-memory convention: the caller retracts/preempts).
            Slots acquired by this call are released again on failure.
        """
        reqs = [int(r) for r in req_pool_indices]
        fresh = [r for r in reqs if r not in self._slot_of]
        for r, n in zip(reqs, seq_lens):
            if r not in self._slot_of:
                tenant = self._tenant_of(r) if self._tenant_of else None
                self._bind(r, self.cache.acquire(tenant=tenant, expected_len=int(n)))
        if self.cache.ensure({self._slot_of[r]: int(n) for r, n in zip(reqs, seq_lens)}):
            for r in fresh:
                self.free_request(r)
            return None
        return self._locs(reqs, prefix_lens, seq_lens)

    def alloc_decode(self, req_pool_indices, seq_lens) -> torch.Tensor | None:
        """Index of position ``seq_lens[i] - 1`` (the new token) of each request; ``None`` if OOM."""
        reqs = [int(r) for r in req_pool_indices]
        if self.cache.step({self.slot_of(r): int(n) for r, n in zip(reqs, seq_lens)}):
            return None
        return self._locs(reqs, [int(n) - 1 for n in seq_lens], seq_lens)

    def free_request(self, req_pool_idx: int) -> None:
        """Release a finished/retracted request's slot (event-fenced by the core)."""
        slot = self._slot_of.pop(int(req_pool_idx), None)
        if slot is None:
            raise SlotError(f"request {req_pool_idx} holds no vattn slot (double free?)")
        self.pool.req_slots[int(req_pool_idx)] = PAD_SLOT
        self.cache.release(slot)

    def free(self, free_index: torch.Tensor) -> None:
        """SGLang-style free by token indices: releases every slot those indices belong to."""
        slots = set(torch.unique(free_index.long() // self.rows_per_slot).tolist()) - {PAD_SLOT}
        for req in [r for r, s in self._slot_of.items() if s in slots]:
            self.free_request(req)

    # -- helpers -------------------------------------------------------------------------------
    def _bind(self, req: int, slot: int) -> None:
        self._slot_of[req] = slot
        self.pool.req_slots[req] = slot

    def _locs(self, reqs, starts, ends) -> torch.Tensor:
        parts = [self._slot_of[r] * self.rows_per_slot + torch.arange(int(a), int(b))
                 for r, a, b in zip(reqs, starts, ends)]
        out = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
        return out.to(device=self.device, dtype=torch.int64)
