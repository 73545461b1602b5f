"""One row per engine step of vattn's host work, for reading a run's timeline afterwards.

A total per run (host ms of ``apply``, the device's idle ms behind it, driver calls) says how
much a burst cost, not when: whether the map calls of a step ran while the device computed the
step before, or while it sat idle. With ``VATTN_STEP_TRACE=PATH`` in the engine's environment
an adapter records, per step, when its host section started and ended, how many requests it
bound, and the cache's driver-call counters at both ends (calls made between two rows were made
by the map-ahead worker); the device's idle time behind each section is filled in once its
events complete. :meth:`StepTrace.write` replaces ``PATH`` (``{pid}`` = the process id) with a
JSON object; nothing is recorded unless the variable is set (:func:`from_env`).
"""

from __future__ import annotations

import contextlib
import json
import os
import time

from .errors import ConfigError

__all__ = ["StepTrace", "from_env", "section", "STEP_TRACE_ENV", "COUNTERS"]

#: The environment variable naming the trace file.
STEP_TRACE_ENV = "VATTN_STEP_TRACE"

#: the cache counters a row carries at the start and the end of its section
COUNTERS = ("map_calls", "set_access_calls", "unmap_calls", "pages_aliased", "pages_packed",
            "pages_mapped_on_demand", "pages_mapped_ahead", "fence_waits", "calls_deferred", "issued_us")


class StepTrace:
    """Rows of ``{t0, t1, idle_us, cpu_ms, c0, c1, ...}`` (seconds since the trace began, device
    idle µs or ``None`` until known, the thread's CPU ms in the section, the section's own
    fields, counters at each end).

    Parameters
    ----------
    path : str
        The JSON file (``{pid}`` is replaced by this process's id).
    counters : callable
        ``() -> object`` with the attributes named in :data:`COUNTERS` (the cache's counters).
    header : dict, optional
        Written with the rows (the cache's configuration: what the run was).
    limit : int
        Rows kept at most (the first ``limit``; later steps are counted, not kept).
    profile : bool
        Also profile the sections (``cProfile``, this thread only); :meth:`write` saves the
        stats to ``PATH.prof`` (read them with ``pstats``).
    """

    def __init__(self, path: str, counters, *, header: dict | None = None, limit: int = 200_000,
                 profile: bool = False):
        if not path:
            raise ConfigError("StepTrace: expected a file path, got an empty one")
        if limit < 1:
            raise ConfigError(f"StepTrace: expected limit >= 1, got {limit}")
        self.path = path.replace("{pid}", str(os.getpid()))
        self.counters, self.header, self.limit = counters, dict(header or {}), limit
        self.rows: list[dict] = []
        self.dropped = 0
        self._idles: list[float] = []         # device idle µs per section, in order
        #: a cProfile of the sections themselves (``profile=True``), written beside the trace
        self.profile = None
        if profile:
            import cProfile
            self.profile = cProfile.Profile()
        self._origin = time.perf_counter()
        self.header["wall0"] = time.time()    # rows' seconds are since this wall-clock time
        self._open: dict | None = None
        self._cpu0 = 0.0                      # the open section's thread CPU time at its start

    def _now(self) -> float:
        return round(time.perf_counter() - self._origin, 6)

    def _counts(self) -> list[int]:
        c = self.counters()
        return [int(getattr(c, name)) for name in COUNTERS]

    def begin(self) -> None:
        """A section starts (call :meth:`end` when it is over)."""
        self._open = {"t0": self._now(), "c0": self._counts()}
        self._cpu0 = time.thread_time()
        if self.profile is not None:
            self.profile.enable()

    def end(self, **fields) -> None:
        """The section started by :meth:`begin` is over; ``fields`` are its own (JSON scalars)."""
        if self._open is None:
            raise ConfigError("StepTrace.end without begin")
        if self.profile is not None:
            self.profile.disable()
        row, self._open = self._open, None
        if len(self.rows) >= self.limit:
            self.dropped += 1
            return
        # the section's own thread CPU time: host ms well above it were spent waiting (a lock,
        # the GIL, a driver call that sleeps), not computing
        cpu = round((time.thread_time() - self._cpu0) * 1e3, 3)
        row |= {"t1": self._now(), "c1": self._counts(), "idle_us": None, "cpu_ms": cpu} | fields
        self.rows.append(row)

    def idle(self, value_us: float) -> None:
        """The device idle µs of the next section in order, as its events complete (maybe
        before :meth:`end` has added the section's row)."""
        self._idles.append(round(float(value_us), 1))

    def write(self) -> str:
        """Replace the file with the header, the counter names and the rows; returns the path."""
        for row, idle_us in zip(self.rows, self._idles):
            row["idle_us"] = idle_us
        out = {"pid": os.getpid(), "time": time.time(), "header": self.header,
               "counters": list(COUNTERS), "rows": self.rows, "dropped": self.dropped}
        tmp = f"{self.path}.tmp"
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(out, f, separators=(",", ":"))
        os.replace(tmp, self.path)
        if self.profile is not None:
            self.profile.dump_stats(f"{self.path}.prof")
        return self.path


def from_env(counters, *, header: dict | None = None, environ=None) -> StepTrace | None:
    """A :class:`StepTrace` at ``$VATTN_STEP_TRACE`` (profiled with ``$VATTN_STEP_PROFILE=1``;
    ``$VATTN_RUN_NAME``, set by a harness, goes into the header), or ``None`` when the variable
    is not set."""
    env = os.environ if environ is None else environ
    path = env.get(STEP_TRACE_ENV)
    if env.get("VATTN_RUN_NAME"):                    # what a harness calls this engine
        header = {"run": env["VATTN_RUN_NAME"]} | dict(header or {})
    profile = env.get("VATTN_STEP_PROFILE", "0")
    if profile not in ("0", "1"):
        raise ConfigError(f"VATTN_STEP_PROFILE: expected 0 or 1, got {profile!r}")
    return StepTrace(path, counters, header=header, profile=profile == "1") if path else None


@contextlib.contextmanager
def section(trace: StepTrace | None, wait, **fields):
    """An adapter's host section of one engine step: ``wait`` (a
    :class:`~vattn.core.device_wait.DeviceWait`) times the device's idle time behind it and, with
    ``trace``, it is a row carrying ``fields`` and whether the device was still busy at its start."""
    wait.begin()
    if trace is not None:
        trace.begin()
        fields["busy"] = wait.busy()
    try:
        yield
    finally:
        wait.end()
        if trace is not None:
            trace.end(**fields)
