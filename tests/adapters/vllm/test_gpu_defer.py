"""Deferred mapping in the vLLM GPU runtime, on the host backend (no vLLM needed): a step's VMM
calls wait for the forward and are made range by range as its layers come; the engine config
check that decides whether the backend's layers run where they can make them."""

import json
from types import SimpleNamespace

import pytest
import torch

from vattn.adapters.vllm import gpu_layout as gl
from vattn.adapters.vllm.gpu_runtime import GpuRuntime
from vattn.core.deferred import DeferredCallError
from vattn.core.driver import FaultInjector, HostDriver

NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
# (map / access / unmap counts depend on when the map-ahead worker runs: not compared)
COUNTED = ("pages_aliased", "keys_bound", "prefix_hits", "pages_packed")


def _runtime(defer, driver=None):
    cfg = gl.cache_config(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.float32, num_blocks=12,
                          max_num_reqs=4, max_model_len=4000, device="cpu", group_size=2)
    block = gl.tokens_per_page(num_kv_heads=2, head_dim=64, dtype=torch.float32, group_size=2)
    return GpuRuntime(cfg, block_size=block, layer_names=NAMES, max_num_tokens=64, max_model_len=4000,
                      prefix_caching=True, defer_mapping=defer, driver=driver)


def _steps(rt):
    """Two requests, the second hitting the first's two blocks, then both grow; after each
    step the forward plays the backend's calls (every layer's range before the layer) and
    writes and reads every layer's KV of the step's requests."""
    seen = []
    for blocks in ([(0, 2, [0, 1], 0)], [(1, 3, [0, 1, 2], 2)], [(0, 3, [3], 0), (1, 4, [4], 0)]):
        for index, n, ids, hits in blocks:
            rt.on_blocks(index, n, new_request=index not in rt._slot, block_ids=ids, hits=hits)
        rt.apply()
        for layer in range(4):
            rt.ready(layer)
            kv = rt.kv_view(layer)                          # [2, slots + 1, rows, H, D]
            for index, n, _, _ in blocks:
                rows = n * rt.block_size
                kv[:, rt.slot(index), rows - 1] = float(10 * layer + index)
                seen.append(kv[:, rt.slot(index), :rows].sum().item())
        seen.append(rt.cache.calls_queued)
    return seen, {k: rt.cache.metrics()[k] for k in COUNTED}


def test_the_same_steps_alias_the_same_blocks_deferred_or_not_and_read_the_same_kv():
    plain, deferred = _runtime(False), _runtime(True)
    try:
        (kv_plain, calls_plain), (kv_deferred, calls_deferred) = _steps(plain), _steps(deferred)
        assert kv_plain == kv_deferred and calls_plain == calls_deferred
        assert calls_plain["pages_aliased"] > 0
        assert plain.cache.metrics()["calls_deferred"] == 0
        assert deferred.cache.metrics()["calls_deferred"] > 0
        deferred.cache.audit()
    finally:
        plain.close()
        deferred.close()


def test_ready_makes_a_layers_range_and_those_before_it():
    rt = _runtime(True)
    try:
        rt.on_blocks(0, 3, new_request=True, block_ids=[0, 1, 2])
        rt.apply()
        queued = rt.cache.calls_queued
        assert queued > 0
        rt.ready(1)                                         # layers 0-1: range 0
        left = rt.cache.calls_queued
        assert 0 < left < queued
        rt.ready(2)                                         # layers 2-3: range 1
        assert rt.cache.calls_queued == 0
        rt.ready(3)                                         # nothing left: no call
        rt.ready()
    finally:
        rt.close()


