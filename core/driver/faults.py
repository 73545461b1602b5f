"""Fault injection: a driver wrapper that fails chosen calls, for tests."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from ..errors import InjectedFault

__all__ = ["FaultInjector", "FAULTABLE"]

FAULTABLE = ("reserve", "create", "map", "set_access", "unmap", "release", "zero")


class FaultInjector:
    """Wrap a driver and fail the N-th call of chosen methods with :class:`InjectedFault`.

    Parameters
    ----------
    driver : Driver
        The real backend; every call is forwarded to it unless it is chosen to fail.
    fail : dict[str, int | Iterable[int]]
        Method name -> 1-based call numbers to fail, e.g. ``{"map": 3}`` fails the third
        ``map`` call. A failed call does nothing (the wrapped driver is not called).

    Example
    -------
    >>> drv = FaultInjector(HostDriver(), fail={"map": [2, 5]})
    """

    def __init__(self, driver, *, fail: dict[str, int | Iterable[int]] | None = None):
        self.inner = driver
        self.calls: Counter[str] = Counter()
        self.fail: dict[str, set[int]] = {}
        for name, which in (fail or {}).items():
            self.arm(name, which)

    def arm(self, name: str, which: int | Iterable[int]) -> None:
        """Fail the given (1-based, counted from the start) calls of ``name``."""
        if name not in FAULTABLE:
            raise ValueError(f"cannot inject faults into {name!r}; expected one of {FAULTABLE}")
        self.fail[name] = {which} if isinstance(which, int) else set(which)

    def __getattr__(self, name: str):
        attr = getattr(self.inner, name)
        if name not in FAULTABLE:
            return attr

        def call(*args):
            self.calls[name] += 1
            if self.calls[name] in self.fail.get(name, ()):
                raise InjectedFault(name, {"args": args, "call_number": self.calls[name]}, "INJECTED")
            return attr(*args)
        return call
