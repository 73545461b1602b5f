"""Deferred mapping in the SGLang adapter: the VMM calls of a forward's preparation are queued
per VA range and made by the attention backend as the forward reaches each layer (all of them
before a decode graph replay); SGLang's own memory classes drive the pool as in test_radix.py,
every request's K/V checked after every forward, nothing left queued after one."""

import pytest

pytest.importorskip("sglang.srt.mem_cache.radix_cache", reason="sglang (CPU import set) not installed")

from tests.adapters.sglang._engine import PAGE, TOKEN_BYTES, Engine, new_req  # noqa: E402
from tests.adapters.sglang.test_radix import _churn  # noqa: E402
from vattn.core.deferred import DeferredCallError  # noqa: E402

#: counters that depend on what SGLang asked for, not on when the calls were made
SAME = ("keys_bound", "prefix_hits", "pages_aliased", "pages_packed", "packs_built")


def _queued_per_layer(e) -> list[tuple[int | None, int]]:
    """Record ``(layer, calls still queued)`` after each :meth:`RowSlots.ready` of ``e``."""
    seen, ready = [], e.pool.requests.ready

    def logged(layer=None):
        ready(layer)
        seen.append((layer, e.cache.calls_queued))
    e.pool.requests.ready = logged
    return seen


def test_churn_deferred_binds_the_same_pages_and_makes_calls_layer_by_layer():
    """The packed churn with and without deferral: the same keys, hits, aliases and packs; with
    it, calls were deferred, some still waited after layer 0 (made at layer 1's range), none
    after a forward (the engine asserts it), every request's K/V exact, nothing leaked."""
    plain = Engine(reqs=5, page_sets=24, radix=True, defer_frees=True, packs=True)
    deferred = Engine(reqs=5, page_sets=24, radix=True, defer_frees=True, packs=True, defer_mapping=True)
    seen = _queued_per_layer(deferred)
    assert _churn(plain, 7) == _churn(deferred, 7) > 0
    got, want = deferred.cache.metrics(), plain.cache.metrics()
    assert {k: got[k] for k in SAME} == {k: want[k] for k in SAME}
    assert want["calls_deferred"] == 0 and got["calls_deferred"] > 0
    assert any(layer == 0 and queued for layer, queued in seen), "nothing waited past layer 0"
    for e in (plain, deferred):
        e.alloc.drain_frees(wait=True)
        assert e.alloc.available_size() == e.alloc.size
        e.cache.audit()


def test_a_decode_graph_replay_finds_every_call_made():
    """Decode through the platform's graph runner: the backend makes every deferred call when it
    loads the batch (a replay runs no layer's Python), so the first layer finds none queued."""
    e = Engine(reqs=4, radix=True, graphs=True, defer_mapping=True)
    seen = _queued_per_layer(e)
    a = new_req(list(range(100, 100 + 2 * PAGE - 1)))   # decode grows it into a third page-set
    e.admit([a])
    seen.clear()
    for _ in range(3):
        e.decode([a])
    assert (None, 0) in seen and all(q == 0 for _, q in seen), seen
    e.finish(a)
    e.cache.audit()


def test_a_deferred_call_that_fails_fails_the_forward_with_a_typed_error():
    """A map made at a layer's turn that fails is final: the forward raises DeferredCallError
    (SGLang cannot hand one request back), naming the call; the cache refuses later calls."""
    from vattn.core.driver import FaultInjector, HostDriver
    driver = FaultInjector(HostDriver(granularity=PAGE * TOKEN_BYTES))
    e = Engine(reqs=3, radix=True, driver=driver, defer_mapping=True)
    a = new_req(list(range(10, 10 + 2 * PAGE)))
    e.admit([a])
    e.unfinished(a)                                    # its pages in the tree, a still running
    driver.arm_rate("map", 1.0)
    with pytest.raises(DeferredCallError, match="engine must be restarted") as err:
        e.admit([new_req(a.origin_input_ids + [1, 2, 3])])   # its hit is mapped into a new slot
    assert err.value.call == "map"
    with pytest.raises(DeferredCallError):
        e.cache.issue()
