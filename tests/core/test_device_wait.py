"""DeviceWait: the device's idle time behind a host section, read from completed events only."""

import time

import pytest

from vattn.core.device_wait import DeviceWait


class _Event:
    """A stand-in for ``torch.cuda.Event``: done after ``ticks`` queries, times from a table."""
    clock: list = []

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.at = None

    def record(self):
        self.at = len(_Event.clock)
        _Event.clock.append(None)

    def query(self):
        return _Event.clock[self.at] is not None

    def elapsed_time(self, end):            # ms, as torch reports it
        return _Event.clock[end.at] - _Event.clock[self.at]


def test_disabled_records_nothing():
    wait = DeviceWait(False)
    wait.begin()
    wait.end()
    assert wait.collect().n == 0


def test_sections_are_folded_in_once_their_events_complete(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    _Event.clock = []
    wait = DeviceWait(True)
    wait.begin()
    wait.end()                                  # device still busy: not complete, not read
    assert wait.collect().n == 0
    wait.begin()
    wait.end()
    _Event.clock[0:2] = [10.0, 10.0]            # the first section: the device never idled
    assert wait.collect().n == 1 and wait.hist.total_us == 0.0
    _Event.clock[2:4] = [20.0, 27.5]            # the second: idle 7.5 ms behind it
    hist = wait.collect()
    assert hist.n == 2 and hist.total_us == pytest.approx(7500.0) and hist.max_us == pytest.approx(7500.0)


@pytest.mark.gpu
@pytest.mark.parametrize("events", ["torch", "driver"])
def test_on_cuda_idle_time_is_counted_and_busy_time_is_not(events):
    import torch
    make = None
    if events == "driver":                      # the CUDA driver's events, with the GIL held
        from vattn.core.driver.cuda import CudaDriver
        make = CudaDriver("cuda", keep_gil="all").timing_event
    wait = DeviceWait(True, make_event=make)
    torch.cuda.synchronize()
    wait.begin()                                # an idle device waits for the whole section
    time.sleep(0.02)
    wait.end()
    torch.cuda.synchronize()
    idle = wait.collect().total_us
    assert idle > 15_000, idle
    torch.cuda._sleep(2_000_000_000)            # ~1 s of device work queued before the section
    wait.begin()
    time.sleep(0.02)
    wait.end()
    torch.cuda.synchronize()
    hist = wait.collect()
    assert hist.n == 2 and hist.total_us - idle < 5_000, hist.as_dict()


def test_events_are_reused_once_read(monkeypatch):
    """A steady stream of sections makes no new event once the first ones are read."""
    import torch
    made = []

    class Counted(_Event):
        def __init__(self, enable_timing=False):
            super().__init__(enable_timing)
            made.append(self)
    monkeypatch.setattr(torch.cuda, "Event", Counted)
    _Event.clock = []
    wait = DeviceWait(True)
    for step in range(50):
        wait.begin()
        wait.end()
        _Event.clock[-2:] = [float(step), float(step) + 0.5]   # this section's events complete
        wait.collect()
    assert wait.hist.n == 50 and wait.hist.total_us == pytest.approx(50 * 500.0)
    assert len(made) == 2


def test_busy_and_the_sink_follow_the_events(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    _Event.clock = []
    seen = []
    wait = DeviceWait(True, sink=seen.append)
    assert wait.busy() is None                   # no section open
    wait.begin()
    assert wait.busy() is True                   # its start event has not completed
    wait.end()
    _Event.clock[0:2] = [5.0, 6.0]
    wait.collect()
    assert seen == [pytest.approx(1000.0)]
    wait.begin()
    _Event.clock[2] = 7.0                        # everything before it already done
    assert wait.busy() is False


def test_a_driver_event_factory_is_used_and_none_falls_back_to_torch(monkeypatch):
    """``make_event`` (a CUDA driver's ``timing_event``, whose calls keep the GIL) makes the
    section's events; where it gives ``None`` (the calls release the GIL there) torch's are made."""
    import torch
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    _Event.clock = []
    made = []

    def factory():
        made.append(_Event(enable_timing=True))
        return made[-1]
    wait = DeviceWait(True, make_event=factory)
    wait.begin()
    wait.end()
    _Event.clock[0:2] = [1.0, 3.0]
    assert len(made) == 2 and wait.collect().total_us == pytest.approx(2000.0)
    torch_made = DeviceWait(True, make_event=lambda: None)
    torch_made.begin()
    assert isinstance(torch_made._start, _Event) and len(made) == 2
