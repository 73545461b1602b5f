"""What the vattn allocator did inside SGLang's scheduler process, for benchmarks and soaks.

SGLang runs the KV pool and allocator in its scheduler subprocess, out of reach of the process that
called ``sglang.Engine`` or started the server. With ``VATTN_METRICS=PATH`` set in the engine's
environment the allocator writes :func:`allocator_metrics` to ``PATH`` (a
:class:`vattn.core.snapshots.MetricsFile`): at most once a second while it serves, and each time
its last running request is freed, i.e. when the engine goes idle after a batch, with the core's
page audit. The caller (SGLang's conformance worker, ``vattn.conformance.workers.sglang``, or
``vattn bench soak``) reads it. Counters are cumulative since the engine started (warm-up included).
"""

from __future__ import annotations

from vattn.core import snapshots
from vattn.core.layout import cache_layout_row
from vattn.core.metrics import jsonable
from vattn.core.snapshots import METRICS_ENV

__all__ = ["allocator_metrics", "metrics_file", "METRICS_ENV"]


def allocator_metrics(alloc) -> dict:
    """Core metrics of ``alloc``'s cache, the allocator's host time per call and the layout's
    worst-case waste per request (JSON-able)."""
    cache = alloc.cache
    return jsonable(cache.metrics() | {
        "alloc_extend_us": alloc.extend_us.as_dict(), "alloc_decode_us": alloc.decode_us.as_dict(),
        "free_us": alloc.free_us.as_dict(), "prewarmed_pages": alloc.prewarmed_pages,
        "prepare_phase_ms": {mode: {k: round(v, 2) for k, v in parts.items()}
                             for mode, parts in alloc.requests.phase_ms.items()},
        "device_reads": alloc.requests.device_reads, "driver_retries": alloc.requests.retry.retried,
        "hit_copy_waits": alloc.requests.hit_ids.waits, "requests_holding_slots": alloc.requests.live,
        "rows_per_slot": alloc.rows_per_slot, "max_slots": cache.config.max_slots,
        "layout": cache_layout_row(cache.config, cache.layout.page_bytes)})


def metrics_file(alloc):
    """``alloc``'s :class:`~vattn.core.snapshots.MetricsFile` at ``$VATTN_METRICS``, or ``None``."""
    return snapshots.from_env(lambda: allocator_metrics(alloc), audit=alloc.cache.audit_when_quiet)
