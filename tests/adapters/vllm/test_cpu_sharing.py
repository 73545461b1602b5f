"""vLLM prefix caching on the CPU path, engine-free: the page-set = block config, the runtime's
binding of new / running / resumed requests' blocks, and the ``_update_states`` hook against
fakes of vLLM's scheduler output and runner (no vLLM needed)."""

from types import SimpleNamespace

import pytest
import torch

from vattn.adapters.vllm import kv_hooks
from vattn.adapters.vllm import runtime as rt
from vattn.core.errors import ConfigError, UnsupportedError, VattnError

B = 32            # block size: 32 tokens x 512 bytes (2 KV heads x 32 x fp32 x K,V) = 16 KiB pages


def _vllm_config(prefix_caching=True, block=B, heads=2, head_dim=32, dtype=torch.float32, layers=2,
                 max_seqs=3, max_len=512):
    model = SimpleNamespace(get_num_layers=lambda par: layers, get_num_kv_heads=lambda par: heads,
                            get_head_size=lambda: head_dim, dtype=dtype, max_model_len=max_len)
    return SimpleNamespace(model_config=model, parallel_config=SimpleNamespace(),
                           scheduler_config=SimpleNamespace(max_num_seqs=max_seqs),
                           cache_config=SimpleNamespace(enable_prefix_caching=prefix_caching,
                                                        block_size=block))


def _kv_config(num_blocks=40, block=B, groups=1):
    spec = SimpleNamespace(block_size=block)
    return SimpleNamespace(num_blocks=num_blocks,
                           kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec)] * groups)


@pytest.fixture
def runtime():
    run = rt.VattnRuntime(rt.config_from_vllm(_vllm_config(), device="cpu", num_blocks=40), block_size=B)
    yield run
    run.cache.audit()
    run.close()


def fill(run, req_id, first, last, value):
    slot = run.slot(req_id)
    for layer in range(run.cache.config.num_layers):
        run.cache.k(layer)[slot, first:last] = value
        run.cache.v(layer)[slot, first:last] = -value


def same(run, req_id, first, last, value):
    slot = run.slot(req_id)
    return all(run.cache.k(layer)[slot, first:last].unique().tolist() == [float(value)] and
               run.cache.v(layer)[slot, first:last].unique().tolist() == [float(-value)]
               for layer in range(run.cache.config.num_layers))


# -- config: one page-set = one block --------------------------------------------------------------
def test_prefix_caching_makes_a_page_set_one_block_and_the_budget_vllms_pool(monkeypatch):
    monkeypatch.setenv("VATTN_PAGE_BUDGET", "1MiB")
    cfg = rt.config_from_vllm(_vllm_config(), device="cpu", num_blocks=40)
    assert cfg.page_bytes == B * 2 * 2 * 32 * 4 == 16384
    assert cfg.page_budget == 41 * cfg.page_bytes * 2           # num_blocks + 1 page-sets, 2 ranges
    run = rt.VattnRuntime(cfg, block_size=B)
    try:
        lay = run.cache.layout
        assert lay.tokens_for(1) == B and lay.pages_for(B) == 1 and lay.pages_for(B + 1) == 2
        assert run.cache.metrics()["pages_total"] == 41 * 2
    finally:
        run.close()


def test_prefix_caching_off_keeps_todays_config(monkeypatch):
    monkeypatch.setenv("VATTN_PAGE_BUDGET", "64MiB")
    cfg = rt.config_from_vllm(_vllm_config(prefix_caching=False), device="cpu", num_blocks=40)
    assert cfg.page_bytes is None and cfg.page_budget == 64 << 20 and cfg.group_size == 1


def test_a_block_that_is_no_whole_os_page_is_refused_naming_one_that_is():
    # 1 KV head x 80 x bf16 x K,V = 320 bytes per token: 32 x 320 = 10240 bytes, 2.5 OS pages
    config = _vllm_config(heads=1, head_dim=80, dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match=r"--block-size 64 \(block_size=64\)"):
        rt.config_from_vllm(config, device="cpu", num_blocks=40)
    config.cache_config.block_size = 64
    assert rt.config_from_vllm(config, device="cpu", num_blocks=40).page_bytes == 64 * 320
    # smaller than one OS page: 32 x 64 bytes (1 head x 16 x fp16 x K,V) = 2048 bytes
    small = _vllm_config(heads=1, head_dim=16, dtype=torch.float16)
    with pytest.raises(ConfigError, match=r"--block-size 64 "):
        rt.config_from_vllm(small, device="cpu", num_blocks=40)


def test_a_block_size_that_is_not_one_page_set_is_refused():
    cfg = rt.config_from_vllm(_vllm_config(), device="cpu", num_blocks=40)
    with pytest.raises(ConfigError, match="not one page-set"):
        rt.VattnRuntime(cfg, block_size=2 * B)


