"""The allocator's metrics, written from SGLang's scheduler process when it goes idle."""

import json
import os

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.allocation", reason="sglang (CPU import set) not installed")

from vattn.adapters.sglang import engine_run, gpu_run  # noqa: E402
from vattn.adapters.sglang.metrics import METRICS_ENV, allocator_metrics  # noqa: E402

from .test_allocator import extend, make  # noqa: E402


def test_metrics_written_only_when_the_last_request_is_freed(tmp_path, monkeypatch):
    path = tmp_path / "m.json"
    monkeypatch.setenv(METRICS_ENV, str(path))
    cache, alloc, _, tree = make()
    a = extend(tree, [0], [40], [-1])
    b = extend(tree, [0], [20], [-1])
    alloc.alloc_decode(torch.tensor([41]), torch.tensor([41]), a[-1:])
    alloc.free(a[:1])                        # one request left: still busy, nothing written
    assert not path.exists()
    alloc.free(b[5:])                        # a tail: the request stays
    assert not path.exists()
    alloc.free(b[:1])                        # idle
    m = json.loads(path.read_text())
    assert m["alloc_extend_us"]["count"] == 2 and m["alloc_decode_us"]["count"] == 1
    assert m["free_us"]["count"] == 3 and m["active_slots"] == 1          # the pad slot
    assert m["layout"]["worst_waste_bytes"] == cache.layout.num_ranges * cache.layout.page_bytes - (
        cache.layout.num_ranges * min(cache.layout.token_bytes, cache.layout.page_bytes))
    assert m["prewarmed_pages"] == alloc.prewarmed_pages
    assert m == json.loads(json.dumps(allocator_metrics(alloc)))         # what is on disk is all of it


def test_no_file_without_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv(METRICS_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    _, alloc, _, tree = make()
    alloc.free(extend(tree, [0], [8], [-1]))
    assert list(tmp_path.iterdir()) == []


def test_engine_run_hands_the_path_to_the_scheduler_and_reads_it(monkeypatch, tmp_path):
    monkeypatch.setenv(METRICS_ENV, "")                 # restored after the test
    monkeypatch.setattr(engine_run.tempfile, "mkdtemp", lambda prefix: str(tmp_path))
    path = engine_run._metrics_path()
    assert os.environ[METRICS_ENV] == path and not os.path.exists(path)
    assert "never idle" in engine_run._read_metrics(path)["error"]
    with open(path, "w") as f:
        json.dump({"pages_mapped_on_demand": 3}, f)
    assert engine_run._read_metrics(path) == {"pages_mapped_on_demand": 3}
    assert engine_run._read_metrics(None) is None


def test_throughput_row_columns_from_the_metrics():
    _, alloc, _, tree = make()
    alloc.free(extend(tree, [0], [8], [-1]))
    m = allocator_metrics(alloc)
    cols = gpu_run._vattn_columns(m)
    assert cols["worst_waste_MiB_per_request"] == m["layout"]["worst_waste_bytes"] / 2**20
    crit = cols["vmm_critical_path"]
    assert set(crit["host_ms"]) == {"alloc_extend", "alloc_decode", "free"}
    assert crit["pages_mapped_on_demand"] == m["pages_mapped_on_demand"]
    assert gpu_run._vattn_columns({"error": "x"}) == {"vattn_metrics_error": "x"}
    assert gpu_run._vattn_columns(None) == {}
