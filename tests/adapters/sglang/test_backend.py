"""vattn pool/allocator/backend through SGLang's own classes vs its torch_native backend.

Both sides get the same requests through SGLang's real ReqToTokenPool, allocation functions
(``alloc_token_slots`` for stock, ``alloc_paged_token_slots_extend/decode`` for vattn),
ChunkCache, RadixAttention layers and ForwardBatch; outputs must be bit-identical.
"""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang.srt.layers.attention.torch_native_backend",
                    reason="sglang (CPU import set) not installed")

from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: E402
from sglang.srt.layers.radix_attention import RadixAttention  # noqa: E402
from sglang.srt.mem_cache.allocation import (  # noqa: E402
    alloc_paged_token_slots_decode, alloc_paged_token_slots_extend, alloc_token_slots,
    get_last_loc_torch)
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.chunk_cache import ChunkCache  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402

from vattn.adapters.sglang.allocator import VattnTokenAllocator  # noqa: E402
from vattn.adapters.sglang.backend import VattnAttnBackend  # noqa: E402
from vattn.adapters.sglang.pool import VattnMHATokenToKVPool, make_cache  # noqa: E402
from vattn.core.errors import ConfigError, UnsupportedError  # noqa: E402

L, HQ, HK, D, CTX, REQS, PAGE = 2, 4, 2, 32, 96, 5, 16


class Side:
    """One engine side: SGLang ReqToTokenPool + KV pool + allocator + ChunkCache + backend."""

    def __init__(self, pool, allocator, backend_cls, r2t=None, **kw):
        self.r2t = r2t or ReqToTokenPool(size=REQS, max_context_len=CTX, device="cpu",
                                         enable_memory_saver=False)
        self.pool, self.alloc = pool, allocator
        self.tree = ChunkCache(SimpleNamespace(req_to_token_pool=self.r2t, page_size=pool.page_size,
                                               token_to_kv_pool_allocator=allocator))
        self.runner = SimpleNamespace(device="cpu", req_to_token_pool=self.r2t,
                                      token_to_kv_pool=pool, server_args=kw.pop("server_args", None))
        self.backend = backend_cls(self.runner, **kw)

    def locs(self, mode, rpi, prefix, seq):
        n = sum(s - p for p, s in zip(prefix, seq))
        if self.pool.page_size == 1:
            return alloc_token_slots(self.tree, n)
        rpi_t, p_t, s_t = (torch.tensor(x, dtype=torch.int64) for x in (rpi, prefix, seq))
        last = get_last_loc_torch(self.r2t.req_to_token, rpi_t, p_t)
        if mode is ForwardMode.EXTEND:
            return alloc_paged_token_slots_extend(self.tree, p_t, p_t, s_t, s_t, last, n)
        return alloc_paged_token_slots_decode(self.tree, s_t, s_t, last)

    def forward_batch(self, mode, rpi, prefix, seq):
        loc = self.locs(mode, rpi, prefix, seq)
        for r, p, s, part in zip(rpi, prefix, seq, loc.split([s - p for p, s in zip(prefix, seq)])):
            self.r2t.write((r, slice(p, s)), part.to(torch.int32))
        ext = [s - p for p, s in zip(prefix, seq)]
        t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
        fb = ForwardBatch(forward_mode=mode, batch_size=len(rpi), input_ids=t([0] * sum(ext)),
                          req_pool_indices=t(rpi), seq_lens=t(seq), out_cache_loc=loc,
                          seq_lens_sum=sum(seq), seq_lens_cpu=t(seq), extend_num_tokens=sum(ext),
                          extend_prefix_lens=t(prefix), extend_seq_lens=t(ext),
                          extend_prefix_lens_cpu=prefix, extend_seq_lens_cpu=ext)
        self.backend.init_forward_metadata(fb)
        return fb

    def finish(self, req, length):
        self.tree.cache_finished_req(req, kv_len_to_handle=length)
        self.r2t.free(req)


