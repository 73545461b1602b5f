"""store / rows_for: any mix of requests and positions lands in row slot * rows_per_slot + pos."""

import os

import pytest
import torch

from vattn.core.errors import TensorError, UnsupportedError
from vattn.core.ops import rows_for, store
from vattn.core.ops.synthetic import group_views

CUDA = torch.cuda.is_available()


def _case(device, dtype, *, slots=7, rows=97, group=3, heads=5, dim=24, n=41, seed=0):
    g = torch.Generator().manual_seed(seed)
    k, v, keep = group_views(slots=slots, rows_per_slot=rows, group_size=group, kv_heads=heads,
                             head_dim=dim, dtype=dtype, device=device, layer=1, generator=g)
    pairs = torch.randperm(slots * rows, generator=g)[:n]          # distinct (slot, pos) pairs
    tok_slots, tok_pos = (pairs // rows).to(device), (pairs % rows).to(device)
    k_new = torch.randn(n, heads, dim, generator=g).to(device, dtype)
    v_new = torch.randn(n, heads, dim, generator=g).to(device, dtype)
    return k, v, keep, tok_slots, tok_pos, k_new, v_new


@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("as_rows", [True, False])
def test_store_writes_each_token_to_its_row(backend, as_rows):
    k, v, keep, s, p, k_new, v_new = _case("cpu", torch.float32)
    before = keep.clone()
    rows = rows_for(s, p, k.shape[1])
    store(_rows(k) if as_rows else k, _rows(v) if as_rows else v, k_new, v_new, rows,
          backend=backend)
    torch.testing.assert_close(k[s, p], k_new, rtol=0, atol=0)
    torch.testing.assert_close(v[s, p], v_new, rtol=0, atol=0)
    # nothing else changed (other layers of the group, other rows)
    mask = torch.ones(keep.shape[:2], dtype=torch.bool)
    mask[s, p] = False
    torch.testing.assert_close(keep[mask], before[mask], rtol=0, atol=0)
    torch.testing.assert_close(keep[s, p][:, [0, 2]], before[s, p][:, [0, 2]], rtol=0, atol=0)


def _rows(view):
    slots, rows, h, d = view.shape
    return view.as_strided((slots * rows, h, d), view.stride()[1:])


def test_rows_for_is_64_bit():
    slots = torch.tensor([0, 40000], dtype=torch.int32)
    pos = torch.tensor([5, 131071], dtype=torch.int32)
    rows = rows_for(slots, pos, 131072)
    assert rows.dtype == torch.int64
    assert rows.tolist() == [5, 40000 * 131072 + 131071]


def test_store_strided_new_rows():
    k, v, keep, s, p, k_new, v_new = _case("cpu", torch.float16, n=5)
    qkv = torch.randn(5, 3, *k_new.shape[1:]).to(torch.float16)       # k_new as a strided slice
    store(k, v, qkv[:, 1], qkv[:, 2], rows_for(s, p, k.shape[1]))
    torch.testing.assert_close(k[s, p], qkv[:, 1], rtol=0, atol=0)
    torch.testing.assert_close(v[s, p], qkv[:, 2], rtol=0, atol=0)


def test_store_empty_is_noop():
    k, v, keep, *_ = _case("cpu", torch.float32)
    before = keep.clone()
    empty = torch.empty(0, *k.shape[2:])
    store(k, v, empty, empty, torch.empty(0, dtype=torch.int64))
    assert torch.equal(keep, before)


def test_store_errors():
    k, v, keep, s, p, k_new, v_new = _case("cpu", torch.float32, n=4)
    rows = rows_for(s, p, k.shape[1])
    with pytest.raises(TensorError, match="k_new"):
        store(k, v, k_new[:, :2], v_new, rows)
    with pytest.raises(TensorError, match="k_new"):
        store(k, v, k_new.half(), v_new, rows)
    with pytest.raises(TensorError, match="rows"):
        store(k, v, k_new, v_new, rows.int())
    with pytest.raises(TensorError, match="rows"):
        store(k, v, k_new, v_new, rows[:3])
    with pytest.raises(TensorError, match="strides"):
        store(k.transpose(2, 3), v.transpose(2, 3), k_new, v_new, rows)
    with pytest.raises(UnsupportedError):
        store(k, v, k_new, v_new, rows, backend="nope")


def test_store_into_virtual_cache_far_slots_and_straddling_tokens():
    core = pytest.importorskip("vattn.core")
    # 3 heads x 40 dims fp32 x 2 (K,V) = 960 bytes a token: tokens straddle 2 MiB pages
    cfg = core.KVCacheConfig(num_layers=2, num_kv_heads=3, head_dim=40, dtype=torch.float32,
                             max_slots=64, max_context=80000, group_size=2, page_budget=64 << 20,
                             device="cpu", map_ahead_tokens=0)
    with core.VirtualKVCache(cfg) as cache:
        slots = [cache.acquire() for _ in range(64)]
        first, last = slots[0], slots[-1]
        n_tok = 2200                                   # crosses the first page boundary (2184.5)
        assert cache.ensure({first: n_tok, last: n_tok}) == []
        rows_per_slot = cache.layout.rows_per_slot
        offset = int(last * rows_per_slot * cache.k_rows(1).stride(0))
        assert offset > 2**31, offset                      # 64-bit element offsets needed
        pos = torch.arange(2180, 2190)
        s = torch.tensor([first, last] * 5)
        k_new = torch.randn(10, 3, 40)
        v_new = torch.randn(10, 3, 40)
        store(cache.k_rows(1), cache.v_rows(1), k_new, v_new, rows_for(s, pos, rows_per_slot))
        torch.testing.assert_close(cache.k(1)[s, pos], k_new, rtol=0, atol=0)
        torch.testing.assert_close(cache.v(1)[s, pos], v_new, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_store_cuda(backend, dtype):
    if backend == "triton":
        pytest.importorskip("triton")
    k, v, keep, s, p, k_new, v_new = _case("cuda", dtype, n=300, dim=128, heads=8, rows=1000)
    store(_rows(k), _rows(v), k_new, v_new, rows_for(s, p, k.shape[1]), backend=backend)
    torch.testing.assert_close(k[s, p], k_new, rtol=0, atol=0)
    torch.testing.assert_close(v[s, p], v_new, rtol=0, atol=0)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="set TRITON_INTERPRET=1 "
                    "(and install triton) to run the Triton store kernel on the CPU interpreter")
def test_store_triton_interpreter():
    pytest.importorskip("triton")
    k, v, keep, s, p, k_new, v_new = _case("cpu", torch.float16, n=13, dim=24)
    store(k, v, k_new, v_new, rows_for(s, p, k.shape[1]), backend="triton")
    torch.testing.assert_close(k[s, p], k_new, rtol=0, atol=0)
    torch.testing.assert_close(v[s, p], v_new, rtol=0, atol=0)
