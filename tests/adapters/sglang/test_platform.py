"""The vattn SGLang platform: discovery by SGLang's own resolver, class choice by its configurator.

CPU seam: SGLang resolves its process-wide ``current_platform`` once, at import (the CPU
platform here), and ``ServerArgs`` under a CUDA platform queries CUDA memory. So discovery is
checked by calling SGLang's resolver ``_resolve_platform()`` directly, and the configurator by
replacing its module's ``current_platform`` with a ``VattnCudaPlatform()`` (a plain object: no
CUDA call when built); everything after that is SGLang's own code on the host backend.
"""

import tomllib
from pathlib import Path

import pytest

pytest.importorskip("sglang.srt.mem_cache.kv_cache_configurator",
                    reason="sglang (CPU import set) not installed")

from sglang.srt import platforms  # noqa: E402
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402

from vattn.adapters.sglang.allocator import VattnTokenAllocator  # noqa: E402
from vattn.adapters.sglang.platform import VattnCudaPlatform, activate  # noqa: E402
from vattn.adapters.sglang.pool import VattnMHATokenToKVPool  # noqa: E402
from vattn.core.errors import ConfigError, UnsupportedError  # noqa: E402

PYPROJECT = Path(__file__).resolve().parents[3] / "pyproject.toml"


@pytest.fixture
def entry_point(tmp_path, monkeypatch):
    """Declare pyproject's ``sglang.srt.platforms`` table through package metadata on sys.path."""
    table = tomllib.loads(PYPROJECT.read_text())["project"]["entry-points"]["sglang.srt.platforms"]
    dist = tmp_path / "vattn_test_shim-0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vattn-test-shim\nVersion: 0\n")
    lines = [f"{name} = {value}" for name, value in table.items()]
    (dist / "entry_points.txt").write_text("[sglang.srt.platforms]\n" + "\n".join(lines) + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("SGLANG_PLATFORM", raising=False)
    return table


def test_opt_in_resolves_vattn_platform_through_sglang_discovery(entry_point, monkeypatch):
    assert entry_point == {"vattn": "vattn.adapters.sglang.platform:activate"}
    monkeypatch.setenv("VATTN_SGLANG", "1")
    found = platforms._resolve_platform()
    assert type(found) is VattnCudaPlatform
    assert found.is_out_of_tree() and found.is_cuda()          # hooks on, CUDA branches stock
    assert found.get_mha_kv_pool_cls() is VattnMHATokenToKVPool
    assert found.get_paged_allocator_cls() is VattnTokenAllocator
    assert found.get_dispatch_key_name() == "cuda"
    monkeypatch.setenv("SGLANG_PLATFORM", "vattn")               # explicit selection works too
    assert type(platforms._resolve_platform()) is VattnCudaPlatform


def test_without_opt_in_sglang_keeps_its_platform(entry_point, monkeypatch):
    monkeypatch.delenv("VATTN_SGLANG", raising=False)
    assert activate() is None
    found = platforms._resolve_platform()
    assert not isinstance(found, VattnCudaPlatform) and not found.is_out_of_tree()
    monkeypatch.setenv("SGLANG_PLATFORM", "vattn")
    with pytest.raises(RuntimeError, match="returned None"):
        platforms._resolve_platform()


def test_configurator_chooses_vattn_pool_and_allocator(configure_pools):
    pools = configure_pools(VattnCudaPlatform(), num_tokens=512)
    r2t, pool, alloc = pools.req_to_token_pool, pools.token_to_kv_pool, pools.token_to_kv_pool_allocator
    assert type(r2t) is ReqToTokenPool and (r2t.size, r2t.max_context_len) == (3, 100)
    assert type(pool) is VattnMHATokenToKVPool and type(alloc) is VattnTokenAllocator
    cfg = pool.vattn_cache.config
    assert (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim) == (2, 2, 64)
    assert cfg.max_context == r2t.max_context_len               # req_to_token row length
    assert pool.max_requests >= r2t.size                         # --max-running-requests 3
    assert alloc.size == 512 and alloc.available_size() == 512   # SGLang's idle leak check holds
    # the pool was pre-warmed (every slot's share mapped at start) and that changed no size above
    assert pool.prewarmed_pages > 0
    assert pool.vattn_cache.metrics()["pages_mapped_ahead"] == pool.prewarmed_pages


def test_configurator_without_vattn_platform_chooses_stock(configure_pools):
    pools = configure_pools(None)
    assert type(pools.token_to_kv_pool) is MHATokenToKVPool
    assert type(pools.token_to_kv_pool_allocator) is PagedTokenToKVPoolAllocator


def test_platform_defaults_page_size_to_one_page_set_keeps_radix_and_refuses_the_rest(
        sglang_server_args):
    from types import SimpleNamespace as NS
    plat = VattnCudaPlatform()
    mc = sglang_server_args.get_model_config()      # tiny Llama: 2 layers, 2 KV heads, 64
    args = NS(device="cuda", attention_backend=None, prefill_attention_backend=None,
              decode_attention_backend=None, page_size=None, disable_radix_cache=False,
              kv_cache_dtype="auto", tp_size=1, get_model_config=lambda: mc)
    plat.apply_server_args_defaults(args)
    # 2 MiB / (2 layers per range x K,V x 2 heads x 64 x the dtype's bytes); radix stays on
    tokens = (2 << 20) // (2 * 2 * 2 * 64 * mc.dtype.itemsize)
    assert (args.attention_backend, args.page_size, args.disable_radix_cache) == ("vattn", tokens, False)
    tp2 = NS(**dict(vars(args), tp_size=2, page_size=None))
    plat.apply_server_args_defaults(tp2)
    assert tp2.page_size == 2 * tokens                # one KV head per rank: twice the tokens
    with pytest.raises(ConfigError, match=f"--page-size 16: .* {tokens} tokens for this model"):
        plat.apply_server_args_defaults(NS(**dict(vars(args), page_size=16)))
    with pytest.raises(ConfigError, match="hierarchical"):
        plat.apply_server_args_defaults(NS(**dict(vars(args), enable_hierarchical_cache=True)))
    with pytest.raises(UnsupportedError, match="kv-cache-dtype fp8_e4m3"):
        plat.apply_server_args_defaults(NS(**dict(vars(args), kv_cache_dtype="fp8_e4m3")))
    with pytest.raises(ConfigError, match="--attention-backend vattn; got attention_backend='fa3'"):
        plat.apply_server_args_defaults(NS(**dict(vars(args), attention_backend="fa3")))
    with pytest.raises(UnsupportedError, match="CUDA only"):
        plat.apply_server_args_defaults(NS(**dict(vars(args), device="cpu")))
    with pytest.raises(UnsupportedError, match="MLA"):
        plat.get_mla_kv_pool_cls()


def test_pool_refuses_unsupported_sglang_arguments(configure_pools):
    kw = dict(page_size=16, dtype=__import__("torch").float32, head_num=2, head_dim=64,
              layer_num=2, device="cpu")
    with pytest.raises(UnsupportedError, match="enable_kv_cache_copy"):
        VattnMHATokenToKVPool(512, **kw, enable_kv_cache_copy=True)   # hybrid-model call site
    with pytest.raises(UnsupportedError, match="pipeline"):
        VattnMHATokenToKVPool(512, **kw, start_layer=1, end_layer=2)
    with pytest.raises(UnsupportedError, match="memory-saver"):
        VattnMHATokenToKVPool(512, **kw, enable_memory_saver=True)


def test_platform_turns_the_default_prefill_graph_off_and_refuses_one_asked_for(
        sglang_server_args):
    """SGLang's resolved prefill CUDA graph (its default on CUDA is ``breakable``) is turned off
    unless the user asked for it by name, which is refused with the flag to pass."""
    import copy
    from types import SimpleNamespace as NS

    from sglang.srt.server_args import ServerArgs
    plat = VattnCudaPlatform()
    fields = copy.deepcopy(vars(sglang_server_args))
    mc = sglang_server_args.get_model_config()
    fields.update(device="cuda", attention_backend=None, page_size=None, get_model_config=lambda: mc)
    default = NS(**fields)
    default.cuda_graph_config.prefill.backend = "breakable"        # as resolved on CUDA
    default._cuda_graph_config_locked = set()
    plat.apply_server_args_defaults(default)
    assert default.cuda_graph_config.prefill.backend == "disabled"

    asked = ServerArgs(model_path=sglang_server_args.model_path, device="cpu", page_size=16,
                       disable_radix_cache=True, skip_tokenizer_init=True,
                       cuda_graph_backend_prefill="breakable", context_length=96)
    assert ("prefill", "backend") in asked._cuda_graph_config_locked
    asked = NS(**dict(copy.deepcopy(vars(asked)), device="cuda", attention_backend=None,
                      page_size=None, get_model_config=lambda: mc))
    with pytest.raises(ConfigError, match="disable-prefill-cuda-graph"):
        plat.apply_server_args_defaults(asked)
    assert asked.cuda_graph_config.prefill.backend == "breakable"


@pytest.mark.parametrize("tokens", [600, 70_000, 3_500_000])
@pytest.mark.parametrize("requested", [None, 3, 5000])
def test_slot_count_is_sglang_s_own_request_count(sglang_server_args, monkeypatch, tokens, requested):
    """vattn's slots follow SGLang's own ``resolve_max_num_reqs`` (a slot SGLang never fills
    would thin every slot's pre-warmed share): the formula is checked against SGLang's code."""
    from types import SimpleNamespace as NS

    from sglang.srt.mem_cache import kv_cache_configurator as kcc

    from vattn.adapters.sglang.sizing import sglang_max_requests
    mc = sglang_server_args.get_model_config()
    monkeypatch.setattr(kcc, "get_schedule", lambda: NS(max_running_requests=requested))
    configurator = object.__new__(kcc.KVCacheConfigurator)
    configurator.model_config, configurator.ps, configurator.mambaish_config = \
        mc, NS(attn_dp_size=1), None
    assert sglang_max_requests(tokens, mc.context_len, requested) == \
        configurator.resolve_max_num_reqs(tokens)
