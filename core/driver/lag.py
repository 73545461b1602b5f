"""A device that trails the host: fences that complete some engine steps after they are recorded.

On a GPU under an engine's asynchronous scheduling (vLLM's async scheduling, SGLang's overlap
scheduler) the host prepares step ``n`` while the device still runs step ``n - 1``: a fence
recorded during that preparation completes only once the forward in flight does. A host that
waits on such a fence has lost the overlap for that step. The host backend's fences are always
complete, so CPU runs never see those waits; :class:`LaggingFences` makes them visible (and
countable) on the host backend, for tests and ``vattn bench host``.
"""

from __future__ import annotations

__all__ = ["LaggingFences"]


class _LagFence:
    __slots__ = ("owner", "due")

    def __init__(self, owner: "LaggingFences", due: int):
        self.owner, self.due = owner, due

    def done(self) -> bool:
        return self.owner.now >= self.due

    def wait(self) -> None:
        if not self.done():                 # the host blocks until the device catches up
            self.owner.waits += 1
            self.owner.now = self.due


class LaggingFences:
    """Wrap a driver so that its fences complete ``lag`` :meth:`tick` s after they are recorded.

    Parameters
    ----------
    driver : Driver
        The real backend; every other call is forwarded to it unchanged.
    lag : int
        Steps the device trails the host (1: one forward in flight, as under async scheduling;
        0: every fence complete at once, like the host backend's).

    Call :meth:`tick` once per engine step, after the step's forward is issued. ``waits`` counts
    the fences the host had to wait for (each one a step whose overlap was lost).
    """

    def __init__(self, driver, *, lag: int = 1):
        if not isinstance(lag, int) or lag < 0:
            raise ValueError(f"lag must be an int >= 0 (steps), got {lag!r}")
        self.inner, self.lag = driver, lag
        self.now = 0
        self.waits = 0

    def record_fence(self) -> _LagFence:
        return _LagFence(self, self.now + self.lag)

    def tick(self) -> None:
        """The device finished one more step."""
        self.now += 1

    def __getattr__(self, name: str):
        return getattr(self.inner, name)
