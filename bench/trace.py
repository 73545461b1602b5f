"""A torch profiler trace (Chrome JSON, as vLLM's profiler writes it) as a few numbers per window.

What a serving gap needs told apart: is the GPU slower (kernels take longer), or is it idle
more (the host feeds it late: host work or a synchronization on the step's path)? Over the
profiled window:

* ``window_ms``: first GPU activity to last; ``gpu_busy_ms``: the union of kernel, memcpy and
  memset intervals; ``gpu_idle_share`` = 1 - busy / window;
* ``steps``: vLLM's step annotations (``execute_...`` CPU ranges) and their mean span;
* ``sync_calls`` / ``sync_ms``: CUDA runtime calls that block the host (stream, event and device
  synchronizations, synchronous memcpy), ``host_alloc_calls`` (pinned allocations) and
  ``runtime_top``: the CUDA runtime / driver calls that took the host longest.
"""

from __future__ import annotations

import glob
import gzip
import json
import os

from vattn.core.errors import ConfigError

__all__ = ["trace_summary", "find_trace", "busy_union_us", "SYNC_CALLS"]

#: CUDA runtime / driver calls that make the host wait for the device
SYNC_CALLS = frozenset({"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
                        "cudaMemcpy", "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize"})
_GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
_HOST_ALLOC = ("cudaHostAlloc", "cudaMallocHost", "cuMemHostAlloc", "cudaHostRegister")


def find_trace(folder: str) -> str | None:
    """The newest ``*.pt.trace.json[.gz]`` under ``folder`` (``None`` if there is none)."""
    found = glob.glob(os.path.join(folder, "**", "*.pt.trace.json*"), recursive=True)
    return max(found, key=os.path.getmtime) if found else None


def _load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError, EOFError) as exc:
        raise ConfigError(f"expected a Chrome trace JSON in {path!r}, could not read it ({exc})") from exc
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise ConfigError(f"expected a 'traceEvents' list in {path!r}, got {type(events).__name__}")
    return events


def busy_union_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``[start, end)`` intervals (overlapping streams count once)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def trace_summary(path: str) -> dict:
    """The window's numbers (module docstring) of the trace at ``path``.

    A trace without GPU activity (a CPU engine) has ``None`` for the GPU numbers.

    Raises
    ------
    ConfigError
        The file is not a readable Chrome trace, or it holds neither GPU activity nor a step.
    """
    gpu, steps, syncs = [], [], []
    host_allocs = 0
    runtime: dict[str, list[float]] = {}   # CUDA runtime / driver call -> [calls, us]
    for e in _load(path):
        if e.get("ph") != "X" or "dur" not in e:
            continue
        cat, name = e.get("cat", ""), e.get("name", "")
        start, dur = float(e["ts"]), float(e["dur"])
        if cat in _GPU_CATS:
            gpu.append((start, start + dur))
        elif cat == "user_annotation" and name.startswith("execute_"):
            steps.append(dur)
        elif cat in ("cuda_runtime", "cuda_driver"):
            acc = runtime.setdefault(name, [0, 0.0])
            acc[0] += 1
            acc[1] += dur
            if name in SYNC_CALLS:          # not cudaMemcpyAsync
                syncs.append(dur)
            elif name.startswith(_HOST_ALLOC):
                host_allocs += 1
    if not gpu and not steps:
        raise ConfigError(f"the trace {path!r} holds neither GPU activity nor an engine step "
                          f"(did the profiled window hold a step?)")
    out = {"window_ms": None, "gpu_busy_ms": None, "gpu_idle_share": None}   # a CPU-only trace
    if gpu:
        window = max(b for _, b in gpu) - min(a for a, _ in gpu)
        busy = busy_union_us(gpu)
        out = {"window_ms": window / 1e3, "gpu_busy_ms": busy / 1e3,
               "gpu_idle_share": 1 - busy / window if window > 0 else 0.0}
    return out | {"gpu_ops": len(gpu), "steps": len(steps),
            "step_span_ms_mean": sum(steps) / len(steps) / 1e3 if steps else None,
            "sync_calls": len(syncs), "sync_ms": sum(syncs) / 1e3, "host_alloc_calls": host_allocs,
            # the host's CUDA calls that took longest in the window: [name, calls, ms]
            "runtime_top": [[name, int(n), round(us / 1e3, 3)] for name, (n, us) in
                            sorted(runtime.items(), key=lambda kv: -kv[1][1])[:8]]}