# -- the runtime: new, running and resumed requests ------------------------------------------------
def test_a_hit_maps_the_cached_page_sets_into_the_new_requests_region(runtime):
    runtime.bind_blocks([("a", [1, 2, 3], 0)], [])
    runtime.plan_step([("a", 0, 3 * B - 5)])
    fill(runtime, "a", 0, 3 * B - 5, 7)
    runtime.end_step()
    # b hits a's first two blocks (64 tokens); its third block is fresh
    runtime.bind_blocks([("b", [1, 2, 9], 2 * B)], [])
    sa, sb = runtime.slot("a"), runtime.slot("b")
    assert sa != sb
    pages = runtime.cache._pages
    assert pages.at(sb, 0) == pages.at(sa, 0) and pages.at(sb, 1) == pages.at(sa, 1)
    assert pages.at(sb, 2) != pages.at(sa, 2)
    assert runtime.plan_step([("b", 2 * B, 10)]) == []     # ensure finds the page-sets mapped
    assert same(runtime, "b", 0, 2 * B, 7)                 # a's KV through b's own addresses
    fill(runtime, "b", 2 * B, 2 * B + 10, 3)
    assert same(runtime, "a", 2 * B, 3 * B - 5, 7)         # b's fresh block is not a's
    m = runtime.cache.metrics()
    assert m["prefix_hits"] == 2 and m["pages_aliased"] == 2 * 2 and m["keys_bound"] == 4


def test_running_requests_bind_new_blocks_after_the_ones_they_hold(runtime, monkeypatch):
    calls = []
    bind = runtime.cache.bind
    monkeypatch.setattr(runtime.cache, "bind",
                        lambda slot, start, keys, hits=0: calls.append((slot, start, list(keys), hits))
                        or bind(slot, start, keys, hits=hits))
    runtime.bind_blocks([("a", [4, 5], 0)], [])
    runtime.bind_blocks([], [("a", [6]), ("a", [])])
    runtime.bind_blocks([], [("a", [7, 8])])
    slot = runtime.slot("a")
    assert calls == [(slot, 0, [4, 5], 0), (slot, 2, [6], 0), (slot, 3, [7, 8], 0)]
    assert runtime.blocks("a") == 5
    assert runtime.plan_step([("a", 0, 5 * B)]) == []
    with pytest.raises(VattnError, match="holds no vattn slot"):
        runtime.bind_blocks([], [("zz", [11])])


def test_a_repeated_prompt_takes_the_slot_where_its_prefix_is(runtime):
    # x's slot ends up warmer (4 page-sets): without the hit it is the one handed out
    runtime.bind_blocks([("a", [1, 2], 0), ("x", [5, 6, 7, 10], 0)], [])
    fill(runtime, "a", 0, 2 * B, 4)
    home = runtime.slot("a")
    runtime.finish(["a", "x"])
    aliased = runtime.cache.metrics()["pages_aliased"]
    runtime.bind_blocks([("again", [1, 2, 9], 2 * B)], [])
    assert runtime.slot("again") == home                  # the last hit block's home
    assert runtime.cache.metrics()["pages_aliased"] == aliased   # found in place: nothing mapped
    assert same(runtime, "again", 0, 2 * B, 4)


def test_a_hit_on_a_block_another_request_gets_this_step_is_bound_after_it(runtime):
    # vLLM caches a block when it schedules it: "late" can hit "early"'s fresh blocks in the
    # same step even when it is listed first (a resumed request before a new one)
    runtime.bind_blocks([("late", [1, 2, 3], 2 * B), ("early", [1, 2], 0)], [])
    pages = runtime.cache._pages
    assert pages.at(runtime.slot("late"), 1) == pages.at(runtime.slot("early"), 1)
    assert runtime.blocks("late") == 3 and runtime.blocks("early") == 2
    with pytest.raises(VattnError, match=r"hits blocks \[77\] that no request received"):
        runtime.bind_blocks([("lost", [77, 78], B)], [])
    assert "lost" not in runtime._slot_of


def test_a_hit_inside_a_block_without_vllms_copy_is_refused(runtime):
    with pytest.raises(UnsupportedError, match="sent no copy of the cached block"):
        runtime.bind_blocks([("a", [1, 2], B + 5)], [])
    with pytest.raises(VattnError, match="needs more than its 1 blocks"):
        runtime.bind_blocks([("a", [1], B + 5)], [], copies=[(3, 1)])
    with pytest.raises(VattnError, match="needs more than its 1 blocks"):
        runtime.bind_blocks([("a", [1], 2 * B)], [])


