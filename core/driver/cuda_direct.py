"""The hot CUDA driver calls made with the GIL held (``ctypes.PYFUNCTYPE`` over the entry points
the driver hands out through ``cuGetProcAddress``), instead of through ``cuda.bindings``, which
releases the GIL around every call.

Why: an engine's process runs other Python threads beside the one that steps the model (vLLM's
engine core reads requests and writes outputs on two threads; SGLang's scheduler has its own).
A call that releases the GIL and blocks even a few microseconds lets such a thread take the GIL,
and the caller then waits for that thread's switch interval (``sys.getswitchinterval()``, 5 ms)
to get it back: with a busy thread beside it, each of a step's VMM calls can cost ~5 ms of wall
time at ~10 µs of CPU (the "convoy" of CPython's GIL; ``vattn bench vmm --only contended``
measures it). These calls take microseconds and never wait on another Python thread, so holding
the GIL through them costs the other threads nothing they would not wait anyway.

Only the engine's own thread holds it: the map-ahead worker's calls keep releasing the GIL
(held there, the worker would be the busy thread the engine's thread waits for). The default
since it ran on the H100 (``VATTN_DRIVER_GIL=release`` or :class:`~.cuda.CudaDriver`'s
``keep_gil=False`` go back to ``cuda.bindings``): with a busy thread beside, ~5 ms a call through
the bindings against the call's own µs here (``vattn bench vmm --only contended``).
Only the calls on a step's path are here (map, unmap, set-access, the copy and the memset, and the
fences' events: create, record, query, destroy); creating and releasing physical memory, reserving
VA and errors stay on ``cuda.bindings``. A fence's blocking wait (``cuEventSynchronize``) releases
the GIL: it waits on the device, and another thread may run meanwhile.
"""

from __future__ import annotations

import ctypes
from ctypes import c_size_t, c_ubyte, c_uint64, c_void_p

__all__ = ["DirectCalls", "DirectEvent", "DirectFence", "DirectTimingEvent", "MemcpyAttributes",
           "direct_calls", "SIGNATURES", "OPTIONAL"]

#: CUDA version asked of ``cuGetProcAddress``: the newest ABI of each call up to it (the ``_v2``
#: copy and memset, the 10.2 VMM calls)
CUDA_VERSION = 12000
#: name -> C argument types (every call returns ``CUresult``, an int)
SIGNATURES = {
    "cuMemMap": (c_uint64, c_size_t, c_size_t, c_uint64, c_uint64),   # va, size, offset, handle, flags
    "cuMemUnmap": (c_uint64, c_size_t),                                 # va, size
    "cuMemSetAccess": (c_uint64, c_size_t, c_void_p, c_size_t),        # va, size, desc*, count
    "cuMemcpyDtoDAsync": (c_uint64, c_uint64, c_size_t, c_void_p),     # dst, src, bytes, stream
    "cuMemsetD8Async": (c_uint64, c_ubyte, c_size_t, c_void_p),        # dst, value, bytes, stream
    "cuMemcpyHtoDAsync": (c_uint64, c_void_p, c_size_t, c_void_p),     # dst, host src, bytes, stream
    "cuEventCreate": (ctypes.POINTER(c_void_p), ctypes.c_uint),         # event*, flags
    "cuEventRecord": (c_void_p, c_void_p),                              # event, stream
    "cuEventQuery": (c_void_p,),                                        # event
    "cuEventDestroy": (c_void_p,),                                      # event
    "cuEventElapsedTime": (ctypes.POINTER(ctypes.c_float), c_void_p, c_void_p),   # ms*, start, end
}
#: called through ``ctypes.CFUNCTYPE``: the GIL is released while they run (they may block)
RELEASING = {"cuEventSynchronize": (c_void_p,)}
#: name -> (the CUDA version whose ABI is asked for, argument types): entry points a driver may
#: lack (the attribute is then ``None``). ``cuMemcpyBatchAsync`` of CUDA 13 (no failure-index
#: argument): dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, stream — it refuses the
#: legacy default stream (see :class:`~.cuda.CudaDriver.copy_many`)
OPTIONAL = {
    "cuMemcpyBatchAsync": (13000, (ctypes.POINTER(c_uint64), ctypes.POINTER(c_uint64),
                                   ctypes.POINTER(c_size_t), c_size_t, c_void_p,
                                   ctypes.POINTER(c_size_t), c_size_t, c_void_p)),
    "cuStreamCreate": (12000, (ctypes.POINTER(c_void_p), ctypes.c_uint)),   # stream*, flags
}


class MemcpyAttributes(ctypes.Structure):
    """``CUmemcpyAttributes``: source access order, source and destination location hints
    (``CUmemLocation``: type, id), flags."""

    _fields_ = [("src_access_order", ctypes.c_int), ("src_type", ctypes.c_int), ("src_id", ctypes.c_int),
                ("dst_type", ctypes.c_int), ("dst_id", ctypes.c_int), ("flags", ctypes.c_uint)]


#: ``CU_MEMCPY_SRC_ACCESS_ORDER_STREAM``, ``CU_MEM_LOCATION_TYPE_DEVICE``
SRC_ACCESS_ORDER_STREAM, LOCATION_DEVICE = 1, 1
#: ``CU_EVENT_DISABLE_TIMING``: a fence needs no timestamp
EVENT_FLAGS = 0x2
CUDA_ERROR_NOT_READY = 600


