"""Slot tables and the GPU runtime on CPU tensors / the host VMM backend (no vLLM needed)."""

import os

import numpy as np
import pytest
import torch

from vattn.adapters.vllm import gpu_layout as gl
from vattn.adapters.vllm.gpu_runtime import GpuRuntime
from vattn.adapters.vllm.slot_tables import PAD_ROW, SlotTables
from vattn.core import ops
from vattn.core.errors import ConfigError, SlotError, VattnError


def _tables(rows=97, reqs=9, tokens=64, fused=False):
    t = SlotTables(max_num_reqs=reqs, max_num_tokens=tokens, rows_per_slot=rows, padding_slot=11,
                   device="cpu")
    if fused:                                  # the CUDA form, on Triton's CPU interpreter
        pytest.importorskip("triton")
        t.fused = True
        t.slot_mapping.fill_(123)             # warm_up must leave the buffer all padding
        t.warm_up()
        assert t.fused and (t.slot_mapping == PAD_ROW).all()
    return t


# "fused": the one-launch Triton slot mapping used on CUDA; CI runs it on the CPU interpreter
FUSED = [pytest.param(False, id="torch"), pytest.param(True, id="triton_interpreter", marks=pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="set TRITON_INTERPRET=1 to run the Triton "
    "slot-mapping kernel on the CPU interpreter"))]


@pytest.mark.parametrize("fused", FUSED)
def test_block_table_and_slot_mapping_match_reference(fused):
    t = _tables(fused=fused)
    for index, slot in {0: 3, 2: 0, 4: 7, 6: 10}.items():
        t.assign(index, slot)
    t.upload()
    idx = torch.tensor([4, 0, 6, 2, 1], dtype=torch.int32)          # batch row -> request index
    lens = [1, 1, 5, 3, 2]                                          # decode, decode, chunks
    starts = [40, 12, 0, 90, 7]                                     # first position of each row
    qsl = torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32)
    qsl_padded = torch.cat([qsl, qsl[-1:].repeat(3)])               # FULL-graph padding rows
    pos = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)] + [torch.zeros(9, dtype=torch.int64)])
    bt = t.gather_block_table(idx, num_reqs_padded=8)
    assert bt.shape == (8, 1) and bt.dtype == torch.int32
    expect_slots = [7, 3, 10, 0, 11]                                 # index 1 holds none: padding slot
    assert bt[:, 0].tolist() == expect_slots + [11, 11, 11]
    sm = t.compute_slot_mapping(idx, qsl_padded, pos, num_tokens_padded=16)
    assert sm.shape == (1, 16) and sm.dtype == torch.int64
    ref = [s * 97 + p for s, st, n in zip(expect_slots, starts, lens) for p in range(st, st + n)]
    assert sm[0].tolist() == ref + [PAD_ROW] * (16 - len(ref))
    assert (t.slot_mapping[0, 16:] == PAD_ROW).all()
    assert bt.data_ptr() == t.block_table.data_ptr() and sm.data_ptr() == t.slot_mapping.data_ptr()


@pytest.mark.parametrize("fused", FUSED)
def test_stale_slot_mapping_is_cleared_and_dummies_pad(fused):
    t = _tables(fused=fused)
    t.assign(0, 1)
    t.upload()
    idx = torch.tensor([0], dtype=torch.int32)
    t.compute_slot_mapping(idx, torch.tensor([0, 30], dtype=torch.int32), torch.arange(64), 30)
    sm = t.compute_slot_mapping(idx, torch.tensor([0, 1], dtype=torch.int32), torch.arange(64), 2)
    assert sm[0].tolist() == [97, PAD_ROW] and (t.slot_mapping[0, 2:] == PAD_ROW).all()
    assert (t.dummy_block_table(5) == 11).all()
    assert (t.dummy_slot_mapping(9) == PAD_ROW).all()