def test_a_deferred_call_that_fails_stops_the_step_loudly():
    injector = FaultInjector(HostDriver(granularity=gl.PAGE_BYTES))
    rt = _runtime(True, driver=injector)
    try:
        injector.arm("map", injector.calls["map"] + 1)
        rt.on_blocks(0, 3, new_request=True, block_ids=[0, 1, 2])
        rt.apply()                                          # queued: nothing failed yet
        with pytest.raises(DeferredCallError, match="engine must be restarted"):
            rt.ready(0)
        with pytest.raises(DeferredCallError):
            rt.apply()
    finally:
        rt.close()                                          # best effort, raises nothing
        injector.inner.close()


def _vllm_config(mode="FULL_AND_PIECEWISE", split=gl.KV_OPS, eager=False):
    return SimpleNamespace(compilation_config=SimpleNamespace(cudagraph_mode=SimpleNamespace(name=mode),
                                                              splitting_ops=list(split)),
                           model_config=SimpleNamespace(enforce_eager=eager))


@pytest.mark.parametrize("config, ok", [
    (_vllm_config(), True),                                  # vLLM 0.26's default
    (_vllm_config("PIECEWISE"), True),
    (_vllm_config("FULL_DECODE_ONLY", split=()), True),      # mixed steps eager, full replays hooked
    (_vllm_config("FULL", split=()), True),
    (_vllm_config("NONE", split=()), True),
    (_vllm_config(split=("vllm::unified_attention_with_output",)), False),   # the store inside a graph
    (_vllm_config(split=()), False),
    (_vllm_config(split=(), eager=True), True),
    (SimpleNamespace(model_config=None), False),
])
def test_deferred_mapping_only_where_every_layer_runs_the_backend(config, ok):
    got, why = gl.defer_mapping_for(config)
    assert got is ok and (bool(why) is not ok)


def test_a_repeated_prompt_returns_to_its_own_slot_and_its_copy_on_write_is_elided():
    """A 1B-class shape: the shared system prompt fills whole blocks, so a repeated prompt's last
    hit block is the shared one, mapped in every earlier request's slot. Its copy-on-write reads
    its *own* cached last block: the slot is chosen in ``apply`` (vLLM sends the copies after the
    blocks), at that block's home, so the copy is elided there (and vLLM's cache stays intact)."""
    rt = _runtime(defer=True)
    try:
        shared, own = 1, [2, 3, 4]
        for i, block in enumerate(own):                  # generation 1: [shared, own] each
            rt.on_blocks(i, 2, new_request=True, block_ids=[shared, block], hits=1 if i else 0)
        rt.apply()
        rt.ready()
        first = {block: rt.slot(i) for i, block in enumerate(own)}
        for i in range(3):
            rt.release(i)
        fresh = [5, 6, 7]
        for j, block in enumerate(reversed(own)):        # generation 2, in another order
            rt.on_blocks(j, 2, new_request=True, block_ids=[shared, fresh[j]], hits=1)
        rt.copy_blocks([(block, fresh[j]) for j, block in enumerate(reversed(own))])
        rt.apply()
        rt.ready()
        assert [rt.slot(j) for j in range(3)] == [first[b] for b in reversed(own)]
        assert rt.cache.metrics()["copies_elided"] == 3
        rt.cache.audit()
    finally:
        rt.close()


def test_step_snapshots_leave_the_trace_to_the_idle_ones(tmp_path, monkeypatch):
    """Under ``VATTN_METRICS`` a snapshot is taken on the step's path every few seconds; writing
    the whole step trace there would stall a serving engine's step, so only idle snapshots (and
    metrics() / close()) write it."""
    trace = tmp_path / "steps.json"
    monkeypatch.setenv("VATTN_STEP_TRACE", str(trace))
    monkeypatch.setenv("VATTN_METRICS", str(tmp_path / "m.json"))
    monkeypatch.setenv("VATTN_METRICS_EVERY_S", "0")
    rt = _runtime(True)
    try:
        _steps(rt)
        snap = rt.snapshot()
        assert snap["requests_holding_slots"] == 2 and not trace.exists()
        rt.snapshots.idle()
        assert trace.exists() and json.loads(trace.read_text())["rows"]
    finally:
        rt.close()
