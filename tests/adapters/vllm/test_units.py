"""Engine-free parts of the vLLM adapter: version gate, layer names, budget parsing, slots."""

import pytest
import torch

from vattn.core.errors import ConfigError, SlotError, UnsupportedError


def test_version_gate_rejects_untested():
    from vattn.adapters.vllm.version import check_version
    assert check_version("0.32.0") == "cpu"
    assert check_version("0.26.0") == "gpu"
    with pytest.raises(UnsupportedError, match="0.27.1"):
        check_version("0.27.1")


def test_layer_index():
    from vattn.adapters.vllm.runtime import layer_index
    assert layer_index("model.layers.7.self_attn.attn") == 7
    assert layer_index("language_model.model.layers.31.self_attn.attn") == 31
    with pytest.raises(ConfigError):
        layer_index("lm_head")


def test_parse_budget():
    from vattn.adapters.vllm.sizing import _parse_budget
    assert _parse_budget("256MiB") == 256 << 20
    assert _parse_budget("0.5") == 0.5
    assert _parse_budget("4096") == 4096
    with pytest.raises(ConfigError):
        _parse_budget("lots")


def _runtime(max_slots=3):
    from vattn.adapters.vllm.runtime import VattnRuntime
    from vattn.core import KVCacheConfig
    cfg = KVCacheConfig(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float32,
                        max_slots=max_slots, max_context=300, page_budget=64 << 20, device="cpu",
                        map_ahead_tokens=0)
    return VattnRuntime(cfg)


def test_plan_rows_and_release():
    rt = _runtime()
    try:
        failed = rt.plan_step([("a", 0, 5), ("b", 7, 1)])
        assert failed == []
        sa, sb = rt.slot("a"), rt.slot("b")
        assert sa != sb
        r = rt.rows_per_slot
        expected = [sa * r + p for p in range(5)] + [sb * r + 7]
        assert rt._plan.rows.tolist() == expected
        assert rt._plan.slots.tolist() == [sa, sb]
        assert rt.cache.mapped_tokens(sb) >= 8
        rt.end_step()
        assert not rt.has_plan()
        rt.finish(["a", "unknown"])
        with pytest.raises(SlotError):
            rt.slot("a")
    finally:
        rt.close()


def test_attend_matches_reference_per_request():
    from vattn.core.ops.reference import attend_one
    rt = _runtime()
    try:
        torch.manual_seed(0)
        lens = [("a", 0, 6), ("b", 0, 3)]
        rt.plan_step(lens)
        n = 9
        q, k, v = torch.randn(n, 4, 32), torch.randn(n, 2, 32), torch.randn(n, 2, 32)
        qsl = torch.tensor([0, 6, 9], dtype=torch.int32)
        out = torch.empty(n, 4, 32)
        rt.attend(1, q, k, v, query_start_loc=qsl, seq_lens=torch.tensor([6, 3], dtype=torch.int32),
                  max_query_len=6, max_seq_len=6, scale=32 ** -0.5, out=out)
        for lo, hi in ((0, 6), (6, 9)):
            ref = attend_one(q[lo:hi], k[lo:hi], v[lo:hi], scale=32 ** -0.5, causal=True)
            torch.testing.assert_close(out[lo:hi], ref)
    finally:
        rt.close()


def test_metrics_snapshots_while_serving_and_when_idle(tmp_path, monkeypatch):
    """``VATTN_METRICS``: a snapshot per step (at most one a second) and, once no step came for a
    second, one with the page audit; the watcher thread stops with the runtime."""
    import json
    import threading
    import time
    path = tmp_path / "m.json"
    monkeypatch.setenv("VATTN_METRICS", str(path))
    rt = _runtime()
    try:
        rt.plan_step([("a", 0, 5), ("b", 0, 9)])
        rt.end_step()
        snap = json.loads(path.read_text())
        assert snap["idle"] is False and snap["requests_holding_slots"] == 2 and snap["steps"] == 1
        rt.finish(["a"])
        deadline = time.monotonic() + 10
        while not json.loads(path.read_text())["idle"] and time.monotonic() < deadline:
            time.sleep(0.05)
        snap = json.loads(path.read_text())
        assert snap["idle"] is True and snap["audit"] == "ok" and snap["requests_holding_slots"] == 1
        assert snap["pages_mapped"] == rt.cache.metrics()["pages_mapped"]
    finally:
        rt.close()
    assert not any(t.name == "vattn-metrics" and t.is_alive() for t in threading.enumerate())
    monkeypatch.delenv("VATTN_METRICS")
    assert _runtime().snapshots is None
