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
(held there, the worker would be the busy thread the engine's thread waits for). Opt-in for now (``VATTN_DRIVER_GIL=hold``; :class:`~.cuda.CudaDriver`'s ``keep_gil``) until it
has run on a GPU. Only the calls on a step's path are here (map, unmap, set-access, the copy and the memset);
creating and releasing physical memory, reserving VA and errors stay on ``cuda.bindings``.
"""

from __future__ import annotations

import ctypes
from ctypes import c_size_t, c_ubyte, c_uint64, c_void_p

__all__ = ["DirectCalls", "direct_calls", "SIGNATURES"]

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
}


class DirectCalls:
    """One attribute per name of :data:`SIGNATURES`: the driver's function, called with the GIL
    held, returning the ``CUresult`` as an int (0: success)."""

    def __init__(self, pointers: dict[str, int]):
        missing = sorted(set(SIGNATURES) - set(pointers))
        if missing:
            raise ValueError(f"DirectCalls: no entry point for {', '.join(missing)}")
        for name, argtypes in SIGNATURES.items():
            setattr(self, name, ctypes.PYFUNCTYPE(ctypes.c_int, *argtypes)(pointers[name]))


def direct_calls(cu) -> tuple[DirectCalls | None, str]:
    """The calls of :data:`SIGNATURES` resolved through ``cu.cuGetProcAddress`` (``cu``: the
    ``cuda.bindings.driver`` module), or ``(None, why)`` when the driver does not hand one out
    (the caller then keeps ``cuda.bindings``)."""
    flags = cu.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_LEGACY_STREAM   # torch's stream 0
    pointers = {}
    for name in SIGNATURES:
        result = cu.cuGetProcAddress(name.encode(), CUDA_VERSION, flags)
        err, pfn = result[0], result[1]
        if err != cu.CUresult.CUDA_SUCCESS or not int(pfn):
            return None, f"cuGetProcAddress({name}) gave {err!r}, pointer {int(pfn):#x}"
        pointers[name] = int(pfn)
    return DirectCalls(pointers), "ok"
