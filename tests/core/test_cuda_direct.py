"""The GIL-holding driver entry points (core/driver/cuda_direct.py), against stand-in functions:
arguments reach the C function as the driver's signatures say, a driver that hands out no
entry point leaves the caller on cuda.bindings, and the switch refuses what it does not know."""

import ctypes
import types

import pytest

from vattn.core.driver import cuda_direct
from vattn.core.driver.cuda import DRIVER_GIL_ENV, _keep_gil_from_env
from vattn.core.errors import ConfigError


def _stand_ins(calls):
    """C function pointers (ctypes callbacks) recording their arguments, one per signature."""
    made = {}
    for name, argtypes in {**cuda_direct.SIGNATURES, **cuda_direct.RELEASING}.items():
        def record(*args, _name=name):
            calls.append((_name, args))
            return 0 if _name != "cuMemUnmap" else 1      # CUDA_ERROR_INVALID_VALUE
        made[name] = ctypes.CFUNCTYPE(ctypes.c_int, *argtypes)(record)
    return made


def _fake_cu(pointers, fail=None):
    success = object()

    def get_proc_address(symbol, version, flags):
        name = symbol.decode()
        assert version == cuda_direct.OPTIONAL.get(name, (cuda_direct.CUDA_VERSION,))[0] and flags == "legacy"
        if name == fail or name not in pointers:
            return ("not found", 0, None)
        return (success, pointers[name], "found")
    return types.SimpleNamespace(
        cuGetProcAddress=get_proc_address, CUresult=types.SimpleNamespace(CUDA_SUCCESS=success),
        CUdriverProcAddress_flags=types.SimpleNamespace(CU_GET_PROC_ADDRESS_LEGACY_STREAM="legacy"))


def test_calls_reach_the_c_function_with_64_bit_addresses_and_return_cuda_results():
    calls = []
    funcs = _stand_ins(calls)
    pointers = {name: ctypes.cast(f, ctypes.c_void_p).value for name, f in funcs.items()}
    direct, why = cuda_direct.direct_calls(_fake_cu(pointers))
    assert why == "ok"
    va, handle, stream = 0x7F28_A1C0_0000, 0x47E7_0820_1234, 0x5555_0000_1000
    assert direct.cuMemMap(va, 2 << 20, 0, handle, 0) == 0
    assert direct.cuMemUnmap(va, 2 << 20) == 1                # a failure comes back as its code
    assert direct.cuMemcpyDtoDAsync(va + 64, va, 4096, stream) == 0
    assert direct.cuMemsetD8Async(va, 0, 128, None) == 0
    assert calls == [("cuMemMap", (va, 2 << 20, 0, handle, 0)), ("cuMemUnmap", (va, 2 << 20)),
                     ("cuMemcpyDtoDAsync", (va + 64, va, 4096, stream)),
                     ("cuMemsetD8Async", (va, 0, 128, None))]


def test_a_driver_without_an_entry_point_keeps_the_bindings():
    calls = []
    funcs = _stand_ins(calls)
    pointers = {name: ctypes.cast(f, ctypes.c_void_p).value for name, f in funcs.items()}
    direct, why = cuda_direct.direct_calls(_fake_cu(pointers, fail="cuMemSetAccess"))
    assert direct is None and "cuMemSetAccess" in why
    with pytest.raises(ValueError, match="cuMemcpyDtoDAsync"):
        cuda_direct.DirectCalls({k: v for k, v in pointers.items() if k != "cuMemcpyDtoDAsync"})


def test_a_fence_is_an_event_created_recorded_queried_and_destroyed_through_the_entry_points():
    """DirectFence against stand-ins: the event the create call writes is the one recorded on
    the stream, queried (600, not ready, is False; 0 is True; anything else the caller's typed
    error), waited on, and destroyed once the fence goes."""
    calls, state = [], {"query": 600}

    def create(event_p, flags):
        calls.append(("create", flags))
        event_p[0] = 0xE7E47
        return 0
    c_api = {"cuEventCreate": create,
             "cuEventRecord": lambda ev, stream: calls.append(("record", ev, stream)) or 0,
             "cuEventQuery": lambda ev: state["query"],
             "cuEventSynchronize": lambda ev: calls.append(("sync", ev)) or 0,
             "cuEventDestroy": lambda ev: calls.append(("destroy", ev)) or 0}
    tables = {**cuda_direct.SIGNATURES, **cuda_direct.RELEASING}
    funcs = {name: ctypes.CFUNCTYPE(ctypes.c_int, *tables[name])(fn) for name, fn in c_api.items()}
    funcs.update({name: f for name, f in _stand_ins([]).items() if name not in funcs})
    direct = cuda_direct.DirectCalls({name: ctypes.cast(f, ctypes.c_void_p).value for name, f in funcs.items()})
    failed = []
    fence = cuda_direct.DirectFence(direct, 0x5000, lambda name, err: failed.append((name, err)))
    assert fence.done() is False
    state["query"] = 0
    assert fence.done() is True
    fence.wait()
    state["query"] = 700                                  # CUDA_ERROR_ILLEGAL_ADDRESS
    fence.done()
    assert failed == [("cuEventQuery", 700)]
    del fence
    assert calls == [("create", cuda_direct.EVENT_FLAGS), ("record", 0xE7E47, 0x5000),
                     ("sync", 0xE7E47), ("destroy", 0xE7E47)]


