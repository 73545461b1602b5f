import json
import os

import pytest

from vattn.bench import steps
from vattn.cli import run_command
from vattn.core.errors import ConfigError


def _runtime_trace(tmp_path, monkeypatch) -> str:
    """A host-backend vLLM runtime with prefix caching, traced: two requests sharing blocks."""
    from tests.adapters.vllm.test_gpu_tables import _runtime, _two_requests_sharing_two_blocks
    path = str(tmp_path / "run" / "steps" / "{pid}.json")
    monkeypatch.setenv("VATTN_STEP_TRACE", path)
    rt, _ = _runtime(prefix_caching=True)
    try:
        _two_requests_sharing_two_blocks(rt)
        rt.metrics()                                   # writes the trace
        return rt.trace.path
    finally:
        rt.close()


def test_the_vllm_runtime_traces_each_apply_with_its_driver_calls(tmp_path, monkeypatch):
    trace = steps.load_trace(_runtime_trace(tmp_path, monkeypatch))
    rows = trace["rows"]
    assert len(rows) == 2 and [r["binds"] for r in rows] == [1, 1]
    assert rows[1]["calls"]["pages_aliased"] > 0           # the second request hit the first's blocks
    assert "tokens per page-set" in trace["header"]["cache"] and trace["header"]["sharing"] is True
    assert all(r["idle_us"] is None for r in rows)          # a host run has no device events


def _results(tmp_path, monkeypatch) -> str:
    path = _runtime_trace(tmp_path, monkeypatch)
    folder = os.path.dirname(os.path.dirname(path))
    pid = json.load(open(path))["pid"]
    os.makedirs(os.path.join(folder, "logs"))
    with open(os.path.join(folder, "logs", "vllm_shared-prefix_vattn:p0.log"), "w") as f:
        f.write(f"INFO start\n(EngineCore pid={pid}) INFO vattn KV cache: ...\n")
    wall0 = json.load(open(path))["header"]["wall0"]
    rows = {"vattn:p0": {"seconds": 1.0, "wall_each": [[wall0 - 1, wall0 + 1e6]]}}
    with open(os.path.join(folder, "throughput_shared-prefix.json"), "w") as f:
        json.dump({"rows": rows}, f)
    return folder


def test_run_names_traces_by_mode_and_cuts_generations(tmp_path, monkeypatch, capsys):
    folder = _results(tmp_path, monkeypatch)
    assert run_command(["bench", "steps", "--results", folder, "--plot", str(tmp_path / "s.png")]) == 0
    out = capsys.readouterr().out
    assert "## vattn:p0" in out and "- before: 0 steps" in out and "- gen 1: 2 steps" in out
    assert os.path.getsize(tmp_path / "s.png") > 0


def test_generations_put_rows_before_the_first_window_in_before():
    trace = {"header": {"wall0": 100.0}, "rows": [{"t0": 0.5}, {"t0": 2.0}, {"t0": 5.0}]}
    parts = steps.generations(trace, [[101.0, 103.0], [104.0, 106.0]])
    assert [(name, len(rows)) for name, rows in parts] == [("before", 1), ("gen 1", 1), ("gen 2", 1)]
    assert steps.generations(trace, None) == [("all", trace["rows"])]


def test_bad_input_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="results folder"):
        run_command(["bench", "steps", "--results", str(tmp_path / "nope")])
    with pytest.raises(ConfigError, match="VATTN_TRACE_STEPS=1"):
        run_command(["bench", "steps", "--results", str(tmp_path)])
    os.makedirs(tmp_path / "steps")
    (tmp_path / "steps" / "1.json").write_text("{not json")
    with pytest.raises(ConfigError, match="invalid JSON"):
        run_command(["bench", "steps", "--results", str(tmp_path)])
    (tmp_path / "steps" / "1.json").write_text("[]")
    with pytest.raises(ConfigError, match="rows and counters"):
        run_command(["bench", "steps", "--results", str(tmp_path)])


def test_schedule_gaps_per_generation_and_report(tmp_path, capsys):
    walls = [10.0, 10.1, 10.5, 20.0, 20.02]
    assert steps.schedule_gaps(walls, [[9.9, 11.0], [19.9, 21.0]]) == [[100.0, 400.0], [20.0]]
    rows = {"stock": {"seconds": 1.0, "wall_each": [[9.9, 11.0]], "schedule_walls": walls}}
    (tmp_path / "throughput_x.json").write_text(json.dumps({"rows": rows}))
    assert run_command(["bench", "steps", "--results", str(tmp_path)]) == 0   # no traces: schedules only
    out = capsys.readouterr().out
    assert "stock, gen 1: 3 steps scheduled" in out and "[100.0, 400.0]" in out


def test_summary_gives_per_step_percentiles_and_the_steps_that_waited_off_the_cpu():
    """A server's trace has no generations: the per-step host time and the steps whose section
    waited >= 1 ms off its thread's CPU (the GIL, a sleeping driver call) say where it went."""
    calls = {"map_calls": 0, "unmap_calls": 0, "set_access_calls": 0}
    worker = {"map_calls": 0, "unmap_calls": 0, "issued_us": 0}

    def row(t0, ms, cpu_ms):
        return {"t0": t0, "t1": t0 + ms / 1e3, "cpu_ms": cpu_ms, "idle_us": None, "calls": calls,
                "worker": worker}

    rows = [row(i * 0.01, 0.2, 0.2) for i in range(98)] + [row(1.0, 6.0, 0.5), row(1.1, 3.0, 2.9)]
    s = steps.summarize(rows)
    assert s["host_p50_us"] == pytest.approx(200.0) and s["host_p99_us"] == pytest.approx(6000.0)
    assert s["waited_steps"] == 1 and s["waited_ms"] == pytest.approx(5.5)
    assert steps.summarize([])["host_p99_us"] == 0.0


def test_summary_counts_the_sections_that_began_with_the_device_still_busy():
    """A host-bound engine's sections begin with the device idle; rows without the field (host
    runs, older traces) are not counted either way."""
    calls = {"map_calls": 0, "unmap_calls": 0, "set_access_calls": 0}
    worker = {"map_calls": 0, "unmap_calls": 0, "issued_us": 0}
    rows = [{"t0": i, "t1": i + 0.001, "idle_us": 5.0, "calls": calls, "worker": worker, "busy": busy}
            for i, busy in enumerate([True, False, False, None, True])]
    for row in rows:
        if row["busy"] is None:
            del row["busy"]
    s = steps.summarize(rows)
    assert (s["busy_starts"], s["busy_known"]) == (2, 4)


def test_step_periods_split_the_steps_that_bound_requests_from_the_others():
    rows = [{"t0": t, "binds": b} for t, b in [(0.000, 0), (0.005, 1), (0.025, 0), (0.030, 0), (0.036, 2),
                                                (0.060, 0), (5.0, 0)]]                # then idle 4.9 s
    periods = steps.step_periods(rows)
    assert periods["binding"][0] == 2 and periods["binding"][1] == pytest.approx(22.0)
    assert periods["none"][0] == 3 and periods["none"][1] == pytest.approx(16 / 3, abs=1e-3)   # not the idle 4.9 s
    assert steps.step_periods(rows[:1]) == {}
