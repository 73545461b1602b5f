"""SGLang's radix cache on vattn's pool: its own classes drive shared-prefix admission, eviction,
preemption and free; every request's region must hold exactly its tokens' K/V after every
forward (one physical page-set mapped into several regions), and nothing may leak."""

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.radix_cache", reason="sglang (CPU import set) not installed")

from tests.adapters.sglang._engine import PAGE, TOKEN_BYTES, Engine, new_req  # noqa: E402
from vattn.core.errors import SlotError, UnsupportedError, VattnError  # noqa: E402

P = list(range(100, 140))                         # a 40-token prompt: 2 whole pages + 8 tokens


def settle(engine):
    """One empty forward's worth of bookkeeping: departed rows release their slots."""
    engine.pool.requests.prepare([], [])


def test_shared_prefix_admission_maps_the_cached_pages_into_both_regions():
    e = Engine()
    a = new_req(P + [1, 2, 3])
    assert e.admit([a]) == [0]
    e.decode([a])
    e.finish(a)                                    # P's two whole pages go to the tree
    b, d = new_req(P + [5] * 10), new_req(P + [6] * 30)
    assert e.admit([b, d]) == [2 * PAGE, 2 * PAGE]  # page-aligned hits, one batch
    m = e.cache.metrics()
    assert m["prefix_hits"] == 4 and m["pages_aliased"] > 0
    for _ in range(3):
        e.decode([b, d])
    pool = e.cache._pool
    ids = e.r2t.req_to_token[b.req_pool_idx, :2 * PAGE:PAGE].tolist()
    assert ids == e.r2t.req_to_token[d.req_pool_idx, :2 * PAGE:PAGE].tolist()
    pids = [e.cache._keys.get(i // PAGE) for i in ids]
    assert all(pool.refs[p] >= 3 for ps in pids for p in ps)   # key + two mappings at least
    e.cache.audit()
    for r in (b, d):
        e.finish(r)
    settle(e)
    e.cache.audit()


def test_next_turn_gets_the_idle_slot_where_its_conversation_is_mapped():
    e = Engine()
    b = new_req(P + [5] * 25)
    e.admit([b])
    e.decode([b])
    slot = e.slot_of(b)
    e.finish(b)
    settle(e)
    turn = new_req(b.origin_input_ids + b.output_ids + [9] * 20)
    before = e.cache.metrics()
    assert e.admit([turn]) == [4 * PAGE]            # 66 tokens cached -> 4 whole pages hit
    after = e.cache.metrics()
    assert e.slot_of(turn) == slot                  # found in place: nothing mapped for it
    assert after["pages_aliased"] == before["pages_aliased"]
    e.finish(turn)
    settle(e)
    e.cache.audit()


def test_eviction_forgets_keys_and_an_idle_engine_has_every_token_back():
    e = Engine()
    reqs = [new_req(P + [i] * (20 + 7 * i)) for i in range(3)]
    e.admit(reqs)
    e.decode(reqs)
    for r in reqs:
        e.finish(r)
    settle(e)
    held = e.cache.metrics()["keys_held"]
    assert held > 0 and e.tree.evictable_size() > 0
    assert e.idle_free() == e.alloc.size            # SGLang's _check_full_pool
    e.evict_all()
    assert e.cache.metrics()["keys_held"] == 0
    assert e.alloc.available_size() == e.alloc.size
    e.alloc._debug_check_no_duplicate_pages()       # every page id freed exactly once
    e.cache.audit()


def test_preempted_sharer_frees_only_its_own_pages_and_re_hits():
    e = Engine()
    a = new_req(P + [1])
    e.admit([a])
    e.finish(a)
    b, c = new_req(P + [2] * 20), new_req(P + [3] * 5)
    e.admit([b])
    e.decode([b])
    e.retract(b)                                    # preempted while sharing A's prefix
    settle(e)
    assert e.tree.evictable_size() == 2 * PAGE      # the shared prefix stays in the tree
    assert e.admit([c]) == [2 * PAGE]
    assert e.admit([b]) == [2 * PAGE]               # back: hits the prefix again
    e.decode([b, c])
    for r in (b, c):
        e.finish(r)
    settle(e)
    e.evict_all()
    assert e.alloc.available_size() == e.alloc.size
    e.cache.audit()


@pytest.mark.parametrize("defer", [False, True])
def test_duplicates_freed_while_their_writer_reads_them_are_held_back(defer):
    e = Engine(defer_frees=defer)
    a, x = new_req(P + [1] * 8), new_req(P + [1] * 8)   # same prompt, one batch: both miss
    e.admit([a, x])
    free_before = e.alloc.available_size()
    e.unfinished(a)                                  # A inserts first
    e.unfinished(x)                                  # X's copies are duplicates: freed by SGLang
    requests = e.pool.requests
    assert e.alloc.available_size() == free_before   # X still reads its own 3 pages: not free
    assert requests.held_pages() == 3                # (deferred: settled by that count)
    for _ in range(4):
        e.decode([a, x])                             # X reads its own copy: still exact
    e.finish(x)
    assert requests.held_pages() == 0
    e.finish(a)
    settle(e)
    e.evict_all()
    assert e.alloc.available_size() == e.alloc.size
    e.cache.audit()


def test_a_released_slot_reused_from_position_zero_leaves_the_tree_pages_intact():
    """The failure of slot-address indices: A's slot goes to an unrelated E that writes from
    position 0; F hitting A's prefix must still read A's K/V."""
    e = Engine(reqs=2)
    a = new_req(P + [1] * 30)
    e.admit([a])
    slot = e.slot_of(a)
    e.finish(a)
    settle(e)
    other = new_req(list(range(500, 560)))
    e.admit([other])
    assert e.slot_of(other) == slot or e.cache.config.max_slots > 3
    e.decode([other])
    f = new_req(P + [4] * 3)
    assert e.admit([f]) == [2 * PAGE]
    e.decode([f, other])
    assert e.cache.metrics()["page_sets_moved"] + e.cache.metrics()["pages_aliased"] > 0
    e.cache.audit()


def test_free_of_a_finished_request_after_the_next_forward_is_ordered():
    """Overlap scheduling: batch N+1 (with the request that finished in N, one extra decode) is
    prepared before N's results free it; its slot is released at the forward after."""
    e = Engine()
    a, b = new_req(P + [1] * 12), new_req(P + [2] * 12)
    e.admit([a, b])
    e.decode([a, b])                                 # N: A finishes here
    e.decode([a, b])                                 # N+1 prepared, A still in it
    slot = e.slot_of(a)
    e.finish(a)                                      # N's results processed now
    assert slot not in e.alloc.live_slots()          # A has left ...
    assert e.cache._active[slot]                     # ... but N+1 may still read its slot
    e.decode([b])                                    # N+2: A's slot released first
    assert not e.cache._active[slot]
    e.finish(b)
    settle(e)
    e.cache.audit()


def test_bad_input_is_refused_with_typed_errors():
    e = Engine()
    a = new_req(P)
    e.admit([a])
    requests = e.pool.requests
    with pytest.raises(VattnError, match="whole pages"):
        requests.prepare([a.req_pool_idx + 1], [40], [5])        # new row, unaligned prefix
    with pytest.raises(VattnError, match="never had an extend"):
        requests.prepare([a.req_pool_idx + 1], [41])             # decode of an unknown row
    row = a.req_pool_idx + 1
    e.r2t.req_to_token[row, :2 * PAGE] = torch.arange(60 * PAGE, 62 * PAGE, dtype=torch.int32)
    with pytest.raises(SlotError, match="no page-set holds"):
        requests.prepare([row], [2 * PAGE + 1], [2 * PAGE])      # a hit on ids never bound
    e.cache.audit()


def test_a_page_claimed_in_decode_is_named_before_its_free_and_hit_after_it():
    """A decode step entering a new page claims it and learns its id one step later; a free of
    that id in between (a retract) names it first, so nothing leaks; a later request hits a page
    that was claimed this way."""
    e = Engine()
    requests = e.pool.requests
    a = new_req(P)
    e.admit([a])
    for _ in range(9):                                   # 40 -> 49 tokens: page 3 is entered
        e.decode([a])
    assert len(requests.late) == 1 and requests.device_reads == 0
    page = int(e.r2t.req_to_token[a.req_pool_idx, 3 * PAGE]) // PAGE
    assert not e.cache.holds(page)                       # claimed, not named yet
    e.retract(a)                                         # frees it: named, then forgotten
    assert not requests.late and not e.cache.holds(page)
    settle(e)
    e.evict_all()
    assert e.alloc.available_size() == e.alloc.size and e.cache.metrics()["keys_held"] == 0
    b = new_req(P)
    e.admit([b])
    for _ in range(25):                                  # 40 -> 65: pages 3 and 4 claimed
        e.decode([b])
    e.finish(b)
    c = new_req(b.get_fill_ids() + [5, 6])
    assert e.admit([c]) == [4 * PAGE]                    # hits page 3, claimed in decode
    e.cache.audit()


def test_deferred_frees_settle_when_sglang_next_counts_or_allocates():
    """On the GPU freed page ids reach the host without waiting; they are settled (keys
    forgotten, ids back on SGLang's free list) when SGLang next asks for its free size or
    allocates, not counted free before."""
    e = Engine(radix=False, defer_frees=True)
    a = new_req(P)
    e.admit([a])
    e.decode([a])                                        # names a's 3 claimed pages
    assert e.cache.metrics()["keys_held"] == 3
    e.finish(a)                                          # ChunkCache frees all of them
    assert len(e.alloc._limbo) == 1 and len(e.alloc.free_pages) == e.alloc.size // PAGE - 3
    assert e.cache.metrics()["keys_held"] == 3           # not settled yet
    e.admit([new_req(P[::-1])])                          # its allocation settles them first
    assert not e.alloc._limbo and e.cache.metrics()["keys_held"] == 0
    b = new_req(P)
    e.admit([b])
    e.finish(b)
    assert e.alloc._limbo
    assert e.alloc.available_size() == e.alloc.size - 3 * PAGE   # settled by the count itself
    assert not e.alloc._limbo
    e.cache.audit()


@pytest.mark.parametrize("radix,rids,defer", [(True, True, True), (False, True, True),
                                               (True, False, False), (True, True, False)])
def test_many_requests_churn_without_leaks(radix, rids, defer):
    """Random admission / decode / finish / retract / evict against SGLang's classes, with
    prompts sharing prefixes of varied lengths (not multiples of the page); with request ids
    in the forward batches (SGLang's) decode never reads rows from the device, without them it
    reads them every step. ``defer``: freed page ids are settled at the next allocation (the
    GPU's way), so SGLang's checks see them free before vattn has forgotten them."""
    e = Engine(reqs=5, page_sets=24, radix=radix, rids=rids, defer_frees=defer)
    hit_admissions = _churn(e, 5 if radix else 6)
    reads = e.pool.requests.device_reads
    assert hit_admissions > 0 or not radix
    # with request ids nothing is read: rows by id, hit page ids copied when SGLang handed the
    # row out (from the radix nodes it matched); without them rows and hits are read
    assert reads == 0 if rids else reads > hit_admissions
    e.alloc.drain_frees(wait=True)
    assert e.alloc.available_size() == e.alloc.size and e.cache.metrics()["keys_held"] == 0
    e.cache.audit()


def test_churn_with_packs_maps_shared_runs_from_them_and_corrupts_nothing():
    """The churn with packs on (runs of 2 page-sets): SGLang's radix hits map packed runs, every
    request's K/V is still exactly its own after every forward, nothing leaks."""
    e = Engine(reqs=5, page_sets=24, radix=True, defer_frees=True, packs=True)
    assert _churn(e, 7) > 0         # a seed whose churn hits a packed run (most hit warm slots)
    m = e.cache.metrics()
    assert m["packs_built"] > 0 and m["pages_packed"] > 0, m
    e.alloc.drain_frees(wait=True)
    assert e.alloc.available_size() == e.alloc.size
    e.cache.audit()


def test_churn_with_driver_faults_is_retried_and_corrupts_nothing():
    """The churn with the cache's driver failing 20 % of its map and set-access calls: each
    failed call is retried within the forward and every request's K/V is still exactly its own
    after every forward (Engine.check), nothing leaks."""
    from vattn.core.driver import FaultInjector, HostDriver
    driver = FaultInjector(HostDriver(granularity=PAGE * TOKEN_BYTES))
    e = Engine(reqs=5, page_sets=24, radix=True, defer_frees=True, driver=driver)
    # a retry re-runs every driver call of its operation (a prefix hit maps and grants access
    # to a run of pages), so at 20 % a call, several attempts in a row may fail
    e.pool.requests.retry.retries = 10
    driver.arm_rate("map", 0.2, seed=1)
    driver.arm_rate("set_access", 0.2, seed=2)
    _churn(e, 7)
    assert driver.injected["map"] > 0 and driver.injected["set_access"] > 0
    # every injected failure was retried, except those absorbed while a failed replacement
    # was undone (the old page mapped back: that call may fail too, and is not retried)
    undo = e.cache.metrics()["undo_faults"]
    assert e.pool.requests.retry.retried + undo == sum(driver.injected.values())
    e.cache.audit()


def test_a_driver_call_that_keeps_failing_fails_the_forward_and_says_why():
    from vattn.core.driver import FaultInjector, HostDriver
    from vattn.core.errors import DriverError
    driver = FaultInjector(HostDriver(granularity=PAGE * TOKEN_BYTES))
    e = Engine(reqs=4, page_sets=12, radix=True, driver=driver)
    e.cache.reclaim(e.cache.capacity().reclaimable_pages)   # nothing pre-warmed: admission maps
    e.pool.requests.retry.retries = 1
    driver.arm_rate("map", 1.0)
    with pytest.raises(DriverError) as info:
        e.admit([new_req(P)])
    assert "still failing after 1 retries; VATTN_DRIVER_RETRIES" in "".join(info.value.__notes__)
    assert e.pool.requests.retry.retried == 1


def _churn(e, seed: int) -> int:
    """Random admission / decode / finish / retract / evict on ``e``, audited after every step,
    everything finished and settled at the end; returns the admissions that hit a prefix."""
    import random
    rng = random.Random(seed)
    prefixes = [list(range(1000 + 97 * i, 1000 + 97 * i + n)) for i, n in enumerate((21, 37, 50))]
    running, hit_admissions = [], 0
    for step in range(60):
        roll = rng.random()
        if roll < 0.35 and len(running) < 4:
            req = new_req(rng.choice(prefixes) + [rng.randrange(50)] * rng.randrange(1, 20))
            if e.idle_free() > len(req.origin_input_ids) + 4 * PAGE:
                hit_admissions += e.admit([req])[0] > 0
                running.append(req)
        elif roll < 0.8 and running:
            if all(len(r.get_fill_ids()) < 120 for r in running) and e.idle_free() > 4 * PAGE:
                e.decode(running)
        elif running:
            req = running.pop(rng.randrange(len(running)))
            (e.retract if roll > 0.95 else e.finish)(req)
        e.cache.audit()
    for req in running:
        e.finish(req)
    settle(e)
    e.evict_all()
    assert e.alloc.available_size() == e.alloc.size
    assert e.pool.requests.held_pages() == 0
    return hit_admissions


def test_a_model_that_stores_kv_itself_is_refused():
    """SGLang's fused RoPE + KV store writes at SGLang's indices (page names here): refused."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    e = Engine()
    a = new_req(P)
    e.admit([a])
    fb = type("FB", (), {})()
    fb.forward_mode = ForwardMode.DECODE
    layer = e.layers[0]
    k = torch.zeros(1, 2, 32)
    with pytest.raises(UnsupportedError, match="writes its KV cache itself"):
        e.backend.forward_decode(torch.zeros(1, 4 * 32), k, k, layer, fb, save_kv_cache=False)


def test_hit_page_ids_come_from_the_radix_nodes_and_follow_a_split():
    """A new request's hit page ids are copied from the radix nodes it matched when SGLang hands
    it a row (nothing read from the device at its extend); a node split afterwards (another
    prompt sharing only its first page) gives the node a new value, and the next request that
    matches it takes fresh copies. Every request's K/V is checked after every forward."""
    e = Engine(reqs=6, page_sets=40)
    base = list(range(500, 500 + 3 * PAGE + 5))
    a = new_req(base)
    e.admit([a])
    e.decode([a])
    e.finish(a)                                       # 3 whole pages in the tree: one node
    b = new_req(base[:3 * PAGE] + [7, 8])
    assert e.admit([b]) == [3 * PAGE]                 # hits the node: ids from its host copy
    c = new_req(base[:PAGE] + list(range(900, 930)))
    assert e.admit([c]) == [PAGE]                     # splits the node after its first page
    d = new_req(base[:3 * PAGE] + [9])
    assert e.admit([d]) == [3 * PAGE]                 # both halves, the lower one copied anew
    for _ in range(3):
        e.decode([b, c, d])
    assert e.pool.requests.device_reads == 0 and e.pool.requests.hit_ids.waits == 0
    assert e.slot_of(b) != e.slot_of(d)
    for req in (b, c, d):
        e.finish(req)
    e.cache.audit()


@pytest.mark.parametrize("stage", [True, False])
def test_a_burst_on_one_prefix_is_staged_into_idle_slots(stage, monkeypatch):
    """Two new requests hit the tree's prefix in one batch: with map-ahead on, the prefix is
    mapped into two empty idle slots on the worker, and the next two requests with it are handed
    those slots and map nothing for their hit; every region holds exactly its tokens."""
    monkeypatch.setenv("VATTN_STAGE_PREFIXES", "1" if stage else "0")
    e = Engine(reqs=8, map_ahead=PAGE)
    assert e.pool.requests.staging is stage
    a = new_req(P + [1, 2, 3])
    e.admit([a])
    e.finish(a)
    first = [new_req(P + [5 + i] * 10) for i in range(2)]
    assert e.admit(first) == [2 * PAGE] * 2
    e.cache.wait()
    before = e.cache.metrics()
    later = [new_req(P + [9 + i] * 10) for i in range(2)]
    assert e.admit(later) == [2 * PAGE] * 2
    after = e.cache.metrics()            # the worker may be staging for this batch meanwhile
    ranges = e.cache.layout.num_ranges
    on_path = (after["pages_aliased"] - before["pages_aliased"]
               - (after["page_sets_staged"] - before["page_sets_staged"]) * ranges)
    if stage:
        assert before["page_sets_staged"] >= 4 and on_path == 0
    else:
        assert after["page_sets_staged"] == 0 and on_path == 2 * 2 * ranges
    e.decode(first + later)
    e.cache.audit()
    for r in first + later:
        e.finish(r)
    settle(e)
    e.cache.wait()
    e.cache.audit()


@pytest.mark.parametrize("packs,env,staging", [(False, None, True), (True, None, False),
                                               (True, "1", True), (False, "0", False)])
def test_staging_is_off_by_default_with_packs(packs, env, staging, monkeypatch):
    """Staging maps a burst's prefix page by page into idle slots, so packs would never serve
    it: with packs it is off unless VATTN_STAGE_PREFIXES=1 asks for it."""
    if env is None:
        monkeypatch.delenv("VATTN_STAGE_PREFIXES", raising=False)
    else:
        monkeypatch.setenv("VATTN_STAGE_PREFIXES", env)
    e = Engine(map_ahead=PAGE, packs=packs)
    assert e.pool.requests.staging is staging
