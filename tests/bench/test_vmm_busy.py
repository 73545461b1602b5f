"""The calls-while-busy probe of ``vattn bench vmm``: it must tell a driver call that waits for
the kernel in flight from one that does not (a fake kernel: a deadline on the host clock)."""

from __future__ import annotations

import time

import pytest

from vattn.bench.vmm_busy import CALLS, busy_latency, markdown
from vattn.core.driver.host import HostDriver


class FakeKernel:
    """A 'kernel' that runs until a deadline; ``idle`` waits for it."""

    def __init__(self):
        self.end = 0.0

    def launch(self, ms: float) -> None:
        self.end = time.monotonic() + ms / 1e3

    def running(self) -> bool:
        return time.monotonic() < self.end

    def idle(self) -> None:
        time.sleep(max(0.0, self.end - time.monotonic()))


class SyncingUnmap(HostDriver):
    """A driver whose unmap waits for the kernel in flight, as an implicit synchronisation would."""

    def __init__(self, kernel: FakeKernel):
        super().__init__()
        self.kernel = kernel

    def unmap(self, va: int, size: int) -> None:
        self.kernel.idle()
        super().unmap(va, size)


@pytest.fixture
def kernel():
    return FakeKernel()


def test_a_call_that_waits_for_the_kernel_is_counted_and_the_others_are_not(kernel):
    drv = SyncingUnmap(kernel)
    out = busy_latency(drv, 4, busy_ms=30, launch=kernel.launch, running=kernel.running, idle=kernel.idle)
    assert out["unmap"]["waited"] == 4
    assert out["unmap"]["median_us"] > 20_000          # it sat out the 30 ms kernel
    for name in ("create", "map", "set_access", "release"):
        assert out[name]["waited"] == 0, name
        assert out[name]["median_us"] < 20_000, name


def test_idle_rows_count_no_waits_and_the_table_names_every_call(kernel):
    drv = HostDriver()
    idle = busy_latency(drv, 3, busy_ms=5, launch=None)
    busy = {"default stream": busy_latency(drv, 3, busy_ms=5, launch=kernel.launch,
                                           running=kernel.running, idle=kernel.idle)}
    assert all(idle[c]["waited"] is None and idle[c]["calls"] == 3 for c in CALLS)
    table = markdown(idle, busy, 5)
    assert all(f"| {c} |" in table for c in CALLS)
    assert "0 of 3" in table


def test_the_address_range_is_given_back_even_when_a_call_fails(kernel):
    freed = []

    class Failing(HostDriver):
        def set_access(self, va, size):
            raise RuntimeError("injected")

        def free_va(self, va, size):
            freed.append((va, size))
            super().free_va(va, size)

    with pytest.raises(RuntimeError, match="injected"):
        busy_latency(Failing(), 2, busy_ms=1, launch=None)
    assert len(freed) == 1


def test_a_worker_holding_a_lock_the_launches_need_shows_as_launch_stalls():
    import threading
    lock = threading.Lock()

    class LockedUnmap(HostDriver):
        def unmap(self, va, size):
            with lock:                                  # a driver lock held across a wait
                time.sleep(0.02)
                super().unmap(va, size)

    def launch(ms):
        with lock:
            pass

    from vattn.bench.vmm_busy import launch_stalls, stalls_markdown
    drv = LockedUnmap()
    alone = launch_stalls(drv, launch, lambda: None, launches=30, worker=False)
    beside = launch_stalls(drv, launch, lambda: None, launches=30, worker=True)
    assert alone["launch_max_us"] < 10_000 and alone["worker_calls"] is None
    assert beside["launch_max_us"] > 10_000 and beside["worker_calls"] >= 3
    table = stalls_markdown(alone, beside)
    assert "| alone |" in table and "beside a VMM worker thread" in table
