"""The allocator's metrics, written from SGLang's scheduler process while it serves and, with
the page audit, when it goes idle."""

import json

import pytest

pytest.importorskip("sglang.srt.mem_cache.allocation", reason="sglang (CPU import set) not installed")

from vattn.adapters.sglang.metrics import METRICS_ENV, allocator_metrics  # noqa: E402

from tests.adapters.sglang._engine import Engine, new_req  # noqa: E402


def test_metrics_written_when_the_last_request_leaves(tmp_path, monkeypatch):
    """Written as the last running request leaves, not at the next forward (there may be none:
    the benchmark reads the file after the last generation, and got the one before it)."""
    path = tmp_path / "m.json"
    monkeypatch.setenv(METRICS_ENV, str(path))
    monkeypatch.setenv("VATTN_METRICS_EVERY_S", "3600")      # one step snapshot, the first
    e = Engine(radix=False)
    cache, alloc = e.cache, e.alloc
    a, b = new_req(list(range(40))), new_req(list(range(50, 70)))
    e.admit([a, b])
    e.decode([a, b])
    e.finish(a)                              # one request left: still busy, no idle snapshot
    e.decode([b])
    busy = json.loads(path.read_text())
    assert busy["idle"] is False and busy["steps"] == 1 and "audit" not in busy
    assert busy["requests_holding_slots"] == 2
    e.finish(b)                              # gone (its slot is released at the next forward)
    m = json.loads(path.read_text())
    assert m["idle"] is True and m["audit"] == "ok" and m["steps"] == 3
    assert m["requests_holding_slots"] == 1     # b's, released at the next forward (as in vLLM: one step late)
    assert m["alloc_extend_us"]["count"] == 1 and m["alloc_decode_us"]["count"] == 2
    assert m["free_us"]["count"] >= 2 and m["active_slots"] == 2          # the pad slot, b's
    assert m["layout"]["worst_waste_bytes"] == cache.layout.num_ranges * cache.layout.page_bytes - (
        cache.layout.num_ranges * min(cache.layout.token_bytes, cache.layout.page_bytes))
    assert m["prewarmed_pages"] == alloc.prewarmed_pages
    on_disk = {k: v for k, v in m.items() if k not in ("time", "pid", "steps", "idle", "audit")}
    assert on_disk == json.loads(json.dumps(allocator_metrics(alloc)))   # what is on disk is all of it
    c = new_req(list(range(90, 120)))        # a second batch: the file follows it
    e.admit([c])
    e.decode([c])
    e.finish(c)
    m = json.loads(path.read_text())
    assert m["alloc_extend_us"]["count"] == 2 and m["alloc_decode_us"]["count"] == 3


def test_no_file_without_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv(METRICS_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    e = Engine(radix=False)
    a = new_req(list(range(8)))
    e.admit([a])
    e.finish(a)
    e.pool.requests.prepare([], [])
    assert list(tmp_path.iterdir()) == []


def test_prepare_phases_add_up_to_the_calls():
    """The parts of a forward's preparation (``prepare_phase_ms``) cover the whole call: their sum
    is the histogram's total for extends and for decodes, and a radix hit shows under ``hits``."""
    e = Engine(radix=True)
    a = new_req(list(range(40)))
    e.admit([a])
    e.decode([a])
    e.finish(a)
    b = new_req(list(range(40)) + [99])      # two whole pages of a's are hits
    assert e.admit([b]) == [32]
    e.decode([b])
    m = allocator_metrics(e.alloc)
    for mode, hist in (("extend", "alloc_extend_us"), ("decode", "alloc_decode_us")):
        parts = m["prepare_phase_ms"][mode]
        assert set(parts) == {"resolve", "release", "hits", "acquire", "claim", "step"}
        total_ms = m[hist]["mean_us"] * m[hist]["count"] / 1e3
        assert sum(parts.values()) == pytest.approx(total_ms, rel=0.05, abs=0.05)
    assert m["prepare_phase_ms"]["extend"]["hits"] > 0 and m["prepare_phase_ms"]["extend"]["acquire"] > 0
    assert m["prepare_phase_ms"]["decode"]["acquire"] < m["prepare_phase_ms"]["extend"]["acquire"]
