"""``vattn.core.snapshots``: the metrics file an engine's worker writes for soaks and benchmarks."""

import json
import os
import threading
import time

import pytest

from vattn.core.errors import ConfigError, VattnError
from vattn.core.snapshots import METRICS_ENV, MetricsFile, from_env, read_snapshot


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_step_snapshots_are_rate_limited(tmp_path):
    clock, calls = Clock(), []
    m = MetricsFile(str(tmp_path / "m.json"), lambda: calls.append(1) or {"pages_mapped": len(calls)},
                    every_s=1.0, clock=clock)
    m.step()                                   # the first step writes
    m.step()
    clock.now += 0.5
    m.step()                                   # < 1 s since the last write: nothing
    assert m.written == 1 and len(calls) == 1
    clock.now += 0.6
    m.step()
    snap = read_snapshot(m.path)
    assert m.written == 2 and snap["pages_mapped"] == 2 and snap["steps"] == 4 and snap["idle"] is False
    assert "audit" not in snap and snap["pid"] == os.getpid()
    assert sorted(os.listdir(tmp_path)) == ["m.json"]          # replaced atomically, no temp left


def test_idle_snapshot_carries_the_audit_verdict(tmp_path):
    verdict = {"bad": False}

    def audit():
        if verdict["bad"]:
            raise VattnError("page 3: its references are not its mappings plus its key")

    m = MetricsFile(str(tmp_path / "m.json"), lambda: {"x": 1}, audit=audit)
    assert m.write(idle=True)["audit"] == "ok"
    verdict["bad"] = True
    m.idle()
    snap = read_snapshot(m.path)
    assert snap["idle"] is True and snap["audit"].startswith("VattnError: page 3")
    skipped = MetricsFile(str(tmp_path / "s.json"), lambda: {"x": 1}, audit=lambda: "skipped: busy")
    assert skipped.write(idle=True)["audit"] == "skipped: busy"   # an audit may say why it did not run


def test_the_watcher_writes_an_idle_snapshot_after_quiet(tmp_path):
    audits = []
    m = MetricsFile(str(tmp_path / "m-{pid}.json"), lambda: {"x": 1}, audit=lambda: audits.append(1),
                    every_s=100.0, idle_s=0.05)
    try:
        assert m.path.endswith(f"m-{os.getpid()}.json")
        time.sleep(0.2)
        assert not os.path.exists(m.path)      # no step yet: nothing to report
        m.step()
        deadline = time.monotonic() + 5
        while not (read_snapshot(m.path) or {}).get("idle") and time.monotonic() < deadline:
            time.sleep(0.02)
        assert read_snapshot(m.path)["idle"] is True and read_snapshot(m.path)["audit"] == "ok"
        time.sleep(0.3)
        assert len(audits) == 1                # once per quiet spell, not again and again
        m.step()                               # busy again (a step snapshot is not due yet) ...
        while len(audits) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(audits) == 2                # ... and quiet again: a new idle snapshot
    finally:
        m.close()
    assert not any(t.name == "vattn-metrics" and t.is_alive() for t in threading.enumerate())


def test_from_env(tmp_path):
    assert from_env(dict, environ={}) is None
    m = from_env(dict, environ={METRICS_ENV: str(tmp_path / "a.json"), "VATTN_METRICS_EVERY_S": "0"})
    assert m.every_s == 0.0 and m._thread is None
    with pytest.raises(ConfigError, match="VATTN_METRICS_EVERY_S: expected seconds"):
        from_env(dict, environ={METRICS_ENV: "x.json", "VATTN_METRICS_EVERY_S": "soon"})
    with pytest.raises(ConfigError, match="expected every_s >= 0 and idle_s > 0"):
        MetricsFile("x.json", dict, every_s=-1)
    with pytest.raises(ConfigError, match="expected every_s >= 0 and idle_s > 0"):
        from_env(dict, environ={METRICS_ENV: "x.json", "VATTN_METRICS_EVERY_S": "nan"})
    with pytest.raises(ConfigError, match="expected a file path"):
        MetricsFile("", dict)
    assert read_snapshot(str(tmp_path / "none.json")) is None


def test_snapshots_are_json_of_the_metrics(tmp_path):
    m = MetricsFile(str(tmp_path / "m.json"), lambda: {"h": {"count": 2}, 3: object})
    m.step()
    data = json.loads((tmp_path / "m.json").read_text())
    assert data["h"] == {"count": 2} and data["3"].startswith("<class")


def test_on_idle_runs_before_idle_snapshots_only_and_its_error_is_reported(tmp_path):
    """Work too slow for the step's path (a step trace) runs with the idle snapshots; a failure
    there is written into the snapshot, never raised into the engine."""
    calls, clock = [], Clock()
    m = MetricsFile(str(tmp_path / "m.json"), lambda: {"x": 1}, every_s=0.0, clock=clock,
                    on_idle=lambda: calls.append("on_idle"))
    m.step()
    m.step()
    assert calls == [] and m.written == 2
    m.idle()
    assert calls == ["on_idle"] and read_snapshot(m.path)["idle"] is True

    def boom():
        raise OSError("disk full")

    bad = MetricsFile(str(tmp_path / "b.json"), lambda: {"x": 1}, on_idle=boom)
    bad.idle()
    snap = read_snapshot(bad.path)
    assert snap["idle"] is True and snap["on_idle_error"] == "OSError: disk full"
    env = {METRICS_ENV: str(tmp_path / "e.json")}
    assert from_env(lambda: {}, environ=env, on_idle=boom).on_idle is boom
