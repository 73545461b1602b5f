"""What a cache reports about its pages: capacity for a scheduler, gauges for metrics, and the
audit that checks the page accounting end to end. Every function runs under the cache lock."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import VattnError
from .state import CacheState

__all__ = ["Capacity", "capacity", "gauges", "audit"]


@dataclass(frozen=True, slots=True)
class Capacity:
    """What a scheduler may still admit."""

    free_pages: int          # in the pool, unmapped
    reclaimable_pages: int   # mapped to idle slots or beyond active slots' needs
    free_page_sets: int      # (free + reclaimable) // ranges
    free_tokens: int         # tokens those page-sets hold
    idle_slots: int


def capacity(st: CacheState, reclaimable: int) -> Capacity:
    """:class:`Capacity` with ``reclaimable`` pages (:meth:`~vattn.core.reclaim.Reclaim.reclaimable`)."""
    lay, n = st.layout, st.config.max_slots
    sets = (st.pool.num_free + reclaimable) // lay.num_ranges
    idle = int(n - st.slots.active[:n].sum())
    tokens = sets * lay.page_bytes // lay.token_bytes
    return Capacity(st.pool.num_free, reclaimable, sets, tokens, idle)


def gauges(st: CacheState) -> dict:
    """The page and slot gauges of :meth:`~vattn.core.cache.VirtualKVCache.metrics`."""
    lay, n, pool = st.layout, st.config.max_slots, st.pool
    active, held = st.slots.active[:n], st.pages.held_n[:n]
    used = int(st.slots.length[:n][active].sum()) * lay.token_bytes * lay.num_ranges
    held_active = int(held[active].sum()) * lay.page_bytes
    warm = int(held[~active].sum()) * lay.page_bytes
    return {"pages_total": pool.num_pages, "pages_free": pool.num_free,
            "pages_mapped": pool.num_used, "active_slots": int(active.sum()),
            "warm_bytes": warm, "waste_bytes": held_active - used,
            "mapped_bytes": pool.num_used * lay.page_bytes,
            "keys_held": len(st.keys), "pages_bound": int(st.pages.bound.sum()),
            "retired_mappings": st.pages.retired.count()}


def audit(st: CacheState) -> None:
    """:meth:`~vattn.core.cache.VirtualKVCache.audit` once the map-ahead worker is idle."""
    pages, pool = st.pages, st.pool
    for slot, ranges in enumerate(pages.mapped):
        for rng, pids in enumerate(ranges):
            if -1 in pids and pids.index(-1) < pages.num_accessible[slot][rng]:
                raise VattnError(f"slot {slot} range {rng}: a hole below its accessible pages "
                                 f"(a failed remap left position {pids.index(-1)} unmapped)")
    for slot, (_, spots) in pages.retired.items():
        for rng, index in spots:
            if index < len(pages.mapped[slot][rng]):
                raise VattnError(f"slot {slot} range {rng}: position {index} is recorded as mapped "
                                 "and as retired (its old mapping not yet unmapped)")
    mapped = np.fromiter((pid for ranges in pages.mapped for pids in ranges for pid in pids if pid >= 0),
                         dtype=np.int64)
    count = np.bincount(mapped, minlength=pool.num_pages)
    reads = np.bincount(np.fromiter(_read_pages(st), dtype=np.int64), minlength=pool.num_pages)
    bound = np.zeros(pool.num_pages, dtype=bool)
    for pids in st.keys.pids.values():
        bound[list(pids)] = True
    for what, bad in (("the bound flags disagree with the keys", bound != pages.bound),
                      ("its references are not its mappings plus its key", pool.refs != count + bound),
                      ("two running requests read it but no key shares it", ~bound & (reads > 1))):
        if bad.any():
            pid = int(np.flatnonzero(bad)[0])
            raise VattnError(f"page {pid}: {what} (mapped {int(count[pid])}x, refs "
                             f"{int(pool.refs[pid])}, bound {bool(bound[pid])}, at "
                             f"{_where(st, pid)})")
    held = [sum(map(len, ranges)) for ranges in pages.mapped]
    if held != pages.held_n.tolist():
        slot = next(s for s, (n, m) in enumerate(zip(pages.held_n.tolist(), held)) if n != m)
        raise VattnError(f"slot {slot} is counted as holding {pages.held_n[slot]} "
                         f"pages but holds {held[slot]}")
    if pages.packs is not None:
        pages.packs.check(pages.mapped)
    if int((pool.refs > 0).sum()) + pool.num_free != pool.num_pages:
        raise VattnError(f"{int((pool.refs > 0).sum())} used + {pool.num_free} free pages != "
                         f"{pool.num_pages} in the pool")


def _read_pages(st: CacheState):
    """Pages mapped where a running request reads: below an acquired slot's length or its
    bound page-sets."""
    for slot in np.flatnonzero(st.slots.active[:st.config.max_slots]).tolist():
        top = int(st.slots.num_read_sets(slot))
        for pids in st.pages.mapped[slot]:
            yield from (p for p in pids[:top] if p >= 0)


def _where(st: CacheState, pid: int) -> list[tuple[int, int, int]]:
    """Every (slot, range, index) that maps pool page ``pid`` (for error messages)."""
    return [(slot, rng, i) for slot, ranges in enumerate(st.pages.mapped)
            for rng, pids in enumerate(ranges) for i, p in enumerate(pids) if p == pid]
