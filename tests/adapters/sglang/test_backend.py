"""vattn pool/allocator/backend driven through SGLang's own classes vs TorchNativeAttnBackend."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang.srt.layers.attention.torch_native_backend",
                    reason="sglang (CPU import set) not installed")

from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402

from vattn.adapters.sglang.allocator import VattnTokenAllocator  # noqa: E402
from vattn.adapters.sglang.backend import VattnAttnBackend  # noqa: E402
from vattn.adapters.sglang.pool import VattnMHATokenToKVPool, make_cache  # noqa: E402

L, HQ, HK, D, CTX, REQS = 2, 4, 2, 32, 96, 5


def _layer(i):
    return SimpleNamespace(layer_id=i, tp_q_head_num=HQ, tp_k_head_num=HK, qk_head_dim=D,
                           v_head_dim=D, scaling=D ** -0.5, is_cross_attention=False,
                           attn_type=None, sliding_window_size=None, logit_cap=0.0)


class _Pair:
    """Stock SGLang pools + torch_native backend next to the vattn ones, same requests."""

    def __init__(self):
        self.r2t = ReqToTokenPool(size=REQS, max_context_len=CTX, device="cpu",
                                  enable_memory_saver=False)
        self.stock_pool = MHATokenToKVPool(size=REQS * CTX, page_size=1, dtype=torch.float32,
                                           head_num=HK, head_dim=D, layer_num=L, device="cpu",
                                           enable_memory_saver=False, enable_alt_stream=False)
        self.cache = make_cache(num_layers=L, num_kv_heads=HK, head_dim=D, dtype=torch.float32,
                                max_requests=REQS, max_context=CTX, device="cpu",
                                page_budget=64 << 20)
        self.pool = VattnMHATokenToKVPool(self.cache)
        self.alloc = VattnTokenAllocator(self.pool)
        runner = lambda pool: SimpleNamespace(device="cpu", req_to_token_pool=self.r2t,
                                              token_to_kv_pool=pool)
        self.stock = TorchNativeAttnBackend(runner(self.stock_pool))
        self.vattn = VattnAttnBackend(runner(self.pool), op_backend="reference")
        self.next_stock = 1  # stock token index 0 is SGLang's padding slot

    def batch(self, mode, reqs, prefix, seq):
        new = [s - p for p, s in zip(prefix, seq)]
        stock_loc = torch.arange(self.next_stock, self.next_stock + sum(new))
        self.next_stock += sum(new)
        for r, p, s, loc in zip(reqs, prefix, seq, stock_loc.split(new)):
            self.r2t.req_to_token[r, p:s] = loc.to(torch.int32)
        alloc = self.alloc.alloc_extend if mode is ForwardMode.EXTEND else None
        vloc = (alloc(reqs, prefix, seq) if alloc else self.alloc.alloc_decode(reqs, seq))
        common = dict(forward_mode=mode, req_pool_indices=torch.tensor(reqs),
                      seq_lens=torch.tensor(seq), seq_lens_cpu=torch.tensor(seq),
                      extend_prefix_lens=torch.tensor(prefix), extend_seq_lens=torch.tensor(new),
                      extend_seq_lens_cpu=new, encoder_lens=None)
        return (SimpleNamespace(out_cache_loc=stock_loc, **common),
                SimpleNamespace(out_cache_loc=vloc, **common), sum(new))

    def step(self, mode, reqs, prefix, seq, gen):
        fb_s, fb_v, n = self.batch(mode, reqs, prefix, seq)
        self.stock.init_forward_metadata(fb_s)
        self.vattn.init_forward_metadata(fb_v)
        fwd = "forward_extend" if mode is ForwardMode.EXTEND else "forward_decode"
        for i in range(L):
            q, k, v = (torch.randn(n, h * D, generator=gen) for h in (HQ, HK, HK))
            k, v = k.view(n, HK, D), v.view(n, HK, D)
            o_s = getattr(self.stock, fwd)(q, k, v, _layer(i), fb_s)
            o_v = getattr(self.vattn, fwd)(q, k, v, _layer(i), fb_v)
            # fp32 SDPA vs the ops reference path: same math, different reduction order (~1e-7)
            torch.testing.assert_close(o_v, o_s, rtol=1e-5, atol=2e-6)


def test_extend_chunked_then_decode_matches_torch_native():
    pair, gen = _Pair(), torch.Generator().manual_seed(0)
    reqs = [3, 1, 4]
    pair.step(ForwardMode.EXTEND, reqs, [0, 0, 0], [17, 5, 40], gen)
    pair.step(ForwardMode.EXTEND, reqs, [17, 5, 40], [30, 6, 53], gen)  # chunked prefill
    seq = [30, 6, 53]
    for _ in range(4):
        seq = [s + 1 for s in seq]
        pair.step(ForwardMode.DECODE, reqs, [s - 1 for s in seq], seq, gen)


def test_token_index_is_slot_times_rows_per_slot_plus_position():
    pair = _Pair()
    loc = pair.alloc.alloc_extend([2], [0], [7])
    slot, c = pair.alloc.slot_of(2), pair.cache.layout.rows_per_slot
    assert loc.tolist() == [slot * c + t for t in range(7)]
    assert pair.pool.get_key_buffer(0).data_ptr() == pair.cache.k_rows(0).data_ptr()


def test_free_releases_slot_and_capacity_reports_physical_pages():
    pair = _Pair()
    before = pair.alloc.available_size()
    pair.alloc.alloc_extend([1], [0], [80])
    during = pair.alloc.available_size()
    assert during < before  # mapped pages leave the free count
    pair.alloc.free_request(1)
    assert pair.alloc.available_size() == before  # a released slot's pages are reclaimable
    with pytest.raises(Exception, match="no vattn slot"):
        pair.alloc.free_request(1)
