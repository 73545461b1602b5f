"""``vattn bench host``: vattn's vLLM runtime driven through a generation's calls (host backend)."""

import json

import pytest

from vattn.cli import main


def test_host_bench_counts_the_calls_of_a_generation(tmp_path, capsys):
    out = tmp_path / "host.json"
    bench = tmp_path / "B.md"
    bench.write_text("# Benchmarks\n")
    rc = main(["bench", "host", "--device", "cpu", "--batch", "4", "--prompt", "100", "--new", "300",
               "--generations", "2", "--json", str(out), "--benchmarks", str(bench)])
    assert rc == 0
    result = json.loads(out.read_text())
    # lengths 101..400 need 1..4 blocks of 128 tokens: 4 block changes x 4 requests per generation
    assert result["on_blocks_calls"] == 16
    assert result["total_ms_per_generation"] > 0 and result["on_blocks_mean_us"] > 0
    assert set(result["ms_per_generation"]) == {"on_blocks", "apply", "tables", "release"}
    assert "## host time per generation (cpu)" in bench.read_text()
    assert "µs per on_blocks" in capsys.readouterr().out


def test_host_bench_refuses_an_empty_generation(capsys):
    assert main(["bench", "host", "--device", "cpu", "--batch", "0", "--no-report"]) == 2
    assert "argument --batch: expected an int >= 1, got '0'" in capsys.readouterr().err


def test_prefix_caching_repeats_hit_their_prompts_and_map_nothing_on_the_critical_path(tmp_path):
    """Generations of the same prompts with vLLM's prefix caching: from the second on, each request
    hits its own cached prompt in the slot it ran in, and every new block takes a cached block's
    position by one device copy, not by VMM calls (the guard for the repeated-generation cost)."""
    out = tmp_path / "prefix.json"
    rc = main(["bench", "host", "--device", "cpu", "--prefix-caching", "--batch", "8", "--prompt", "300",
               "--new", "400", "--generations", "2", "--json", str(out), "--no-report"])
    assert rc == 0
    gens = [g["calls"] for g in json.loads(out.read_text())["generations"]]
    assert len(gens) == 3 and gens[0]["prefix_hits"] == 0 and gens[0]["keys_bound"] == 8 * 6
    for g in gens[1:]:
        assert g["prefix_hits"] == 8 * 2                       # (300 - 1) // 128 whole blocks each
        assert g["map_calls"] == g["unmap_calls"] == 0 and g["page_sets_moved"] > 0


def test_prefix_caching_shared_prompt_maps_it_into_every_request(tmp_path):
    out = tmp_path / "shared.json"
    assert main(["bench", "host", "--device", "cpu", "--prefix-caching", "--workload", "shared-prefix",
                 "--shared", "512", "--batch", "4", "--prompt", "700", "--new", "50", "--generations", "1",
                 "--json", str(out), "--no-report"]) == 0
    first = json.loads(out.read_text())["generations"][0]["calls"]
    # 3 of 4 requests hit the 4 shared blocks (the first one fills them): 12 page-sets aliased
    assert first["prefix_hits"] == 12 and first["pages_aliased"] == 12 * 8
    assert main(["bench", "host", "--device", "cpu", "--prefix-caching", "--workload", "shared-prefix",
                 "--shared", "700", "--prompt", "700", "--no-report"]) == 2


def test_the_block_pool_evicts_least_recently_freed_and_hits_whole_blocks():
    from vattn.bench.prefix_pool import PrefixBlockPool
    pool = PrefixBlockPool(num_blocks=6, block_size=2)              # blocks 1..5 (0 is null)
    a, hits = pool.admit([1, 2, 3, 4, 5])
    assert (a, hits) == ([1, 2, 3], 0)
    pool.finish(a)                                                  # freed 3, 2, 1: still cached
    b, hits = pool.admit([1, 2, 3, 4, 9])
    assert (b, hits) == ([1, 2, 4], 2)                              # [1,2] [3,4] hit; never-used 4
    assert pool.admit([7, 7, 7]) == ([5, 3], 0)                     # then the least recently freed
    small = PrefixBlockPool(num_blocks=3, block_size=2)
    x, _ = small.admit([1, 2, 3])
    small.finish(x)
    assert small.admit([1, 2, 3]) == ([1, 2], 1)                    # at most len - 1 tokens hit
    small.finish([1, 2])
    y, _ = small.admit([5, 6, 7])                                   # takes 2, then 1: [1,2] evicted
    small.finish(y)
    assert small.admit([1, 2, 3])[1] == 0


