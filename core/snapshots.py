"""A running engine's cache metrics, written to a JSON file for soaks and benchmarks.

Engines run the KV cache in a worker process out of reach of the process that drives them (a
server, a benchmark). With ``VATTN_METRICS=PATH`` in the engine's environment, each adapter
gives its cache a :class:`MetricsFile`: the engine's step hook calls :meth:`MetricsFile.step`
(a snapshot at most every ``every_s`` seconds), and when the engine goes idle a snapshot with
the core's page audit is written (:meth:`MetricsFile.idle`: called by an adapter that knows
when its last request left, or by the watcher thread when no step came for ``idle_s``
seconds). The file is replaced atomically, so a reader never sees half a snapshot. ``{pid}``
in the path is replaced by the worker's process id (one file per tensor-parallel rank).

Nothing runs and nothing is written unless the variable is set (:func:`from_env`).
"""

from __future__ import annotations

import json
import os
import threading
import time

from .errors import ConfigError, VattnError
from .metrics import jsonable

__all__ = ["MetricsFile", "from_env", "METRICS_ENV", "read_snapshot"]

#: The environment variable naming the snapshot file.
METRICS_ENV = "VATTN_METRICS"


class MetricsFile:
    """Snapshots of ``read()`` in ``path``.

    Parameters
    ----------
    path : str
        The JSON file (``{pid}`` is replaced by this process's id).
    read : callable
        ``() -> dict``: the metrics (cache metrics plus the adapter's own).
    audit : callable, optional
        ``() -> None``, raising :class:`VattnError` on inconsistent page accounting
        (:meth:`VirtualKVCache.audit_when_quiet`; it may return why it skipped the check
        instead); run for every idle snapshot.
    every_s : float
        Least time between two snapshots written by :meth:`step`.
    idle_s : float, optional
        Start a watcher thread that writes an idle snapshot once no :meth:`step` came for
        ``idle_s`` seconds (for engines whose hooks do not run while idle). ``None``: no thread.
    on_idle : callable, optional
        ``() -> None``, run before every idle snapshot: work too slow for the step's path (an
        adapter's step trace is written there); an error it raises goes into the snapshot
        (``on_idle_error``) instead of stopping it.
    """

    def __init__(self, path: str, read, *, audit=None, every_s: float = 1.0,
                 idle_s: float | None = None, clock=time.monotonic, on_idle=None):
        if not path:
            raise ConfigError("MetricsFile: expected a file path, got an empty one")
        if not every_s >= 0 or (idle_s is not None and not idle_s > 0):      # NaN refused too
            raise ConfigError(f"MetricsFile: expected every_s >= 0 and idle_s > 0, got {every_s}, {idle_s}")
        self.path = path.replace("{pid}", str(os.getpid()))
        self.read, self.audit, self.on_idle = read, audit, on_idle
        self.every_s, self.idle_s, self.clock = float(every_s), idle_s, clock
        self.steps = self.written = 0
        self._last_step = self._last_write = None
        self._idle_since_step = True          # an idle snapshot covers the latest step
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        if idle_s is not None:
            self._thread = threading.Thread(target=self._watch, name="vattn-metrics", daemon=True)
            self._thread.start()

    def step(self) -> None:
        """One engine step happened: write a snapshot if the last is ``every_s`` old."""
        now = self.clock()
        with self._lock:
            self.steps += 1
            self._last_step, self._idle_since_step = now, False
            due = self._last_write is None or now - self._last_write >= self.every_s
        if due:
            self.write(idle=False)

    def idle(self) -> None:
        """The engine has no request left: write a snapshot with the audit's verdict."""
        with self._lock:
            self._idle_since_step = True
        error = None
        if self.on_idle is not None:
            try:
                self.on_idle()
            except Exception as exc:  # noqa: BLE001 - reported in the snapshot, never raised
                error = f"{type(exc).__name__}: {exc}"
        self.write(idle=True, **({"on_idle_error": error} if error else {}))

    def write(self, *, idle: bool, **extra) -> dict:
        """Write one snapshot now (``idle``: with the audit) and return it."""
        snap = {"time": time.time(), "pid": os.getpid(), "steps": self.steps, "idle": idle}
        snap |= jsonable(self.read()) | extra
        if idle and self.audit is not None:
            try:
                snap["audit"] = self.audit() or "ok"      # or why it was skipped
            except VattnError as exc:
                snap["audit"] = f"{type(exc).__name__}: {exc}"
        tmp = f"{self.path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "w") as f:
            json.dump(snap, f)
        os.replace(tmp, self.path)
        with self._lock:
            self._last_write = self.clock()
            self.written += 1
        return snap

    def _watch(self) -> None:
        while not self._stop.wait(self.idle_s / 4):
            with self._lock:
                quiet = (not self._idle_since_step and self._last_step is not None
                         and self.clock() - self._last_step >= self.idle_s)
            if quiet:
                try:
                    self.idle()
                except Exception:      # a snapshot must never take the engine down
                    self._idle_since_step = True

    def close(self) -> None:
        """Stop the watcher thread (the file stays)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


def from_env(read, *, audit=None, idle_s: float | None = None, environ=None,
             on_idle=None) -> MetricsFile | None:
    """A :class:`MetricsFile` at ``$VATTN_METRICS`` (``$VATTN_METRICS_EVERY_S`` seconds between
    step snapshots, default 1), or ``None`` when the variable is not set."""
    env = os.environ if environ is None else environ
    path = env.get(METRICS_ENV)
    if not path:
        return None
    every = env.get("VATTN_METRICS_EVERY_S", "1")
    try:
        every_s = float(every)
    except ValueError:
        raise ConfigError(f"VATTN_METRICS_EVERY_S: expected seconds (a number >= 0), got {every!r}") from None
    return MetricsFile(path, read, audit=audit, every_s=every_s, idle_s=idle_s, on_idle=on_idle)


def read_snapshot(path: str) -> dict | None:
    """The snapshot in ``path``, or ``None`` when there is none yet."""
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