def make_sides(d=D):
    stock_pool = MHATokenToKVPool(size=REQS * CTX, page_size=1, dtype=torch.float32, head_num=HK,
                                  head_dim=d, layer_num=L, device="cpu", enable_memory_saver=False,
                                  enable_alt_stream=False)
    stock = Side(stock_pool, TokenToKVPoolAllocator(REQS * CTX, torch.float32, "cpu", stock_pool,
                                                    need_sort=False), TorchNativeAttnBackend)
    cache = make_cache(num_layers=L, num_kv_heads=HK, head_dim=d, dtype=torch.float32,
                       max_requests=REQS, max_context=CTX, device="cpu", page_budget=64 << 20,
                       page_bytes=PAGE * 2 * HK * d * 4)       # one page-set = one SGLang page
    pool = VattnMHATokenToKVPool.from_cache(cache, page_size=PAGE)
    return stock, Side(pool, VattnTokenAllocator.for_pool(pool), VattnAttnBackend)


LAYERS = [RadixAttention(HQ, D, D ** -0.5, HK, layer_id=i) for i in range(L)]


def run_step(sides, mode, rpi, prefix, seq, gen, layers=None):
    fbs = [side.forward_batch(mode, rpi, prefix, seq) for side in sides]
    n = sum(s - p for p, s in zip(prefix, seq))
    for layer in layers or LAYERS:
        d = layer.qk_head_dim
        q, k, v = (torch.randn(n, h * d, generator=gen) for h in (HQ, HK, HK))
        k, v = k.view(n, HK, d), v.view(n, HK, d)
        fwd = "forward_extend" if mode is ForwardMode.EXTEND else "forward_decode"
        o_stock, o_vattn = (getattr(s.backend, fwd)(q, k, v, layer, fb)
                            for s, fb in zip(sides, fbs))
        assert torch.equal(o_vattn, o_stock), (mode, layer.layer_id,
                                               (o_vattn - o_stock).abs().max().item())


@pytest.mark.parametrize("lens", [(17, 5, 40), (1, 33, 64)])
def test_extend_chunked_then_decode_bit_identical_to_torch_native(lens):
    run_cycle(make_sides(), lens)


def test_configurator_built_vattn_side_bit_identical_to_torch_native(configure_pools,
                                                                     sglang_server_args):
    """Pool, allocator and ReqToTokenPool from SGLang's configurator with the vattn platform,
    backend from the plugin's factory (which checks the cache against the ReqToTokenPool)."""
    from vattn.adapters.sglang.platform import VattnCudaPlatform
    from vattn.adapters.sglang.plugin import create_vattn_backend

    pools = configure_pools(VattnCudaPlatform(), num_tokens=512)
    d = 64                                                        # the tiny model's head dim
    vattn = Side(pools.token_to_kv_pool, pools.token_to_kv_pool_allocator, create_vattn_backend,
                 r2t=pools.req_to_token_pool, server_args=sglang_server_args)
    run_cycle([make_sides(d)[0], vattn], (9, 40, 3),
              layers=[RadixAttention(HQ, d, d ** -0.5, HK, layer_id=i) for i in range(L)])
    assert vattn.alloc.available_size() == 512                    # idle again: SGLang's check


