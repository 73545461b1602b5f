import contextlib

import pytest
import torch

from tests.conftest import devices
from vattn.core import ConfigError, DriverError
from vattn.core.driver import FaultInjector, HostDriver, get_driver
from vattn.core.errors import InjectedFault

PAGE = 64 << 10


def _driver(device):
    return HostDriver(granularity=PAGE) if device == "cpu" else get_driver(device)


@pytest.mark.parametrize("device", devices())
def test_map_access_view_unmap_roundtrip(device):
    drv = _driver(device)
    g = drv.granularity
    base = drv.reserve(4 * g)
    view = drv.view(base, 4 * g)
    handles = [drv.create(g) for _ in range(2)]
    drv.map(base + g, g, handles[0]); drv.map(base + 2 * g, g, handles[1])
    drv.set_access(base + g, 2 * g)                    # one call over a contiguous run
    view[g:3 * g] = 7
    drv.zero(base + g, g)
    assert view[g:2 * g].sum().item() == 0 and view[2 * g:3 * g].float().mean().item() == 7
    drv.unmap(base + 2 * g, g)
    drv.map(base + 3 * g, g, handles[1])                # the same page at another address
    drv.set_access(base + 3 * g, g)
    assert view[3 * g:4 * g].float().mean().item() == 7   # physical content moved with the page
    drv.unmap(base + g, g); drv.unmap(base + 3 * g, g)
    for h in handles:
        drv.release(h)
    drv.free_va(base, 4 * g)


def test_host_refuses_what_cuda_refuses():
    drv = HostDriver(granularity=PAGE)
    base = drv.reserve(2 * PAGE)
    h = drv.create(PAGE)
    with pytest.raises(DriverError, match="range not fully mapped"):
        drv.set_access(base, PAGE)
    drv.map(base, PAGE, h)
    with pytest.raises(DriverError, match="already mapped"):
        drv.map(base, PAGE, h)
    with pytest.raises(DriverError, match="multiples"):
        drv.map(base + 1, PAGE, h)
    with pytest.raises(DriverError, match="still mapped"):
        drv.release(h)
    with pytest.raises(DriverError, match="pages still mapped"):
        drv.free_va(base, 2 * PAGE)
    with pytest.raises(DriverError, match="outside every reservation"):
        drv.map(base + 8 * PAGE, PAGE, h)
    with pytest.raises(DriverError, match="range not fully mapped"):
        drv.unmap(base + PAGE, PAGE)
    drv.unmap(base, PAGE); drv.release(h)
    with pytest.raises(DriverError, match="unknown or released"):
        drv.release(h)
    drv.free_va(base, 2 * PAGE); drv.close()


def test_error_names_call_and_arguments():
    drv = HostDriver(granularity=PAGE)
    with pytest.raises(DriverError) as info:
        drv.reserve(PAGE + 1)
    assert info.value.call == "reserve" and info.value.call_args == {"size": PAGE + 1}
    assert "reserve(size=" in str(info.value)


def test_fault_injector_fails_exactly_the_nth_call():
    drv = FaultInjector(HostDriver(granularity=PAGE), fail={"create": 2})
    drv.create(PAGE)
    with pytest.raises(InjectedFault, match="call_number"):
        drv.create(PAGE)
    drv.create(PAGE)
    assert drv.calls["create"] == 3
    with pytest.raises(ValueError, match="cannot inject"):
        drv.arm("frobnicate", 1)


def test_get_driver_validates_backend_and_device():
    with pytest.raises(ConfigError, match="backend must be"):
        get_driver("cpu", backend="opencl")
    with pytest.raises(ConfigError, match="host backend serves"):
        get_driver(torch.device("cuda"), backend="host")
    with pytest.raises(ConfigError, match="cuda backend serves"):
        get_driver("cpu", backend="cuda")


