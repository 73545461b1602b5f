"""Fault injection: a driver wrapper that fails chosen calls, for tests and ``vattn bench faults``."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterable

from ..errors import InjectedFault

__all__ = ["FaultInjector", "FAULTABLE"]

FAULTABLE = ("reserve", "create", "map", "set_access", "unmap", "release", "zero")


class FaultInjector:
    """Wrap a driver and fail chosen calls with :class:`InjectedFault`.

    Parameters
    ----------
    driver : Driver
        The real backend; every call is forwarded to it unless it is chosen to fail.
    fail : dict[str, int | Iterable[int]]
        Method name -> 1-based call numbers to fail, e.g. ``{"map": 3}`` fails the third
        ``map`` call. A failed call does nothing (the wrapped driver is not called).

    Calls can also fail at a rate (:meth:`arm_rate`): each later call of the method fails
    with that probability, drawn from a seeded generator (the same seed fails the same calls).
    ``calls`` counts every call per method, ``injected`` the calls failed on purpose.

    Example
    -------
    >>> drv = FaultInjector(HostDriver(), fail={"map": [2, 5]})
    >>> drv.arm_rate("set_access", 0.1, seed=3)       # from now on, 10 % of set_access calls
    """

    def __init__(self, driver, *, fail: dict[str, int | Iterable[int]] | None = None):
        self.inner = driver
        self.calls: Counter[str] = Counter()
        self.injected: Counter[str] = Counter()
        self.fail: dict[str, set[int]] = {}
        self.rates: dict[str, tuple[float, random.Random]] = {}
        for name, which in (fail or {}).items():
            self.arm(name, which)

    def arm(self, name: str, which: int | Iterable[int]) -> None:
        """Fail the given (1-based, counted from the start) calls of ``name``."""
        self._check(name)
        self.fail[name] = {which} if isinstance(which, int) else set(which)

    def arm_rate(self, name: str, rate: float, *, seed: int = 0) -> None:
        """Fail each later call of ``name`` with probability ``rate`` (0 < rate <= 1; 1 fails
        every call: a driver that stays broken)."""
        self._check(name)
        if not 0.0 < rate <= 1.0:
            raise ValueError(f"rate must be in (0, 1], got {rate!r}")
        self.rates[name] = (float(rate), random.Random(f"{seed}:{name}"))

    def disarm(self, name: str | None = None) -> None:
        """Stop failing calls of ``name`` (of every method when ``None``)."""
        for table in (self.fail, self.rates):
            for key in ([name] if name is not None else list(table)):
                table.pop(key, None)

    @staticmethod
    def _check(name: str) -> None:
        if name not in FAULTABLE:
            raise ValueError(f"cannot inject faults into {name!r}; expected one of {FAULTABLE}")

    def _fails(self, name: str) -> bool:
        if self.calls[name] in self.fail.get(name, ()):
            return True
        armed = self.rates.get(name)
        return armed is not None and armed[1].random() < armed[0]

    def __getattr__(self, name: str):
        attr = getattr(self.inner, name)
        if name not in FAULTABLE:
            return attr

        def call(*args):
            self.calls[name] += 1
            if self._fails(name):
                self.injected[name] += 1
                raise InjectedFault(name, {"args": args, "call_number": self.calls[name]}, "INJECTED")
            return attr(*args)
        return call