def run_cycle(sides, lens, layers=None):
    gen = torch.Generator().manual_seed(sum(lens))
    reqs = [SimpleNamespace(req_pool_idx=None, cache_protected_len=0) for _ in lens]
    rpi = sides[0].r2t.alloc(reqs)
    assert sides[1].r2t.alloc([SimpleNamespace(req_pool_idx=None) for _ in lens]) == rpi
    first = [max(1, n // 2) for n in lens]
    run_step(sides, ForwardMode.EXTEND, rpi, [0] * len(lens), first, gen, layers)
    run_step(sides, ForwardMode.EXTEND, rpi, first, list(lens), gen, layers)  # chunked prefill
    seq = list(lens)
    for _ in range(5):
        seq = [s + 1 for s in seq]
        run_step(sides, ForwardMode.DECODE, rpi, [s - 1 for s in seq], seq, gen, layers)
    stock_free, vattn = sides[0].alloc.available_size(), sides[1]
    for req, s in zip(reqs, seq):
        sides[0].finish(SimpleNamespace(**vars(req)), s)
        vattn.finish(SimpleNamespace(**vars(req)), s)
    assert sides[0].alloc.available_size() == stock_free + sum(seq)
    assert vattn.alloc.live_slots() == frozenset()


def test_decode_graph_metadata_is_persistent_pads_to_the_pad_slot_and_matches_eager():
    """The decode CUDA-graph path (capture/replay metadata in persistent buffers) against the
    eager path of the same backend, on a batch padded the way SGLang's graph runner pads it."""
    from vattn.adapters.sglang.pool import PAD_SLOT
    _, vattn = make_sides()
    vattn.backend = VattnAttnBackend(vattn.runner, op_backend="reference")
    gen = torch.Generator().manual_seed(7)
    lens = [12, 30, 5]
    rpi = vattn.r2t.alloc([SimpleNamespace(req_pool_idx=None) for _ in lens])
    fb0 = vattn.forward_batch(ForwardMode.EXTEND, rpi, [0] * 3, lens)   # prefill: store the KV
    for layer in LAYERS:
        n = sum(lens)
        vattn.backend.forward_extend(torch.randn(n, HQ * D, generator=gen), torch.randn(n, HK, D, generator=gen),
                                     torch.randn(n, HK, D, generator=gen), layer, fb0)
    seq = [n + 1 for n in lens]
    fb = vattn.forward_batch(ForwardMode.DECODE, rpi, lens, seq)   # eager metadata (+ this step's KV slots)
    layer = LAYERS[1]
    q = torch.randn(3, HQ * D, generator=gen)
    k, v = torch.randn(3, HK, D, generator=gen), torch.randn(3, HK, D, generator=gen)
    eager = vattn.backend.forward_decode(q, k, v, layer, fb)
    assert vattn.backend.forward_metadata.cu_seqlens_q.tolist() == [0, 1, 2, 3]

    be = vattn.backend
    with pytest.raises(ConfigError, match="init_cuda_graph_state"):
        be.init_forward_metadata_out_graph(fb, in_capture=True)
    be.init_cuda_graph_state(max_bs=8, max_num_tokens=8)
    stale = torch.tensor([*rpi, rpi[0]], dtype=torch.int64)          # a padding row with a stale index
    padded = SimpleNamespace(forward_mode=ForwardMode.DECODE, batch_size=4, num_padding=1,
                             req_pool_indices=stale, seq_lens=torch.tensor([*seq, 1]))
    be.init_forward_metadata_out_graph(padded, in_capture=True)      # capture: a dummy batch
    md = be.forward_metadata
    assert md.slots.tolist() == [PAD_SLOT] * 4 and md.rows.tolist() == [0] * 4
    be.init_forward_metadata_out_graph(padded)                         # replay: the real batch
    assert be.forward_metadata.slots.data_ptr() == md.slots.data_ptr()  # the same buffers
    assert md.slots.data_ptr() == be._graph_slots.data_ptr() and md.slots[3].item() == PAD_SLOT
    assert md.slots[:3].tolist() == [vattn.pool.requests.slot_of[r] for r in rpi]
    assert md.max_seqlen_k == vattn.pool.rows_per_slot and md.seqlens.tolist() == [*seq, 1]
    assert md.cu_seqlens_q.tolist() == [0, 1, 2, 3, 4]                 # built once, not per layer
    assert md.cu_seqlens_q.data_ptr() == be._graph_cu_q.data_ptr()
    qp = torch.cat([q, torch.randn(1, HQ * D, generator=gen)])
    out = be.forward_decode(qp, None, None, layer, padded, save_kv_cache=False)   # KV stored above
    torch.testing.assert_close(out[:3], eager, rtol=1e-6, atol=1e-6)
    with pytest.raises(UnsupportedError, match="decode only"):
        be.init_forward_metadata_out_graph(SimpleNamespace(forward_mode=ForwardMode.EXTEND, batch_size=1))
    with pytest.raises(UnsupportedError, match="sdpa"):
        VattnAttnBackend(vattn.runner, op_backend="sdpa").init_cuda_graph_state(4, 4)
