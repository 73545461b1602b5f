"""The worker process's vattn runtime (at most one, like vLLM's own KV cache) and the driver
wrapper later runtimes are built on (fault injection in tests and ``vattn bench faults``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vattn.core.errors import VattnError

if TYPE_CHECKING:
    from .runtime import VattnRuntime

__all__ = ["install", "uninstall", "installed", "current", "set_driver_wrapper", "driver_wrapper"]

_RUNTIME: list["VattnRuntime"] = []   # the worker process's runtime (at most one)
_DRIVER_WRAP: list = []   # at most one callable: driver -> driver (set_driver_wrapper)


def set_driver_wrapper(wrap=None) -> None:
    """Build every later runtime's cache on ``wrap(driver)`` instead of the device's driver
    (e.g. a :class:`vattn.core.driver.FaultInjector`, for tests and ``vattn bench faults``);
    ``None`` restores the default. In-process only: the engine core must run in this process."""
    _DRIVER_WRAP.clear()
    if wrap is not None:
        _DRIVER_WRAP.append(wrap)


def driver_wrapper():
    """The callable set by :func:`set_driver_wrapper`, or ``None``."""
    return _DRIVER_WRAP[0] if _DRIVER_WRAP else None


def install(runtime: "VattnRuntime") -> None:
    if _RUNTIME:
        raise VattnError("a vattn runtime is already installed in this process")
    _RUNTIME.append(runtime)


def uninstall() -> None:
    while _RUNTIME:
        _RUNTIME.pop().close()


def installed() -> bool:
    """Whether this process has a runtime (the hooks built one when vLLM's KV cache was made)."""
    return bool(_RUNTIME)


def current() -> "VattnRuntime":
    """The process's runtime; raises if the vattn hooks did not start one."""
    if not _RUNTIME:
        raise VattnError("the vattn attention backend is selected but the vattn KV hooks are not "
                         "active in this process (is VATTN_VLLM=1 set and the plugin installed?)")
    return _RUNTIME[0]