@pytest.mark.parametrize("fused", FUSED)
def test_slot_mapping_for_every_batch_size_class(fused):
    """num_reqs == 1, a multiple of 16 and other sizes: one kernel (no per-class variant) serves all."""
    t = _tables(reqs=40, tokens=64, fused=fused)
    for index in range(33):
        t.assign(index, index % 11)
    t.upload()
    for n in (1, 16, 5, 32, 33):
        idx = torch.arange(n, dtype=torch.int32).flip(0)
        qsl = torch.arange(n + 1, dtype=torch.int32)          # one decode token per row
        pos = torch.arange(64) + 3
        sm = t.compute_slot_mapping(idx, qsl, pos, num_tokens_padded=n)
        assert sm[0].tolist() == [(int(i) % 11) * 97 + r + 3 for r, i in enumerate(idx)], n
        assert (t.slot_mapping[0, n:] == PAD_ROW).all()


def _break_kernel(monkeypatch, name: str, message: str) -> None:
    """Make ``slot_kernels.<name>`` raise, as a Triton that cannot compile would."""
    pytest.importorskip("triton")
    from vattn.adapters.vllm import slot_kernels

    def broken(*args, **kwargs):
        raise RuntimeError(message)
    monkeypatch.setattr(slot_kernels, name, broken)


def test_warm_up_failure_falls_back_loudly(monkeypatch):
    _break_kernel(monkeypatch, "warm_up", "no compiler here")
    t = _tables()
    t.fused = True
    with pytest.warns(UserWarning, match="no compiler here"):
        t.warm_up()
    assert not t.fused and "no compiler here" in t.fused_error


def test_upload_only_when_changed_and_clear():
    t = _tables()
    t.assign(3, 2)
    t.upload()
    t.slot_of_index[3] = 5          # a host change without assign() is not uploaded
    t.upload()
    assert t._slot_dev[3].item() == 2
    t.clear(3)
    t.upload()
    assert t._slot_dev[3].item() == 11
    with pytest.raises(SlotError):
        t.assign(0, 11)


def test_uploads_cycle_the_staging_ring_and_each_matches_its_step():
    """Every upload lands the table as it was at that upload, through a ring of reused staging
    buffers (more uploads than buffers), and later host changes never reach an earlier copy."""
    from vattn.adapters.vllm.slot_tables import STAGING_RING
    t = _tables(reqs=9)
    rng = np.random.default_rng(3)
    buffers = {b.data_ptr() for b in t._staging}
    for step in range(3 * STAGING_RING + 1):
        for index in rng.choice(9, size=3, replace=False):
            t.assign(int(index), int(rng.integers(0, 11)))
        t.clear(int(rng.integers(0, 9)))
        expected = t.slot_of_index.copy()
        t.upload()
        assert t._slot_dev.tolist() == expected.tolist(), step
        t.slot_of_index[:] = 7               # a host change after the upload reaches no copy
        assert t._slot_dev.tolist() == expected.tolist()
        t.slot_of_index[:] = expected
    assert {b.data_ptr() for b in t._staging} == buffers and t.staging_waits == 0


@pytest.mark.gpu
@pytest.mark.parametrize("through", ["torch", "driver"])
def test_on_cuda_uploads_through_the_driver_or_torch_land_each_steps_table(through):
    """On CUDA, with a driver that keeps the GIL everywhere (``VATTN_DRIVER_GIL=hold-all``) the
    uploads are its ``copy_from_host`` and its fences; without one, torch's ``copy_`` and events:
    either way every upload lands its step's table, through a ring of buffers the device may
    still be reading."""
    from vattn.adapters.vllm.slot_tables import STAGING_RING
    driver = None
    if through == "driver":
        from vattn.core.driver.cuda import CudaDriver
        driver = CudaDriver("cuda", keep_gil="all")
    t = SlotTables(max_num_reqs=9, max_num_tokens=64, rows_per_slot=97, padding_slot=11,
                   device="cuda", driver=driver)
    assert (t._upload is not None) == (through == "driver")
    rng = np.random.default_rng(5)
    for step in range(3 * STAGING_RING + 1):
        torch.cuda._sleep(1_000_000)             # the device behind: copies still queued
        for index in rng.choice(9, size=3, replace=False):
            t.assign(int(index), int(rng.integers(0, 11)))
        expected = t.slot_of_index.copy()
        t.upload()
        t.slot_of_index[:] = 7
        assert t._slot_dev.tolist() == expected.tolist(), step
        t.slot_of_index[:] = expected


