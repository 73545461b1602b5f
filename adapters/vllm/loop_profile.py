"""``$VATTN_ENGINE_PROFILE``: a ``cProfile`` window over vLLM's engine-core loop (stock or vattn).

Loaded by the plugin in every vLLM process whether vattn is on or not, so a stock server and a
vattn server profile the same window of the same loop (:mod:`vattn.core.window_profile`): vLLM's
``EngineCoreProc._process_engine_step`` (one call = one step: schedule, execute, update) and
``_process_input_queue`` (the requests taken in between) are wrapped; only the engine-core process
calls them. Nothing is patched unless the variable is set.
"""

from __future__ import annotations

from vattn.core import window_profile
from vattn.core.errors import UnsupportedError

__all__ = ["install_loop_profile", "PATCHES"]

PATCHES = ["vllm.v1.engine.core.EngineCoreProc._process_engine_step",
           "vllm.v1.engine.core.EngineCoreProc._process_input_queue"]
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
    from vllm.v1.engine.core import EngineCoreProc
    if getattr(EngineCoreProc, _MARK, False):
        return True
    for name in ("_process_engine_step", "_process_input_queue"):
        if not callable(getattr(EngineCoreProc, name, None)):
            raise UnsupportedError(f"vattn: {window_profile.ENGINE_PROFILE_ENV} needs "
                                   f"vllm.v1.engine.core.EngineCoreProc.{name}, missing in this vLLM")
    EngineCoreProc._process_engine_step = profile.wrap(EngineCoreProc._process_engine_step, step=True)
    EngineCoreProc._process_input_queue = profile.wrap(EngineCoreProc._process_input_queue, step=False)
    setattr(EngineCoreProc, _MARK, True)
    return True
