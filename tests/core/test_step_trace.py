import json
from types import SimpleNamespace

import pytest

from vattn.core import step_trace
from vattn.core.errors import ConfigError
from vattn.core.step_trace import COUNTERS, StepTrace


def _counters(**values):
    return SimpleNamespace(**({name: 0 for name in COUNTERS} | values))


def test_rows_carry_counters_at_both_ends_and_idle_in_order(tmp_path):
    c = _counters()
    trace = StepTrace(str(tmp_path / "t-{pid}.json"), lambda: c, header={"mode": "x"})
    for calls in (3, 0, 5):
        trace.begin()
        c.map_calls += calls
        trace.end(binds=calls)
        c.unmap_calls += 1                              # the worker, between two sections
    trace.idle(10.0)
    trace.idle(0.0)                                     # the third section's events not done yet
    path = trace.write()
    data = json.load(open(path))
    assert str(data["pid"]) in path and data["header"]["mode"] == "x" and "wall0" in data["header"]
    rows = data["rows"]
    i, j = COUNTERS.index("map_calls"), COUNTERS.index("unmap_calls")
    assert [r["c1"][i] - r["c0"][i] for r in rows] == [3, 0, 5]
    assert [r["c0"][j] for r in rows] == [0, 1, 2]
    assert [r["idle_us"] for r in rows] == [10.0, 0.0, None]
    assert [r["binds"] for r in rows] == [3, 0, 5] and all(r["t1"] >= r["t0"] for r in rows)


def test_rows_past_the_limit_are_counted_not_kept(tmp_path):
    trace = StepTrace(str(tmp_path / "t.json"), _counters, limit=2)
    for _ in range(5):
        trace.begin()
        trace.end()
    assert len(trace.rows) == 2 and trace.dropped == 3


def test_bad_input_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="file path"):
        StepTrace("", _counters)
    with pytest.raises(ConfigError, match="limit >= 1"):
        StepTrace(str(tmp_path / "t.json"), _counters, limit=0)
    with pytest.raises(ConfigError, match="without begin"):
        StepTrace(str(tmp_path / "t.json"), _counters).end()


def test_from_env_only_when_set(tmp_path):
    assert step_trace.from_env(_counters, environ={}) is None
    got = step_trace.from_env(_counters, environ={"VATTN_STEP_TRACE": str(tmp_path / "a.json")})
    assert isinstance(got, StepTrace) and got.path.endswith("a.json")


def test_idle_reported_before_the_row_is_added_lands_on_its_row(tmp_path):
    """DeviceWait folds a section in as soon as its events complete, which on an idle device is
    inside its ``end()``, before the trace's ``end()`` adds the row."""
    trace = StepTrace(str(tmp_path / "t.json"), _counters)
    for idle in (7.0, 0.0, 3.0):
        trace.begin()
        trace.idle(idle)
        trace.end()
    trace.begin()
    trace.end()                                         # its events not complete yet
    rows = json.load(open(trace.write()))["rows"]
    assert [r["idle_us"] for r in rows] == [7.0, 0.0, 3.0, None]


def test_profile_covers_the_sections_only(tmp_path):
    import pstats

    def inside():
        return sum(range(1000))

    def outside():
        return sum(range(1000))
    trace = StepTrace(str(tmp_path / "t.json"), _counters, profile=True)
    outside()
    trace.begin()
    inside()
    trace.end()
    outside()
    trace.write()
    names = {func[2] for func in pstats.Stats(f"{trace.path}.prof").stats}
    assert "inside" in names and "outside" not in names


def test_profile_env_is_checked(tmp_path):
    env = {"VATTN_STEP_TRACE": str(tmp_path / "a.json"), "VATTN_STEP_PROFILE": "yes"}
    with pytest.raises(ConfigError, match="VATTN_STEP_PROFILE: expected 0 or 1, got 'yes'"):
        step_trace.from_env(_counters, environ=env)
    env["VATTN_STEP_PROFILE"] = "1"
    assert step_trace.from_env(_counters, environ=env).profile is not None


def test_the_harness_run_name_goes_into_the_header(tmp_path):
    env = {"VATTN_STEP_TRACE": str(tmp_path / "a.json"), "VATTN_RUN_NAME": "vattn:p0@2"}
    assert step_trace.from_env(_counters, environ=env).header["run"] == "vattn:p0@2"


def test_a_section_that_waits_shows_less_cpu_than_host_time(tmp_path):
    """``cpu_ms`` is the section's own thread CPU time: a section that sleeps (as one waiting for
    a lock or the GIL does) shows far less CPU than wall time, one that computes about as much."""
    import time
    trace = StepTrace(str(tmp_path / "t.json"), _counters)
    trace.begin()
    time.sleep(0.05)
    trace.end()
    trace.begin()
    end = time.thread_time() + 0.03
    while time.thread_time() < end:
        pass
    trace.end()
    waited, computed = trace.rows
    assert (waited["t1"] - waited["t0"]) * 1e3 >= 45 and waited["cpu_ms"] < 10
    assert computed["cpu_ms"] >= 29 and computed["cpu_ms"] <= (computed["t1"] - computed["t0"]) * 1e3 + 1


def test_section_is_one_row_with_its_fields_even_when_the_step_fails(tmp_path):
    """``section``: the device-idle events around the body and, with a trace, one row with the
    given fields and ``busy`` (``None`` without device events) — also when the body raises."""
    from vattn.core.device_wait import DeviceWait
    trace = StepTrace(str(tmp_path / "t.json"), lambda: _counters())
    wait = DeviceWait(False)
    with step_trace.section(trace, wait, binds=2):
        pass
    with pytest.raises(RuntimeError, match="boom"):
        with step_trace.section(trace, wait, binds=0):
            raise RuntimeError("boom")
    with step_trace.section(None, wait, binds=9):     # no trace: nothing recorded
        pass
    assert [(r["binds"], r["busy"]) for r in trace.rows] == [(2, None), (0, None)]
