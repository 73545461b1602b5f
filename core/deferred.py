"""Deferred mapping: an engine step's VMM calls queued per range, made as the forward reaches
the layers that read each range.

Admitting a burst of requests costs one map and one access grant per physical allocation
(~30 µs each on an H100), made on the host before the step's forward is launched, while the
device waits. Every page of a range belongs to one group of layers, and a layer's attention
reads only its own range. So the calls for range ``r`` can wait until the forward reaches the
first layer of range ``r``: by then the kernels of the layers before it are queued, and the
device computes them while the host maps. Only range 0 stays on the step's critical path.

:class:`DeferredCalls` wraps the cache's driver. Inside a window (:meth:`~DeferredCalls.open_window`
.. ``close_window``), the ``map`` / ``set_access`` / ``unmap`` / ``zero`` calls the window's
thread makes on the cache's ranges are queued in order, one queue per range, and the cache's
record is updated as if they were made; :meth:`issue` makes the queued calls of ranges
``0 .. r`` in order. Any other call that touches memory or the stream (``record_fence``, a map
outside the ranges, a fence outside the window ...) first makes everything queued; the cache's
copies through its views and a fence inside the window are queued too (:meth:`later`,
:class:`LaterFence`), so nothing the host or the device does can see a page the record says is
mapped before it is, and no fence completes before the copies it covers ran. Only the map-ahead worker's thread (it called ``bind_thread``; it
plans nothing while calls are queued) goes straight through.

A queued call that fails cannot be undone in the record: :meth:`issue` raises
:class:`DeferredCallError` and the wrapper refuses every later call, so the engine stops
before a kernel reads an address the record got wrong.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from .errors import DriverError, VattnError
from .metrics import Counters

__all__ = ["CopyBatch", "DeferredCalls", "DeferredCallError", "LaterFence"]

#: the driver's other calls that touch what a queued call may name (a handle, the reservation):
#: whatever is queued is made before them (``create`` and ``reserve`` make something new; the
#: calls a window queues, and fences, have methods of their own below)
_ORDERED = frozenset(("release", "free_va"))


class DeferredCallError(DriverError):
    """A deferred VMM call failed when it was made: the cache's record no longer matches the
    device's mappings, so the cache refuses every later call."""


