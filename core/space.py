"""The cache's virtual address space: one reservation holding every VA range, the K/V views over
it (fixed for the cache's lifetime) and page-set copies inside it."""

from __future__ import annotations

import torch

from .errors import ConfigError, DriverError
from .layout import KVLayout

__all__ = ["AddressSpace", "MAX_VA_BYTES"]

MAX_VA_BYTES = 1 << 46  # 64 TiB: inside both the x86-64 user space and the CUDA VA limits


class AddressSpace:
    """The VA ranges of one cache, range ``r`` at ``base + r * range_bytes``. Reserved through
    the cache's driver; the cache then sets ``driver`` to its :class:`~.deferred.DeferredCalls`
    over these ranges (copies queue behind their ranges' calls in a deferral window).

    Raises
    ------
    ConfigError
        The ranges need more than :data:`MAX_VA_BYTES` (checked before anything is reserved).
    """

    def __init__(self, driver, layout: KVLayout):
        self.driver, self.layout = driver, layout
        self.num_bytes = layout.num_ranges * layout.range_bytes
        if self.num_bytes > MAX_VA_BYTES:
            raise ConfigError(f"the cache needs {self.num_bytes / 2**40:.1f} TiB of virtual address "
                              f"space, more than {MAX_VA_BYTES >> 40} TiB; lower max_slots or max_context")
        self.base: int | None = None
        self.bases: list[int] = []
        self.elems: torch.Tensor | None = None
        self.views: dict[tuple[int, str], torch.Tensor] = {}

    def reserve(self, dtype: torch.dtype) -> None:
        """Reserve the ranges and view them as ``dtype`` elements (``ConfigError`` if the
        driver refuses the reservation)."""
        try:
            self.base = self.driver.reserve(self.num_bytes)
        except DriverError as exc:
            raise ConfigError(f"could not reserve {self.num_bytes} bytes of virtual address space: "
                              f"{exc}") from exc
        self.bases = [self.base + r * self.layout.range_bytes for r in range(self.layout.num_ranges)]
        self.elems = self.driver.view(self.base, self.num_bytes).view(dtype)

    def view(self, layer: int, which: str) -> torch.Tensor:
        """K (``which="k"``) or V of ``layer``: ``[max_slots + 1, rows_per_slot, H, D]``, made once."""
        key = (layer, which)
        if key not in self.views:
            place = self.layout.place(layer)
            rng, off = (place.k_range, place.k_offset) if which == "k" else (place.v_range, place.v_offset)
            elems = self.elems[rng * self.layout.range_bytes // self.elems.element_size():]
            self.views[key] = self.layout.slot_view(elems, off)
        return self.views[key]

    def copy_set(self, src: tuple[int, int], dst: tuple[int, int], pages: tuple) -> None:
        """Copy page-set ``src`` to ``dst`` (``(slot, index)`` each): one driver copy per range
        (``cuMemcpyDtoDAsync`` on CUDA). Inside a deferral window, each range's copy is queued
        behind that range's calls (it reads and writes through them), also when nothing waits
        yet: it is made where the forward reaches the range, before that range's layers write
        the source's position, instead of on the step's path; ``pages``: the pool pages of
        ``src`` and of ``dst`` (one per range each), marked as used by the queued copies.
        A window opened with ``copies=False`` queues them only behind calls already waiting."""
        lay = self.layout
        src_off, dst_off = lay.page_offset(*src), lay.page_offset(*dst)
        nbytes = lay.page_bytes
        if self.driver.copies_later():
            for rng, base in enumerate(self.bases):
                self.driver.touch([pids[rng] for pids in pages], rng)
                self.driver.copy_later(rng, base + dst_off, base + src_off, nbytes)
            return
        self.driver.copy_many([(base + dst_off, base + src_off, nbytes) for base in self.bases])

    def run_bytes(self, rng: int, slot: int, index: int, count: int) -> torch.Tensor:
        """``uint8`` bytes of page-sets ``index .. index + count - 1`` of ``slot`` in range ``rng``."""
        flat = self.elems.view(torch.uint8)
        start = rng * self.layout.range_bytes + self.layout.page_offset(slot, index)
        return flat[start:start + count * self.layout.page_bytes]

    def drop_views(self) -> None:
        """Forget every view (the memory under them is about to go)."""
        self.views.clear()
        self.elems = None

    def free(self) -> None:
        """Give the reservation back (once; its pages must be unmapped)."""
        if self.base is not None:
            self.driver.free_va(self.base, self.num_bytes)
            self.base = None