def test_a_timing_event_records_on_the_current_stream_and_times_through_the_entry_points():
    """DirectTimingEvent (DeviceWait's events where the driver keeps the GIL): made with timing
    (flags 0), recorded on the stream the callback gives at each record, queried, and
    ``elapsed_time`` read from the driver's float; a failure is the caller's typed error."""
    calls, made = [], iter((0xA1, 0xB2))

    def create(event_p, flags):
        calls.append(("create", flags))
        event_p[0] = next(made)
        return 0

    def elapsed(ms_p, start, end):
        calls.append(("elapsed", start, end))
        ms_p[0] = 7.5
        return 0
    c_api = {"cuEventCreate": create,
             "cuEventRecord": lambda ev, stream: calls.append(("record", ev, stream)) or 0,
             "cuEventQuery": lambda ev: 0,
             "cuEventElapsedTime": elapsed,
             "cuEventDestroy": lambda ev: calls.append(("destroy", ev)) or 0}
    funcs = {name: ctypes.CFUNCTYPE(ctypes.c_int, *cuda_direct.SIGNATURES[name])(fn) for name, fn in c_api.items()}
    funcs.update({name: f for name, f in _stand_ins([]).items() if name not in funcs})
    direct = cuda_direct.DirectCalls({name: ctypes.cast(f, ctypes.c_void_p).value for name, f in funcs.items()})
    stream = {"now": 0x10}
    start = cuda_direct.DirectTimingEvent(direct, lambda: stream["now"], lambda name, err: None)
    end = cuda_direct.DirectTimingEvent(direct, lambda: stream["now"], lambda name, err: None)
    start.record()
    stream["now"] = 0x20
    end.record()
    assert start.query() and end.query()
    assert start.elapsed_time(end) == 7.5
    del start, end
    assert calls == [("create", 0), ("create", 0), ("record", 0xA1, 0x10), ("record", 0xB2, 0x20),
                     ("elapsed", 0xA1, 0xB2), ("destroy", 0xA1), ("destroy", 0xB2)]


def test_gil_switch(monkeypatch):
    monkeypatch.delenv(DRIVER_GIL_ENV, raising=False)
    assert _keep_gil_from_env() == "all"                  # the default since it ran on a GPU
    monkeypatch.setenv(DRIVER_GIL_ENV, "hold")
    assert _keep_gil_from_env() is True
    monkeypatch.setenv(DRIVER_GIL_ENV, "release")
    assert _keep_gil_from_env() is False
    monkeypatch.setenv(DRIVER_GIL_ENV, "hold-all")
    assert _keep_gil_from_env() == "all"
    monkeypatch.setenv(DRIVER_GIL_ENV, "yes")
    with pytest.raises(ConfigError, match="expected 'hold', 'hold-all' or 'release', got 'yes'"):
        _keep_gil_from_env()


def test_only_the_engine_thread_holds_the_gil_the_worker_keeps_releasing_it():
    """A map-ahead worker (it called bind_thread) goes through cuda.bindings: with the GIL held
    there it would be the busy Python thread the engine's own thread waits 5 ms for."""
    import threading
    from vattn.core.driver.cuda import CudaDriver
    drv = CudaDriver.__new__(CudaDriver)               # no GPU here: only the per-thread choice
    drv._direct, drv._thread = object(), threading.local()
    seen = {}

    def worker():
        seen["before"] = drv._fast()
        drv._thread.worker = True                        # what bind_thread records
        seen["after"] = drv._fast()
    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen["before"] is drv._direct and seen["after"] is None
    assert drv._fast() is drv._direct                   # the engine's thread still holds it
    drv._direct = None
    assert drv._fast() is None


