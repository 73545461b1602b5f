"""``LaggingFences``: a device trailing the host by some steps, on the host backend."""

import pytest

from vattn.core.driver import HostDriver
from vattn.core.driver.lag import LaggingFences


def test_fences_complete_lag_steps_after_they_are_recorded():
    drv = LaggingFences(HostDriver(), lag=2)
    f = drv.record_fence()
    assert not f.done()
    drv.tick()
    assert not f.done()
    drv.tick()
    assert f.done() and drv.waits == 0
    f.wait()                                    # a completed fence costs no wait
    assert drv.waits == 0


def test_a_wait_counts_once_and_completes_every_earlier_fence():
    drv = LaggingFences(HostDriver(), lag=1)
    first = drv.record_fence()
    drv.tick()
    second, third = drv.record_fence(), drv.record_fence()
    assert first.done() and not second.done()
    second.wait()
    assert drv.waits == 1 and second.done() and third.done()
    third.wait()
    assert drv.waits == 1


def test_lag_zero_is_the_host_backend_and_other_calls_pass_through():
    inner = HostDriver()
    drv = LaggingFences(inner, lag=0)
    assert drv.record_fence().done() and drv.granularity == inner.granularity
    with pytest.raises(ValueError, match="lag must be an int >= 0"):
        LaggingFences(inner, lag=-1)
