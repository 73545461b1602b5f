"""How long the device sat idle behind a host section: the part of vattn's host work that a
step actually waited for, as opposed to host time hidden behind kernels still running.

An event recorded when the section starts completes when the device has finished everything
queued before it (at once, if it was already idle); one recorded when the section ends
completes right after. The time between the two on the device is the idle time the section
caused (plus whatever the section queued itself, e.g. copies): about 0 while the device was
still busy with the previous step, the section's whole host time when it was idle throughout.
"""

from __future__ import annotations

from collections import deque

from .metrics import Histogram

__all__ = ["DeviceWait"]


class DeviceWait:
    """Device idle time behind :meth:`begin` ... :meth:`end` sections, per section, in a
    :class:`Histogram` (µs). ``enabled=False`` (a host run) records nothing. The events are
    read once complete, never waited for (:meth:`collect`), and reused once read: a step
    creates no event once the first few are made."""

    def __init__(self, enabled: bool, sink=None, make_event=None):
        self.enabled = enabled
        #: ``make_event()``: an event that times (record / query / elapsed_time, as
        #: ``torch.cuda.Event(enable_timing=True)``), or ``None`` for torch's; e.g. a CUDA driver's
        #: ``timing_event``, whose calls keep the GIL (torch's record releases it)
        self.make_event = make_event
        #: ``sink(idle_us)`` for each section in order, as its events complete (a step trace)
        self.sink = sink
        self.hist = Histogram()
        self._open: deque = deque()
        self._free: list = []                 # events read already, recorded again next
        self._start = None

    def _event(self):
        if self._free:
            return self._free.pop()
        event = self.make_event() if self.make_event is not None else None
        if event is None:
            import torch
            event = torch.cuda.Event(enable_timing=True)
        return event

    def begin(self) -> None:
        if self.enabled:
            self._start = self._event()
            self._start.record()

    def busy(self) -> bool | None:
        """Whether the device was still working through earlier work when the open section
        began (``None``: no section open, or a host run)."""
        return None if self._start is None else not self._start.query()

    def end(self) -> None:
        if self._start is None:
            return
        done = self._event()
        done.record()
        self._open.append((self._start, done))
        self._start = None
        self.collect()

    def collect(self) -> Histogram:
        """Fold in the sections whose events have completed; returns the histogram."""
        while self._open and self._open[0][1].query():
            start, done = self._open.popleft()
            idle_us = start.elapsed_time(done) * 1e3
            self.hist.observe(idle_us)
            if self.sink is not None:
                self.sink(idle_us)
            self._free += (start, done)
        return self.hist
