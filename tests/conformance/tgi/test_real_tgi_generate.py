"""Generation through TGI v3.3.7's real server with vattn on CPU (skipped without TGI).

TGI's real ``TextGenerationService`` (Warmup, Prefill with and without a running batch,
Decode, FilterBatch, ClearCache), ``FlashCausalLM`` and ``FlashLlamaForCausalLM`` run on a tiny
random Llama with vattn's cache and attention, and with ``vattn.conformance.workers.tgi_cpu``'s stand-ins
for TGI's CUDA-only kernels; tokens and log-probs are compared with transformers' Llama.
"""

import importlib.util
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("text_generation_server") is None,
                                reason="TGI's server (text_generation_server v3.3.7) is not installed; "
                                       "it is not on any package index, install it from TGI's repository")

TINY = dict(num_hidden_layers=2, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, intermediate_size=512, vocab_size=1024, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from vattn.conformance.models import build_model
    return build_model(TINY, str(tmp_path_factory.mktemp("tgi-tiny")), seed=3)


def test_generation_with_joins_and_leaves_matches_transformers(model_dir):
    import torch
    from vattn.conformance.runners.tgi import TgiRunner
    from vattn.conformance.models import random_prompts
    # odd lengths; 300 tokens spans two TGI blocks (256) and several 64 KiB vattn pages
    prompts = random_prompts(4, [7, 300, 13, 29], vocab_size=TINY["vocab_size"], seed=11)
    arrivals = [0.0, 0.0, 1e-3, 1e-3]        # the last two join the running batch
    runner = TgiRunner()
    got = runner.run("vattn", model_dir, prompts, 9, logprobs=5, arrival_times=arrivals)
    ref = runner.run("reference", model_dir, prompts, 9, logprobs=5)
    assert got.token_ids == ref.token_ids
    assert len({tuple(ids) for ids in got.token_ids}) == 4
    for steps_got, steps_ref, ids in zip(got.logprobs, ref.logprobs, got.token_ids):
        chosen = torch.tensor([s[t] for s, t in zip(steps_got, ids)])
        expect = torch.tensor([s[t] for s, t in zip(steps_ref, ids)])
        torch.testing.assert_close(chosen, expect, atol=1e-4, rtol=0)
    calls, extra = got.extra["calls"], got.extra
    assert calls["prefills_with_running_batch"] >= 1      # TGI's concatenate ran
    assert calls["filters"] >= 1                          # TGI's filter released the first pair
    assert extra["applied"] == ["attention_package", "cache", "flash_causal_lm"]
    assert extra["bound_after_run"] == 0 and extra["cache"]["active_slots"] == 0
    assert extra["cache"]["map_calls"] > 4                # pages mapped as requests grew


def test_cli_conformance_identity_passes(model_dir, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("VATTN_")}
    res = subprocess.run([sys.executable, "-m", "vattn", "conformance", "--engine", "tgi", "--model",
                          model_dir, "--workload", "identity", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=900, env=env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "identity: PASS exact-match 1.000" in res.stdout