def test_the_block_pool_with_a_hit_unit_copies_the_block_a_hit_reaches_into():
    from vattn.bench.prefix_pool import PrefixBlockPool
    pool = PrefixBlockPool(num_blocks=8, block_size=4, unit=2)
    a, _ = pool.admit(list(range(8)))                               # two full blocks, cached
    assert pool.take_copies() == []
    pool.finish(a)
    b, hits = pool.admit(list(range(8)))                            # the same prompt: 7 tokens may hit
    assert hits == 1 and b[0] == a[0] and b[1] != a[1]              # block 2 is not handed out again
    assert pool.take_copies() == [(a[1], b[1])] and pool.take_copies() == []
    c, hits = pool.admit([0, 1, 2, 3, 4, 9, 9, 9])                  # block 2 differs: no copy
    assert hits == 1 and pool.take_copies() == []
    assert PrefixBlockPool(num_blocks=8, block_size=4).admit(list(range(8)))[1] == 0
    with pytest.raises(ValueError, match="divide"):
        PrefixBlockPool(num_blocks=8, block_size=4, unit=3)


def test_prefix_caching_multi_turn_hits_the_whole_conversation_in_place(tmp_path):
    out = tmp_path / "turns.json"
    assert main(["bench", "host", "--device", "cpu", "--prefix-caching", "--workload", "multi-turn",
                 "--batch", "4", "--prompt", "300", "--new", "100", "--user", "50", "--generations", "2",
                 "--json", str(out), "--no-report"]) == 0
    gens = [g["calls"] for g in json.loads(out.read_text())["generations"]]
    # turn 2: 450 tokens, the 3 full blocks of the first 400 hit; turn 3: 600 tokens, 4 blocks hit
    assert [g["prefix_hits"] for g in gens] == [0, 4 * 3, 4 * 4]
    assert all(g["map_calls"] == 0 for g in gens[1:])           # each conversation in its own slot


def _sched(tmp_path, *extra):
    out = tmp_path / "sched.json"
    assert main(["bench", "host", "--device", "cpu", "--prefix-caching", "--batch", "8", "--prompt", "300",
                 "--new", "300", "--generations", "1", "--json", str(out), "--no-report", *extra]) == 0
    return [g["calls"] for g in json.loads(out.read_text())["generations"]]


def test_a_device_one_step_behind_costs_no_wait_and_no_vmm_call_without_memory_pressure(tmp_path):
    """The guard for async scheduling: with the device trailing the host by one step (a fence
    recorded at a release completes one step later), repeated generations still make no VMM call
    and never wait on a fence."""
    gens = _sched(tmp_path, "--fence-lag", "1")
    assert gens[0]["preemptions"] == 0 and gens[0]["steps"] == 301
    for g in gens[1:]:
        assert g["fence_waits"] == 0 and g["map_calls"] == g["unmap_calls"] == 0
        assert g["prefix_hits"] == 8 * 2 and g["page_sets_moved"] > 0


def test_memory_pressure_preempts_like_vllm_and_every_request_still_finishes(tmp_path):
    """Half the pool the run needs: requests are preempted and recomputed (hitting what is still
    cached of their own blocks); the cache's audit passes after the run (run_prefix audits it)."""
    gens = _sched(tmp_path, "--pool-fraction", "0.5", "--fence-lag", "1")
    assert all(g["preemptions"] > 0 and g["steps"] > 301 for g in gens)
    assert sum(g["prefix_hits"] for g in gens) > 0
    # the price of pressure today: pages move between regions by VMM calls (see BENCHMARKS.md)
    assert all(g["map_calls"] > 0 for g in gens)