def test_host_multi_page_allocation_is_mapped_and_unmapped_only_whole():
    """As CUDA: an allocation of several pages maps at one address as a whole (no offset, no part),
    is unmapped whole, and its bytes are the same through every mapping."""
    from vattn.core.driver.host import HostDriver
    from vattn.core.errors import DriverError
    drv = HostDriver(granularity=1 << 16)
    g = drv.granularity
    base = drv.reserve(16 * g)
    view = drv.view(base, 16 * g)
    try:
        four = drv.create(4 * g)
        with pytest.raises(DriverError, match="mapped whole"):
            drv.map(base, g, four)                       # a part of it
        drv.map(base, 4 * g, four)
        drv.map(base + 8 * g, 4 * g, four)               # the same pages at a second address
        drv.set_access(base, 4 * g)
        drv.set_access(base + 8 * g, 4 * g)
        view[2 * g:3 * g].fill_(7)
        assert bool((view[10 * g:11 * g] == 7).all())
        with pytest.raises(DriverError, match="only whole"):
            drv.unmap(base + g, g)
        with pytest.raises(DriverError, match="still mapped"):
            drv.release(four)
        drv.unmap(base, 4 * g)
        drv.unmap(base + 8 * g, 4 * g)
        assert not drv.is_mapped(base) and not drv.is_mapped(base + 11 * g)
        drv.release(four)
        one = drv.create(g)                              # its pages serve one-page handles again
        drv.map(base, g, one)
        drv.unmap(base, g)
        drv.release(one)
        with pytest.raises(DriverError, match="multiples"):
            drv.create(g + 4096)
    finally:
        drv.free_va(base, 16 * g)
        drv.close()


@pytest.mark.parametrize("device", devices())
def test_one_unmap_takes_adjacent_mappings_where_the_driver_says_so(device):
    """``unmap_spans``: one call over three adjacent one-page mappings unmaps all three (the same
    addresses map again afterwards); the content of each page outlives its mapping."""
    drv = _driver(device)
    g = drv.granularity
    if not drv.unmap_spans:
        pytest.skip(f"the {drv.name} driver on this machine unmaps one mapping per call")
    base = drv.reserve(3 * g)
    view = drv.view(base, 3 * g)                          # made over unmapped VA, as the cache does
    handles = [drv.create(g) for _ in range(3)]
    try:
        for i, h in enumerate(handles):
            drv.map(base + i * g, g, h)
        drv.set_access(base, 3 * g)
        for i in range(3):
            view[i * g:(i + 1) * g] = i + 1
        if device != "cpu":
            torch.cuda.synchronize()
        drv.unmap(base, 3 * g)
        for i, h in enumerate(reversed(handles)):          # all three gone: remapped in reverse
            drv.map(base + i * g, g, h)
        drv.set_access(base, 3 * g)
        assert [int(view[i * g]) for i in range(3)] == [3, 2, 1]
        drv.unmap(base, 3 * g)
    finally:
        for h in handles:
            drv.release(h)
        drv.free_va(base, 3 * g)


