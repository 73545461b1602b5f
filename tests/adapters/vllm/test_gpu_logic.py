"""Engine-free parts of the vLLM GPU path, on CPU tensors and the host VMM backend (no vLLM)."""

from types import SimpleNamespace

import pytest
import torch

from vattn.adapters.vllm import gpu_layout as gl
from vattn.core.errors import ConfigError, UnsupportedError


# -- block size = tokens per page-set ------------------------------------------------------------
@pytest.mark.parametrize("heads, dim, group, expected", [(8, 128, 1, 512), (8, 128, 2, 256),
                                                         (8, 128, 4, 128), (2, 64, 2, 2048),
                                                         (4, 128, 4, 256)])
def test_tokens_per_page(heads, dim, group, expected):
    assert gl.tokens_per_page(num_kv_heads=heads, head_dim=dim, dtype=torch.bfloat16,
                              group_size=group) == expected


@pytest.mark.parametrize("heads, dim, group", [(8, 128, 8), (3, 96, 1), (5, 128, 1)])
def test_tokens_per_page_refuses_partial_tiles_and_fractions(heads, dim, group):
    with pytest.raises(ConfigError):
        gl.tokens_per_page(num_kv_heads=heads, head_dim=dim, dtype=torch.bfloat16, group_size=group)


def test_group_size_env(monkeypatch):
    monkeypatch.delenv("VATTN_GROUP_SIZE", raising=False)
    assert [gl.group_size_for(n) for n in (32, 2, 6, 7)] == [4, 2, 2, 1]
    monkeypatch.setenv("VATTN_GROUP_SIZE", "2")
    assert gl.group_size_for(32) == 2
    for bad in ("3", "x", "0"):
        monkeypatch.setenv("VATTN_GROUP_SIZE", bad)
        with pytest.raises(ConfigError):
            gl.group_size_for(32)


def test_cache_config_budget_is_num_blocks_page_sets():
    cfg = gl.cache_config(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                          num_blocks=37, max_num_reqs=5, max_model_len=1000, device="cpu", group_size=4)
    assert cfg.page_budget == 37 * 8 * gl.PAGE_BYTES       # 8 ranges of 2 MiB per block
    assert cfg.max_context == 1024 and cfg.max_slots == 5
    assert cfg.map_ahead_tokens == 128                     # one block (page-set) ahead


def test_exact_mode_reserves_spare_rows_and_env_is_checked(monkeypatch):
    kw = dict(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, num_blocks=37,
              max_num_reqs=5, device="cpu", group_size=4)
    assert gl.cache_config(max_model_len=1024, **kw).max_context == 1024
    assert gl.cache_config(max_model_len=1024, exact=True, **kw).max_context == 1152   # 1024 + 16 -> 9 pages
    assert gl.cache_config(max_model_len=1000, exact=True, **kw).max_context == 1024   # 1016 still fits 8
    monkeypatch.delenv(gl.EXACT_ENV, raising=False)
    assert gl.exact_kernel_path() is False
    monkeypatch.setenv(gl.EXACT_ENV, "1")
    assert gl.exact_kernel_path() is True
    monkeypatch.setenv(gl.EXACT_ENV, "yes")
    with pytest.raises(ConfigError, match="VATTN_VLLM_EXACT must be 0 or 1"):
        gl.exact_kernel_path()


def _vllm_config(**over):
    cfg = SimpleNamespace(
        cache_config=SimpleNamespace(enable_prefix_caching=False, cache_dtype="auto"),
        model_config=SimpleNamespace(enable_sleep_mode=False, enable_cumem_allocator=False,
                                     use_mla=False, dtype=torch.bfloat16),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1, prefill_context_parallel_size=1),
        attention_config=SimpleNamespace(backend=SimpleNamespace(name="CUSTOM")),
        speculative_config=None, kv_transfer_config=None)
    for path, value in over.items():
        obj, name = cfg, path.split(".")
        for part in name[:-1]:
            obj = getattr(obj, part)
        setattr(obj, name[-1], value)
    return cfg


@pytest.mark.parametrize("path, value, error", [
    ("model_config.enable_sleep_mode", True, ConfigError),
    ("model_config.enable_cumem_allocator", True, ConfigError),
    ("attention_config.backend", SimpleNamespace(name="FLASH_ATTN"), ConfigError),
    ("attention_config.backend", None, ConfigError),
    ("speculative_config", object(), UnsupportedError),
    ("kv_transfer_config", object(), UnsupportedError),
    ("parallel_config.decode_context_parallel_size", 2, UnsupportedError),
    ("cache_config.cache_dtype", "fp8", UnsupportedError),
])
def test_check_engine_config_refuses(path, value, error):
    gl.check_engine_config(_vllm_config())
    with pytest.raises(error):
        gl.check_engine_config(_vllm_config(**{path: value}))


def test_prefix_caching_is_accepted_on_gpu():
    gl.check_engine_config(_vllm_config(**{"cache_config.enable_prefix_caching": True}))


class FullAttentionSpec(SimpleNamespace):   # the name is what the check looks at
    pass


def _kv_config(block_size=128, groups=1, layers=32, page=None):
    spec = FullAttentionSpec(block_size=block_size, sliding_window=None, attention_chunk_size=None,
                             page_size_bytes=page or 2 * block_size * 8 * 128 * 2)
    group = SimpleNamespace(kv_cache_spec=spec, layer_names=[f"model.layers.{i}.attn" for i in range(layers)])
    return SimpleNamespace(kv_cache_groups=[group] * groups, num_blocks=10)


def test_check_kv_cache_config():
    page_set = 8 * gl.PAGE_BYTES
    gl.check_kv_cache_config(_kv_config(), block_size=128, page_set_bytes=page_set)
    with pytest.raises(ConfigError, match="block_size=128"):
        gl.check_kv_cache_config(_kv_config(block_size=16), block_size=128, page_set_bytes=page_set)
    with pytest.raises(UnsupportedError):
        gl.check_kv_cache_config(_kv_config(groups=2), block_size=128, page_set_bytes=page_set)
    with pytest.raises(ConfigError):
        gl.check_kv_cache_config(_kv_config(page=12345), block_size=128, page_set_bytes=page_set)
    other = _kv_config()
    other.kv_cache_groups[0].kv_cache_spec = SimpleNamespace(block_size=128)
    with pytest.raises(UnsupportedError):
        gl.check_kv_cache_config(other, block_size=128, page_set_bytes=page_set)
