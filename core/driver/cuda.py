"""CUDA backend: the driver's virtual-memory API through ``cuda.bindings.driver``.

Every failed call raises :class:`~vattn.core.errors.DriverError` naming the call and its
arguments. The module imports ``cuda.bindings`` lazily, so ``vattn.core`` imports without it.
"""

from __future__ import annotations

import ctypes
import os
import threading

import torch

from ..config import env_flag
from ..errors import ConfigError, DriverError, UnsupportedError
from .cuda_direct import (LOCATION_DEVICE, SRC_ACCESS_ORDER_STREAM, DirectFence, DirectTimingEvent,
                          MemcpyAttributes, direct_calls)

__all__ = ["CudaDriver", "CudaFence", "DRIVER_GIL_ENV", "BATCH_COPIES_ENV"]

#: ``hold-all`` (the default): the step's VMM calls and fences keep the GIL (:mod:`.cuda_direct`),
#: and so do the engine adapters' per-step torch calls that have a driver form (the slot table's
#: upload and its fences, the device-wait events); ``hold``: the VMM calls and fences only;
#: ``release``: every call through ``cuda.bindings`` and torch's events, which release it
DRIVER_GIL_ENV = "VATTN_DRIVER_GIL"
#: ``1``: :meth:`CudaDriver.copy_many` makes a batch of copies with one ``cuMemcpyBatchAsync``
#: (CUDA 13 drivers; the default where the driver has it); ``0``: one call per copy
BATCH_COPIES_ENV = "VATTN_BATCH_COPIES"


def _bindings():
    try:
        from cuda.bindings import driver as cu  # noqa: PLC0415  (optional dependency)
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise UnsupportedError(
            "the CUDA backend needs the cuda-python package (pip install 'vattn[cuda]'); "
            f"importing cuda.bindings failed: {exc}") from exc
    return cu


