"""decode against an independent fp64 reference: odd batches, contexts, GQA ratios, far slots."""

import math
import os

import pytest
import torch

from vattn.core.errors import TensorError, UnsupportedError
from vattn.core.ops import decode, installed_backends, is_supported
from vattn.core.ops.synthetic import group_views, make_decode_batch

CUDA = torch.cuda.is_available()
TOL = {torch.float16: dict(rtol=1e-3, atol=1e-3), torch.bfloat16: dict(rtol=1e-2, atol=1e-2),
       torch.float32: dict(rtol=1e-5, atol=1e-5)}
CASES = [  # (batch, contexts, kv_heads, gqa)
    (1, [1], 2, 1), (3, [97, 1, 1029], 2, 4), (17, None, 1, 7), (3, [1000, 1500, 7], 4, 1)]


def naive_decode(q, k, v, slots, seqlens, scale):
    """fp64, one request at a time, all heads at once (query head h reads KV head h // gqa)."""
    out = torch.empty(q.shape, dtype=torch.float64)
    kv_heads = k.shape[2]
    for b, (s, n) in enumerate(zip(slots.tolist(), seqlens.tolist())):
        qq = q[b].double().view(kv_heads, -1, q.shape[-1])             # [Hk, gqa, D]
        kk, vv = k[s, :n].double(), v[s, :n].double()                  # [n, Hk, D]
        w = torch.softmax(torch.einsum("hgd,nhd->hgn", qq, kk) * scale, dim=-1)
        out[b] = torch.einsum("hgn,nhd->hgd", w, vv).reshape(q.shape[1:])
    return out


def _data(batch, lens, kv_heads, gqa, dtype, device, dim=40, rows=1536):
    g = torch.Generator().manual_seed(batch * 31 + gqa)
    # tensors drawn where they live: on a GPU, filling GBs on the host would dominate the test
    gt = g if torch.device(device).type == "cpu" else torch.Generator(device=device).manual_seed(batch * 31 + gqa)
    lens = lens or torch.randint(1, rows + 1, (batch,), generator=g).tolist()
    num_slots = 3 * batch + 2
    slots = torch.randperm(num_slots, generator=g)[:batch].tolist()
    slots[-1] = num_slots - 1                                   # far apart: first and last slots
    k, v, keep = group_views(slots=num_slots, rows_per_slot=rows, group_size=2, kv_heads=kv_heads,
                             head_dim=dim, dtype=dtype, device=device, layer=1, generator=gt)
    qb = make_decode_batch(slots=slots, seqlens=lens, q_heads=kv_heads * gqa, head_dim=dim,
                           dtype=dtype, device=device, generator=gt)
    return k, v, keep, qb


@pytest.mark.parametrize("batch,lens,kv_heads,gqa", CASES)
def test_decode_cpu_matches_fp64(batch, lens, kv_heads, gqa):
    k, v, _, qb = _data(batch, lens, kv_heads, gqa, torch.float32, "cpu")
    out = decode(qb.q, k, v, slots=qb.slots, seqlens=qb.seqlens)
    ref = naive_decode(qb.q, k, v, qb.slots, qb.seqlens, qb.q.shape[-1] ** -0.5)
    torch.testing.assert_close(out.double(), ref, **TOL[torch.float32])


def test_decode_out_and_scale():
    k, v, _, qb = _data(3, [5, 9, 2], 2, 4, torch.float32, "cpu")
    out = torch.empty_like(qb.q)
    res = decode(qb.q, k, v, slots=qb.slots, seqlens=qb.seqlens, scale=0.3, out=out)
    assert res.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out.double(), naive_decode(qb.q, k, v, qb.slots, qb.seqlens, 0.3),
                               **TOL[torch.float32])


