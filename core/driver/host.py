"""Host backend: CUDA VMM semantics on Linux memory (for CI and machines without a GPU).

reserve  = an anonymous ``PROT_NONE`` mapping with ``MAP_NORESERVE``;
create   = a range of one growing memfd (a physical page);
map      = ``mmap(MAP_FIXED | MAP_SHARED)`` of that range into the reservation, still ``PROT_NONE``;
set_access = ``mprotect(PROT_READ | PROT_WRITE)``;
unmap    = the range goes back to an anonymous ``PROT_NONE`` reservation.
Like the CUDA driver it refuses to map over a mapped page or to grant access to an unmapped one,
so bookkeeping bugs surface here as typed errors instead of silent aliasing.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading

import torch

from ..errors import DriverError
from .base import DoneFence

__all__ = ["HostDriver"]

_PROT_NONE, _PROT_RW = 0, 0x1 | 0x2
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANON, _MAP_NORESERVE = 0x01, 0x02, 0x10, 0x20, 0x4000
_FALLOC_PUNCH = 0x01 | 0x02  # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE
_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def _locked(method):
    """Serialise a call: the map-ahead worker and the engine thread share one driver."""
    @functools.wraps(method)
    def call(self, *args):
        with self._lock:
            return method(self, *args)
    return call


class HostDriver:
    """VMM semantics on host memory.

    Parameters
    ----------
    granularity : int
        Physical page size in bytes (a multiple of the OS page size). Defaults to 2 MiB,
        the CUDA VMM granularity on Hopper, so byte math matches the GPU.
    """

    name = "host"
    unmap_spans = True   # munmap takes any whole pages, several mappings at once

    def __init__(self, *, granularity: int = 2 << 20):
        os_page = os.sysconf("SC_PAGE_SIZE")
        if granularity <= 0 or granularity % os_page:
            raise DriverError("HostDriver", {"granularity": granularity}, "EINVAL",
                              f"granularity must be a positive multiple of {os_page}")
        self.device = torch.device("cpu")
        self.granularity = granularity
        self._lock = threading.Lock()
        self._fd = os.memfd_create("vattn-pages", os.MFD_CLOEXEC)
        self._fd_size = 0
        self._spare: list[int] = []          # released page offsets, reused by create
        self._live: set[int] = set()         # offsets of created, unreleased pages
        self._reserved: dict[int, int] = {}  # va -> size
        self._mapped: dict[int, int] = {}    # page va -> page offset
        self._sizes: dict[int, int] = {}     # offset -> bytes, of handles of more than one page
        self._spans: dict[int, int] = {}     # page va -> first va of its multi-page mapping
        self._access: set[int] = set()       # page vas with read/write access

    # -- reservations -------------------------------------------------------------------------
    @_locked
    def reserve(self, size: int) -> int:
        self._check_aligned("reserve", size=size)
        g = self.granularity
        raw = _libc.mmap(None, size + g, _PROT_NONE, _MAP_PRIVATE | _MAP_ANON | _MAP_NORESERVE, -1, 0)
        if raw in (None, _FAILED):
            raise self._errno("mmap", size=size)
        va = -(-raw // g) * g                       # align like cuMemAddressReserve does
        if va > raw:
            _libc.munmap(raw, va - raw)
        if raw + g > va:
            _libc.munmap(va + size, raw + g - va)
        self._reserved[va] = size
        return va

    @_locked
    def free_va(self, va: int, size: int) -> None:
        if self._reserved.get(va) != size:
            raise DriverError("munmap", {"va": va, "size": size}, "EINVAL", "not a reservation")
        if any(va <= p < va + size for p in self._mapped):
            raise DriverError("munmap", {"va": va, "size": size}, "EBUSY", "pages still mapped")
        if _libc.munmap(va, size) != 0:
            raise self._errno("munmap", va=va, size=size)
        del self._reserved[va]

    # -- physical pages -----------------------------------------------------------------------
    @_locked
    def create(self, size: int) -> int:
        if size <= 0 or size % self.granularity:
            raise DriverError("memfd_create", {"size": size}, "EINVAL",
                              f"host allocations are positive multiples of {self.granularity} bytes")
        if size > self.granularity:          # several pages: one new extent, mapped only whole
            offset = self._fd_size
            os.ftruncate(self._fd, offset + size)
            self._fd_size = offset + size
            self._live.add(offset)
            self._sizes[offset] = size
            return offset
        if self._spare:
            offset = self._spare.pop()
        else:
            offset = self._fd_size
            os.ftruncate(self._fd, offset + size)
            self._fd_size = offset + size
        self._live.add(offset)
        return offset

    @_locked
    def release(self, handle: int) -> None:
        if handle not in self._live:
            raise DriverError("release", {"handle": handle}, "EINVAL", "unknown or released page")
        if handle in self._mapped.values():
            raise DriverError("release", {"handle": handle}, "EBUSY", "page is still mapped")
        size = self._sizes.pop(handle, self.granularity)
        _libc.fallocate(self._fd, _FALLOC_PUNCH, handle, size)  # give memory back
        self._live.discard(handle)
        self._spare.extend(range(handle, handle + size, self.granularity))

    # -- mapping --------------------------------------------------------------------------------
    @_locked
    def map(self, va: int, size: int, handle: int) -> None:
        self._check_aligned("mmap", va=va, size=size)
        if handle not in self._live or size != self._sizes.get(handle, self.granularity):
            raise DriverError("mmap", {"va": va, "size": size, "handle": handle}, "EINVAL",
                              "one live allocation per map call, mapped whole (as CUDA's cuMemMap)")
        self._check_reserved("mmap", va, size)
        pages = range(va, va + size, self.granularity)
        if any(p in self._mapped for p in pages):
            raise DriverError("mmap", {"va": va, "size": size}, "EEXIST", "page already mapped")
        got = _libc.mmap(va, size, _PROT_NONE, _MAP_SHARED | _MAP_FIXED, self._fd, handle)
        if got != va:
            raise self._errno("mmap", va=va, size=size, handle=handle)
        for p in pages:
            self._mapped[p] = handle
            if size > self.granularity:
                self._spans[p] = va

    @_locked
    def set_access(self, va: int, size: int) -> None:
        pages = self._pages("mprotect", va, size)
        if any(p not in self._mapped for p in pages):
            raise DriverError("mprotect", {"va": va, "size": size}, "EINVAL", "range not fully mapped")
        if _libc.mprotect(va, size, _PROT_RW) != 0:
            raise self._errno("mprotect", va=va, size=size)
        self._access.update(pages)

    @_locked
    def unmap(self, va: int, size: int) -> None:
        pages = self._pages("munmap", va, size)
        if any(p not in self._mapped for p in pages):
            raise DriverError("munmap", {"va": va, "size": size}, "EINVAL", "range not fully mapped")
        for p in pages:                     # a multi-page allocation is unmapped only whole
            first = self._spans.get(p)
            if first is not None and not va <= first < first + self._sizes[self._mapped[p]] <= va + size:
                raise DriverError("munmap", {"va": va, "size": size}, "EINVAL",
                                  "part of a multi-page mapping (unmapped only whole)")
        flags = _MAP_PRIVATE | _MAP_ANON | _MAP_NORESERVE | _MAP_FIXED
        if _libc.mmap(va, size, _PROT_NONE, flags, -1, 0) != va:
            raise self._errno("mmap", va=va, size=size)
        for p in pages:
            del self._mapped[p]
            self._access.discard(p)
            self._spans.pop(p, None)

    # -- memory access --------------------------------------------------------------------------
    def view(self, va: int, nbytes: int) -> torch.Tensor:
        self._check_reserved("view", va, nbytes)
        if va - va % self.granularity in self._mapped:    # CUDA maps a scratch page there
            raise DriverError("view", {"va": va, "nbytes": nbytes}, "EINVAL",
                              "make views before mapping: the first page is mapped")
        buf = (ctypes.c_uint8 * nbytes).from_address(va)
        return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)

    @_locked
    def zero(self, va: int, nbytes: int) -> None:
        pages = self._pages("memset", va - va % self.granularity,
                            nbytes + va % self.granularity + (-(va + nbytes)) % self.granularity)
        if any(p not in self._access for p in pages):
            raise DriverError("memset", {"va": va, "nbytes": nbytes}, "EFAULT", "range not accessible")
        ctypes.memset(va, 0, nbytes)

    @_locked
    def copy(self, dst: int, src: int, nbytes: int) -> None:
        g, access = self.granularity, self._access
        for name, va in (("dst", dst), ("src", src)):   # accessible pages are reserved ones
            if nbytes <= 0 or any(p not in access for p in range(va - va % g, va + nbytes, g)):
                raise DriverError("memmove", {"dst": dst, "src": src, "nbytes": nbytes}, "EFAULT",
                                  f"{name} range not accessible")
        if dst < src + nbytes and src < dst + nbytes:
            raise DriverError("memmove", {"dst": dst, "src": src, "nbytes": nbytes}, "EINVAL",
                              "the ranges overlap")
        ctypes.memmove(dst, src, nbytes)

    def record_fence(self) -> DoneFence:
        return DoneFence()

    def bind_thread(self) -> None:
        return None

    def free_memory(self) -> int:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

    def close(self) -> None:
        """Unmap everything, free every reservation and the memfd."""
        for va, size in list(self._reserved.items()):
            _libc.munmap(va, size)
        self._reserved.clear(), self._mapped.clear(), self._access.clear(), self._live.clear()
        self._sizes.clear(), self._spans.clear()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    # -- helpers -------------------------------------------------------------------------------
    def is_mapped(self, va: int) -> bool:
        """Whether the page at ``va`` is mapped (for tests and invariant checks)."""
        return va in self._mapped

    def mapped_handle(self, va: int) -> int | None:
        return self._mapped.get(va)

    def _pages(self, call: str, va: int, size: int) -> range:
        self._check_aligned(call, va=va, size=size)
        self._check_reserved(call, va, size)
        return range(va, va + size, self.granularity)

    def _check_aligned(self, call: str, **args) -> None:
        bad = {k: v for k, v in args.items() if v % self.granularity or (k == "size" and v <= 0)}
        if bad:
            raise DriverError(call, args, "EINVAL", f"must be positive multiples of {self.granularity}")

    def _check_reserved(self, call: str, va: int, size: int) -> None:
        if not any(b <= va and va + size <= b + s for b, s in self._reserved.items()):
            raise DriverError(call, {"va": va, "size": size}, "EINVAL", "outside every reservation")

    @staticmethod
    def _errno(call: str, **args) -> DriverError:
        err = ctypes.get_errno()
        return DriverError(call, args, os.strerror(err) if err else "failed")
