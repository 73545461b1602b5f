"""The SGLang throughput stage's vattn columns, from a real allocator's metrics (sglang's CPU
import set)."""

import pytest

pytest.importorskip("sglang.srt.mem_cache.allocation", reason="sglang (CPU import set) not installed")

from tests.adapters.sglang._engine import Engine, new_req  # noqa: E402
from vattn.adapters.sglang.metrics import allocator_metrics  # noqa: E402
from vattn.bench.gpu.report import vattn_columns  # noqa: E402


def test_throughput_row_columns_from_the_metrics():
    e = Engine(radix=False)
    a = new_req(list(range(8)))
    e.admit([a])
    e.finish(a)
    m = allocator_metrics(e.alloc)
    cols = vattn_columns(m, "sglang")
    assert cols["worst_waste_MiB_per_request"] == m["layout"]["worst_waste_bytes"] / 2**20
    crit = cols["vmm_critical_path"]
    assert set(crit["host_ms"]) == {"alloc_extend", "alloc_decode", "free"}
    assert crit["pages_mapped_on_demand"] == m["pages_mapped_on_demand"]
    assert crit["device_reads"] == crit["hit_copy_waits"] == crit["driver_retries"] == 0
    assert vattn_columns({"error": "x"}, "sglang") == {"vattn_metrics_error": "x"}
    assert vattn_columns(None, "sglang") == {}
