"""VMM calls while the GPU is busy: does a call wait for the kernels in flight?

An engine under async scheduling makes its VMM calls while the previous step's kernels run. A
call that waits for them (an implicit synchronisation) costs the rest of the kernel's time and
takes the host's lead away, however fast the call itself is on an idle GPU. For each driver call
this measures its host time with the GPU idle and while a kernel of ``busy_ms`` runs (on the
default stream, as engines run their forward, and on a stream of its own), on pages no kernel
reads, and counts the calls after which the kernel had already finished.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Callable

from .report import upper_quantile

__all__ = ["CALLS", "busy_latency", "cuda_busy", "launch_stalls", "markdown", "stalls_markdown"]

#: the driver calls measured, in the order one page goes through them
CALLS = ("create", "map", "set_access", "unmap", "release")


def busy_latency(drv, num_pages: int, *, busy_ms: float, launch: Callable[[float], None] | None,
                 running: Callable[[], bool] = lambda: False, idle: Callable[[], None] = lambda: None) -> dict:
    """Per call: median host µs and, with ``launch``, how many of ``num_pages`` calls returned
    only after the kernel ``launch(busy_ms)`` started just before them had finished
    (``running()`` false right after the call). ``idle()`` waits for the kernel before the next
    call; without ``launch`` the GPU stays idle."""
    page = drv.granularity
    base = drv.reserve(num_pages * page)
    times = {c: [] for c in CALLS}
    waited = dict.fromkeys(CALLS, 0)

    def timed(name: str, fn):
        if launch is not None:
            launch(busy_ms)
        t0 = time.perf_counter()
        result = fn()
        times[name].append(time.perf_counter() - t0)
        if launch is not None:
            waited[name] += not running()
            idle()
        return result

    try:
        for i in range(num_pages):
            va, handle, mapped = base + i * page, None, False
            try:
                handle = timed("create", lambda: drv.create(page))
                timed("map", lambda: drv.map(va, page, handle))
                mapped = True
                timed("set_access", lambda: drv.set_access(va, page))
                timed("unmap", lambda: drv.unmap(va, page))
                mapped = False
                timed("release", lambda: drv.release(handle))
                handle = None
            finally:                                  # a failed call: give back what it left
                if mapped:
                    drv.unmap(va, page)
                if handle is not None:
                    drv.release(handle)
    finally:
        drv.free_va(base, num_pages * page)
    return {c: {"median_us": statistics.median(times[c]) * 1e6, "max_us": max(times[c]) * 1e6,
                "waited": waited[c] if launch is not None else None, "calls": num_pages} for c in CALLS}


def cuda_busy(device, *, side_stream: bool):
    """``(launch, running, idle)`` for :func:`busy_latency` on a CUDA ``device``: a spin kernel
    (``torch.cuda._sleep``, its clock rate measured first) on the default stream or on a stream
    of its own."""
    import torch
    stream = torch.cuda.Stream(device) if side_stream else torch.cuda.default_stream(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
    end.synchronize()
    cycles_per_ms = 10_000_000 / start.elapsed_time(end)

    def launch(ms: float) -> None:
        with torch.cuda.stream(stream):
            torch.cuda._sleep(int(ms * cycles_per_ms))
    return launch, (lambda: not stream.query()), stream.synchronize


def markdown(idle: dict, busy: dict[str, dict], busy_ms: float) -> str:
    """The table: per call, idle µs, then per busy variant µs and calls that waited."""
    names = list(busy)
    head = "| call | idle GPU µs | " + " | ".join(f"{n}: µs · waited for the kernel" for n in names) + " |"
    rows = [f"VMM calls on pages no kernel reads, with the GPU idle and while a {busy_ms:g} ms kernel "
            "runs (median host µs; waited = calls that returned only after the kernel had finished):",
            "", head, "|---|---|" + "---|" * len(names)]
    for c in CALLS:
        cells = [f"{busy[n][c]['median_us']:.1f} · {busy[n][c]['waited']} of {busy[n][c]['calls']}" for n in names]
        rows.append(f"| {c} | {idle[c]['median_us']:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def launch_stalls(drv, launch: Callable[[float], None], idle: Callable[[], None], *, launches: int = 400,
                  kernel_ms: float = 0.25, worker: bool) -> dict:
    """Host µs per kernel launch on this thread (``launches`` kernels of ``kernel_ms`` queued
    back to back, so the device stays busy) while, with ``worker``, another thread maps, grants
    access to and unmaps a page of its own in a loop — what moving VMM calls off the engine's
    thread onto a background one would cost the engine's launches (a driver lock held across
    an implicit wait would show here). Also the worker's calls and their slowest µs."""
    page = drv.granularity
    base, handle = drv.reserve(page), drv.create(page)
    stop, calls, slowest = threading.Event(), [0], [0.0]

    def churn() -> None:
        drv.bind_thread()
        while not stop.is_set():
            t0 = time.perf_counter()
            drv.map(base, page, handle)
            drv.set_access(base, page)
            drv.unmap(base, page)
            slowest[0] = max(slowest[0], time.perf_counter() - t0)
            calls[0] += 3

    thread = threading.Thread(target=churn, daemon=True) if worker else None
    times = []
    try:
        if thread:
            thread.start()
            time.sleep(0.01)
        for _ in range(launches):
            t0 = time.perf_counter()
            launch(kernel_ms)
            times.append(time.perf_counter() - t0)
        idle()
    finally:
        stop.set()
        if thread:
            thread.join()
        drv.release(handle)
        drv.free_va(base, page)
    times.sort()
    return {"launch_median_us": statistics.median(times) * 1e6, "launch_p99_us": upper_quantile(times, 0.99) * 1e6,
            "launch_max_us": times[-1] * 1e6, "launches": launches, "kernel_ms": kernel_ms,
            "worker_calls": calls[0] if worker else None, "worker_slowest_us": slowest[0] * 1e6 if worker else None}


def stalls_markdown(alone: dict, with_worker: dict) -> str:
    """The launch-stall table: this thread's launches alone and beside a VMM worker thread."""
    rows = [f"Kernel launches on this thread ({alone['launches']} kernels of {alone['kernel_ms']:g} ms queued "
            "back to back), alone and while another thread maps / grants access / unmaps in a loop:", "",
            "| | launch µs median | p99 | max | worker's VMM calls | worker's slowest map+access+unmap µs |",
            "|---|---|---|---|---|---|"]
    for name, r in (("alone", alone), ("beside a VMM worker thread", with_worker)):
        worker = "— | —" if r["worker_calls"] is None else f"{r['worker_calls']} | {r['worker_slowest_us']:.0f}"
        rows.append(f"| {name} | {r['launch_median_us']:.1f} | {r['launch_p99_us']:.1f} | {r['launch_max_us']:.1f} | "
                    f"{worker} |")
    return "\n".join(rows)
