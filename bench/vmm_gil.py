"""``vattn bench vmm --only contended``: each step-path driver call's wall and CPU time with
another Python thread busy beside it, as an engine's input / output threads are.

A call that releases the GIL and blocks a few microseconds hands the GIL to the busy thread;
the caller then waits up to the switch interval (5 ms) to get it back: wall time far above the
caller's CPU time. The table gives, per driver path (on CUDA: ``cuda.bindings``, which releases
the GIL, and vattn's direct entry points, which keep it; on the host: the host backend) and
call, the median and mean wall µs with the thread beside idle and busy, and the caller's own
CPU µs per call (``time.thread_time``).
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from contextlib import contextmanager

__all__ = ["contended", "drivers", "torch_calls", "markdown", "CALLS"]

CALLS = ("map", "set_access", "copy", "zero", "fence", "unmap")


@contextmanager
def busy_python_thread(on: bool):
    """A thread running pure Python (no GIL release) while the block runs; nothing when ``on`` is false."""
    stop = threading.Event()

    def spin():
        x = 0
        while not stop.is_set():
            for _ in range(1000):
                x += 1
    thread = threading.Thread(target=spin, name="vattn-busy-python", daemon=True) if on else None
    if thread is not None:
        thread.start()
        time.sleep(0.02)
    try:
        yield
    finally:
        stop.set()
        if thread is not None:
            thread.join()


def _round(drv, base: int, handles: list, sync, extras: dict) -> dict[str, list[tuple[float, float]]]:
    """One round over the pages: every call timed alone, ``(wall s, thread CPU s)`` each."""
    g = drv.granularity
    out: dict[str, list[tuple[float, float]]] = {c: [] for c in (*CALLS, *extras)}

    def timed(name, fn, *args):
        c0, t0 = time.thread_time(), time.perf_counter()
        fn(*args)
        out[name].append((time.perf_counter() - t0, time.thread_time() - c0))
    for i, h in enumerate(handles):
        timed("map", drv.map, base + i * g, g, h)
        timed("set_access", drv.set_access, base + i * g, g)
    for i in range(1, len(handles)):
        timed("copy", drv.copy, base + i * g, base + (i - 1) * g, 64 << 10)
        timed("zero", drv.zero, base + i * g, 64 << 10)
        timed("fence", lambda: drv.record_fence().done())   # recorded and queried, as reclaim does
    for name, fn in extras.items():
        for _ in handles:
            timed(name, fn)
    sync()
    for i in range(len(handles)):
        timed("unmap", drv.unmap, base + i * g, g)
    return out


def contended(drv, *, pages: int = 16, rounds: int = 5, sync=lambda: None, extras=None) -> dict:
    """``{"idle" | "busy": {call: {"wall_median_us", "wall_mean_us", "cpu_mean_us", "n"}}}``;
    ``extras``: more calls to time, ``{name: fn()}`` (e.g. the CUDA event a step records)."""
    extras = dict(extras or {})
    g = drv.granularity
    base = drv.reserve(pages * g)
    drv.view(base, pages * g)                       # as the cache does (CUDA: before any mapping)
    handles = [drv.create(g) for _ in range(pages)]
    result = {}
    try:
        _round(drv, base, handles, sync, extras)    # warm-up
        for beside in ("idle", "busy"):
            samples: dict[str, list[tuple[float, float]]] = {c: [] for c in (*CALLS, *extras)}
            with busy_python_thread(beside == "busy"):
                for _ in range(rounds):
                    for name, xs in _round(drv, base, handles, sync, extras).items():
                        samples[name] += xs
            result[beside] = {name: {"wall_median_us": statistics.median(w for w, _ in xs) * 1e6,
                                     "wall_mean_us": statistics.fmean(w for w, _ in xs) * 1e6,
                                     "cpu_mean_us": statistics.fmean(c for _, c in xs) * 1e6, "n": len(xs)}
                              for name, xs in samples.items()}
    finally:
        for h in handles:
            drv.release(h)
        drv.free_va(base, pages * g)
    return result


def torch_calls(device: str) -> dict:
    """On CUDA, what a step's host section also calls through torch (which releases the GIL in
    each): an event record, an event query, a 4 KiB pinned host-to-device copy."""
    if not device.startswith("cuda"):
        return {}
    import torch
    event = torch.cuda.Event()
    host = torch.zeros(1024, dtype=torch.int32).pin_memory()
    dev = torch.empty(1024, dtype=torch.int32, device=device)
    return {"torch event record": event.record, "torch event query": event.query,
            "torch copy_ 4 KiB H2D": lambda: dev.copy_(host, non_blocking=True)}


def drivers(device: str) -> list[tuple[str, object]]:
    """The driver paths to compare on ``device``: on CUDA both GIL modes, on the host its backend."""
    from vattn.core.driver import HostDriver
    if device.startswith("cuda"):
        from vattn.core.driver.cuda import CudaDriver
        held = CudaDriver(device, keep_gil=True)
        return [("cuda.bindings (GIL released)", CudaDriver(device, keep_gil=False)),
                (f"direct (GIL {held.gil})", held)]
    return [("host backend", HostDriver())]


def markdown(rows: list[tuple[str, dict]]) -> str:
    lines = [f"Each step-path driver call timed alone, a Python thread beside it idle or busy "
             f"(switch interval {sys.getswitchinterval() * 1e3:g} ms); wall µs median / mean, the "
             f"caller's CPU µs mean:", "",
             "| driver path | call | wall, beside idle | wall, beside busy | CPU, beside busy | calls |",
             "|---|---|---|---|---|---|"]
    for label, res in rows:
        for call in res["idle"]:
            idle, busy = res["idle"][call], res["busy"][call]
            lines.append(f"| {label} | {call} | {idle['wall_median_us']:.1f} / {idle['wall_mean_us']:.1f} | "
                         f"**{busy['wall_median_us']:.1f} / {busy['wall_mean_us']:.1f}** | "
                         f"{busy['cpu_mean_us']:.1f} | {busy['n']} |")
    return "\n".join(lines)