def _runtime(num_blocks=9, reqs=3, max_len=4000, exact=False, prefix_caching=False, driver=None):
    cfg = gl.cache_config(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.float32,
                          num_blocks=num_blocks, max_num_reqs=reqs, max_model_len=max_len, device="cpu",
                          group_size=2, exact=exact)
    block = gl.tokens_per_page(num_kv_heads=2, head_dim=64, dtype=torch.float32, group_size=2)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    return GpuRuntime(cfg, block_size=block, layer_names=names, max_num_tokens=64,
                      attn_margin=gl.EXACT_MARGIN if exact else 0, max_model_len=max_len,
                      prefix_caching=prefix_caching, driver=driver), block


@pytest.mark.parametrize("max_len", [4000, 4096, 4090])
def test_exact_mode_page_is_no_multiple_of_the_key_tile_and_holds_every_request(max_len):
    default, _ = _runtime(max_len=max_len)
    exact, block = _runtime(max_len=max_len, exact=True)
    try:
        assert default.attn_rows == default.rows_per_slot and default.attn_rows % gl.KV_TILE == 0
        assert exact.attn_rows == exact.rows_per_slot - gl.EXACT_MARGIN
        assert exact.attn_rows % gl.KV_TILE != 0 and exact.attn_rows >= max_len
        assert exact.metrics()["attn_page_rows"] == exact.attn_rows
    finally:
        default.close()
        exact.close()
    cfg = gl.cache_config(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.float32, num_blocks=9,
                          max_num_reqs=3, max_model_len=4096, device="cpu", group_size=2)   # no spare rows
    with pytest.raises(ConfigError, match="attn_margin"):
        GpuRuntime(cfg, block_size=1024, layer_names=[f"l.{i}" for i in range(4)], max_num_tokens=8,
                   attn_margin=gl.EXACT_MARGIN, max_model_len=4096)


def test_runtime_maps_one_page_set_per_block_and_releases():
    rt, block = _runtime()
    try:
        assert block == 1024 and rt.padding_tokens == block
        rt.on_blocks(2, 1, new_request=True)
        rt.on_blocks(0, 3, new_request=True)
        rt.apply()
        s2, s0 = rt.slot(2), rt.slot(0)
        assert rt.cache.mapped_tokens(s2) >= block and rt.cache.mapped_tokens(s0) >= 3 * block   # >=: pre-warmed
        assert rt.tables._slot_dev[[2, 0]].tolist() == [s2, s0]
        rt.on_blocks(2, 2, new_request=False)
        rt.apply()
        assert rt.cache.mapped_tokens(s2) >= 2 * block
        rt.cache.wait()                                 # the block mapped ahead has landed
        rt.release(0)
        assert rt.slot(0) is None and rt.tables.slot_of_index[0] == rt.cache.padding_slot
        rt.on_blocks(1, 3, new_request=True)           # the warmest idle slot comes back
        rt.apply()
        assert rt.slot(1) == s0 and rt.cache.metrics()["warm_hits"] >= 1
        with pytest.raises(VattnError):
            rt.on_blocks(0, 1, new_request=False)     # blocks for an index without a slot
    finally:
        rt.close()


def test_runtime_budget_is_exactly_vllm_blocks():
    rt, _ = _runtime(num_blocks=5)                     # 1 padding + 4 blocks for requests
    try:
        rt.on_blocks(0, 2, new_request=True)
        rt.on_blocks(1, 2, new_request=True)
        rt.apply()                                     # all 4 request blocks in use: fits exactly
        rt.release(1)
        rt.on_blocks(2, 2, new_request=True)           # reuses or reclaims the released pages
        rt.apply()
        rt.on_blocks(0, 3, new_request=False)          # one block more than vLLM could hand out
        with pytest.raises(VattnError, match="could not map"):
            rt.apply()
    finally:
        rt.close()