class DeferredCalls:
    """A driver whose calls on ``[base, base + num_ranges * range_bytes)`` may be deferred.

    Parameters
    ----------
    driver : Driver
        The real backend (or a fault injector around it).
    base, range_bytes, num_ranges : int
        The cache's ranges: range ``r`` is ``[base + r * range_bytes, base + (r + 1) * range_bytes)``.
    counters : Counters, optional
        ``calls_deferred`` and ``issue_us`` (host time of each :meth:`issue` that made calls).

    ``on_empty``, if set, is called (under the cache's lock) whenever :meth:`issue` has made the
    last queued call: the cache wakes its map-ahead worker there.
    """

    def __init__(self, driver, *, base: int, range_bytes: int, num_ranges: int,
                 counters: Counters | None = None):
        self.inner = driver
        self.base, self.range_bytes, self.num_ranges = base, range_bytes, num_ranges
        self.counters = counters if counters is not None else Counters()
        self.queues: list[deque[tuple[str, tuple]]] = [deque() for _ in range(num_ranges)]
        self.pending = 0                  # calls queued, not made yet
        self.failed: Exception | None = None
        self.failed_code = None
        self._owner: int | None = None    # the thread whose calls are queued, while a window is open
        self._queuer: int | None = None   # the last window's thread, until its calls are made
        self._bypass: set[int] = set()    # threads that called bind_thread (the map-ahead worker)
        self.on_empty = None
        self._issuing = False             # inside issue(): the calls a job makes go straight through
        self._copies_later = True         # the open window queues copies while nothing waits too
        #: the driver makes a batch of copies in one call: queuing them always pays
        self._batches = bool(getattr(driver, "batch_copies", False))
        self.touched: dict[int, int] = {}  # pool page -> the last range whose queued work uses it

    # -- the window ------------------------------------------------------------------------------
    def open_window(self, copies: bool = True) -> None:
        """From now on queue the calling thread's deferrable calls until :meth:`issue` (what an
        earlier window queued is made first). The caller holds the cache's lock."""
        if self._owner is not None:
            raise VattnError("a deferral window is open already: expected it closed (leave the "
                             "`with cache.deferred()` block) before another opens, got a second open")
        self.issue()
        self._owner = self._queuer = threading.get_ident()
        self._copies_later = copies

    def close_window(self) -> None:
        """End the window (what it queued stays queued until :meth:`issue`)."""
        self._owner = None

    def issue(self, upto: int | None = None) -> int:
        """Make the queued calls of ranges ``0 .. upto`` (all with ``None``), in order; returns
        the calls made. Raises :class:`DeferredCallError` if one fails (and from then on).
        The caller holds the cache's lock."""
        self._check()
        if not self.pending:
            return 0
        if self.foreign():
            raise VattnError(f"deferred VMM calls queued by thread {self._queuer} must be made by it "
                             f"(its CUDA context and stream), got a call from thread "
                             f"{threading.get_ident()}")
        last = self.num_ranges - 1 if upto is None else min(upto, self.num_ranges - 1)
        start, made = time.perf_counter(), 0
        self._issuing = True
        batch = CopyBatch()                  # queued copies in a row, made as one batch
        try:
            for queue in self.queues[:last + 1]:
                while queue:
                    name, args = queue.popleft()
                    self.pending -= 1
                    made += 1
                    if name == "copy" and batch.takes(*args):
                        continue
                    self._made(batch.flush, self._copy_many, name="copy", args=batch.first())
                    if name == "copy":
                        batch.takes(*args)
                    elif name == "job":
                        self._made(args[0], name=name, args=args)
                    else:
                        self._made(getattr(self.inner, name), *args, name=name, args=args)
            self._made(batch.flush, self._copy_many, name="copy", args=batch.first())
        finally:
            self._issuing = False
        if self.touched:
            self.touched = {pid: r for pid, r in self.touched.items() if r > last and self.pending}
        if made:
            self.counters.issue_us.observe((time.perf_counter() - start) * 1e6)
        if not self.pending and self.on_empty is not None:
            self.on_empty()
        return made

    def _made(self, fn, *fn_args, name: str, args: tuple):
        """``fn(*fn_args)``, a queued call being made; a failure is final (see :meth:`issue`)."""
        try:
            return fn(*fn_args)
        except Exception as exc:
            self.failed = exc
            code = self.failed_code = exc.code if isinstance(exc, DriverError) else type(exc).__name__
            raise DeferredCallError(name, _args(name, args), code,
                                    f"a deferred call failed, so the cache's record no longer "
                                    f"matches the device's mappings ({exc}); the engine must be "
                                    f"restarted") from exc

    def _copy_many(self, copies: list[tuple[int, int, int]]) -> None:
        """Independent copies: one batch where the driver has one, else one call each."""
        many = getattr(self.inner, "copy_many", None)
        if many is not None and len(copies) > 1:
            many(copies)
            return
        for dst, src, nbytes in copies:
            self.inner.copy(dst, src, nbytes)

    def foreign(self) -> bool:
        """Whether calls are queued and the calling thread neither queued them nor is the
        map-ahead worker's (such a thread must not make them: another thread's CUDA context
        and current stream)."""
        me = threading.get_ident()
        return bool(self.pending) and me != self._queuer and me not in self._bypass

    def deferring(self) -> bool:
        """Whether calls wait in the queue and the calling thread's would join them."""
        return bool(self.pending) and threading.get_ident() == self._owner

    def in_window(self) -> bool:
        """Whether the calling thread's deferrable calls and :meth:`later` jobs are queued (its
        window is open and no :meth:`issue` is running), whether or not anything waits yet: work
        queued then must :meth:`touch` the pool pages it uses."""
        return threading.get_ident() == self._owner and not self._issuing

    def copies_later(self) -> bool:
        """Whether a page-set copy the calling thread asks for now is queued (:meth:`copy_later`):
        behind calls that wait, or in a window opened with ``copies=True`` or over a driver that
        batches copies (queued in a row, they are made as one call)."""
        return self.deferring() or ((self._copies_later or self._batches) and self.in_window())

    def later(self, rng: int, job) -> None:
        """Run ``job()`` (host work that reads or writes range ``rng`` through the device, e.g. a
        copy on the stream) where the calls queued for ``rng`` so far are made: queued behind
        them inside the window, else now, after everything queued. Driver calls the job makes go
        straight to the driver."""
        if threading.get_ident() == self._owner and not self._issuing:
            self.queues[rng].append(("job", (job,)))
            self.pending += 1
            return
        self._drain()
        job()

    def touch(self, pids, rng: int) -> None:
        """Queued device work in range ``rng`` (a copy, a scrub) reads or writes pool pages
        ``pids``: see :meth:`reuse`."""
        for pid in pids:
            if self.touched.get(pid, -1) < rng:
                self.touched[pid] = rng

    def reuse(self, pid: int, rng: int) -> None:
        """Pool page ``pid`` is about to serve range ``rng``. A page moves between ranges only
        through the pool; if work queued in a later range still reads or writes it (queued
        before the page was freed), that work is made now: issued range by range, the new use
        would otherwise reach the device first."""
        last = self.touched.get(pid)
        if last is not None and last > rng:
            self.issue(last)

    def abandon(self) -> None:
        """Drop what is queued and forget a failure: teardown of a cache whose record is wrong
        (best effort from here on)."""
        for queue in self.queues:
            queue.clear()
        self.pending, self.failed, self._owner, self._queuer = 0, None, None, None
        self.touched.clear()

    # -- the driver ------------------------------------------------------------------------------
    def map(self, va: int, size: int, handle) -> None:
        self._call("map", va, size, handle)

    def set_access(self, va: int, size: int) -> None:
        self._call("set_access", va, size)

    def unmap(self, va: int, size: int) -> None:
        self._call("unmap", va, size)

    def zero(self, va: int, nbytes: int) -> None:
        """Queued like a map (a scrub: ordered on the stream before the layer that reads it)."""
        self._call("zero", va, nbytes)

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        """A copy through mapped memory: what is queued is made first (inside :meth:`issue`, as a
        queued copy, it goes straight through)."""
        self._drain()
        self.inner.copy(dst, src, nbytes)

    def copy_many(self, copies: list[tuple[int, int, int]]) -> None:
        """Independent ``(dst, src, nbytes)`` copies made now (what is queued first): one batch
        where the driver has one."""
        self._drain()
        self._copy_many(copies)

    def copy_later(self, rng: int, dst: int, src: int, nbytes: int) -> None:
        """A copy in range ``rng``, queued behind that range's calls inside the window (copies
        queued in a row are made as one batch, see :class:`CopyBatch`), else made now."""
        if self.in_window():
            self.queues[rng].append(("copy", (dst, src, nbytes)))
            self.pending += 1
            return
        self.copy(dst, src, nbytes)

    def record_fence(self):
        """A fence after the work issued so far. Inside the window: one recorded where the
        queue reaches it (after the copies queued before it), a :class:`LaterFence`."""
        if threading.get_ident() == self._owner and self.pending and not self._issuing:
            fence = LaterFence(self)
            self.queues[-1].append(("job", (fence.record,)))
            self.pending += 1
            return fence
        self._drain()
        return self.inner.record_fence()

    def bind_thread(self) -> None:
        """The calling thread's calls go straight to the driver from now on (the map-ahead
        worker's: it maps without the cache's lock and plans nothing while calls are queued)."""
        self._bypass.add(threading.get_ident())
        self.inner.bind_thread()

    def _call(self, name: str, va: int, *rest) -> None:
        self._check()
        if threading.get_ident() == self._owner and not self._issuing:
            rng = (va - self.base) // self.range_bytes
            if va >= self.base and rng < self.num_ranges:
                self.queues[rng].append((name, (va, *rest)))
                self.pending += 1
                self.counters.calls_deferred += 1
                return
        self._drain()
        getattr(self.inner, name)(va, *rest)

    def __getattr__(self, name: str):
        attr = getattr(self.inner, name)
        if name not in _ORDERED or not callable(attr):
            return attr

        def ordered(*args, **kwargs):
            self._drain()
            return attr(*args, **kwargs)
        return ordered

    def _drain(self) -> None:
        """Before a call that is made now: everything queued first (not from the worker's
        thread, nor from a job ``issue`` is running); refused after a failure."""
        self._check()
        if self.pending and not self._issuing and threading.get_ident() not in self._bypass:
            self.issue()

    def _check(self) -> None:
        if self.failed is not None:
            raise DeferredCallError("deferred", {}, self.failed_code,
                                    f"an earlier deferred call failed ({self.failed}); the cache's "
                                    f"record no longer matches the device's mappings")


