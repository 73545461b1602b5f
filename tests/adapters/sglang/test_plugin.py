"""Version gate and plugin registration against the installed SGLang."""

from types import SimpleNamespace

import pytest

from vattn.adapters.sglang.version import SUPPORTED_VERSIONS, check_version
from vattn.core.errors import ConfigError, UnsupportedError


def test_unsupported_version_fails_loudly():
    with pytest.raises(UnsupportedError, match="0.4.0"):
        check_version("0.4.0")
    assert check_version(SUPPORTED_VERSIONS[0]) == SUPPORTED_VERSIONS[0]


def test_register_adds_backend_and_choice():
    pytest.importorskip("sglang.srt.layers.attention.attention_registry",
                        reason="sglang (CPU import set) not installed")
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES

    from vattn.adapters.sglang.plugin import create_vattn_backend, register

    register()
    assert ATTENTION_BACKENDS["vattn"] is create_vattn_backend
    assert "vattn" in ATTENTION_BACKEND_CHOICES


def test_radix_cache_is_served_page_size_one_and_the_hierarchical_cache_are_refused():
    pytest.importorskip("sglang.srt.server_args", reason="sglang (CPU import set) not installed")
    from vattn.adapters.sglang.plugin import check_server_args

    check_server_args(SimpleNamespace(disable_radix_cache=False, page_size=128))
    check_server_args(SimpleNamespace(disable_radix_cache=True, page_size=128))
    with pytest.raises(ConfigError, match="page-size > 1"):
        check_server_args(SimpleNamespace(disable_radix_cache=False, page_size=1))
    with pytest.raises(ConfigError, match="hierarchical"):
        check_server_args(SimpleNamespace(page_size=128, enable_hierarchical_cache=True))


def test_prefill_cuda_graphs_are_refused_by_name():
    pytest.importorskip("sglang.srt.server_args", reason="sglang (CPU import set) not installed")
    from vattn.adapters.sglang.plugin import check_server_args

    def args(backend):
        graphs = SimpleNamespace(prefill=SimpleNamespace(backend=backend))
        return SimpleNamespace(disable_radix_cache=True, page_size=16, cuda_graph_config=graphs)

    for backend in ("breakable", "tc_piecewise", "full"):
        with pytest.raises(ConfigError, match=f"'{backend}' prefill graph.*"
                                              "--disable-prefill-cuda-graph"):
            check_server_args(args(backend))
    check_server_args(args("disabled"))


def test_backend_factory_needs_vattn_pool_and_a_fitting_cache(configure_pools,
                                                              sglang_server_args):
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    from vattn.adapters.sglang.platform import VattnCudaPlatform
    from vattn.adapters.sglang.plugin import create_vattn_backend

    stock = configure_pools(None)
    runner = SimpleNamespace(server_args=sglang_server_args, device="cpu",
                             token_to_kv_pool=stock.token_to_kv_pool,
                             req_to_token_pool=stock.req_to_token_pool)
    with pytest.raises(ConfigError, match="VATTN_SGLANG=1"):
        create_vattn_backend(runner)
    pools = configure_pools(VattnCudaPlatform())
    runner.token_to_kv_pool = pools.token_to_kv_pool
    runner.req_to_token_pool = ReqToTokenPool(size=3, max_context_len=4096, device="cpu",
                                              enable_memory_saver=False)
    with pytest.raises(ConfigError, match="req_to_token rows hold 4096"):
        create_vattn_backend(runner)