class DirectCalls:
    """One attribute per name of :data:`SIGNATURES`: the driver's function, called with the GIL
    held, returning the ``CUresult`` as an int (0: success)."""

    def __init__(self, pointers: dict[str, int]):
        missing = sorted((set(SIGNATURES) | set(RELEASING)) - set(pointers))
        if missing:
            raise ValueError(f"DirectCalls: no entry point for {', '.join(missing)}")
        for table, kind in ((SIGNATURES, ctypes.PYFUNCTYPE), (RELEASING, ctypes.CFUNCTYPE)):
            for name, argtypes in table.items():
                setattr(self, name, kind(ctypes.c_int, *argtypes)(pointers[name]))
        for name, (_, argtypes) in OPTIONAL.items():
            pfn = pointers.get(name)
            setattr(self, name, ctypes.PYFUNCTYPE(ctypes.c_int, *argtypes)(pfn) if pfn else None)


class DirectEvent:
    """A CUDA event made through :class:`DirectCalls` (created, recorded, queried and destroyed
    with the GIL held). ``timing``: it can time (:meth:`elapsed_time`); ``fail(name, err)``
    raises the caller's typed error for a failed call."""

    __slots__ = ("_calls", "_event", "_fail")

    def __init__(self, calls: DirectCalls, fail, *, timing: bool = False):
        self._calls, self._fail, self._event = calls, fail, None
        event = c_void_p()
        self._check("cuEventCreate", calls.cuEventCreate(ctypes.byref(event), 0 if timing else EVENT_FLAGS))
        self._event = event.value

    def _check(self, name: str, err: int) -> None:
        if err:
            self._fail(name, err)

    def record_on(self, stream: int) -> None:
        self._check("cuEventRecord", self._calls.cuEventRecord(self._event, stream))

    def done(self) -> bool:
        err = self._calls.cuEventQuery(self._event)
        if err == CUDA_ERROR_NOT_READY:
            return False
        self._check("cuEventQuery", err)
        return True

    def wait(self) -> None:
        """Block until the device is past the event (the GIL released meanwhile)."""
        self._check("cuEventSynchronize", self._calls.cuEventSynchronize(self._event))

    def __del__(self):
        event, self._event = self._event, None
        if event is not None:
            self._calls.cuEventDestroy(event)   # freed once the device is past it


class DirectFence(DirectEvent):
    """A fence: an event without timing recorded on ``stream`` (a handle, or a callable giving
    the current one) when made, and again by :meth:`again`."""

    __slots__ = ("_stream",)

    def __init__(self, calls: DirectCalls, stream, fail):
        super().__init__(calls, fail)
        self._stream = stream if callable(stream) else (lambda: stream)
        self.again()

    def again(self) -> None:
        """Record the fence once more, after the work issued since (its event reused)."""
        self.record_on(self._stream())


class DirectTimingEvent(DirectEvent):
    """What :class:`~vattn.core.device_wait.DeviceWait` needs of ``torch.cuda.Event(enable_timing=
    True)``, with the GIL held: ``record()`` on the current stream (``stream()`` gives it),
    ``query()``, ``elapsed_time(end)`` in ms."""

    __slots__ = ("_stream",)

    def __init__(self, calls: DirectCalls, stream, fail):
        super().__init__(calls, fail, timing=True)
        self._stream = stream

    def record(self) -> None:
        self.record_on(self._stream())

    def query(self) -> bool:
        return self.done()

    def elapsed_time(self, end: "DirectTimingEvent") -> float:
        ms = ctypes.c_float()
        err = self._calls.cuEventElapsedTime(ctypes.byref(ms), self._event, end._event)
        self._check("cuEventElapsedTime", err)
        return ms.value


def direct_calls(cu) -> tuple[DirectCalls | None, str]:
    """The calls of :data:`SIGNATURES` resolved through ``cu.cuGetProcAddress`` (``cu``: the
    ``cuda.bindings.driver`` module), or ``(None, why)`` when the driver does not hand one out
    (the caller then keeps ``cuda.bindings``)."""
    try:
        return _resolve(cu)
    except (TypeError, ValueError) as exc:      # a cuda.bindings whose signature differs
        return None, f"cuGetProcAddress: {exc}"


def _resolve(cu) -> tuple[DirectCalls | None, str]:
    flags = cu.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_LEGACY_STREAM   # torch's stream 0
    pointers = {}
    for name in (*SIGNATURES, *RELEASING):
        result = cu.cuGetProcAddress(name.encode(), CUDA_VERSION, flags)
        err, pfn = result[0], result[1]
        if err != cu.CUresult.CUDA_SUCCESS or not int(pfn):
            return None, f"cuGetProcAddress({name}) gave {err!r}, pointer {int(pfn):#x}"
        pointers[name] = int(pfn)
    for name, (version, _) in OPTIONAL.items():     # absent from an older driver: left out
        result = cu.cuGetProcAddress(name.encode(), version, flags)
        if result[0] == cu.CUresult.CUDA_SUCCESS and int(result[1]):
            pointers[name] = int(result[1])
    return DirectCalls(pointers), "ok"