def test_kv_view_is_k_and_v_and_store_lands_at_slot_rows():
    rt, block = _runtime()
    try:
        rt.on_blocks(1, 1, new_request=True)
        rt.apply()
        view = rt.kv_view(3)
        assert view.shape == (2, 4, rt.rows_per_slot, 2, 64)
        assert view[0].data_ptr() == rt.cache.k(3).data_ptr() and view[1].stride() == rt.cache.v(3).stride()
        rows = torch.tensor([rt.slot(1) * rt.rows_per_slot + p for p in (0, 5, 1023)])
        k, v = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
        ops.store(rt.cache.k_rows(3), rt.cache.v_rows(3), k, v, rows)
        torch.testing.assert_close(view[0, rt.slot(1), [0, 5, 1023]], k)
        torch.testing.assert_close(view[1, rt.slot(1), [0, 5, 1023]], v)
        assert rt.metrics()["layout"]["worst_waste_bytes"] > 0
    finally:
        rt.close()


def test_surplus_of_a_warm_slot_reused_in_the_same_step_is_reclaimable():
    # vLLM admits 1 + 3 blocks (all 4 it has); the short request took a warm slot holding 3
    # page-sets, so the long one needs 2 of them back in the same apply()
    rt, _ = _runtime(num_blocks=5)
    try:
        rt.on_blocks(0, 3, new_request=True)
        rt.apply()
        rt.cache.wait()                                 # the block mapped ahead has landed
        warm = rt.slot(0)
        rt.release(0)
        rt.on_blocks(1, 1, new_request=True)
        rt.on_blocks(2, 3, new_request=True)
        rt.apply()
        # whichever slot each took (all start pre-warmed), both hold what vLLM gave them
        assert rt.cache.mapped_tokens(rt.slot(2)) >= 3 * rt.block_size
        assert rt.cache.mapped_tokens(rt.slot(1)) >= rt.block_size and warm in (rt.slot(1), rt.slot(2))
        rt.cache.audit()
    finally:
        rt.close()


def test_runtime_prewarms_every_slot_within_its_region_when_the_pool_is_larger():
    # vLLM sizes its pool from free memory: it can hold far more blocks than slots x max_model_len
    rt, block = _runtime(num_blocks=60, reqs=3, max_len=4000)
    try:
        per_slot = rt.cache.layout.pages_per_slot
        assert rt.prewarmed_pages == per_slot * rt.cache.layout.num_ranges * 3
        before = rt.cache.metrics()["map_calls"]                         # incl. the padding slot's
        rt.on_blocks(0, per_slot, new_request=True)
        rt.apply()
        m = rt.cache.metrics()
        assert m["map_calls"] == before and m["warm_hits"] == 1            # no VMM call in the step
        assert rt.metrics()["on_blocks_us"]["count"] == 1
        rt.cache.audit()
    finally:
        rt.close()


def test_fused_slot_mapping_that_fails_falls_back_loudly_to_the_same_result(monkeypatch):
    _break_kernel(monkeypatch, "slot_mapping_triton", "no compiler")
    t = _tables()
    t.fused = True                                   # as on CUDA
    t.assign(0, 1)
    t.upload()
    idx = torch.tensor([0], dtype=torch.int32)
    with pytest.warns(UserWarning, match="no compiler"):
        sm = t.compute_slot_mapping(idx, torch.tensor([0, 2], dtype=torch.int32), torch.arange(64), 3)
    assert sm[0].tolist() == [97, 98, PAD_ROW] and not t.fused and "no compiler" in t.fused_error


def _fill(rt, index, block_index, value):
    slot, b = rt.slot(index), rt.block_size
    for layer in range(4):
        rt.kv_view(layer)[:, slot, block_index * b:(block_index + 1) * b] = value


def _reads(rt, index, block_index, value):
    slot, b = rt.slot(index), rt.block_size
    return all(bool((rt.kv_view(layer)[:, slot, block_index * b:(block_index + 1) * b] == value).all())
               for layer in range(4))