def test_decode_errors():
    k, v, _, qb = _data(3, [5, 9, 2], 2, 4, torch.float32, "cpu")
    with pytest.raises(TensorError, match="dtype of q"):
        decode(qb.q.double(), k, v, slots=qb.slots, seqlens=qb.seqlens)
    with pytest.raises(TensorError, match="multiple of kv heads"):
        decode(qb.q[:, :7], k, v, slots=qb.slots, seqlens=qb.seqlens)
    with pytest.raises(TensorError, match="slots"):
        decode(qb.q, k, v, slots=qb.slots[:2], seqlens=qb.seqlens)
    with pytest.raises(TensorError, match="max_seqlen_k"):
        decode(qb.q, k, v, slots=qb.slots, seqlens=qb.seqlens, max_seqlen_k=k.shape[1] + 1)
    with pytest.raises(TensorError, match="out"):
        decode(qb.q, k, v, slots=qb.slots, seqlens=qb.seqlens, out=torch.empty(2, 8, 40))
    with pytest.raises(UnsupportedError, match="CUDA"):
        decode(qb.q, k, v, slots=qb.slots, seqlens=qb.seqlens, backend="torch_fa2")
    with pytest.raises(TensorError, match="cu_seqlens_q"):
        decode(qb.q, k, v, slots=qb.slots, seqlens=qb.seqlens, cu_seqlens_q=torch.arange(4))
    with pytest.raises(TensorError, match="cu_seqlens_q"):
        decode(qb.q, k, v, slots=qb.slots, seqlens=qb.seqlens,
               cu_seqlens_q=torch.arange(3, dtype=torch.int32))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="set TRITON_INTERPRET=1 "
                    "(and install triton) to run the Triton kernel on the CPU interpreter")
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("batch,lens,kv_heads,gqa", CASES[:3])
def test_triton_decode_interpreter(batch, lens, kv_heads, gqa, splits):
    pytest.importorskip("triton")
    from vattn.core.ops.triton_decode import TritonDecodeConfig, decode_triton
    k, v, _, qb = _data(batch, lens, kv_heads, gqa, torch.float16, "cpu", rows=1100)
    out = decode_triton(qb.q, k, v, slots=qb.slots, seqlens=qb.seqlens, max_seqlen_k=k.shape[1],
                        scale=qb.q.shape[-1] ** -0.5, out=torch.empty_like(qb.q),
                        config=TritonDecodeConfig(block_n=64), num_splits=splits)
    ref = naive_decode(qb.q, k, v, qb.slots, qb.seqlens, qb.q.shape[-1] ** -0.5)
    torch.testing.assert_close(out.double(), ref, **TOL[torch.float16])


GPU_BACKENDS = ["triton", "torch_fa2", "vllm_fa3", "vllm_fa2", "sgl_fa3", "flash_attn", "flashinfer"]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch,lens,kv_heads,gqa", CASES + [(64, None, 8, 4)])
def test_decode_cuda(backend, dtype, batch, lens, kv_heads, gqa):
    dim = 128
    cap = tuple(torch.cuda.get_device_capability())
    if not is_supported(backend, op="decode", device_type="cuda", dtype=dtype, head_dim=dim,
                        capability=cap):
        pytest.skip(f"{backend} not installed / not supported here ({sorted(installed_backends())})")
    k, v, _, qb = _data(batch, lens, kv_heads, gqa, dtype, "cuda", dim=dim, rows=2048)
    out = decode(qb.q, k, v, slots=qb.slots, seqlens=qb.seqlens, backend=backend)
    ref = naive_decode(qb.q.cpu(), k.cpu(), v.cpu(), qb.slots.cpu(), qb.seqlens.cpu(), dim ** -0.5)
    torch.testing.assert_close(out.double().cpu(), ref, **TOL[dtype])
    assert not math.isnan(out.float().sum().item())


