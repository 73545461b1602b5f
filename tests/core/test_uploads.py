"""``vattn.core.uploads.HostUploads``: per-step host arrays to the device, through the driver's
copy where it keeps the GIL (a fake device here that runs its copies only when asked, and the
real one on a GPU)."""

import ctypes

import numpy as np
import pytest
import torch

from vattn.core.uploads import RING, HostUploads


class FakeDevice:
    """Copies queued by ``copy_from_host`` land when the device runs (a fence's wait, or
    :meth:`run`); a fence is done once everything queued before it landed."""

    gil_everywhere = True

    def __init__(self):
        self.queue, self.landed = [], 0

    def copy_from_host(self, dst, src, nbytes):
        self.queue.append((dst, src, nbytes))     # read when the device runs it, as a real copy

    def run(self):
        for dst, src, nbytes in self.queue:
            ctypes.memmove(dst, src, nbytes)
        self.landed += len(self.queue)
        self.queue.clear()

    def record_fence(self):
        device, mark = self, self.landed + len(self.queue)

        class Fence:
            def done(self):
                return device.landed >= mark

            def wait(self):
                device.run()
        return Fence()


def _through(device, capacity=4):
    """HostUploads over ``device`` as on CUDA (the CPU stands in for the device memory)."""
    up = HostUploads("cpu", capacity=capacity)
    up._driver, up.through_driver = device, True
    up._grow(capacity)
    return up


def test_values_land_in_one_copy_per_upload_as_int64_views():
    dev = FakeDevice()
    up = _through(dev)
    a, b = up.to_device(np.array([3, 1], dtype=np.int32), [7])
    assert len(dev.queue) == 1 and a.dtype == torch.int64 and a.numel() == 2 and b.numel() == 1
    dev.run()
    assert a.tolist() == [3, 1] and b.tolist() == [7]
    empty, = up.to_device(np.zeros(0))
    assert empty.numel() == 0 and len(dev.queue) == 0         # nothing to copy, no fence


def test_a_host_buffer_is_reused_only_after_its_copy_landed():
    """RING uploads in flight; the next one reuses the first entry's host buffer, so it waits for
    that copy first (counted), and every value still lands as uploaded."""
    dev = FakeDevice()
    up = _through(dev)
    outs = [up.to_device([i, i + 1])[0] for i in range(RING)]
    assert up.waits == 0 and len(dev.queue) == RING              # the device ran nothing yet
    last = up.to_device([100, 101])[0]
    assert up.waits == 1 and len(dev.queue) == 1                 # the wait ran the queue first
    assert [o.tolist() for o in outs[1:]] == [[i, i + 1] for i in range(1, RING)]
    dev.run()
    assert last.tolist() == [100, 101]
    assert outs[0].tolist() == [100, 101]     # the same ring entry: use a view within its step


def test_a_larger_upload_grows_the_ring_after_every_copy_in_flight():
    dev = FakeDevice()
    up = _through(dev, capacity=4)
    small = up.to_device([1, 2, 3])[0]
    big, tail = up.to_device(np.arange(9), [5, 6])
    assert up.capacity == 16 and len(dev.queue) == 1             # the first copy landed before
    assert small.tolist() == [1, 2, 3]
    dev.run()
    assert big.tolist() == list(range(9)) and tail.tolist() == [5, 6]


def test_without_a_gil_keeping_driver_it_is_torchs_copy():
    class Releasing:
        gil_everywhere = False
    up = HostUploads("cpu", Releasing())
    assert not up.through_driver
    a, b = up.to_device([1, 2], np.array([3]))
    assert a.tolist() == [1, 2] and b.tolist() == [3] and a.device.type == "cpu"
    assert not HostUploads("cpu", FakeDevice()).through_driver    # the host needs no copy


@pytest.mark.gpu
def test_uploads_through_the_driver_on_a_gpu():
    """On CUDA with a driver that keeps the GIL everywhere: every upload's values on the device,
    across ring wrap-arounds and a growth, each checked before the next upload (as a step uses
    its metadata)."""
    from vattn.core.driver.cuda import CudaDriver
    drv = CudaDriver("cuda", keep_gil="all")
    up = HostUploads("cuda", drv, capacity=8)
    assert up.through_driver
    rng = np.random.default_rng(0)
    for step in range(3 * RING):
        n = 40 if step == RING + 3 else int(rng.integers(1, 8))
        arrays = [rng.integers(-2**40, 2**40, size=n), rng.integers(0, 9, size=2)]
        got = up.to_device(*arrays)
        assert all(g.device.type == "cuda" for g in got)
        assert [g.cpu().tolist() for g in got] == [a.tolist() for a in arrays]
    assert up.capacity == 64 and up.uploads == 3 * RING


def test_the_ring_records_a_buffers_fence_again_instead_of_making_one_per_upload():
    """A fence that can be recorded again (a CUDA event) is reused once the ring hands its buffer
    out again: no event made per step; one that cannot is made anew."""
    from vattn.core.uploads import FenceRing

    class Reusable:
        made = 0

        def __init__(self):
            Reusable.made += 1
            self.records, self.finished = 1, True

        def done(self):
            return self.finished

        def wait(self):
            self.finished = True

        def again(self):
            self.records += 1

    ring = FenceRing(2)
    for _ in range(5):
        ring.read_by(ring.claim(), Reusable)
    assert Reusable.made == 2 and [f.records for f in ring.fences] == [3, 2] and ring.waits == 0
    ring.fences[0].finished = False
    assert ring.claim() == 1 and ring.claim() == 0 and ring.waits == 1     # waited before reuse
    plain = FenceRing(1)
    made = []
    for _ in range(3):
        plain.read_by(plain.claim(), lambda: made.append(1) or FakeDevice().record_fence())
    assert len(made) == 3