def test_prefix_caching_maps_cached_blocks_into_the_new_request():
    rt, _ = _runtime(prefix_caching=True)                # 8 blocks for requests
    try:
        _two_requests_sharing_two_blocks(rt)
        rt.release(0)
        maps = rt.cache.metrics()["map_calls"]
        rt.on_blocks(2, 4, new_request=True, block_ids=[1, 2, 3, 5], hits=3)
        rt.apply()
        assert rt.slot(2) == 0 or rt.cache.metrics()["map_calls"] > maps
        assert _reads(rt, 2, 0, 11) and _reads(rt, 2, 2, 13)
        rt.cache.audit()
    finally:
        rt.close()


def _two_requests_sharing_two_blocks(rt) -> None:
    """Request 0 writes blocks 1-3; request 1 hits blocks 1 and 2 and writes its own block 4."""
    rt.on_blocks(0, 3, new_request=True, block_ids=[1, 2, 3])
    rt.apply()
    for i, v in enumerate((11, 12, 13)):
        _fill(rt, 0, i, v)
    rt.on_blocks(1, 3, new_request=True, block_ids=[1, 2, 4], hits=2)
    rt.apply()
    assert _reads(rt, 1, 0, 11) and _reads(rt, 1, 1, 12)     # the hit, through its own slot
    _fill(rt, 1, 2, 99)
    assert _reads(rt, 0, 2, 13)                              # its own block stays private


def test_prefix_caching_never_runs_short_when_vllm_reuses_evicted_blocks():
    """vLLM counts cached blocks as free and evicts them on reuse: every block it hands out
    must find a page-set (budget = exactly vLLM's blocks)."""
    rt, _ = _runtime(num_blocks=5, prefix_caching=True)          # 4 blocks for requests
    try:
        rt.on_blocks(0, 2, new_request=True, block_ids=[1, 2])
        rt.on_blocks(1, 2, new_request=True, block_ids=[3, 4])
        rt.apply()
        rt.release(0)
        rt.release(1)                                   # all 4 blocks cached in vLLM
        rt.on_blocks(2, 2, new_request=True, block_ids=[4, 3])   # evicted, handed out reversed
        rt.apply()
        rt.on_blocks(0, 2, new_request=True, block_ids=[1, 2], hits=2)
        rt.apply()
        rt.cache.audit()
        assert rt.cache.metrics()["shortfalls"] == 0
    finally:
        rt.close()


def test_prefix_caching_a_new_request_hits_a_block_a_running_one_gets_this_step():
    """vLLM adds new requests before it appends running ones' blocks, and caches a block when it
    schedules it: the hit must still be bound after the running request's fresh block."""
    rt, _ = _runtime(prefix_caching=True)
    try:
        rt.on_blocks(0, 2, new_request=True, block_ids=[1, 2])
        rt.apply()
        rt.on_blocks(1, 4, new_request=True, block_ids=[1, 2, 3, 4], hits=3)   # hits block 3 ...
        rt.on_blocks(0, 3, new_request=False, block_ids=[3])                    # ... given to 0 now
        rt.apply()
        pages = rt.cache._pages
        assert pages.at(rt.slot(1), 2) == pages.at(rt.slot(0), 2)
        rt.cache.audit()
    finally:
        rt.close()


