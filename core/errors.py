"""Typed errors of vattn. Every user-facing failure is one of these."""

from __future__ import annotations

__all__ = [
    "VattnError", "ConfigError", "SlotError", "ContextLengthError", "TensorError",
    "UnsupportedError", "DriverError", "InjectedFault", "retry_driver",
    "DriverRetry",
]


class VattnError(Exception):
    """Base class of every error vattn raises on purpose."""


class ConfigError(VattnError, ValueError):
    """A configuration is invalid or cannot fit in virtual address space or memory."""


class SlotError(VattnError, ValueError):
    """A slot id is out of range, released twice, or used after release."""


class ContextLengthError(VattnError, ValueError):
    """A requested length exceeds the configured maximum context."""


class TensorError(VattnError, TypeError):
    """A tensor has the wrong dtype, device, shape or strides."""


class UnsupportedError(VattnError, NotImplementedError):
    """The requested backend, shape or engine version is not supported here."""


class DriverError(VattnError, RuntimeError):
    """A virtual-memory driver call failed.

    Attributes
    ----------
    call : str
        The driver call, e.g. ``"cuMemMap"`` or ``"mmap"``.
    args : dict
        The arguments it was given.
    code : int | str
        The driver's error code or name.
    """

    def __init__(self, call: str, args: dict, code, message: str = ""):
        self.call, self.call_args, self.code = call, dict(args), code
        shown = ", ".join(f"{k}={_fmt(v)}" for k, v in self.call_args.items())
        super().__init__(f"{call}({shown}) failed: {code}{': ' + message if message else ''}")


class InjectedFault(DriverError):
    """A driver failure raised on purpose by :class:`vattn.core.driver.FaultInjector`."""


def _fmt(value) -> str:
    return hex(value) if isinstance(value, int) and value > 4096 else repr(value)


def retry_driver(call, retries: int, on_retry=None):
    """``call()`` run up to ``retries + 1`` times while it raises :class:`DriverError` (the
    cache's calls leave nothing half done when a driver call fails, so a retry continues where
    the failed call stopped); the last error propagates. ``on_retry()`` runs before each retry."""
    if retries < 0:
        raise ConfigError(f"retries must be >= 0, got {retries}")
    for attempt in range(retries + 1):
        try:
            return call()
        except DriverError:
            if attempt == retries:
                raise
            if on_retry is not None:
                on_retry()


class DriverRetry:
    """Runs cache calls, each retried up to ``retries`` times while a driver call fails
    (:func:`retry_driver`); ``retried`` counts the retries. When a call still fails, its
    :class:`DriverError` propagates with a note: ``still failing after N retries``, then
    ``after`` (what that means for the caller)."""

    def __init__(self, retries: int, after: str = ""):
        if retries < 0:
            raise ConfigError(f"retries must be >= 0, got {retries}")
        self.retries, self.after, self.retried = retries, after, 0

    def __call__(self, call):
        try:
            return retry_driver(call, self.retries, self._count)
        except DriverError as exc:
            exc.add_note(f"vattn: still failing after {self.retries} retries" +
                         (f"; {self.after}" if self.after else ""))
            raise

    def _count(self) -> None:
        self.retried += 1
