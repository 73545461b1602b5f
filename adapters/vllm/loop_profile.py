"""``$VATTN_ENGINE_PROFILE``: a ``cProfile`` window over vLLM's engine-core loop (stock or vattn).

Loaded by the plugin in every vLLM process whether vattn is on or not, so a stock server and a
vattn server profile the same window of the same loop (:mod:`vattn.core.window_profile`): vLLM's
``EngineCoreProc._process_engine_step`` (one call = one step: schedule, execute, update) and
``_process_input_queue`` (the requests taken in between) are wrapped; only the engine-core process
calls them. ``Scheduler.schedule`` is wrapped too, to note what each step scheduled (tokens, new
requests, requests) on the unprofiled timeline before the window. Nothing is patched unless the
variable is set.
"""

from __future__ import annotations

import functools

from vattn.core import window_profile
from vattn.core.errors import UnsupportedError

__all__ = ["install_loop_profile", "PATCHES"]

PATCHES = ["vllm.v1.engine.core.EngineCoreProc._process_engine_step",
           "vllm.v1.engine.core.EngineCoreProc._process_input_queue",
           "vllm.v1.core.sched.scheduler.Scheduler.schedule"]
_MARK = "_vattn_loop_profile"


def install_loop_profile(environ=None) -> bool:
    """Wrap the engine-core loop when ``$VATTN_ENGINE_PROFILE`` is set; returns whether it did.

    Raises
    ------
    UnsupportedError
        This vLLM's ``EngineCoreProc`` lacks the methods wrapped (a layout not tested).
    """
    profile = window_profile.from_env(environ)
    if profile is None:
        return False
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCoreProc
    if getattr(EngineCoreProc, _MARK, False):
        return True
    for cls, name in ((EngineCoreProc, "_process_engine_step"), (EngineCoreProc, "_process_input_queue"),
                      (Scheduler, "schedule")):
        if not callable(getattr(cls, name, None)):
            raise UnsupportedError(f"vattn: {window_profile.ENGINE_PROFILE_ENV} needs "
                                   f"{cls.__module__}.{cls.__name__}.{name}, missing in this vLLM")
    EngineCoreProc._process_engine_step = profile.wrap(EngineCoreProc._process_engine_step, step=True)
    EngineCoreProc._process_input_queue = profile.wrap(EngineCoreProc._process_input_queue, step=False)
    Scheduler.schedule = _noting(Scheduler.schedule, profile)
    setattr(EngineCoreProc, _MARK, True)
    return True


def _noting(schedule, profile):
    """``Scheduler.schedule`` that notes the step's scheduled tokens, new requests and requests."""
    @functools.wraps(schedule)
    def wrapper(self, *args, **kwargs):
        out = schedule(self, *args, **kwargs)
        if not profile.done:                       # nothing to note once the window is written
            profile.note(tokens=int(out.total_num_scheduled_tokens), new=len(out.scheduled_new_reqs),
                         reqs=len(out.num_scheduled_tokens))
        return out
    return wrapper
