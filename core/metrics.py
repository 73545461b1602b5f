"""Counters and latency histograms of a cache, as a dict and (optionally) for Prometheus."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

__all__ = ["Histogram", "Counters", "prometheus_collector", "jsonable"]

_BOUNDS_US = (5, 10, 20, 40, 80, 160, 320, 640, 1280, 2560, 5120, 10240, 40960, 163840)


@dataclass(slots=True)
class Histogram:
    """Latencies in microseconds in fixed log-spaced buckets (upper bounds), plus sum and count."""

    bounds: tuple = _BOUNDS_US
    counts: list = field(default_factory=lambda: [0] * (len(_BOUNDS_US) + 1))
    total_us: float = 0.0
    n: int = 0
    max_us: float = 0.0

    def observe(self, us: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, us)] += 1
        self.total_us += us
        self.n += 1
        self.max_us = max(self.max_us, us)

    def quantile(self, q: float) -> float:
        """Upper bound of the bucket holding quantile ``q`` (0 when empty)."""
        if not self.n:
            return 0.0
        target, seen = q * self.n, 0
        for i, c in enumerate(self.counts):
            seen += c
            if seen >= target:
                return float(self.bounds[i]) if i < len(self.bounds) else self.max_us
        return self.max_us

    def as_dict(self) -> dict:
        mean = self.total_us / self.n if self.n else 0.0
        return {"count": self.n, "mean_us": mean, "p50_us": self.quantile(0.5),
                "p99_us": self.quantile(0.99), "max_us": self.max_us,
                "buckets_us": dict(zip([*map(str, self.bounds), "inf"], self.counts))}


@dataclass(slots=True)
class Counters:
    """Event counts of one cache (monotonic)."""

    map_calls: int = 0
    set_access_calls: int = 0
    unmap_calls: int = 0
    pages_mapped_ahead: int = 0       # by the background worker
    pages_mapped_on_demand: int = 0   # by ensure(), on the critical path
    pages_reclaimed: int = 0
    pages_scrubbed: int = 0
    shortfalls: int = 0               # slots ensure() could not grow (preemption-worthy)
    driver_faults: int = 0
    undo_faults: int = 0              # of those, failures while undoing a failed replacement
    fence_waits: int = 0              # reclaim or bind had to block on a fence
    pages_retired: int = 0            # reclaimed without waiting: old mapping unmapped after its fence
    pages_aliased: int = 0            # pages mapped from a bound block key (prefix sharing)
    keys_bound: int = 0               # bind(): fresh page-sets named by an engine block key
    prefix_hits: int = 0              # bind(): page-sets taken from a key (hits), mapped or in place
    page_sets_moved: int = 0          # bind(): a cached block copied out of a position a new one takes
    blocks_copied: int = 0            # copy_block(): a block's KV copied into another's (copy-on-write)
    copies_elided: int = 0            # copy_block(): dst's pages still held src's block (moved out this step)
    page_sets_staged: int = 0         # stage_prefix(): a shared page-set mapped into an idle slot ahead
    warm_hits: int = 0                # acquire() reused a slot with pages mapped
    packs_built: int = 0              # shared runs copied into one allocation per range (.packs)
    pages_packed: int = 0             # of pages_aliased, those mapped through a pack (one call a run)
    pack_unpacks: int = 0             # pack runs unmapped for their own pages (a write or a trim inside)
    calls_deferred: int = 0           # VMM calls a deferral window queued (.deferred), made later
    map_page_us: Histogram = field(default_factory=Histogram)
    unmap_page_us: Histogram = field(default_factory=Histogram)
    ensure_us: Histogram = field(default_factory=Histogram)
    issue_us: Histogram = field(default_factory=Histogram)   # making queued calls, per issue()

    @property
    def issued_us(self) -> int:
        """Host µs spent making deferred calls so far (``issue_us``'s total)."""
        return int(self.issue_us.total_us)

    def as_dict(self) -> dict:
        out = {}
        for name in self.__slots__:
            value = getattr(self, name)
            out[name] = value.as_dict() if isinstance(value, Histogram) else value
        return out


def jsonable(value):
    """``value`` (a metrics dict) with string keys and anything not a JSON scalar as its ``repr``."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    return repr(value)


def prometheus_collector(cache, *, prefix: str = "vattn"):
    """A ``prometheus_client`` collector reading ``cache.metrics()`` on every scrape.

    Register it with ``prometheus_client.REGISTRY.register(prometheus_collector(cache))``.
    Raises ``ImportError`` when ``prometheus_client`` is not installed.
    """
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily  # noqa: PLC0415

    class _Collector:
        def collect(self):
            m = cache.metrics()
            for name, value in m.items():
                if isinstance(value, dict) and "count" in value:
                    yield SummaryMetricFamily(f"{prefix}_{name}", f"{name} latency (us)",
                                              count_value=value["count"],
                                              sum_value=value["mean_us"] * value["count"])
                elif isinstance(value, (int, float)) and not isinstance(value, bool):
                    kind = CounterMetricFamily if name in Counters.__slots__ else GaugeMetricFamily
                    yield kind(f"{prefix}_{name}", name.replace("_", " "), value=value)

    return _Collector()
