"""A deterministic profile of an engine's own loop over a window of its steps.

vattn's step trace times vattn's sections; what an engine does around them (its scheduler, its
runner's input preparation, its output handling) is not in it. :class:`WindowProfile` wraps the
engine loop's own methods: after ``skip`` steps it turns ``cProfile`` on for the next ``steps``
steps (the thread that runs them only) and then writes ``PATH.prof`` (read with ``pstats``) and
``PATH.txt`` (the steps, their wall time, the thread's CPU time over them — a thread that waits
for the GIL or a lock spends wall time without CPU — the garbage collector's collections and
time in the window, the functions with the most own time and the most time under them), and
``PATH.json``: the same numbers for a program to read, and the ``steps`` steps just before the
window, unprofiled, each with its wall time and what the adapter noted of it
(:meth:`WindowProfile.note`: e.g. the tokens and new requests it scheduled), so steps of each
kind can be timed on a stock and a vattn engine alike. The same wrapper on a stock engine and on
a vattn engine shows which functions the difference per step is in. Profiling slows Python code down (each call is
counted), so a window's step time is not the engine's; the two engines' windows compare with
each other.

Nothing runs unless an adapter builds one (:func:`from_env`: ``$VATTN_ENGINE_PROFILE=PATH``,
``{pid}`` = the process id; ``$VATTN_ENGINE_PROFILE_STEPS=SKIP:STEPS``, default ``2000:500``;
``$VATTN_RUN_NAME``, set by a harness, labels the files). ``vattn bench loop`` puts two runs'
windows side by side.
"""

from __future__ import annotations

import cProfile
import functools
import gc
import io
import json
import os
import pstats
import time

from .errors import ConfigError

__all__ = ["WindowProfile", "from_env", "ENGINE_PROFILE_ENV", "ENGINE_PROFILE_STEPS_ENV"]

ENGINE_PROFILE_ENV = "VATTN_ENGINE_PROFILE"
ENGINE_PROFILE_STEPS_ENV = "VATTN_ENGINE_PROFILE_STEPS"
_TOP = 45


