"""The fault book of a vLLM worker's runtime: requests that lost their KV, and what vLLM's
scheduler is told to do with them.

A request whose pages cannot be mapped (a driver call failing past its retries, or the pool dry)
is *dead* until vLLM resets it: its rows are left out of the step, and vLLM's scheduler is handed
``{"action": "preempt" | "error", "reason", "evict", "throttle"}`` for it (:data:`.runtime.FAILED_ATTR`).
A request preempted more than ``max_preemptions`` times for driver faults is failed instead, so a
driver that stays broken for it cannot make it loop forever.
"""

from __future__ import annotations

from collections import deque

from vattn.core.errors import ConfigError, DriverError, retry_driver

__all__ = ["FaultBook", "PREEMPT", "ERROR"]

PREEMPT, ERROR = "preempt", "error"


class FaultBook:
    """Dead requests, the failures not yet handed to the scheduler, and the fault counters.

    Parameters
    ----------
    retries : int
        Times a failed driver call is retried within the step.
    max_preemptions : int
        Preemptions for driver faults after which a request is failed instead.
    """

    def __init__(self, retries: int, max_preemptions: int):
        if retries < 0 or max_preemptions < 0:
            raise ConfigError(f"retries and max_preemptions must be >= 0, got {retries}, {max_preemptions}")
        self.retries, self.max_preemptions = retries, max_preemptions
        self.dead: set[str] = set()           # killed; rows left out until vLLM resets them
        self.failures: dict[str, dict] = {}   # killed this step, for the scheduler
        self.reported: set[str] = set()       # killed and handed to the scheduler
        self.strikes: dict[str, int] = {}     # preemptions for driver faults, per request
        self.events: deque[dict] = deque(maxlen=1024)   # the latest kills (tests, bench faults)
        self.counts = {"driver_retries": 0, "requests_preempted": 0, "requests_failed": 0,
                       "pool_shortfalls": 0, "preemptions": 0}

    def retry(self, call) -> tuple[bool, str]:
        """Run a cache call (True: done, False: the pool is short) up to ``retries + 1`` times
        while it raises :class:`DriverError`; returns ``(ok, why not)``."""
        try:
            done = retry_driver(call, self.retries, self._count_retry)
        except DriverError as last:
            return False, f"driver: {last}"
        return (True, "") if done else (False, "short")

    def _count_retry(self) -> None:
        self.counts["driver_retries"] += 1

    def decide(self, req_id: str, reason: str, action: str | None, fault: bool) -> tuple[str, str]:
        """The action for a request losing its KV (default: preempt, or error once it was
        preempted ``max_preemptions`` times for driver faults) and the reason to give."""
        if action is not None:
            return action, reason
        if fault:
            strikes = self.strikes[req_id] = self.strikes.get(req_id, 0) + 1
            if strikes > self.max_preemptions:
                return ERROR, f"{reason} (preempted {strikes - 1} times for driver faults)"
        return PREEMPT, reason

    def record(self, req_id: str, action: str, reason: str, evict: list, throttle: bool) -> None:
        """``req_id`` is dead: its failure waits for the scheduler (:meth:`take`)."""
        self.dead.add(req_id)
        self.failures[req_id] = {"action": action, "reason": f"vattn: {reason}", "evict": list(evict),
                                 "throttle": throttle}
        self.counts["requests_preempted" if action == PREEMPT else "requests_failed"] += 1
        self.events.append({"req_id": req_id, "action": action, "reason": reason})

    def take(self) -> dict[str, dict]:
        """The failures recorded since the last call (now reported)."""
        failures, self.failures = self.failures, {}
        self.reported.update(failures)
        return failures

    def left(self, req_id: str, finished: bool) -> None:
        """``req_id`` left vLLM's batch (reset); ``finished``: gone for good, strikes dropped."""
        self.dead.discard(req_id)
        self.reported.discard(req_id)
        if finished:
            self.strikes.pop(req_id, None)