def test_driver_faults_are_retried_within_the_step_and_a_lasting_one_says_so():
    """The GPU runtime's cache calls are retried while a driver call fails (map / set-access at
    30 %): every request still reads exactly its own blocks and the cached ones it hit; a call
    that keeps failing propagates with a note (the GPU runner has no preemption path yet)."""
    from vattn.core.driver import FaultInjector, get_driver
    from vattn.core.errors import DriverError
    cfg_page = gl.cache_config(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.float32,
                               num_blocks=9, max_num_reqs=3, max_model_len=4000, device="cpu",
                               group_size=2).page_bytes
    driver = FaultInjector(get_driver(torch.device("cpu"), granularity=cfg_page))
    rt, _ = _runtime(prefix_caching=True, driver=driver)
    try:
        rt._retry.retries = 8
        driver.arm_rate("map", 0.3, seed=4)
        driver.arm_rate("set_access", 0.3, seed=5)
        _two_requests_sharing_two_blocks(rt)
        # faults of the background map-ahead are its own (a page it could not map is mapped on
        # demand later); the step's calls were retried
        assert 0 < rt.metrics()["driver_retries"] <= sum(driver.injected.values())
        rt.cache.audit()
        rt._retry.retries = 0
        driver.arm_rate("map", 1.0)
        rt.release(1)
        rt.on_blocks(2, 4, new_request=True, block_ids=[5, 6, 7, 8])
        with pytest.raises(DriverError) as info:
            rt.apply()
        assert "no preemption path" in "".join(info.value.__notes__)
    finally:
        rt.close()


def test_runtime_metrics_snapshots(tmp_path, monkeypatch):
    """``VATTN_METRICS`` on the GPU runner's runtime: written by ``apply`` and, once idle, with
    the page audit (the request indices still holding a slot are counted)."""
    import json
    import time
    path = tmp_path / "m.json"
    monkeypatch.setenv("VATTN_METRICS", str(path))
    rt, block = _runtime()
    try:
        rt.on_blocks(0, 2, new_request=True)
        rt.apply()
        assert json.loads(path.read_text())["requests_holding_slots"] == 1
        rt.release(0)
        deadline = time.monotonic() + 10
        while not json.loads(path.read_text())["idle"] and time.monotonic() < deadline:
            time.sleep(0.05)
        snap = json.loads(path.read_text())
        assert snap["audit"] == "ok" and snap["requests_holding_slots"] == 0 and snap["block_size"] == block
    finally:
        rt.close()
    assert rt.snapshots._thread is None


def _burst(rt):
    """Request 0 wrote blocks 1-2 (a shared prefix) and 3; requests 1 and 2 arrive together
    hitting blocks 1-2 (a burst sharing a system prompt), then requests 3 and 4 do."""
    rt.on_blocks(0, 3, new_request=True, block_ids=[1, 2, 3])
    rt.apply()
    for i, v in enumerate((11, 12, 13)):
        _fill(rt, 0, i, v)
    rt.on_blocks(1, 3, new_request=True, block_ids=[1, 2, 4], hits=2)
    rt.on_blocks(2, 3, new_request=True, block_ids=[1, 2, 5], hits=2)
    rt.apply()
    rt.cache.wait()                                      # the map-ahead worker ran meanwhile
    before = rt.cache.metrics()
    rt.on_blocks(3, 3, new_request=True, block_ids=[1, 2, 6], hits=2)
    rt.on_blocks(4, 3, new_request=True, block_ids=[1, 2, 7], hits=2)
    rt.apply()
    after = rt.cache.metrics()            # the worker may be staging for this step meanwhile
    for index in (1, 2, 3, 4):
        assert _reads(rt, index, 0, 11) and _reads(rt, index, 1, 12)
    rt.cache.wait()
    rt.cache.audit()
    delta = {k: after[k] - before[k] for k in ("pages_aliased", "page_sets_staged")}
    return delta["pages_aliased"] - delta["page_sets_staged"] * rt.cache.layout.num_ranges, before


def _staging_runtime(stage):
    cfg = gl.cache_config(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.float32, num_blocks=12,
                          max_num_reqs=8, max_model_len=4000, device="cpu", group_size=2)
    block = gl.tokens_per_page(num_kv_heads=2, head_dim=64, dtype=torch.float32, group_size=2)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    return GpuRuntime(cfg, block_size=block, layer_names=names, max_num_tokens=64, max_model_len=4000,
                      prefix_caching=True, stage_prefixes=stage)


