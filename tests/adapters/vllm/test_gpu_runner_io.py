"""What the GPU stages leave behind when an engine run hangs, fails or runs out of time (no vLLM)."""

import json
import sys
from types import SimpleNamespace

import pytest

from vattn.adapters.vllm import conformance, gpu_run


def test_run_group_streams_the_log_and_kills_on_timeout(tmp_path):
    log = tmp_path / "run.log"
    code = "import sys, time; print('engine up', flush=True); print('oops', file=sys.stderr, flush=True); time.sleep(60)"
    with pytest.raises(conformance.subprocess.TimeoutExpired):
        conformance._run_group([sys.executable, "-c", code], {}, 8.0, str(log))   # slack for a loaded CI box
    text = log.read_text()
    assert "engine up" in text and "oops" in text and "--- exit -9" in text   # kept although killed


def test_run_group_returns_the_log_tail_as_stderr(tmp_path):
    log = tmp_path / "run.log"
    done = conformance._run_group([sys.executable, "-c", "import sys; sys.exit('bad things')"], {}, 30.0,
                                  str(log))
    assert done.returncode == 1 and "bad things" in done.stderr
    piped = conformance._run_group([sys.executable, "-c", "print('hi')"], {}, 30.0)
    assert piped.stdout.strip() == "hi"


def test_modes_are_cut_to_the_stage_deadline(monkeypatch):
    monkeypatch.setenv("VATTN_STAGE_DEADLINE", str(gpu_run.time.time() + 100))
    seen = []

    class Runner:
        modes, tag, timeout_s = ("stock", "vattn"), "t", 420.0

        def run(self, mode, *a, **kw):
            seen.append(self.timeout_s)
            monkeypatch.setenv("VATTN_STAGE_DEADLINE", str(gpu_run.time.time() + 20))   # time runs out
            return SimpleNamespace()
    results, errors = gpu_run._run_all(Runner(), "m", [[1]], 1, logprobs=0)
    assert list(results) == ["stock"] and "skipped" in errors["vattn"]
    assert 80 < seen[0] <= 85


def test_a_failing_stage_still_writes_its_json(tmp_path, monkeypatch):
    def boom(args):
        raise SystemExit(143)                      # what SIGTERM from `timeout` turns into
    monkeypatch.setitem(gpu_run._STAGES, "smoke", boom)
    assert gpu_run.main(["smoke", "--out", str(tmp_path)]) == 1
    report = json.loads((tmp_path / "smoke.json").read_text())
    assert report["ok"] is False and "SystemExit" in report["errors"]["stage"]


def test_a_failed_engine_run_reports_the_first_traceback_last(tmp_path):
    pytest.importorskip("vattn.adapters.vllm.worker")
    runner = conformance.VllmRunner(device="cpu", modes=("stock",), log_dir=str(tmp_path), tag="t",
                                    timeout_s=120, engine_args={"model_dir": "/nonexistent"})
    try:
        import vllm  # noqa: F401
        pytest.skip("needs an environment where the engine run fails (no vLLM)")
    except ImportError:
        pass
    with pytest.raises(conformance.VattnError) as err:
        runner.run("stock", "/nonexistent", [[1, 2, 3]], 2)
    message = str(err.value)
    assert "--- first traceback in vllm_t_stock.log" in message[-2700:]       # kept by a [-3000:] cut
    assert "No module named 'vllm'" in message[-300:]
    assert (tmp_path / "vllm_t_stock.log").read_text().rstrip().endswith("--- exit 1")
