"""Admission: which idle slot a new request gets, and what acquiring and releasing record.

The policy: the idle slot where the request's prefix-cache hit was last mapped, else the
warmest idle slot holding at least the expected length, then one of the same tenant, then the
one released longest ago. A request with a hit instead takes the idle slot that costs the
fewest VMM calls: one that starts with the same prefix, else one whose pages at the hit
positions (unmapped for the shared ones) and below its expected length (mapped) are fewest.
Slots being mapped in the background are passed over while others are idle.
"""

from __future__ import annotations

import numpy as np

from .errors import SlotError
from .state import CacheState

__all__ = ["Admission"]


class Admission:
    """The admission part of a cache (runs under the cache lock)."""

    def __init__(self, state: CacheState):
        self.state = state

    def acquire(self, tenant, expected_len: int, prefix, home=None) -> int:
        """:meth:`VirtualKVCache.acquire` with checked arguments."""
        st, table = self.state, self.state.slots
        table.clock += 1
        need = st.layout.pages_for(expected_len)
        idle = np.flatnonzero(~table.active[:st.config.max_slots])
        if not idle.size:
            raise SlotError(f"all {st.config.max_slots} slots are in use")
        if table.inflight:
            ready = idle[~np.isin(idle, list(table.inflight))]
            idle = ready if ready.size else idle
        slot = self._home_slot(home) if home is not None else None
        if slot is not None and len(prefix) and st.pages.at(slot, len(prefix) - 1) != st.keys.get(prefix[-1]):
            slot = None                   # the copy's source without the hit in front of it
        if slot is None:
            slot = self._home_slot(prefix[-1] if len(prefix) else None)
        if slot is None:
            slot = self._best_fit(idle, need, tenant, prefix)
        st.settle(slot)
        previous = table.tenant[slot]
        table.one_tenant &= tenant is None
        table.active[slot], table.tenant[slot], table.length[slot] = True, tenant, 0
        table.bound_sets[slot] = 0
        if st.pages.usable(slot):
            st.counters.warm_hits += 1
            # a slot's pages all carry its last tenant (tagged when mapped or retagged); the
            # same tenant again needs no pass over them unless every reuse is scrubbed
            if st.config.scrub == "always" or previous is not tenant or slot in table.mixed:
                try:
                    st.pages.retag(slot, tenant)
                except BaseException:                 # a failed scrub: the slot stays idle
                    table.active[slot], table.tenant[slot] = False, previous
                    raise
        table.mixed.discard(slot)
        return slot

    def release(self, slot: int, fence) -> None:
        """The request in ``slot`` ended; ``fence`` completes when the device is done with it."""
        table = self.state.slots
        table.fence[slot] = fence
        table.active[slot] = False
        table.released_at[slot] = table.clock

    def _home_slot(self, key) -> int | None:
        """The idle slot where the page-set ``key`` names was last mapped, if it still is."""
        st = self.state
        home = st.home(key) if key is not None else None
        if home is None or st.slots.active[home[0]] or home[0] in st.slots.inflight:
            return None
        return home[0]

    def _best_fit(self, idle: np.ndarray, need: int, tenant, prefix=()) -> int:
        """The idle slot to hand out: one holding at least ``need`` page-sets first, the warmest
        of those (a request grows past its prompt: surplus pages spare it mapping as it decodes,
        and stay reclaimable), then the same tenant, then the longest idle (vectorised: one call
        per admission). With a ``prefix`` hit of ``a`` page-sets, the cheapest slot first: one
        starting with the prefix's first page-set costs nothing, another ``min(have, a)`` unmaps
        (its own pages where the shared ones go) plus the page-sets it lacks above the hit.
        Without a prefix, a slot mapping shared page-sets counts as cold (after the empty ones)."""
        table, pages = self.state.slots, self.state.pages
        have = pages.usable_n[idle]
        if table.one_tenant and tenant is None:     # no slot has another tenant: skip the loop
            other = np.zeros(idle.size, dtype=bool)
        else:
            other = np.fromiter((table.tenant[s] != tenant for s in idle.tolist()), dtype=bool,
                                count=idle.size)
        if len(prefix):
            first = self.state.keys.get(prefix[0])
            same = pages.head[idle] == first[0] if first is not None else np.zeros(idle.size, dtype=bool)
            a = len(prefix)
            cost = np.where(same, 0, np.minimum(have, a) + np.maximum(0, need - np.maximum(have, a)))
            order = np.lexsort((table.released_at[idle], other, -have, cost))
        else:
            # a slot mapping shared page-sets (a prefix hit's, or one staged there) is cold to a
            # request without that prefix: its fresh blocks would replace them (unmap + map)
            shared = np.isin(idle, list(table.mixed)) if table.mixed else np.zeros(idle.size, dtype=bool)
            have = np.where(shared, 0, have)
            order = np.lexsort((table.released_at[idle], other, shared, -have, have < need))
        return int(idle[order[0]])