def test_a_burst_sharing_a_prefix_finds_it_staged_in_idle_slots():
    """Two new requests hitting one prefix in a step: it is mapped into two empty idle slots on
    the map-ahead worker, and the next two requests with it take those slots and map nothing for
    their hit (without staging each maps the prefix on the step's path)."""
    staged, plain = _staging_runtime(True), _staging_runtime(False)
    try:
        assert staged.cache.config.map_ahead_tokens > 0 and staged.metrics()["stage_prefixes"]
        (on_path, ahead), (plain_path, _) = _burst(staged), _burst(plain)
        assert on_path == 0 and plain_path == 2 * 2 * 2          # 2 requests x 2 page-sets x 2 ranges
        assert ahead["page_sets_staged"] >= 4 and plain.cache.metrics()["page_sets_staged"] == 0
    finally:
        staged.close()
        plain.close()


def test_one_request_with_a_prefix_stages_nothing_until_the_next_step_hits_it_again():
    rt = _staging_runtime(True)
    try:
        rt.on_blocks(0, 3, new_request=True, block_ids=[1, 2, 3])
        rt.apply()
        rt.on_blocks(1, 3, new_request=True, block_ids=[1, 2, 4], hits=2)
        rt.apply()
        rt.cache.wait()
        assert rt.cache.metrics()["page_sets_staged"] == 0     # one hit: a repeated prompt, maybe
        rt.on_blocks(2, 3, new_request=True, block_ids=[1, 2, 5], hits=2)
        rt.apply()
        rt.cache.wait()
        assert rt.cache.metrics()["page_sets_staged"] == 2     # hit again the next step: staged once
        rt.cache.audit()
    finally:
        rt.close()


def test_device_wait_env_is_a_checked_switch(monkeypatch):
    """``VATTN_DEVICE_WAIT=0`` turns the device-idle events off (host runs never have them);
    anything but 0 / 1 is refused by name."""
    from vattn.core.errors import ConfigError
    monkeypatch.setenv("VATTN_DEVICE_WAIT", "0")
    rt, _ = _runtime(prefix_caching=True)
    assert rt.device_wait.enabled is False
    rt.close()
    monkeypatch.setenv("VATTN_DEVICE_WAIT", "no")
    with pytest.raises(ConfigError, match="VATTN_DEVICE_WAIT must be 0 or 1"):
        _runtime(prefix_caching=True)


def test_the_free_reserve_comes_from_its_variable_in_page_sets(monkeypatch):
    """``VATTN_FREE_RESERVE`` page-sets (off by default) become the cache's reserve in pages, one
    per range; more than half of vLLM's blocks is refused by name."""
    kw = dict(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.float32, num_blocks=12,
              max_num_reqs=3, max_model_len=4000, device="cpu", group_size=2)
    assert gl.cache_config(**kw).free_reserve == 0
    monkeypatch.setenv("VATTN_FREE_RESERVE", "3")
    assert gl.cache_config(**kw).free_reserve == 3 * 2
    monkeypatch.setenv("VATTN_FREE_RESERVE", "7")
    with pytest.raises(ConfigError, match="VATTN_FREE_RESERVE must be at most half of vLLM's 12 blocks, got 7"):
        gl.cache_config(**kw)


def test_cold_slots_come_from_their_variable_with_prefix_caching_only(monkeypatch):
    """``VATTN_COLD_SLOTS`` idle slots stay empty after the pre-warm when prefix caching is on
    (off by default); not fewer than ``max_num_seqs`` is refused by name."""
    assert gl.cold_slots(4) == 0
    monkeypatch.setenv("VATTN_COLD_SLOTS", "1")
    rt, _ = _runtime(prefix_caching=True)
    try:
        assert [rt.cache.mapped_tokens(s) > 0 for s in range(rt.cache.config.max_slots)][-1] is False
    finally:
        rt.close()
    rt, _ = _runtime(prefix_caching=False)
    try:
        assert all(rt.cache.mapped_tokens(s) > 0 for s in range(rt.cache.config.max_slots))
    finally:
        rt.close()
    monkeypatch.setenv("VATTN_COLD_SLOTS", "4")
    with pytest.raises(ConfigError, match="VATTN_COLD_SLOTS must be below max_num_seqs \\(4\\), got 4"):
        gl.cold_slots(4)