def test_under_memory_pressure_a_pending_fence_retires_instead_of_waiting(tmp_path):
    """vLLM's GPU runner is stream_ordered: pages of a slot released this step (its fence still
    pending) go to a growing request at once and their old mapping is unmapped later; the same
    run waiting on the fence makes the same map and access calls (their unmap calls differ: each
    unmaps runs of adjacent pages with one call, and the runs differ) (the audit passes in both)."""
    runs = {p: _sched(tmp_path, "--pool-fraction", "0.5", "--fence-lag", "1", "--fence-policy", p)
            for p in ("wait", "retire")}
    same = ("map_calls", "set_access_calls", "preemptions", "steps", "prefix_hits")
    for waited, retired in zip(runs["wait"], runs["retire"]):
        assert {k: waited[k] for k in same} == {k: retired[k] for k in same}
        assert waited["pages_retired"] == 0 and retired["pages_retired"] > 0
        assert retired["fence_waits"] < waited["fence_waits"]


def test_memory_pressure_options_refuse_bad_values(capsys):
    base = ["bench", "host", "--device", "cpu", "--prefix-caching", "--no-report"]
    assert main(base + ["--pool-fraction", "9"]) == 2
    assert "--pool-fraction must be in (0, 8], got 9.0" in capsys.readouterr().err
    assert main(base + ["--pool-fraction", "0"]) == 2
    assert "expected a number > 0" in capsys.readouterr().err
    assert main(base + ["--fence-lag", "-1"]) == 2
    assert main(base + ["--workload", "multi-turn", "--fence-lag", "1"]) == 2
    assert "not multi-turn" in capsys.readouterr().err
    assert main(base + ["--max-num-seqs", "4"]) == 2
    assert "--max-num-seqs needs the scheduler" in capsys.readouterr().err
    assert main(base + ["--fence-lag", "1", "--max-model-len", "64"]) == 2
    assert "--max-model-len must hold the longest request (1024 tokens), got 64" in capsys.readouterr().err


def test_waves_on_a_full_pool_move_cached_blocks_by_copy_not_by_vmm_calls(tmp_path):
    """Two waves of requests (max_num_seqs 8 of 16) on a pool that holds one wave: the second
    wave's blocks land on positions holding the first wave's cached blocks. With room above the
    requests (vLLM's regions are max_model_len long), the displaced blocks are parked there by
    one device copy each (free pages mapped on a slot's top), so from the second generation on
    no VMM call is made (before parking, 224 maps + 224 unmaps a generation)."""
    gens = _sched(tmp_path, "--batch", "16", "--max-num-seqs", "8", "--pool-fraction", "0.55",
                  "--fence-lag", "1", "--max-model-len", "4096")
    assert all(g["preemptions"] == 0 for g in gens)
    for g in gens[1:]:
        assert g["map_calls"] == g["unmap_calls"] == 0 and g["fence_waits"] == 0
        assert g["page_sets_moved"] > 0


def _packed_burst(tmp_path, *extra):
    out = tmp_path / "packs.json"
    assert main(["bench", "host", "--device", "cpu", "--prefix-caching", "--workload", "shared-prefix",
                 "--shared", "2048", "--batch", "16", "--prompt", "2304", "--new", "4", "--generations", "1",
                 "--max-num-seqs", "64", "--max-batched-tokens", "4096", "--fence-lag", "1",
                 "--stage-prefixes", "off", *extra, "--json", str(out), "--no-report"]) == 0
    return json.loads(out.read_text())["generations"][0]["calls"]


