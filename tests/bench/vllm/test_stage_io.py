"""What the GPU stages leave behind when an engine run hangs, fails or runs out of time (no vLLM)."""

import json
from types import SimpleNamespace

import pytest

from vattn.bench.gpu import vllm_stages
from vattn.conformance import stages
from vattn.conformance.runners.vllm import VllmRunner
from vattn.core.errors import VattnError


def test_modes_are_cut_to_the_stage_deadline(monkeypatch):
    monkeypatch.setenv("VATTN_STAGE_DEADLINE", str(stages.time.time() + 100))
    seen = []

    class Runner:
        modes, tag, timeout_s = ("stock", "vattn"), "t", 420.0

        def run(self, mode, *a, **kw):
            seen.append(self.timeout_s)
            monkeypatch.setenv("VATTN_STAGE_DEADLINE", str(stages.time.time() + 20))   # time runs out
            return SimpleNamespace()
    results, errors = stages.run_modes(Runner(), "m", [[1]], 1, logprobs=0)
    assert list(results) == ["stock"] and "skipped" in errors["vattn"]
    assert 80 < seen[0] <= 85


def test_a_failing_stage_still_writes_its_json(tmp_path, monkeypatch):
    def boom(args):
        raise SystemExit(143)                      # what SIGTERM from `timeout` turns into
    monkeypatch.setitem(vllm_stages.STAGES, "smoke", boom)
    assert vllm_stages.main(["smoke", "--out", str(tmp_path)]) == 1
    report = json.loads((tmp_path / "smoke.json").read_text())
    assert report["ok"] is False and "SystemExit" in report["errors"]["stage"]


def test_a_failed_engine_run_reports_the_first_traceback_last(tmp_path):
    runner = VllmRunner(device="cpu", modes=("stock",), log_dir=str(tmp_path), tag="t",
                                    timeout_s=120, engine_args={"model_dir": "/nonexistent"})
    try:
        import vllm  # noqa: F401
        pytest.skip("needs an environment where the engine run fails (no vLLM)")
    except ImportError:
        pass
    with pytest.raises(VattnError) as err:
        runner.run("stock", "/nonexistent", [[1, 2, 3]], 2)
    message = str(err.value)
    assert "--- first traceback in vllm_t_stock.log" in message[-2700:]       # kept by a [-3000:] cut
    assert "No module named 'vllm'" in message[-300:]
    assert (tmp_path / "vllm_t_stock.log").read_text().rstrip().endswith("--- exit 1")
