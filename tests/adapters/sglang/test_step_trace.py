"""The SGLang adapter's step trace (``VATTN_STEP_TRACE``): one row per forward's preparation,
written when the engine goes idle, read by ``vattn bench steps`` with SGLang's stage JSON."""

import json
import os

import pytest

pytest.importorskip("sglang.srt.mem_cache.radix_cache", reason="sglang (CPU import set) not installed")

from tests.adapters.sglang._engine import PAGE, Engine, new_req  # noqa: E402
from vattn.cli import run_command  # noqa: E402


def _traced_run(tmp_path, monkeypatch) -> tuple[str, Engine]:
    path = tmp_path / "sglang" / "steps" / "{pid}.json"
    monkeypatch.setenv("VATTN_STEP_TRACE", str(path))
    monkeypatch.setenv("VATTN_RUN_NAME", "vattn-packs")
    e = Engine(reqs=4, radix=True)
    a, b = new_req(list(range(100, 100 + 2 * PAGE))), new_req(list(range(100, 100 + 2 * PAGE + 5)))
    e.admit([a, b])                                      # one extend of two requests
    for _ in range(3):
        e.decode([a, b])                                 # three decodes of two
    e.finish(a)
    e.finish(b)                                          # idle: the trace is written
    e.alloc.drain_frees(wait=True)
    return e.pool.requests.trace.path, e


def test_each_forward_is_a_row_written_when_the_engine_goes_idle(tmp_path, monkeypatch):
    path, e = _traced_run(tmp_path, monkeypatch)
    trace = json.load(open(path))
    rows = trace["rows"]
    assert trace["header"]["run"] == "vattn-packs"
    assert [(r["binds"], r["steps"]) for r in rows] == [(2, 2), (0, 2), (0, 2), (0, 2)]
    assert all(len(r["c0"]) == len(r["c1"]) == len(trace["counters"]) and r["t1"] >= r["t0"] for r in rows)
    assert all(r["idle_us"] is None and r["cpu_ms"] >= 0 for r in rows)   # no device on a host run
    e.cache.audit()


def test_bench_steps_cuts_the_trace_by_the_sglang_stage_walls(tmp_path, monkeypatch, capsys):
    path, _ = _traced_run(tmp_path, monkeypatch)
    folder = os.path.dirname(os.path.dirname(path))
    wall0 = json.load(open(path))["header"]["wall0"]
    stage = {"stage": "decode-heavy", "modes": {"vattn-packs": {"seconds": 1.0,
                                                                "wall_each": [[wall0 - 1, wall0 + 1e6]]}}}
    with open(os.path.join(folder, "decode-heavy.json"), "w") as f:
        json.dump(stage, f)
    assert run_command(["bench", "steps", "--results", folder]) == 0
    out = capsys.readouterr().out
    assert "## vattn-packs" in out and "- gen 1: 4 steps" in out and "2 requests bound" in out