class CopyBatch:
    """Queued copies made together (a batch's copies run in any order among themselves): a copy
    joins only if it reads nothing the batch writes and writes nothing it reads or writes, and
    only copies of the batch's size at addresses aligned to it (page-sets' pages), so equal
    start addresses are the only overlap."""

    __slots__ = ("copies", "reads", "writes", "unit")

    def __init__(self):
        self.copies: list[tuple[int, int, int]] = []
        self.reads: set[int] = set()
        self.writes: set[int] = set()
        self.unit = 0

    def takes(self, dst: int, src: int, nbytes: int) -> bool:
        """Add the copy if it may run with the others; False: make the batch first. A copy at
        addresses not aligned to its size goes alone."""
        aligned = nbytes > 0 and not (dst % nbytes or src % nbytes)
        if self.copies:
            if (not aligned or nbytes != self.unit or src in self.writes or dst in self.writes
                    or dst in self.reads):
                return False
        else:
            self.unit = nbytes if aligned else 0        # 0: nothing joins it
        self.copies.append((dst, src, nbytes))
        self.reads.add(src)
        self.writes.add(dst)
        return True

    def first(self) -> tuple:
        """The first copy's ``(dst, src, nbytes)`` (for an error's text), ``()`` if none."""
        return self.copies[0] if self.copies else ()

    def flush(self, make) -> None:
        """``make(copies)`` for the batch's copies, if any, and start a new batch."""
        if self.copies:
            copies = self.copies
            self.copies, self.reads, self.writes, self.unit = [], set(), set(), 0
            make(copies)


class LaterFence:
    """A fence recorded when the deferred queue reaches it: not done before; :meth:`wait` makes
    the queue first (under the cache's lock, as every fence wait in the cache is)."""

    __slots__ = ("calls", "fence")

    def __init__(self, calls: DeferredCalls):
        self.calls, self.fence = calls, None

    def record(self) -> None:
        self.fence = self.calls.inner.record_fence()

    def done(self) -> bool:
        return self.fence is not None and self.fence.done()

    def wait(self) -> None:
        if self.fence is None:
            self.calls.issue()
        if self.fence is not None:                # (None: its queue was dropped, see abandon)
            self.fence.wait()


def _args(name: str, args: tuple) -> dict:
    if name == "job":
        return {"job": getattr(args[0], "func", args[0])}
    if name == "copy":
        return dict(zip(("dst", "src", "nbytes"), args))
    return dict(zip(("va", "size", "handle") if name == "map" else ("va", "size"), args))
