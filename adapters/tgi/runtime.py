"""Request lifecycle of the TGI adapter: one vattn slot per TGI request id.

Host-side only (may synchronize): ``bind`` before a forward, ``release`` when a request
leaves the batch. Nothing here imports TGI; a batch is any object with the attributes
TGI's ``FlashCausalLMBatch`` has (``requests[i].id``, ``slots``, ``cu_slots``,
``block_tables_tensor``, ``cache_lengths``, ``input_lengths``).
"""

from __future__ import annotations

from dataclasses import dataclass

from vattn.core import VirtualKVCache
from vattn.core.errors import VattnError
from vattn.core.requests import RequestSlots

from . import regions

__all__ = ["TgiRuntime", "OutOfPagesError"]


class OutOfPagesError(VattnError):
    """A running request could not be grown. TGI's Python server has no preemption: the router
    admits by the capacity the adapter reports at warmup, so this means that budget was wrong."""


@dataclass
class TgiRuntime:
    """Holds the cache and the request-id -> slot map of one TGI server process."""

    cache: VirtualKVCache
    tenant: str | None = None

    def __post_init__(self):
        self.slot_of = RequestSlots(self.cache)

    @property
    def rows_per_slot(self) -> int:
        return self.cache.layout.rows_per_slot

    def bind(self, batch, *, speculative: int = 0) -> list[int]:
        """Give every unbound request a slot, rewrite its slots/block-table row, map its pages.

        Returns
        -------
        list[int]
            The slot of each request in batch order.

        Raises
        ------
        OutOfPagesError
            ``ensure`` could not grow a request (see the class docstring).
        """
        cfg = self.cache.config
        for i, req in enumerate(batch.requests):
            if req.id in self.slot_of:
                continue
            n = int(batch.cu_slots[i + 1] - batch.cu_slots[i])
            slot = self.slot_of.take(req.id, tenant=self.tenant, expected_len=min(n, cfg.max_context))
            regions.rewrite_request_slots(batch.slots, batch.cu_slots, i, slot,
                                          rows_per_slot=self.rows_per_slot,
                                          max_context=cfg.max_context, num_regions=cfg.max_slots)
            regions.set_region_column(batch.block_tables_tensor, i, slot)
        slots = [self.slot_of[r.id] for r in batch.requests]
        need = regions.needed_lengths(batch.cache_lengths, batch.input_lengths, speculative=speculative)
        failed = self.cache.ensure(dict(zip(slots, need)))
        if failed:
            raise OutOfPagesError(f"no physical pages left to grow slots {failed}; lower "
                                  "--max-total-tokens or raise VATTN_TGI_PAGE_BUDGET")
        return slots

    def release(self, request_ids) -> list[int]:
        """Release the slots of ``request_ids`` that are bound (others are ignored).

        The core records a fence on the current stream, so pages are unmapped only after the
        kernels already queued for the last forward have finished.
        """
        return self.slot_of.drop_many(request_ids)

    def release_all(self) -> list[int]:
        return self.slot_of.drop_all()

    def capacity_tokens(self) -> int:
        """Tokens the router may admit (see :func:`regions.capacity_tokens`)."""
        sets = self.cache.capacity().free_page_sets
        return regions.capacity_tokens(total_page_sets=sets,
                                       tokens_per_page=self.cache.layout.tokens_per_page,
                                       max_slots=self.cache.config.max_slots,
                                       max_context=self.cache.config.max_context)