class WindowProfile:
    """Profile steps ``skip + 1 .. skip + steps`` of an engine loop.

    Parameters
    ----------
    path : str
        Output path without suffix (``{pid}`` is replaced by this process's id).
    skip, steps : int
        Steps let by before the window (``>= 0``), and steps in it (``>= 1``).
    clock : callable
        Wall clock of the window (seconds).
    label : str, optional
        What ran (e.g. a harness's run name), the text's first line.
    """

    def __init__(self, path: str, *, skip: int, steps: int, clock=time.perf_counter, label: str = ""):
        if not path:
            raise ConfigError("WindowProfile: expected an output path, got an empty one")
        if isinstance(skip, bool) or not isinstance(skip, int) or skip < 0:
            raise ConfigError(f"WindowProfile: expected skip >= 0, got {skip!r}")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ConfigError(f"WindowProfile: expected steps >= 1, got {steps!r}")
        self.path = path.replace("{pid}", str(os.getpid()))
        self.skip, self.steps, self.clock, self.label = skip, steps, clock, label
        self.seen = 0                      # steps counted so far
        self.done = False
        self._profile: cProfile.Profile | None = None
        self._t0 = self._cpu0 = 0.0
        self._gc = _GcTimer(time.perf_counter)
        #: the unprofiled steps just before the window (up to ``steps`` of them): per step its
        #: start (ms since the first), its wall ms and what :meth:`note` attached to it
        self.timeline: list[dict] = []
        self._notes: dict = {}
        self._origin: float | None = None

    def note(self, **fields) -> None:
        """Attach ``fields`` (JSON scalars, e.g. the tokens a step scheduled) to the step under way."""
        self._notes.update(fields)

    def wrap(self, fn, *, step: bool):
        """``fn`` timed before the window and profiled in it; ``step=True``: each call is one step
        (the window opens before the call that starts it and closes after the one that ends it)."""
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if self.done:
                return fn(*args, **kwargs)
            if step:
                self._begin_step()
            if self._profile is not None:
                return self._profiled(fn, args, kwargs, step)
            if step and self.skip - self.steps < self.seen <= self.skip:
                return self._timed(fn, args, kwargs)
            return fn(*args, **kwargs)
        return wrapper

    def _begin_step(self) -> None:
        self.seen += 1
        self._notes = {}                          # what this step notes, from here on
        if self.seen == self.skip + 1:
            self._profile, self._t0 = cProfile.Profile(), self.clock()
            self._cpu0 = time.thread_time()
            self._gc.start()

    def _timed(self, fn, args, kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            end = time.perf_counter()
            if self._origin is None:
                self._origin = start
            self.timeline.append({"start_ms": round((start - self._origin) * 1e3, 3),
                                  "ms": round((end - start) * 1e3, 3)} | self._notes)

    def _profiled(self, fn, args, kwargs, step: bool):
        self._profile.enable()
        try:
            return fn(*args, **kwargs)
        finally:
            self._profile.disable()
            if step and self.seen == self.skip + self.steps:
                self.write(self.clock() - self._t0, cpu_s=time.thread_time() - self._cpu0)

    def write(self, wall_s: float, *, cpu_s: float | None = None) -> str:
        """Write ``PATH.prof``, ``PATH.json`` and ``PATH.txt`` now and stop profiling; returns the text.
        ``cpu_s``: the thread's CPU time over the window (wall well above it: the thread waited
        — for the GIL, a lock, the device)."""
        self.done = True
        self._gc.stop()
        profile, self._profile = self._profile, None
        if profile is None:
            return ""
        os.makedirs(os.path.dirname(os.path.abspath(self.path)) or ".", exist_ok=True)
        profile.dump_stats(f"{self.path}.prof")
        summary = {"label": self.label, "skip": self.skip, "steps": self.steps, "wall_ms": wall_s * 1e3,
                   "cpu_ms": None if cpu_s is None else cpu_s * 1e3,
                   "gc": {"collections": list(self._gc.counts), "ms": self._gc.seconds * 1e3},
                   "timeline_first_step": self.seen - self.steps - len(self.timeline) + 1,
                   "timeline": self.timeline}
        with open(f"{self.path}.json", "w") as f:
            json.dump(summary, f)
        out = io.StringIO()
        out.write(f"run: {self.label or '-'}\n{self.steps} steps after {self.skip}, {wall_s * 1e3:.1f} ms wall "
                  f"({wall_s * 1e6 / self.steps:.0f} us a step, profiled)\n")
        if cpu_s is not None:
            out.write(f"thread CPU {cpu_s * 1e3:.1f} ms ({100 * cpu_s / wall_s if wall_s else 0:.0f} % of the wall)\n")
        counts = "/".join(str(n) for n in self._gc.counts)
        out.write(f"gc: {counts} collections of generations 0/1/2 in the window, {self._gc.seconds * 1e3:.1f} ms\n")
        stats = pstats.Stats(profile, stream=out)
        for key in ("tottime", "cumulative"):
            stats.sort_stats(key).print_stats(_TOP)
        text = out.getvalue()
        with open(f"{self.path}.txt", "w") as f:
            f.write(text)
        return text


class _GcTimer:
    """Collections of the garbage collector (any thread) and their time while started."""

    def __init__(self, clock):
        self.clock, self.counts, self.seconds, self._t = clock, [0, 0, 0], 0.0, None

    def start(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def stop(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = self.clock()
        elif self._t is not None:
            self.counts[min(int(info.get("generation", 0)), 2)] += 1
            self.seconds += self.clock() - self._t
            self._t = None


def from_env(environ=None) -> WindowProfile | None:
    """A :class:`WindowProfile` from ``$VATTN_ENGINE_PROFILE`` / ``$VATTN_ENGINE_PROFILE_STEPS``,
    or ``None`` when the first is not set.

    Raises
    ------
    ConfigError
        ``$VATTN_ENGINE_PROFILE_STEPS`` is not ``SKIP:STEPS`` with ``SKIP >= 0``, ``STEPS >= 1``.
    """
    env = os.environ if environ is None else environ
    path = env.get(ENGINE_PROFILE_ENV, "")
    if not path:
        return None
    text = env.get(ENGINE_PROFILE_STEPS_ENV, "2000:500")
    try:
        skip, steps = (int(part) for part in text.split(":"))
    except ValueError:
        raise ConfigError(f"{ENGINE_PROFILE_STEPS_ENV} must be SKIP:STEPS (e.g. 2000:500), "
                          f"got {text!r}") from None
    return WindowProfile(path, skip=skip, steps=steps, label=env.get("VATTN_RUN_NAME", ""))
