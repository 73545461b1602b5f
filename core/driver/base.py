"""The small interface every virtual-memory backend implements.

A backend reserves virtual address (VA) ranges, creates physical pages ("handles"),
maps them into reserved VA, grants access, and unmaps them again. All methods are
host-side and may synchronize; none may be called inside a CUDA graph capture.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

__all__ = ["Driver", "Fence", "DoneFence"]


@runtime_checkable
class Fence(Protocol):
    """Proof that the device finished the work recorded before it."""

    def done(self) -> bool:
        """True once every kernel recorded before the fence has completed."""

    def wait(self) -> None:
        """Block until :meth:`done` would return True."""


class DoneFence:
    """A fence that is already complete (host work is synchronous)."""

    __slots__ = ()

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


class Driver(Protocol):
    """Virtual-memory backend: the same semantics on CUDA and on the host."""

    name: str
    device: torch.device
    granularity: int  # bytes; every size and address below is a multiple of it
    #: whether :meth:`unmap` may cover several adjacent mappings in one call (optional;
    #: absent means no: every mapping is unmapped on its own)
    unmap_spans: bool

    def reserve(self, size: int) -> int:
        """Reserve ``size`` bytes of VA with no memory behind it; returns the base address."""

    def free_va(self, va: int, size: int) -> None:
        """Give back a reservation (every page in it must be unmapped first)."""

    def create(self, size: int) -> object:
        """Create one physical page of ``size`` bytes; returns an opaque handle."""

    def release(self, handle: object) -> None:
        """Free a physical page (it must not be mapped anywhere)."""

    def map(self, va: int, size: int, handle: object) -> None:
        """Map ``handle`` at ``va`` (not yet accessible until :meth:`set_access`)."""

    def set_access(self, va: int, size: int) -> None:
        """Grant read/write access to ``[va, va + size)``, which must be fully mapped."""

    def unmap(self, va: int, size: int) -> None:
        """Unmap ``[va, va + size)``, whole mappings only (several adjacent ones where
        ``unmap_spans``); the VA stays reserved."""

    def view(self, va: int, nbytes: int) -> torch.Tensor:
        """A ``uint8`` tensor over ``[va, va + nbytes)`` on this driver's device; ``va``'s page
        must not be mapped yet (CUDA backs it with a scratch page while torch makes the tensor)."""

    def zero(self, va: int, nbytes: int) -> None:
        """Zero mapped bytes, ordered before later work on the current stream."""

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        """Copy ``nbytes`` from ``src`` to ``dst`` (both accessible, not overlapping), ordered
        after earlier and before later work on the current stream."""

    def record_fence(self) -> Fence:
        """Record a fence after all work issued so far on the current stream."""

    def bind_thread(self) -> None:
        """Make this driver usable from the calling thread (CUDA: set the context)."""

    def free_memory(self) -> int:
        """Bytes of device memory free now (host: available RAM)."""
