"""The SGLang conformance runner: exact CPU refusal, per-mode engine arguments, the allocator's
metrics handed from the scheduler process to the worker."""

import json
import os

import pytest

from vattn.adapters.sglang.metrics import METRICS_ENV
from vattn.conformance.workers import sglang as worker
from vattn.conformance.workers.sglang import _logprobs, engine_kwargs
from vattn.core.errors import UnsupportedError


def test_runner_refuses_cpu_with_the_exact_reason():
    pytest.importorskip("sglang.srt.server_args", reason="sglang (CPU import set) not installed")
    from vattn.conformance.runners.sglang import WHY_CPU, SglangRunner

    runner = SglangRunner()
    assert runner.modes == ("stock", "vattn")
    with pytest.raises(UnsupportedError) as err:
        runner.run("vattn", "/nonexistent", [[1, 2, 3]], 4, device="cpu")
    assert str(err.value) == WHY_CPU and "sgl_kernel's CPU build" in WHY_CPU
    with pytest.raises(UnsupportedError, match="modes must be among"):
        SglangRunner(modes=("paged",))


def test_engine_kwargs_per_mode():
    stock, vattn = (engine_kwargs(m, "/m", {}) for m in ("stock", "vattn"))
    assert (stock["attention_backend"], vattn["attention_backend"]) == ("fa3", "vattn")
    for kw in (stock, vattn):
        assert "page_size" not in kw and "disable_radix_cache" not in kw   # SGLang's defaults
        assert kw["sampling_backend"] == "pytorch"
        assert kw["disable_prefill_cuda_graph"]          # like for like: decode graphs only
    assert "disable_cuda_graph" not in stock and "disable_cuda_graph" not in vattn   # both graphed
    assert engine_kwargs("vattn-eager", "/m", {})["disable_cuda_graph"]
    assert engine_kwargs("vattn-eager", "/m", {})["attention_backend"] == "vattn"
    assert engine_kwargs("stock-eager", "/m", {"load_format": "dummy"})["load_format"] == "dummy"
    with pytest.raises(ValueError, match="mode"):
        engine_kwargs("paged", "/m", {})


def test_logprobs_from_sglang_meta_info():
    out = {"meta_info": {"output_top_logprobs": [[(-0.1, 7, None), (-2.0, 3, None)]],
                         "output_token_logprobs": [(-0.1, 7, None)]}}
    assert _logprobs(out) == [{7: -0.1, 3: -2.0}]


def test_the_worker_hands_the_path_to_the_scheduler_and_reads_it(monkeypatch, tmp_path):
    monkeypatch.setenv(METRICS_ENV, "")                 # restored after the test
    monkeypatch.setattr(worker.tempfile, "mkdtemp", lambda prefix: str(tmp_path))
    path = worker._metrics_path()
    assert os.environ[METRICS_ENV] == path and not os.path.exists(path)
    assert "never idle" in worker._read_metrics(path)["error"]
    with open(path, "w") as f:
        json.dump({"pages_mapped_on_demand": 3}, f)
    assert worker._read_metrics(path) == {"pages_mapped_on_demand": 3}
    assert worker._read_metrics(None) is None


def test_the_nostage_mode_is_vattn_with_prefix_staging_off(monkeypatch):
    from vattn.conformance.runners.sglang import SglangRunner
    monkeypatch.setenv("VATTN_STAGE_PREFIXES", "0")     # this process's setting is not inherited
    plain, off = SglangRunner.env_for("vattn"), SglangRunner.env_for("vattn-nostage")
    assert plain["VATTN_SGLANG"] == off["VATTN_SGLANG"] == "1"
    assert "VATTN_STAGE_PREFIXES" not in plain and off["VATTN_STAGE_PREFIXES"] == "0"
    assert "VATTN_SGLANG" not in SglangRunner.env_for("stock")
    kw = engine_kwargs("vattn-nostage", "/m", {})
    assert kw == engine_kwargs("vattn", "/m", {})           # the same engine otherwise


def test_the_packs_mode_is_vattn_with_staging_off_and_a_pack_budget(monkeypatch):
    from vattn.conformance.runners.sglang import SglangRunner
    monkeypatch.setenv("VATTN_PACK_MB", "7")              # this process's setting is not inherited
    plain, packs = SglangRunner.env_for("vattn"), SglangRunner.env_for("vattn-packs")
    assert "VATTN_PACK_MB" not in plain and packs["VATTN_PACK_MB"] == "1024"
    assert packs["VATTN_STAGE_PREFIXES"] == "0" and packs["VATTN_SGLANG"] == "1"
    assert engine_kwargs("vattn-packs", "/m", {}) == engine_kwargs("vattn", "/m", {})
    assert "VATTN_DEFER_MAPPING" not in packs


def test_the_defer_mode_is_the_packs_mode_with_deferred_mapping(monkeypatch):
    from vattn.conformance.runners.sglang import SglangRunner
    monkeypatch.setenv("VATTN_DEFER_MAPPING", "1")        # this process's setting is not inherited
    packs, defer = SglangRunner.env_for("vattn-packs"), SglangRunner.env_for("vattn-defer")
    assert "VATTN_DEFER_MAPPING" not in packs and defer.pop("VATTN_DEFER_MAPPING") == "1"
    assert defer == packs
    assert engine_kwargs("vattn-defer", "/m", {}) == engine_kwargs("vattn", "/m", {})
