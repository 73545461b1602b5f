"""A deterministic profile of an engine's own loop over a window of its steps.

vattn's step trace times vattn's sections; what an engine does around them (its scheduler, its
runner's input preparation, its output handling) is not in it. :class:`WindowProfile` wraps the
engine loop's own methods: after ``skip`` steps it turns ``cProfile`` on for the next ``steps``
steps (the thread that runs them only) and then writes ``PATH.prof`` (read with ``pstats``) and
``PATH.txt`` (the steps, their wall time, the functions with the most own time and the most
time under them). The same wrapper on a stock engine and on a vattn engine shows which
functions the difference per step is in. Profiling slows Python code down (each call is
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
import io
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
        self._t0 = 0.0

    def wrap(self, fn, *, step: bool):
        """``fn`` profiled while the window is open; ``step=True``: each call is one step (the
        window opens before the call that starts it and closes after the one that ends it)."""
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if self.done:
                return fn(*args, **kwargs)
            if step:
                self.seen += 1
                if self.seen == self.skip + 1:
                    self._profile, self._t0 = cProfile.Profile(), self.clock()
            profile = self._profile
            if profile is None:
                return fn(*args, **kwargs)
            profile.enable()
            try:
                return fn(*args, **kwargs)
            finally:
                profile.disable()
                if step and self.seen == self.skip + self.steps:
                    self.write(self.clock() - self._t0)
        return wrapper

    def write(self, wall_s: float) -> str:
        """Write ``PATH.prof`` and ``PATH.txt`` now and stop profiling; returns the text."""
        self.done = True
        profile, self._profile = self._profile, None
        if profile is None:
            return ""
        os.makedirs(os.path.dirname(os.path.abspath(self.path)) or ".", exist_ok=True)
        profile.dump_stats(f"{self.path}.prof")
        out = io.StringIO()
        out.write(f"run: {self.label or '-'}\n{self.steps} steps after {self.skip}, {wall_s * 1e3:.1f} ms wall "
                  f"({wall_s * 1e6 / self.steps:.0f} us a step, profiled)\n")
        stats = pstats.Stats(profile, stream=out)
        for key in ("tottime", "cumulative"):
            stats.sort_stats(key).print_stats(_TOP)
        text = out.getvalue()
        with open(f"{self.path}.txt", "w") as f:
            f.write(text)
        return text


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
