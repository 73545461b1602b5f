"""The profiler-trace summary of ``vattn bench serve --profile-steps``: GPU busy vs idle, steps,
host synchronizations, on hand-made Chrome traces (the format torch's profiler writes)."""

from __future__ import annotations

import gzip
import json
import os

import pytest

from vattn.bench import serve, serve_report
from vattn.bench.trace import busy_union_us, find_trace, trace_summary
from vattn.core.errors import ConfigError


def _x(cat, name, ts, dur):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1}


def _write(path, events, gz=True):
    data = json.dumps({"traceEvents": events})
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(data)
    else:
        path.write_text(data)
    return str(path)


def test_busy_union_counts_overlaps_once():
    assert busy_union_us([]) == 0
    assert busy_union_us([(0, 10), (5, 12), (20, 30), (21, 22)]) == 22
    assert busy_union_us([(3, 4), (0, 10)]) == 10


def test_trace_summary_splits_busy_idle_and_counts_host_waits(tmp_path):
    events = [
        _x("kernel", "flash_fwd", 1000, 400), _x("kernel", "gemm", 1300, 300),   # overlap: busy 600
        _x("gpu_memcpy", "Memcpy HtoD", 2000, 100),                              # busy 700 of 1100
        _x("user_annotation", "execute_context_4(4)_generation_4(4)", 900, 600),
        _x("user_annotation", "execute_context_0(0)_generation_4(4)", 1600, 400),
        _x("cuda_runtime", "cudaStreamSynchronize", 1500, 250),
        _x("cuda_runtime", "cudaMemcpy", 1800, 50),
        _x("cuda_runtime", "cudaMemcpyAsync", 1850, 5),        # asynchronous: not a wait
        _x("cuda_runtime", "cudaLaunchKernel", 1860, 5),
        _x("cuda_runtime", "cudaHostAlloc", 1870, 80),
        _x("cpu_op", "aten::mm", 1000, 10),
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 5000},            # no duration: ignored
    ]
    got = trace_summary(_write(tmp_path / "w.pt.trace.json.gz", events))
    assert got["window_ms"] == pytest.approx(1.1) and got["gpu_busy_ms"] == pytest.approx(0.7)
    assert got["gpu_idle_share"] == pytest.approx(1 - 700 / 1100)
    assert got["gpu_ops"] == 3 and got["steps"] == 2 and got["step_span_ms_mean"] == pytest.approx(0.5)
    assert got["sync_calls"] == 2 and got["sync_ms"] == pytest.approx(0.3)
    assert got["host_alloc_calls"] == 1
    assert got["runtime_top"][0] == ["cudaStreamSynchronize", 1, 0.25]
    assert [n for n, _, _ in got["runtime_top"]] == ["cudaStreamSynchronize", "cudaHostAlloc", "cudaMemcpy",
                                                    "cudaMemcpyAsync", "cudaLaunchKernel"]


def test_cpu_only_trace_has_steps_and_no_gpu_numbers(tmp_path):
    got = trace_summary(_write(tmp_path / "t.json", [_x("user_annotation", "execute_x", 0, 10)], gz=False))
    assert got["steps"] == 1 and got["window_ms"] is None and got["gpu_ops"] == 0


@pytest.mark.parametrize("content, match", [
    ("not json", "expected a Chrome trace JSON"),
    ('{"traceEvents": 3}', "expected a 'traceEvents' list"),
    ('{"traceEvents": []}', "neither GPU activity nor an engine step"),
])
def test_unreadable_traces_are_refused(tmp_path, content, match):
    path = tmp_path / "bad.pt.trace.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=match):
        trace_summary(str(path))


def test_find_trace_takes_the_newest(tmp_path):
    assert find_trace(str(tmp_path)) is None
    old = _write(tmp_path / "a.pt.trace.json.gz", [])
    (tmp_path / "sub").mkdir()
    new = _write(tmp_path / "sub" / "b.pt.trace.json.gz", [])
    os.utime(old, (1, 1))
    assert find_trace(str(tmp_path)) == new


def test_profile_flags_and_summary(tmp_path):
    flags = serve.profile_flags(str(tmp_path / "p"), steps=40, delay=300)
    assert flags[0] == "--profiler-config"
    cfg = json.loads(flags[1])
    assert cfg["profiler"] == "torch" and cfg["max_iterations"] == 40 and cfg["delay_iterations"] == 300
    assert cfg["torch_profiler_dir"] == str(tmp_path / "p") and (tmp_path / "p").is_dir()
    assert "no trace file" in serve.profile_summary(str(tmp_path / "p"))["profile_error"]
    _write(tmp_path / "p" / "x.pt.trace.json.gz", [_x("kernel", "k", 0, 5), _x("kernel", "k", 10, 5)])
    got = serve.profile_summary(str(tmp_path / "p"))
    assert got["trace"]["gpu_busy_ms"] == pytest.approx(0.01)
    assert "FileNotFoundError" in got["kernels"]["error"]     # no table written


def test_report_has_a_profile_row_per_profiled_run():
    trace = {"window_ms": 100.0, "gpu_busy_ms": 80.0, "gpu_idle_share": 0.2, "steps": 40,
             "sync_calls": 3, "sync_ms": 1.5, "host_alloc_calls": 0,
             "runtime_top": [["cudaLaunchKernel", 900, 4.5]]}
    rows = [{"round": 1, "mode": "stock", "profile": {"trace": trace, "kernels": {
                "families_us": {"attention": 20000.0, "gemm": 50000.0}}}},
            {"round": 1, "mode": "vattn", "profile": {"profile_error": "ConfigError: no trace file"}},
            {"round": 2, "mode": "stock", "profile": {"trace": dict(trace, window_ms=None),
                                                      "kernels": {"error": "ValueError"}}}]
    lines = serve_report._profile_table(rows)
    assert any("take the verdict on latency from a run without --profile-steps" in line for line in lines)
    assert "| 1 | stock | 40 | 100.0 | 80.0 | 20.0% | 20.0 | 50.0 | – | – | – | 3 (1.5) | 0 |" in lines
    assert any(line.startswith("| 1 | vattn | ConfigError: no trace file |") for line in lines)
    assert "| 2 | stock | 40 | – | – | – | – | – | – | – | – | 3 (1.5) | 0 |" in lines
    assert "- round 1 stock, the host's longest CUDA calls in the window: cudaLaunchKernel ×900 4.5 ms" in lines
    assert serve_report._profile_table([{"round": 1, "mode": "stock"}]) == []


def test_profiling_is_refused_for_sglang(tmp_path, capsys):
    from tests.test_cli_errors import refused
    line = refused(capsys, "bench", "serve", "--engine", "sglang", "--model", str(tmp_path),
                   "--out", str(tmp_path / "o"), "--profile-steps", "5")
    assert "--profile-steps: expected --engine vllm" in line and "sglang" in line