@pytest.mark.parametrize("device", devices())
def test_copy_moves_bytes_between_mapped_pages_on_the_stream(device):
    """``copy``: the bytes of one mapped page land in another (on CUDA one cuMemcpyDtoDAsync on
    the current stream, read back after the kernels before it)."""
    drv = _driver(device)
    with _accessible_pages(drv, 2) as (base, view):
        g = drv.granularity
        view[:g] = torch.arange(g, dtype=torch.int64, device=view.device).remainder(251).to(torch.uint8)
        view[g:] = 0
        drv.copy(base + g + 64, base + 128, g // 2)
        assert torch.equal(view[g + 64:g + 64 + g // 2], view[128:128 + g // 2])
        assert view[g:g + 64].sum().item() == 0 and view[g + 64 + g // 2:].sum().item() == 0


@contextlib.contextmanager
def _accessible_pages(drv, n: int):
    """``n`` pages of ``drv`` mapped side by side with access: ``(va, uint8 view)``, given back after."""
    g = drv.granularity
    base = drv.reserve(n * g)
    view = drv.view(base, n * g)          # over unmapped VA, as the cache makes its views
    handles = [drv.create(g) for _ in range(n)]
    for i, h in enumerate(handles):
        drv.map(base + i * g, g, h)
    drv.set_access(base, n * g)
    try:
        yield base, view
    finally:
        for i, h in enumerate(handles):
            drv.unmap(base + i * g, g)
            drv.release(h)
        drv.free_va(base, n * g)


def test_host_copy_refuses_memory_without_access_and_overlap():
    """What would fault on the device is a DriverError on the host, not a segfault."""
    drv = HostDriver(granularity=PAGE)
    base = drv.reserve(3 * PAGE)
    h = drv.create(PAGE)
    drv.map(base, PAGE, h)
    drv.set_access(base, PAGE)
    with pytest.raises(DriverError, match="dst range not accessible"):
        drv.copy(base + PAGE, base, 16)                 # nothing mapped there
    with pytest.raises(DriverError, match="src range not accessible"):
        drv.copy(base, base + PAGE - 8, 16)             # runs past the mapped page
    with pytest.raises(DriverError, match="overlap"):
        drv.copy(base + 8, base, 16)
    drv.unmap(base, PAGE)
    drv.release(h)
    drv.free_va(base, 3 * PAGE)


@pytest.mark.gpu
@pytest.mark.parametrize("keep_gil", [True, False], ids=["direct", "bindings"])
def test_cuda_paths_with_and_without_the_gil_agree_and_fail_typed(keep_gil):
    """The GIL-holding entry points (core/driver/cuda_direct.py) and cuda.bindings: the same
    bytes after map / access / zero / copy / a pinned host upload and a fence after them, the
    same typed error for a bad map (not a bad unmap: unmapping reserved VA with nothing mapped
    succeeds on the H100's driver, 580.159)."""
    from vattn.core.driver.cuda import CudaDriver
    drv = CudaDriver("cuda", keep_gil=keep_gil)
    assert (drv.gil == "held") == keep_gil
    with _accessible_pages(drv, 2) as (base, view):
        g = drv.granularity
        view.fill_(9)
        drv.zero(base + 4096, 8192)
        drv.copy(base + g, base, 16384)
        assert view[g + 4096:g + 12288].sum().item() == 0
        assert view[g:g + 4096].float().mean().item() == 9 and view[g + 12288:g + 16384].float().mean().item() == 9
        assert view[g + 16384:].float().mean().item() == 9
        host = torch.full((4096,), 6, dtype=torch.uint8).pin_memory()
        drv.copy_from_host(base + 2 * g - 4096, host.data_ptr(), 4096)   # a table upload
        fence = drv.record_fence()                      # after the copies, on the same stream
        assert type(fence).__name__ == ("DirectFence" if keep_gil else "CudaFence")
        fence.wait()
        assert fence.done()
        assert view[2 * g - 4096:].float().mean().item() == 6
        torch.cuda.synchronize()
    spare, handle = drv.reserve(g), drv.create(g)
    try:                                                 # half a granule: the driver refuses it
        with pytest.raises(DriverError, match=r"cuMemMap\(va=.*CUDA_ERROR"):
            drv.map(spare, g // 2, handle)
    finally:
        drv.release(handle)
        drv.free_va(spare, g)


@pytest.mark.gpu
def test_a_batch_of_copies_moves_the_bytes_on_the_legacy_stream_and_on_a_stream_of_its_own():
    """``copy_many`` with ``cuMemcpyBatchAsync`` (CUDA 13 drivers): on torch's default stream
    (the legacy stream, which the batch call refuses: a blocking stream of the driver's own, ordered
    both ways) and on a stream of torch's; each batch after the fill before it, before the reads
    after it."""
    from vattn.core.driver.cuda import CudaDriver
    drv = CudaDriver("cuda", keep_gil=True, batch_copies=True)
    if not drv.batch_copies:
        pytest.skip("this driver hands out no cuMemcpyBatchAsync (CUDA 13)")
    with _accessible_pages(drv, 4) as (base, view):
        g = drv.granularity
        view[:g].fill_(1)
        view[g:2 * g].fill_(2)
        view[2 * g:].fill_(0)
        drv.copy_many([(base + 2 * g, base, g), (base + 3 * g, base + g, g)])
        assert view[2 * g:3 * g].float().mean().item() == 1 and view[3 * g:].float().mean().item() == 2
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            view[:g].fill_(5)
            drv.copy_many([(base + 2 * g, base, g), (base + 3 * g, base, g)])
            view[g:2 * g].copy_(view[3 * g:])           # reads the batch's result, on the same stream
        torch.cuda.synchronize()
        assert view[g:].float().mean().item() == 5
