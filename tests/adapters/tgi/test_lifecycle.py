"""Runtime lifecycle, environment checks and attention of the TGI adapter against the real core.

TGI itself is not needed: batches are stand-ins with the attributes of TGI's FlashCausalLMBatch.
"""

from types import SimpleNamespace

import pytest
import torch

from vattn.adapters.tgi import activate, kv, patches
from vattn.adapters.tgi.runtime import OutOfPagesError, TgiRuntime
from vattn.core import KVCacheConfig, VirtualKVCache
from vattn.core.errors import ConfigError

H, D, L = 2, 16, 2


def _cache(max_slots=3, max_context=40, budget=8 << 20):
    cfg = KVCacheConfig(num_layers=L, num_kv_heads=H, head_dim=D, dtype=torch.float32,
                        max_slots=max_slots, max_context=max_context, page_budget=budget,
                        page_bytes=4096, device="cpu", map_ahead_tokens=0)
    return VirtualKVCache(cfg)


def _batch(ids, reserved, cache_lengths, input_lengths):
    cu = torch.tensor([0, *torch.tensor(reserved).cumsum(0).tolist()])
    return SimpleNamespace(requests=[SimpleNamespace(id=i) for i in ids],
                           slots=torch.arange(1000, 1000 + int(cu[-1]), dtype=torch.int64), cu_slots=cu,
                           block_tables_tensor=torch.full((len(ids), 3), 77, dtype=torch.int32),
                           cache_lengths=cache_lengths, input_lengths=input_lengths)


def test_bind_rewrites_slots_maps_pages_and_release_frees():
    cache = _cache()
    rt = TgiRuntime(cache)
    b = _batch([11, 12], [6, 9], [0, 0], [5, 8])
    slots = rt.bind(b)
    assert len(set(slots)) == 2
    C = cache.layout.rows_per_slot
    assert b.slots[:6].tolist() == [slots[0] * C + t for t in range(6)]
    assert b.slots[6:].tolist() == [slots[1] * C + t for t in range(9)]
    assert b.block_tables_tensor[:, 0].tolist() == slots
    assert cache.mapped_tokens(slots[1]) >= 8
    assert rt.bind(b) == slots                 # idempotent: bound requests keep their slot
    assert rt.release([11, 999]) == [slots[0]]
    assert set(rt.slot_of) == {12}
    assert rt.release_all() == [slots[1]]
    cache.close()


def test_all_slots_busy_is_a_slot_error_and_no_pages_is_out_of_pages():
    from vattn.core.errors import SlotError
    cache = _cache(max_slots=1)
    rt = TgiRuntime(cache)
    rt.bind(_batch([1], [4], [0], [4]))
    with pytest.raises(SlotError):
        rt.bind(_batch([2], [4], [0], [4]))
    cache.close()
    small = _cache(max_slots=2, max_context=4000, budget=L * 2 * 4096)
    rt = TgiRuntime(small)
    with pytest.raises(OutOfPagesError, match="VATTN_TGI_PAGE_BUDGET"):
        rt.bind(_batch([1], [3000], [0], [3000]))
    small.close()


@pytest.mark.parametrize("env,match", [({"PREFIX_CACHING": "1", "ATTENTION": "flashdecoding"}, "PREFIX_CACHING=0"),
                                       ({"PREFIX_CACHING": "0", "ATTENTION": "paged"}, "flashdecoding"),
                                       ({"ATTENTION": "flashdecoding", "CUDA_GRAPHS": "1,2"}, "CUDA_GRAPHS")])
def test_environment_errors(env, match):
    with pytest.raises(ConfigError, match=match):
        patches.check_environment(env)


def test_environment_ok_and_config_from_env():
    patches.check_environment({"ATTENTION": "flashdecoding", "PREFIX_CACHING": "false"})
    cfg = patches.config_from_env(num_layers=4, num_heads=2, head_size=8, dtype=torch.float32, device="cpu",
                                  env={"VATTN_TGI_MAX_SLOTS": "5", "VATTN_TGI_PAGE_BUDGET": "1048576",
                                       "VATTN_TGI_GROUP_SIZE": "2"})
    assert (cfg.max_slots, cfg.page_budget, cfg.group_size) == (5, 1 << 20, 2)
    with pytest.raises(ConfigError, match="VATTN_TGI_MAX_SLOTS"):
        patches.config_from_env(num_layers=4, num_heads=2, head_size=8, dtype=torch.float32,
                                device="cpu", env={"VATTN_TGI_MAX_SLOTS": "many"})


def test_enabled_flag_and_pth_roundtrip(tmp_path):
    assert not activate.enabled({})
    assert activate.enabled({"VATTN_TGI": "1"})
    with pytest.raises(ConfigError):
        activate.enabled({"VATTN_TGI": "yes"})
    assert activate.install_from_env({}) is None
    path = activate.write_pth(str(tmp_path))
    assert path.read_text() == activate.PTH_LINE
    assert activate.remove_pth(str(tmp_path)) and not path.exists()


class _FakeKV:  # stands in for TGI's KVCache: store() as TGI does it with ATTENTION=flashdecoding
    def store(self, *, key, value, slots):
        k, v = self.kv_cache
        k.view(-1, k.shape[-2], k.shape[-1])[slots] = key
        v.view(-1, v.shape[-2], v.shape[-1])[slots] = value


def _sdpa(q, k, v, scale):
    # q [n, Hq, D], k/v [m, Hk, D]; causal bottom-right
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    n, m = q.shape[0], k.shape[0]
    mask = torch.ones(n, m, dtype=torch.bool).tril(m - n)
    return torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale).transpose(0, 1)


def test_store_then_prefill_and_decode_match_sdpa():
    torch.manual_seed(0)
    cache = _cache()
    rt = TgiRuntime(cache)
    layer = kv.layer_caches(_FakeKV, cache)[1]
    lens = [7, 13]
    b = _batch([5, 6], [20, 20], [0, 0], lens)
    rt.bind(b)
    hq, scale = 4, D ** -0.5
    keys, vals = torch.randn(sum(lens), H, D), torch.randn(sum(lens), H, D)
    q = torch.randn(sum(lens), hq, D)
    idx = torch.cat([b.slots[0:7], b.slots[20:33]])
    layer.store(key=keys, value=vals, slots=idx)
    cu = torch.tensor([0, 7, 20], dtype=torch.int32)
    seq = SimpleNamespace(cache_lengths=torch.zeros(2, dtype=torch.int32), input_lengths=torch.tensor(lens),
                          cu_seqlen_q=cu, max_q=13, max_k=13)
    out = kv.attention(query=q, key=keys, value=vals, kv_cache=layer, kv_scales=None, seqlen=seq,
                       block_tables=b.block_tables_tensor, softmax_scale=scale)
    for i in range(2):
        s, e = int(cu[i]), int(cu[i + 1])
        torch.testing.assert_close(out[s:e], _sdpa(q[s:e], keys[s:e], vals[s:e], scale))
    qd = torch.randn(2, hq, D)
    seq_d = SimpleNamespace(cache_lengths=torch.tensor(lens) - 1, input_lengths=torch.ones(2, dtype=torch.int32))
    dec = kv.paged_attention(qd, layer, None, scale, b.block_tables_tensor, seq_d, 13, kv_scales=None)
    torch.testing.assert_close(dec[1:], _sdpa(qd[1:], keys[7:], vals[7:], scale))
    cache.close()