def test_decode_and_prefill_on_virtual_cache_far_slots_straddling_pages():
    core = pytest.importorskip("vattn.core")
    from vattn.core.ops import prefill, rows_for, store
    cfg = core.KVCacheConfig(num_layers=4, num_kv_heads=3, head_dim=40, dtype=torch.float32,
                             max_slots=40, max_context=3000, group_size=2, page_budget=96 << 20,
                             device="cpu", map_ahead_tokens=0)
    g = torch.Generator().manual_seed(5)
    with core.VirtualKVCache(cfg) as cache:
        slots = [cache.acquire() for _ in range(40)]
        use, lens = [slots[-1], slots[0], slots[17]], [2300, 1, 1093]   # 2300 crosses a page
        assert cache.ensure(dict(zip(use, lens))) == []
        layer, rps = 3, cache.layout.rows_per_slot
        tok_s = torch.cat([torch.full((n,), s) for s, n in zip(use, lens)])
        tok_p = torch.cat([torch.arange(n) for n in lens])
        k_new, v_new = torch.randn(len(tok_s), 3, 40, generator=g), torch.randn(len(tok_s), 3, 40, generator=g)
        store(cache.k_rows(layer), cache.v_rows(layer), k_new, v_new, rows_for(tok_s, tok_p, rps))
        k, v = cache.k(layer), cache.v(layer)
        q = torch.randn(3, 21, 40, generator=g)                                  # GQA 7
        st, sl = torch.tensor(use), torch.tensor(lens, dtype=torch.int32)
        out = decode(q, k, v, slots=st, seqlens=sl)
        torch.testing.assert_close(out.double(), naive_decode(q, k, v, st, sl, 40 ** -0.5),
                                   **TOL[torch.float32])
        cu = torch.tensor([0, 1, 2, 3], dtype=torch.int32)                        # prefill == decode
        pre = prefill(q, k, v, cu_seqlens_q=cu, slots=st, seqlens_k=sl, max_seqlen_q=1,
                      max_seqlen_k=max(lens))
        torch.testing.assert_close(pre, out, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_decode_cuda_virtual_cache_offsets_beyond_2_31(backend):
    core = pytest.importorskip("vattn.core")
    from vattn.core.ops import rows_for, store
    dtype, cap = torch.bfloat16, tuple(torch.cuda.get_device_capability())
    if not is_supported(backend, op="decode", device_type="cuda", dtype=dtype, head_dim=128,
                        capability=cap):
        pytest.skip(f"{backend} not installed / not supported here")
    cfg = core.KVCacheConfig(num_layers=2, num_kv_heads=8, head_dim=128, dtype=dtype, max_slots=64,
                             max_context=131072, group_size=2, page_budget=1 << 30, device="cuda",
                             map_ahead_tokens=0)
    with core.VirtualKVCache(cfg) as cache:
        slots = [cache.acquire() for _ in range(64)]
        use, lens = [slots[-1], slots[1]], [3001, 77]
        assert cache.ensure(dict(zip(use, lens))) == []
        rps = cache.layout.rows_per_slot
        assert use[0] * rps * cache.k_rows(1).stride(0) > 2**31
        tok_s = torch.cat([torch.full((n,), s) for s, n in zip(use, lens)]).cuda()
        tok_p = torch.cat([torch.arange(n) for n in lens]).cuda()
        kv = torch.randn(2, len(tok_s), 8, 128, device="cuda").to(dtype)
        store(cache.k_rows(1), cache.v_rows(1), kv[0], kv[1], rows_for(tok_s, tok_p, rps))
        q = torch.randn(2, 32, 128, device="cuda").to(dtype)
        st = torch.tensor(use, device="cuda")
        sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
        out = decode(q, cache.k(1), cache.v(1), slots=st, seqlens=sl, max_seqlen_k=4096,
                     backend=backend)
        k_ref = torch.zeros(max(use) + 1, 3001, 8, 128, dtype=dtype)
        v_ref = torch.zeros_like(k_ref)
        k_ref[tok_s.cpu(), tok_p.cpu()] = kv[0].cpu()
        v_ref[tok_s.cpu(), tok_p.cpu()] = kv[1].cpu()
        ref = naive_decode(q.cpu(), k_ref, v_ref, st.cpu(), sl.cpu(), 128 ** -0.5)
        torch.testing.assert_close(out.double().cpu(), ref, **TOL[dtype])
        torch.cuda.synchronize()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="set TRITON_INTERPRET=1 "
                    "(and install triton) to run the Triton kernels on the CPU interpreter")
def test_triton_kernels_on_virtual_cache_with_unmapped_slot0_interpreter():
    """Store + decode on a host VirtualKVCache whose first bytes (slot 0) hold no page."""
    pytest.importorskip("triton")
    from vattn.core import KVCacheConfig, VirtualKVCache
    from vattn.core.ops import rows_for, store
    cfg = KVCacheConfig(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float16, max_slots=4,
                        max_context=4096, group_size=2, page_budget=64 << 20, map_ahead_tokens=0)
    with VirtualKVCache(cfg) as cache:
        slots = [cache.acquire() for _ in range(4)]
        use, lens = [s for s in slots if s != 0][:2], [300, 41]
        assert cache.ensure(dict(zip(use, lens))) == []
        tok_s = torch.cat([torch.full((n,), s) for s, n in zip(use, lens)])
        tok_p = torch.cat([torch.arange(n) for n in lens])
        g = torch.Generator().manual_seed(5)
        kv = torch.randn(2, len(tok_s), 2, 16, generator=g).half()
        rows = rows_for(tok_s, tok_p, cache.layout.rows_per_slot)
        store(cache.k_rows(1), cache.v_rows(1), kv[0], kv[1], rows, backend="triton")
        q = torch.randn(2, 8, 16, generator=g).half()
        st, sl = torch.tensor(use), torch.tensor(lens, dtype=torch.int32)
        from vattn.core.ops.triton_decode import decode_triton
        out = decode_triton(q, cache.k(1), cache.v(1), slots=st, seqlens=sl, max_seqlen_k=300,
                            scale=0.25, out=torch.empty_like(q), num_splits=2)
        ref = naive_decode(q, cache.k(1), cache.v(1), st, sl, 0.25)
        torch.testing.assert_close(out.double(), ref, **TOL[torch.float16])
