"""What the vattn allocator did inside SGLang's scheduler process, for benchmarks.

SGLang runs the KV pool and allocator in its scheduler subprocess, out of reach of the process that
called ``sglang.Engine``. With ``VATTN_SGLANG_METRICS=PATH`` set in the engine's environment the
allocator writes :func:`allocator_metrics` to ``PATH`` (JSON, replaced atomically) each time its
last running request is freed, i.e. when the engine goes idle after a batch; the caller (SGLang's
conformance worker, ``vattn.conformance.workers.sglang``) reads it after ``generate`` returns.
Counters are cumulative since the engine started (warm-up included).
"""

from __future__ import annotations

import json
import os

from vattn.core.layout import cache_layout_row
from vattn.core.metrics import jsonable

#: Environment variable naming the JSON file the allocator writes when it goes idle.
METRICS_ENV = "VATTN_SGLANG_METRICS"


def allocator_metrics(alloc) -> dict:
    """Core metrics of ``alloc``'s cache, the allocator's host time per call and the layout's
    worst-case waste per request (JSON-able)."""
    cache = alloc.cache
    return jsonable(cache.metrics() | {
        "alloc_extend_us": alloc.extend_us.as_dict(), "alloc_decode_us": alloc.decode_us.as_dict(),
        "free_us": alloc.free_us.as_dict(), "prewarmed_pages": alloc.prewarmed_pages,
        "device_reads": alloc.requests.device_reads, "driver_retries": alloc.requests.retry.retried,
        "hit_copy_waits": alloc.requests.hit_ids.waits,
        "rows_per_slot": alloc.rows_per_slot, "max_slots": cache.config.max_slots,
        "layout": cache_layout_row(cache.config, cache.layout.page_bytes)})


def write_if_asked(alloc) -> None:
    """Write :func:`allocator_metrics` to ``$VATTN_SGLANG_METRICS`` when that is set."""
    path = os.environ.get(METRICS_ENV)
    if not path:
        return
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(allocator_metrics(alloc), f)
    os.replace(tmp, path)