def test_packs_map_a_warm_prefix_in_fewer_calls_than_a_cold_one(tmp_path):
    """16 requests on a 2,048-token prefix (16 page-sets, 2 packs of 8), 4,096 tokens a step:
    without packs every hit maps 8 pages per page-set; with packs the burst maps them per range;
    a prefix cached by a warm-up request (as the engine stages run one) is packed at its second
    hit in the first step, a cold one only after the step that wrote it."""
    plain = _packed_burst(tmp_path)
    cold = _packed_burst(tmp_path, "--pack-mb", "4")            # 128 host pages: 2 packs of 8 x 8
    warm = _packed_burst(tmp_path, "--pack-mb", "4", "--warm-up")
    assert cold["packs_built"] == warm["packs_built"] == 2
    # 15 of the 16 alias the prefix (the warm-up's slot, taken again, holds it in place)
    assert plain["pages_aliased"] == cold["pages_aliased"] == warm["pages_aliased"] == 15 * 16 * 8
    assert warm["map_calls"] < cold["map_calls"] < plain["map_calls"], (plain, cold, warm)


def test_deferred_mapping_makes_the_same_calls_and_moves_them_into_the_forward(tmp_path):
    """The packed warm burst with each step's VMM calls deferred to its forward (vLLM's GPU
    runner's default): the same calls, every one made range by range as the played forward
    reaches it, most of them after the first range (off the step's path before the forward);
    the cache's audit at the end passes (run by the bench)."""
    out = tmp_path / "packs.json"
    plain = _packed_burst(tmp_path, "--pack-mb", "4", "--warm-up")
    assert main(["bench", "host", "--device", "cpu", "--prefix-caching", "--workload", "shared-prefix",
                 "--shared", "2048", "--batch", "16", "--prompt", "2304", "--new", "4", "--generations", "1",
                 "--max-num-seqs", "64", "--max-batched-tokens", "4096", "--fence-lag", "1",
                 "--stage-prefixes", "off", "--pack-mb", "4", "--warm-up", "--defer-mapping",
                 "--json", str(out), "--no-report"]) == 0
    gen = json.loads(out.read_text())["generations"][0]
    counted = ("map_calls", "unmap_calls", "set_access_calls", "pages_aliased", "packs_built", "pages_packed")
    assert {k: gen["calls"][k] for k in counted} == {k: plain[k] for k in counted}
    assert gen["issue"] > 0 and 0 < gen["first_range"] < gen["issue"]


def test_requests_arriving_as_a_server_receives_them_run_in_more_steps_and_all_finish(tmp_path):
    """``--arrive-every``: request ``i`` arrives at step ``int(i * every)`` (a server's stream),
    so the generation takes the last arrival's step plus one request's length, every request
    finishes (the audit at the end passes) and the table gives apply's µs per step."""
    out = tmp_path / "arrive.json"
    assert main(["bench", "host", "--device", "cpu", "--prefix-caching", "--workload", "shared-prefix",
                 "--shared", "256", "--batch", "12", "--prompt", "300", "--new", "20", "--generations", "1",
                 "--fence-lag", "1", "--max-batched-tokens", "2048", "--arrive-every", "5",
                 "--json", str(out), "--no-report"]) == 0
    data = json.loads(out.read_text())
    assert data["args"]["arrive_every"] == 5.0
    for gen in data["generations"]:
        # the last request arrives (and is admitted) at step 55 and gains its 20 tokens in the 20
        # steps after it, the last of which releases it: as all at once, 300 new tokens -> 301 steps
        assert gen["calls"]["steps"] == 55 + 20 + 1 and gen["calls"]["preemptions"] == 0
        assert "apply_us" not in gen                        # summarised in the table, not dumped
    all_at_once = _sched(tmp_path, "--fence-lag", "1")
    assert all_at_once[0]["steps"] == 301


def test_arrivals_refuse_a_negative_spacing(capsys):
    assert main(["bench", "host", "--device", "cpu", "--prefix-caching", "--arrive-every", "-1"]) == 2
    assert "--arrive-every" in capsys.readouterr().err