class CudaFence:
    """A CUDA event recorded on the current stream."""

    __slots__ = ("event",)

    def __init__(self):
        self.event = torch.cuda.Event()
        self.event.record()

    def done(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        self.event.synchronize()

    def again(self) -> None:
        """Record the fence once more on the current stream (its event reused)."""
        self.event.record()


class _ArrayInterface:
    """Exposes a raw device pointer to ``torch.as_tensor`` (CUDA array interface v3)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3, "strides": None}


class CudaDriver:
    """VMM on one CUDA device (pinned device memory, read/write access for that device)."""

    name = "cuda"

    def __init__(self, device: torch.device | str | int = "cuda", *, keep_gil: bool | str | None = None,
                 batch_copies: bool | None = None):
        self.cu = cu = _bindings()
        if not torch.cuda.is_available():
            raise UnsupportedError("the CUDA backend was asked for but torch sees no CUDA device")
        self.device = torch.device(device if not isinstance(device, int) else f"cuda:{device}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.init()
        torch.zeros(1, device=self.device)  # make the primary context current here
        self._call("cuInit", cu.cuInit, 0)
        self._ctx = self._call("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain,
                               self._call("cuDeviceGet", cu.cuDeviceGet, self.device.index))
        self._prop = prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.device.index
        self._access = acc = cu.CUmemAccessDesc()
        acc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        acc.location.id = self.device.index
        acc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        flag = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        self.granularity = int(self._call("cuMemGetAllocationGranularity",
                                          cu.cuMemGetAllocationGranularity, prop, flag))
        if keep_gil is None:
            keep_gil = _keep_gil_from_env()     # True, "all" or False
        #: the step's calls with the GIL held (None: through cuda.bindings); ``gil`` says which
        self._direct, why = direct_calls(cu) if keep_gil else (None, f"{DRIVER_GIL_ENV}=release")
        self.gil = "held" if self._direct is not None else f"released ({why})"
        #: ``keep_gil="all"`` (``hold-all``): adapters route their per-step torch calls here too
        #: (:meth:`copy_from_host`, :meth:`timing_event`)
        self.gil_everywhere = keep_gil == "all" and self._direct is not None
        if batch_copies is None:
            batch_copies = env_flag(BATCH_COPIES_ENV, True)
        #: whether :meth:`copy_many` batches (the direct entry point exists and it was asked for)
        self.batch_copies = bool(batch_copies and self._direct is not None
                                 and self._direct.cuMemcpyBatchAsync is not None)
        self._copy_attrs = MemcpyAttributes(SRC_ACCESS_ORDER_STREAM, LOCATION_DEVICE, self.device.index,
                                            LOCATION_DEVICE, self.device.index, 0)
        self._side_stream = None                # a blocking stream for batches (made on first use)
        self._thread = threading.local()       # .worker: a thread that called bind_thread
        self.unmap_spans = self._unmaps_spans()
        #: the current stream's handle without torch.cuda.current_stream's Python layers
        self._raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
            lambda index: torch.cuda.current_stream(index).cuda_stream)

    def _unmaps_spans(self) -> bool:
        """Whether this driver unmaps two adjacent mappings with one cuMemUnmap (asked once, on
        two scratch pages): reclaim then takes a run of pages back in one call."""
        g, cu = self.granularity, self.cu
        va = self.reserve(2 * g)
        handles = [self.create(g), self.create(g)]
        try:
            for i, h in enumerate(handles):
                self.map(va + i * g, g, h)
            err, = cu.cuMemUnmap(va, 2 * g)
            if err == cu.CUresult.CUDA_SUCCESS:
                return True
            for i in range(2):                  # whatever the failed call left mapped
                cu.cuMemUnmap(va + i * g, g)
            return False
        finally:
            for h in handles:
                self.release(h)
            self.free_va(va, 2 * g)

    def _fast(self):
        """The GIL-holding calls for the calling thread, or ``None``: the map-ahead worker (it
        called :meth:`bind_thread`) goes through ``cuda.bindings``, releasing the GIL, so the
        engine's thread runs while the worker maps (held there, the worker would be the busy
        thread the engine's thread waits 5 ms for)."""
        direct = self._direct
        return None if direct is None or getattr(self._thread, "worker", False) else direct

    def _raise(self, name: str, err, shown: dict):
        _, text = self.cu.cuGetErrorName(err)
        raise DriverError(name, shown, text.decode() if isinstance(text, bytes) else str(err))

    def _step_call(self, name: str, shown: dict, direct_args: tuple, *args) -> None:
        """A call of the step's path: the GIL-holding entry point for this thread with
        ``direct_args`` (plain ints and pointers), else ``cuda.bindings`` with ``args``."""
        direct = self._fast()
        if direct is None:
            self._call(name, getattr(self.cu, name), *args, shown=shown)
            return
        err = getattr(direct, name)(*direct_args)
        if err:
            self._raise(name, self.cu.CUresult(err), shown)

    def _call(self, name: str, fn, *args, shown: dict | None = None):
        result = fn(*args)
        err = result[0] if isinstance(result, tuple) else result
        if err != self.cu.CUresult.CUDA_SUCCESS:
            self._raise(name, err, shown if shown is not None else {"args": args})
        if isinstance(result, tuple) and len(result) > 1:
            return result[1] if len(result) == 2 else result[1:]
        return None

    def reserve(self, size: int) -> int:
        va = self._call("cuMemAddressReserve", self.cu.cuMemAddressReserve, size,
                        self.granularity, 0, 0, shown={"size": size})
        return int(va)

    def free_va(self, va: int, size: int) -> None:
        self._call("cuMemAddressFree", self.cu.cuMemAddressFree, va, size,
                   shown={"va": va, "size": size})

    def create(self, size: int):
        return self._call("cuMemCreate", self.cu.cuMemCreate, size, self._prop, 0,
                          shown={"size": size, "device": self.device.index})

    def release(self, handle) -> None:
        self._call("cuMemRelease", self.cu.cuMemRelease, handle, shown={"handle": int(handle)})

    def map(self, va: int, size: int, handle) -> None:
        h = int(handle)
        self._step_call("cuMemMap", {"va": va, "size": size, "handle": h}, (va, size, 0, h, 0),
                        va, size, 0, handle, 0)

    def set_access(self, va: int, size: int) -> None:
        self._step_call("cuMemSetAccess", {"va": va, "size": size}, (va, size, self._access.getPtr(), 1),
                        va, size, [self._access], 1)

    def unmap(self, va: int, size: int) -> None:
        self._step_call("cuMemUnmap", {"va": va, "size": size}, (va, size), va, size)

    def view(self, va: int, nbytes: int) -> torch.Tensor:
        # torch may query the pointer's attributes, which fails on VA with nothing mapped:
        # back the first page with a scratch page while the tensor is made.
        scratch = self.create(self.granularity)
        try:
            self.map(va, self.granularity, scratch)
            try:
                self.set_access(va, self.granularity)
                return torch.as_tensor(_ArrayInterface(va, nbytes), device=self.device)
            finally:
                torch.cuda.synchronize(self.device)
                self.unmap(va, self.granularity)
        finally:
            self.release(scratch)

    def zero(self, va: int, nbytes: int) -> None:
        args = (va, 0, nbytes, self._raw_stream(self.device.index))
        self._step_call("cuMemsetD8Async", {"va": va, "nbytes": nbytes}, args, *args)

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        """One ``cuMemcpyDtoDAsync`` on torch's current stream (a page-set copy makes one per
        range: a driver call each, where a strided tensor copy spanning the ranges costs
        TensorIterator's 64-bit-index split into a launch per range)."""
        args = (dst, src, nbytes, self._raw_stream(self.device.index))
        self._step_call("cuMemcpyDtoDAsync", {"dst": dst, "src": src, "nbytes": nbytes}, args, *args)

    def copy_from_host(self, dst: int, src: int, nbytes: int) -> None:
        """``nbytes`` from pinned host memory at ``src`` to device memory at ``dst``, async on the
        current stream (a small table upload; the source must stay untouched until a fence
        recorded after it is done)."""
        args = (dst, src, nbytes, self._raw_stream(self.device.index))
        self._step_call("cuMemcpyHtoDAsync", {"dst": dst, "src": src, "nbytes": nbytes}, args, *args)

    def copy_many(self, copies: list[tuple[int, int, int]]) -> None:
        """``(dst, src, nbytes)`` copies that do not depend on each other (no copy reads or
        writes what another writes), in any order among themselves, ordered after earlier and
        before later work on the current stream: one ``cuMemcpyBatchAsync`` where
        :attr:`batch_copies`, else one :meth:`copy` each. The batch call refuses the legacy
        default stream (torch's stream 0): there it runs on a blocking stream of its own, which
        the legacy stream orders against both ways."""
        direct = self._fast()
        if not self.batch_copies or direct is None or len(copies) < 2:
            for dst, src, nbytes in copies:
                self.copy(dst, src, nbytes)
            return
        n = len(copies)
        dsts, srcs, sizes = (ctypes.c_uint64 * n)(), (ctypes.c_uint64 * n)(), (ctypes.c_size_t * n)()
        for i, (dst, src, nbytes) in enumerate(copies):
            dsts[i], srcs[i], sizes[i] = dst, src, nbytes
        stream = self._raw_stream(self.device.index) or self._blocking_stream(direct)
        first = ctypes.c_size_t(0)
        err = direct.cuMemcpyBatchAsync(dsts, srcs, sizes, n, ctypes.byref(self._copy_attrs),
                                        ctypes.byref(first), 1, stream)
        if err:
            self._raise("cuMemcpyBatchAsync", self.cu.CUresult(err),
                        {"count": n, "first": copies[0], "stream": stream})

    def _blocking_stream(self, direct) -> int:
        if self._side_stream is None:
            handle = ctypes.c_void_p()
            err = direct.cuStreamCreate(ctypes.byref(handle), 0)   # CU_STREAM_DEFAULT: blocking
            if err:
                self._raise("cuStreamCreate", self.cu.CUresult(err), {"flags": 0})
            self._side_stream = handle.value
        return self._side_stream

    def record_fence(self) -> CudaFence | DirectFence:
        """An event on the current stream: through the GIL-holding entry points on the engine's
        thread when the driver keeps the GIL, else torch's (which releases it per call)."""
        direct = self._fast()
        if direct is None:
            return CudaFence()
        return DirectFence(direct, lambda: self._raw_stream(self.device.index), self._fail_event)

    def timing_event(self) -> DirectTimingEvent | None:
        """An event that times, recorded on the current stream, with the GIL held (for
        :class:`~vattn.core.device_wait.DeviceWait`); ``None`` unless :attr:`gil_everywhere` and
        on a thread whose calls keep the GIL (the caller then takes torch's)."""
        direct = self._fast()
        if direct is None or not self.gil_everywhere:
            return None
        return DirectTimingEvent(direct, lambda: self._raw_stream(self.device.index), self._fail_event)

    def _fail_event(self, name: str, err: int):
        self._raise(name, self.cu.CUresult(err), {})

    def bind_thread(self) -> None:
        self._call("cuCtxSetCurrent", self.cu.cuCtxSetCurrent, self._ctx)
        torch.cuda.set_device(self.device)
        self._thread.worker = True

    def free_memory(self) -> int:
        free, _ = torch.cuda.mem_get_info(self.device)
        return int(free)

    def close(self) -> None:
        return None


def _keep_gil_from_env() -> bool | str:
    """``hold-all`` (the default) -> ``"all"``, ``hold`` -> True, ``release`` -> False."""
    value = os.environ.get(DRIVER_GIL_ENV, "hold-all")
    modes = {"hold": True, "hold-all": "all", "release": False}
    if value not in modes:
        raise ConfigError(f"{DRIVER_GIL_ENV}: expected 'hold', 'hold-all' or 'release', got {value!r}")
    return modes[value]
