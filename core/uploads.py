"""Small per-step uploads of host integer arrays to the device, off the GIL's convoy.

An engine step's metadata (slots, rows, lengths) goes to the device as a few kB every step.
torch's ``pin_memory().to(device, non_blocking=True)`` releases the GIL around its calls, and
with another Python thread busy beside the engine's (SGLang's overlap scheduler, a server's
output thread) each release can wait out that thread's 5 ms switch interval (``vattn bench vmm
--only contended``: a 4 KiB H2D ``copy_`` 10 ms there against its µs alone). Where the cache's
driver keeps the GIL for the adapters' calls too (``gil_everywhere``: ``VATTN_DRIVER_GIL=hold-all``,
the default) :class:`HostUploads` stages the arrays in a ring of persistent pinned buffers and
copies them with the driver's ``cuMemcpyHtoDAsync`` (:meth:`CudaDriver.copy_from_host`) into a
device buffer of the same ring entry: no allocation, no GIL release per step.

A ring entry is reused :data:`RING` uploads later: its host buffer once the fence recorded after
its copy is done (a wait is counted in :attr:`HostUploads.waits`), its device buffer in stream
order (the copy into it is queued after every kernel queued so far, so a kernel that reads the
earlier upload and was queued before runs first). The tensors returned are views of the device
buffer: use them in the step that uploaded them (within the next ``RING - 1`` uploads), as
per-step metadata is; a tensor kept longer must be cloned.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["HostUploads", "FenceRing", "RING", "upload_driver"]

#: ring entries (uploads in flight before a host buffer is reused)
RING = 8


def upload_driver(driver, device):
    """``driver`` where the adapters' per-step uploads go through it (a CUDA device and a driver
    that keeps the GIL for them: ``gil_everywhere``, ``VATTN_DRIVER_GIL=hold-all``), else
    ``None`` (torch's copy)."""
    if torch.device(device).type == "cuda" and getattr(driver, "gil_everywhere", False) is True:
        return driver
    return None


class FenceRing:
    """Which of ``size`` staging buffers a copy reads next: each is handed out again once the
    fence recorded after the copy that last read it is done (waiting for it if not; counted in
    :attr:`waits`)."""

    def __init__(self, size: int):
        self.fences: list = [None] * size
        self.next = 0
        self.waits = 0

    def claim(self) -> int:
        """The next buffer's index, free to overwrite."""
        i = self.next
        self.next = (i + 1) % len(self.fences)
        fence = self.fences[i]
        if fence is not None and not fence.done():     # the device is a whole ring behind
            self.waits += 1
            fence.wait()
        return i

    def read_by(self, i: int, make) -> None:
        """Buffer ``i`` is read by a copy just queued: its fence is recorded after it — the
        buffer's earlier fence recorded again where it can be (:meth:`claim` saw it done; no new
        event a step), else ``make()``."""
        fence = self.fences[i]
        if fence is not None and hasattr(fence, "again"):
            fence.again()
        else:
            self.fences[i] = make()

    def drain(self) -> None:
        """Wait for every copy in flight."""
        for fence in self.fences:
            if fence is not None and not fence.done():
                fence.wait()
        self.fences = [None] * len(self.fences)


class HostUploads:
    """``to_device(*arrays)``: host integer arrays as ``int64`` tensors on ``device``, one copy.

    Parameters
    ----------
    device : torch.device | str
    driver : optional
        The cache's driver: its ``copy_from_host`` and ``record_fence`` are used where it keeps the
        GIL for adapters' calls (``gil_everywhere``); otherwise (or without one, or off CUDA)
        torch's pinned copy, as before.
    capacity : int
        Elements per ring entry at start; grown (to the next power of two) when an upload needs
        more, after every copy in flight has landed.
    """

    def __init__(self, device, driver=None, *, capacity: int = 4096):
        self.device = torch.device(device)
        self._driver = upload_driver(driver, self.device)
        self.through_driver = self._driver is not None
        self.capacity = 0
        self._host: list[torch.Tensor] = []
        self._dev: list[torch.Tensor] = []
        self._ring = FenceRing(RING)
        self.uploads = 0
        if self.through_driver:
            self._grow(max(1, int(capacity)))

    def to_device(self, *arrays) -> list[torch.Tensor]:
        """The arrays, flattened to ``int64`` and uploaded in one copy, as one tensor each."""
        sizes = [int(np.size(a)) for a in arrays]
        flat = np.concatenate([np.asarray(a, dtype=np.int64).reshape(-1) for a in arrays]) if arrays \
            else np.zeros(0, dtype=np.int64)
        self.uploads += 1
        if not self.through_driver:
            if self.device.type == "cpu":
                return list(torch.from_numpy(flat).split(sizes))
            return list(torch.from_numpy(flat).pin_memory().to(self.device, non_blocking=True).split(sizes))
        n = flat.size
        if n > self.capacity:
            self._grow(n)
        i = self._ring.claim()
        host, dev = self._host[i], self._dev[i]
        if n:
            host.numpy()[:n] = flat
            self._driver.copy_from_host(dev.data_ptr(), host.data_ptr(), n * host.element_size())
            self._ring.read_by(i, self._driver.record_fence)
        return list(dev[:n].split(sizes))

    @property
    def waits(self) -> int:
        """Uploads that waited for their host buffer (the device a whole ring behind)."""
        return self._ring.waits

    def _grow(self, n: int) -> None:
        """Ring entries of at least ``n`` elements, once no copy from the old ones is in flight."""
        self._ring.drain()
        size = 1 << max(0, n - 1).bit_length()
        pinned = self.device.type == "cuda"
        self._host = [torch.empty(size, dtype=torch.int64, pin_memory=pinned) for _ in range(RING)]
        self._dev = [torch.empty(size, dtype=torch.int64, device=self.device) for _ in range(RING)]
        self.capacity = size
