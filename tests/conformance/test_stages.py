"""run_modes: every mode runs, a failing one is recorded with its first line and its tail."""

import time
from types import SimpleNamespace

from vattn.conformance.stages import run_modes


class FakeRunner:
    def __init__(self, modes, fail=()):
        self.modes, self.fail, self.timeout_s, self.tag, self.seen = modes, fail, 100.0, "t", []

    def run(self, mode, model, prompts, new, *, logprobs, device, dtype):
        self.seen.append((mode, self.timeout_s))
        if mode in self.fail:
            raise RuntimeError(f"vLLM {mode} run timed out after 90 s:\n" + "log line\n" * 1000 + "ROOT CAUSE")
        return SimpleNamespace(mode=mode)


def test_failing_mode_is_recorded_and_the_others_run():
    runner = FakeRunner(("stock", "vattn", "ceiling"), fail=("vattn",))
    results, errors = run_modes(runner, "m", [[1]], 2, logprobs=0)
    assert set(results) == {"stock", "ceiling"} and set(errors) == {"vattn"}
    text = errors["vattn"]
    assert text.startswith("RuntimeError: vLLM vattn run timed out after 90 s")
    assert text.endswith("ROOT CAUSE") and len(text) < 3100
    assert runner.timeout_s == 100.0


def test_deadline_caps_each_mode_and_skips_when_none_is_left(monkeypatch):
    monkeypatch.setenv("VATTN_STAGE_DEADLINE", str(time.time() + 60))
    runner = FakeRunner(("stock",))
    run_modes(runner, "m", [[1]], 2, logprobs=0)
    assert runner.seen[0][1] <= 45
    monkeypatch.setenv("VATTN_STAGE_DEADLINE", str(time.time() + 20))
    runner = FakeRunner(("stock",))
    results, errors = run_modes(runner, "m", [[1]], 2, logprobs=0)
    assert not results and "skipped" in errors["stock"]
