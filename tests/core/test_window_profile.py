"""``WindowProfile``: cProfile over a window of an engine loop's steps, written as .prof + .json + .txt."""

import gc
import pstats

import pytest

from vattn.core.errors import ConfigError
from vattn.core.window_profile import WindowProfile, from_env


def _only_in_window(n):
    gc.collect()                 # one full collection per window step: the window counts them
    return sum(range(n))


def _loop(profile, steps):
    calls = []

    def step(i):
        calls.append(i)
        return _only_in_window(10) if 3 <= i < 5 else i    # steps 4 and 5 (1-based) of the loop

    def intake():
        return None
    wrapped_step, wrapped_intake = profile.wrap(step, step=True), profile.wrap(intake, step=False)
    for i in range(steps):
        wrapped_intake()
        wrapped_step(i)
    return calls


def test_the_window_profiles_exactly_its_steps_then_writes_both_files(tmp_path):
    ticks = iter(range(100))
    profile = WindowProfile(str(tmp_path / "p-{pid}"), skip=3, steps=2, clock=lambda: float(next(ticks)),
                            label="stock")
    assert _loop(profile, 9) == list(range(9))          # every call still runs, once
    assert profile.done
    prof = next(tmp_path.glob("p-*.prof"))
    stats = pstats.Stats(str(prof)).stats
    by_name = {(key[2]): value for key, value in stats.items()}
    assert by_name["step"][1] == 2                       # primitive calls: steps 4 and 5 only
    assert by_name["_only_in_window"][1] == 2
    assert by_name["intake"][1] == 1                     # the intake between them, not before
    text = next(tmp_path.glob("p-*.txt")).read_text()
    assert text.startswith("run: stock\n2 steps after 3, 1000.0 ms wall (500000 us a step, profiled)")
    assert "_only_in_window" in text
    lines = text.splitlines()
    assert lines[2].startswith("thread CPU ") and "% of the wall)" in lines[2]
    gens = lines[3].split()[1].split("/")
    assert lines[3].startswith("gc: ") and int(gens[2]) >= 2          # the two in the window, at least
    import json
    summary = json.loads(next(tmp_path.glob("p-*.json")).read_text())
    assert (summary["label"], summary["steps"], summary["wall_ms"]) == ("stock", 2, 1000.0)
    assert summary["gc"]["collections"][2] == int(gens[2]) and summary["timeline"] == profile.timeline
    before = list(gc.callbacks)
    gc.collect()
    assert gc.callbacks == before and not any("_GcTimer" in repr(c) for c in gc.callbacks)   # removed


def test_a_loop_shorter_than_the_window_writes_nothing(tmp_path):
    profile = WindowProfile(str(tmp_path / "p"), skip=5, steps=10)
    _loop(profile, 8)
    assert not profile.done and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("steps_env, message", [("100", "SKIP:STEPS"), ("a:b", "SKIP:STEPS"),
                                                ("10:0", "steps >= 1"), ("-1:5", "skip >= 0")])
def test_bad_window_settings_are_refused(steps_env, message):
    with pytest.raises(ConfigError, match=message):
        from_env({"VATTN_ENGINE_PROFILE": "/tmp/x", "VATTN_ENGINE_PROFILE_STEPS": steps_env})


def test_the_harness_run_name_labels_the_window():
    assert from_env({"VATTN_ENGINE_PROFILE": "/tmp/x", "VATTN_RUN_NAME": "vattn:e1"}).label == "vattn:e1"


def test_no_variable_no_profile():
    assert from_env({}) is None
    assert from_env({"VATTN_ENGINE_PROFILE": ""}) is None
    with pytest.raises(ConfigError, match="empty"):
        WindowProfile("", skip=0, steps=1)


def test_the_steps_before_the_window_are_timed_unprofiled_with_their_notes(tmp_path):
    import json
    profile = WindowProfile(str(tmp_path / "p"), skip=4, steps=2)

    def step(i):
        profile.note(tokens=10 * i, new=i % 2)
        if i == 1:
            profile.note(new=5)                # a later note of the same step wins
        return i
    wrapped = profile.wrap(step, step=True)
    for i in range(7):
        wrapped(i)
    assert [r["tokens"] for r in profile.timeline] == [20, 30]          # steps 3 and 4 (1-based)
    assert [r["new"] for r in profile.timeline] == [0, 1]
    assert profile.timeline[0]["start_ms"] == 0.0 and all(r["ms"] >= 0 for r in profile.timeline)
    saved = json.loads((tmp_path / "p.json").read_text())
    assert saved["timeline_first_step"] == 3 and saved["timeline"] == profile.timeline
    assert (saved["label"], saved["skip"], saved["steps"]) == ("", 4, 2)
    assert len(saved["gc"]["collections"]) == 3 and saved["wall_ms"] >= 0 and saved["cpu_ms"] >= 0