def test_a_hit_inside_a_block_copies_the_cached_block_into_the_requests_own(runtime):
    """vLLM's copy-on-write: ``b`` hits 1.5 blocks of ``a``'s: block 1 is shared, cached block 2
    is copied into ``b``'s fresh block 9, which ``b`` then writes without touching block 2."""
    runtime.bind_blocks([("a", [1, 2], 0)], [])
    fill(runtime, "a", 0, B, 3)
    fill(runtime, "a", B, 2 * B, 4)
    killed = runtime.bind_blocks([("b", [1, 9], B + B // 2)], [], copies=[(2, 9)])
    assert killed == [] and runtime.cache.metrics()["blocks_copied"] == 1
    assert same(runtime, "b", 0, B, 3) and same(runtime, "b", B, 2 * B, 4)
    fill(runtime, "b", B + B // 2, 2 * B, 8)
    assert same(runtime, "a", B, 2 * B, 4)
    with pytest.raises(VattnError, match="no request starting this step got"):
        runtime.bind_blocks([("c", [1, 12], B + 1)], [], copies=[(2, 12), (2, 13)])


def test_a_request_without_blocks_is_a_bug_not_a_fresh_slot(runtime):
    with pytest.raises(VattnError, match="got no blocks"):
        runtime.plan_step([("nobody", 0, 4)])


def test_bind_blocks_needs_prefix_caching():
    cfg = rt.config_from_vllm(_vllm_config(prefix_caching=False), device="cpu")
    run = rt.VattnRuntime(cfg)
    try:
        assert not run.sharing
        with pytest.raises(VattnError, match="block_size"):
            run.bind_blocks([("a", [1], 0)], [])
    finally:
        run.close()


# -- the hooks, against fakes of vLLM's runner and scheduler output --------------------------------
def _new(req_id, block_ids, computed=0):
    return SimpleNamespace(req_id=req_id, block_ids=(list(block_ids),), num_computed_tokens=computed)


def _output(new=(), cached=(), resumed=(), finished=(), preempted=(), scheduled=None, copies=None):
    """A SchedulerOutput of vLLM 0.32.0 (the fields the hook reads); ``cached``: (req_id,
    new_block_ids or None, num_computed_tokens)."""
    cached = list(cached)
    return SimpleNamespace(
        scheduled_new_reqs=list(new), finished_req_ids=set(finished), preempted_req_ids=set(preempted),
        num_scheduled_tokens=dict(scheduled or {}), kv_cache_block_copies=copies,
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[c[0] for c in cached], resumed_req_ids=set(resumed),
            new_block_ids=[None if c[1] is None else (list(c[1]),) for c in cached],
            num_computed_tokens=[c[2] for c in cached]))


class _Runner:
    """The CPU runner's persistent batch, updated the way vLLM's ``_update_states`` does."""

    def __init__(self, vllm_config):
        self.vllm_config = vllm_config
        self.input_batch = SimpleNamespace(req_ids=[], num_computed_tokens_cpu=[])
        self.rows = {}

    def original_update(self, out):
        for r in out.scheduled_new_reqs:
            self.rows[r.req_id] = r.num_computed_tokens
        for i, req_id in enumerate(out.scheduled_cached_reqs.req_ids):
            self.rows[req_id] = out.scheduled_cached_reqs.num_computed_tokens[i]
        for req_id in out.finished_req_ids | out.preempted_req_ids:
            self.rows.pop(req_id, None)
        self.input_batch.req_ids = list(self.rows)
        self.input_batch.num_computed_tokens_cpu = list(self.rows.values())


@pytest.fixture
def hooked():
    vllm_config = _vllm_config(max_seqs=4)
    runner = _Runner(vllm_config)
    init = kv_hooks._wrap_init_kv(lambda self, kv_cache_config: None)
    init(runner, _kv_config(num_blocks=40))
    update = kv_hooks._wrap_update_states(lambda self, out: self.original_update(out))
    yield SimpleNamespace(runner=runner, step=lambda out: update(runner, out), runtime=rt.current())
    rt.current().cache.audit()
    rt.uninstall()


def test_init_hook_builds_a_sharing_runtime_from_vllms_block_pool(hooked):
    run = hooked.runtime
    assert run.sharing and run.block_size == B
    assert run.cache.metrics()["pages_total"] == 41 * 2


def test_init_hook_refuses_what_sharing_cannot_follow():
    runner = _Runner(_vllm_config())
    init = kv_hooks._wrap_init_kv(lambda self, kv_cache_config: pytest.fail("vLLM's init ran"))
    with pytest.raises(UnsupportedError, match="one KV cache group only, this model has 2"):
        init(runner, _kv_config(groups=2))
    with pytest.raises(UnsupportedError, match="block size 64 is not the engine's 32"):
        init(runner, _kv_config(block=64))
    small = _Runner(_vllm_config(heads=1, head_dim=16, dtype=torch.float16))
    with pytest.raises(ConfigError, match="--block-size 64"):
        init(small, kv_cache_config=_kv_config())


def test_init_hook_without_prefix_caching_is_unchanged():
    runner = _Runner(_vllm_config(prefix_caching=False))
    kv_hooks._wrap_init_kv(lambda self, kv_cache_config: None)(runner, _kv_config(groups=2))
    try:
        assert not rt.current().sharing and rt.current().cache.layout.page_bytes == 2 << 20
    finally:
        rt.uninstall()


def test_update_hook_binds_new_running_and_resumed_requests(hooked, monkeypatch):
    run, calls = hooked.runtime, []
    bind = run.cache.bind
    monkeypatch.setattr(run.cache, "bind", lambda slot, start, keys, hits=0:
                        calls.append((slot, start, list(keys), hits)) or bind(slot, start, keys, hits=hits))
    # step 1: a (3 blocks, no hit) and b hitting a's first 2 blocks, scheduled in the same step
    hooked.step(_output(new=[_new("a", [1, 2, 3]), _new("b", [1, 2, 4], 2 * B)],
                        scheduled={"a": 70, "b": 10}))
    sa, sb = run.slot("a"), run.slot("b")
    assert calls == [(sa, 0, [1, 2, 3], 0), (sb, 0, [1, 2, 4], 2)]
    assert run._plan.rows.tolist() == ([sa * run.rows_per_slot + p for p in range(70)] +
                                       [sb * run.rows_per_slot + p for p in range(2 * B, 2 * B + 10)])
    run.end_step()
    # step 2: a decodes into a new block, b decodes without one, c arrives with a hit on a's blocks
    calls.clear()
    hooked.step(_output(new=[_new("c", [1, 2, 3, 5], 3 * B)],
                        cached=[("a", [6], 70), ("b", None, 2 * B + 10)],
                        scheduled={"a": 1, "b": 1, "c": 2}))
    sc = run.slot("c")
    assert calls == [(sa, 3, [6], 0), (sc, 0, [1, 2, 3, 5], 3)]
    assert run.blocks("a") == 4 and run.blocks("b") == 3 and run.blocks("c") == 4
    run.end_step()
    # step 3: b preempted (released); step 4: b resumed with its new block list and a hit
    calls.clear()
    hooked.step(_output(cached=[("a", None, 71)], preempted=["b"], scheduled={"a": 1}))
    assert "b" not in run._slot_of and calls == []
    run.end_step()
    hooked.step(_output(cached=[("b", [1, 2, 7], 2 * B)], resumed=["b"], scheduled={"b": 11}))
    assert calls == [(run.slot("b"), 0, [1, 2, 7], 2)] and run.blocks("b") == 3
    run.end_step()
    # finished: released, its block count forgotten
    hooked.step(_output(finished=["a", "b", "c"]))
    assert run._slot_of.as_dict() == {} and run._blocks == {}


def test_update_hook_hands_vllms_block_copies_to_the_runtime(hooked):
    hooked.step(_output(new=[_new("a", [1, 2])], scheduled={"a": 2 * B}))
    hooked.runtime.end_step()
    hooked.step(_output(new=[_new("b", [1, 5], B + 3)], scheduled={"b": B - 3}, copies=[(2, 5)]))
    assert hooked.runtime.cache.metrics()["blocks_copied"] == 1


def test_update_hook_refuses_blocks_of_several_groups(hooked):
    out = _output(scheduled={"a": 3})
    out.scheduled_new_reqs = [SimpleNamespace(req_id="a", block_ids=([1], [2]), num_computed_tokens=0)]
    with pytest.raises(UnsupportedError, match="2 KV cache groups"):
        hooked.step(out)


@pytest.mark.parametrize("order", [["a", "x"], ["x", "a"]])
def test_one_steps_releases_place_alike_whatever_order_vllm_lists_them(order):
    # vLLM passes finished ids as a set: its order differs per process (string hashing), so the
    # placement must not follow it, or tensor-parallel ranks would place the same blocks apart
    run = rt.VattnRuntime(rt.config_from_vllm(_vllm_config(), device="cpu", num_blocks=40), block_size=B)
    try:
        run.bind_blocks([("a", [1, 2], 0), ("x", [5, 6], 0)], [])
        first = min(run.slot("a"), run.slot("x"))   # released together: the lower slot goes first
        run.finish(order)
        run.bind_blocks([("n", [8, 9], 0)], [])
        assert run.slot("n") == first
        run.cache.audit()
    finally:
        run.close()
