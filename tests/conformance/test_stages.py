"""run_modes: every mode runs, a failing one is recorded with its first line and its tail."""

import time
from types import SimpleNamespace

from vattn.conformance.stages import rounds_summary, run_modes, run_rounds


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


class TimedRunner(FakeRunner):
    """Each run of a mode takes the next of its listed seconds."""

    def __init__(self, seconds: dict):
        super().__init__(tuple(seconds))
        self.left = {m: list(s) for m, s in seconds.items()}

    def run(self, mode, model, prompts, new, *, logprobs, device, dtype):
        self.seen.append((mode, self.timeout_s))
        secs = self.left[mode].pop(0)
        return SimpleNamespace(seconds=secs, num_generated_tokens=100,
                               extra={"generation_s": [secs + 1, secs]})


def test_rounds_alternate_modes_and_summarise_medians_and_per_round_ratios():
    runner = TimedRunner({"stock": [10.0, 12.0, 11.0], "vattn": [5.0, 12.0, 22.0]})
    results, errors = run_rounds(runner, "m", [[1]], 2, rounds=3)
    assert not errors and [m for m, _ in runner.seen] == ["stock", "vattn"] * 3
    rows = rounds_summary(results, "stock")
    assert rows["stock"]["round_s"] == [10.0, 12.0, 11.0] and rows["stock"]["seconds"] == 11.0
    assert rows["vattn"]["seconds"] == 12.0 and rows["vattn"]["ratio_vs_stock"] == 11.0 / 12.0
    assert rows["vattn"]["round_ratios"] == [2.0, 1.0, 0.5]
    assert (rows["vattn"]["min_s"], rows["vattn"]["max_s"]) == (5.0, 22.0)
    assert rows["vattn"]["generation_s"][0] == [6.0, 5.0]


def test_a_failing_round_is_recorded_per_mode_and_the_rest_still_summarised():
    runner = TimedRunner({"stock": [10.0, 10.0], "vattn": [9.0]})   # vattn's second run fails
    results, errors = run_rounds(runner, "m", [[1]], 2, rounds=2)
    assert len(results["stock"]) == 2 and len(results["vattn"]) == 1
    assert errors["vattn"][0].startswith("round 2: IndexError")
    assert rounds_summary(results, "stock")["vattn"]["round_ratios"] == [10.0 / 9.0]