def test_step_calls_take_the_direct_entry_point_or_the_bindings_and_fail_typed():
    """CudaDriver's step-path calls against stand-ins of cuda.bindings and of the direct entry
    points: the engine's thread takes the direct one (plain ints), a worker the bindings; a
    failure either way is a DriverError naming the call and its arguments."""
    import enum
    import threading
    from vattn.core.driver.cuda import CudaDriver
    from vattn.core.errors import DriverError

    class CUresult(enum.IntEnum):
        CUDA_SUCCESS = 0
        CUDA_ERROR_INVALID_VALUE = 1
    calls = []
    cu = types.SimpleNamespace(
        CUresult=CUresult,
        cuGetErrorName=lambda err: (CUresult.CUDA_SUCCESS, CUresult(err).name.encode()),
        cuMemUnmap=lambda va, size: calls.append(("bindings", va, size)) or (CUresult.CUDA_SUCCESS,),
        cuMemMap=lambda *args: (CUresult.CUDA_ERROR_INVALID_VALUE,))
    direct = types.SimpleNamespace(cuMemUnmap=lambda va, size: calls.append(("direct", va, size)) or 0,
                                   cuMemMap=lambda *args: 1)
    drv = CudaDriver.__new__(CudaDriver)
    drv.cu, drv._direct, drv._thread = cu, direct, threading.local()
    drv.unmap(1 << 40, 4096)
    with pytest.raises(DriverError, match=r"cuMemMap\(va=.*handle=7.*CUDA_ERROR_INVALID_VALUE"):
        drv.map(1 << 40, 4096, 7)
    t = threading.Thread(target=lambda: (setattr(drv._thread, "worker", True), drv.unmap(2 << 40, 4096)))
    t.start()
    t.join()
    assert calls == [("direct", 1 << 40, 4096), ("bindings", 2 << 40, 4096)]
    drv._direct = None                                   # the default: cuda.bindings everywhere
    with pytest.raises(DriverError, match=r"cuMemMap\(va=.*CUDA_ERROR_INVALID_VALUE"):
        drv.map(1 << 40, 4096, 7)


def test_a_batch_of_copies_reaches_the_driver_as_arrays_on_a_stream_it_accepts():
    """CudaDriver.copy_many against a stand-in ``cuMemcpyBatchAsync``: the copies as three
    arrays, one attribute (stream-ordered source access, device locations) for all of them, and
    — torch's legacy stream 0 being refused by the batch call — a blocking stream made once;
    a current stream of its own is used as it is. Without the entry point or when not asked
    for: one copy each."""
    import enum
    import threading
    from vattn.core.driver.cuda import CudaDriver
    from vattn.core.driver.cuda_direct import MemcpyAttributes

    class CUresult(enum.IntEnum):
        CUDA_SUCCESS = 0
        CUDA_ERROR_INVALID_VALUE = 1
    seen = []
    status = {"err": 0}

    def batch(dsts, srcs, sizes, count, attrs, idxs, num_attrs, stream):
        a = ctypes.cast(attrs, ctypes.POINTER(MemcpyAttributes)).contents
        seen.append(("batch", [dsts[i] for i in range(count)], [srcs[i] for i in range(count)],
                     [sizes[i] for i in range(count)], (a.src_access_order, a.src_type, a.src_id,
                                                        a.dst_type, a.dst_id, a.flags),
                     idxs[0], num_attrs, stream))
        return status["err"]

    def stream_create(handle_p, flags):
        seen.append(("stream", flags))
        handle_p[0] = 0x5EED
        return 0
    funcs = _stand_ins([])
    argtypes = {name: types for name, (_, types) in cuda_direct.OPTIONAL.items()}
    funcs["cuMemcpyBatchAsync"] = ctypes.CFUNCTYPE(ctypes.c_int, *argtypes["cuMemcpyBatchAsync"])(batch)
    funcs["cuStreamCreate"] = ctypes.CFUNCTYPE(ctypes.c_int, *argtypes["cuStreamCreate"])(stream_create)
    direct = cuda_direct.DirectCalls({n: ctypes.cast(f, ctypes.c_void_p).value for n, f in funcs.items()})
    drv = CudaDriver.__new__(CudaDriver)
    drv.cu = types.SimpleNamespace(CUresult=CUresult,
                                   cuGetErrorName=lambda err: (0, CUresult(err).name.encode()))
    drv._direct, drv._thread, drv._side_stream, drv.batch_copies = direct, threading.local(), None, True
    drv._copy_attrs = MemcpyAttributes(1, 1, 3, 1, 3, 0)
    current = {"stream": 0}
    drv._raw_stream = lambda index: current["stream"]
    drv.device = types.SimpleNamespace(index=3)
    singles = []
    drv.copy = lambda dst, src, n: singles.append((dst, src, n))
    hi = 0x7F00_0000_0000
    copies = [(hi + 4096, hi, 2 << 20), (hi + 3 * 4096, hi + 2 * 4096, 2 << 20)]
    drv.copy_many(copies)
    drv.copy_many(copies)
    current["stream"] = 0xABC
    drv.copy_many(copies)
    want = ("batch", [hi + 4096, hi + 3 * 4096], [hi, hi + 2 * 4096], [2 << 20, 2 << 20],
            (1, 1, 3, 1, 3, 0), 0, 1)
    assert seen == [("stream", 0), (*want, 0x5EED), (*want, 0x5EED), (*want, 0xABC)]
    status["err"] = 1
    from vattn.core.errors import DriverError
    with pytest.raises(DriverError, match=r"cuMemcpyBatchAsync\(count=2.*CUDA_ERROR_INVALID_VALUE"):
        drv.copy_many(copies)
    drv.copy_many(copies[:1])                           # one copy: a plain copy
    drv.batch_copies = False
    drv.copy_many(copies)
    assert singles == [copies[0], *copies]
