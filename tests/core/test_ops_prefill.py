"""prefill / chunked prefill on a cached prefix against an fp64 reference (causal bottom-right)."""

import pytest
import torch

from vattn.core.errors import TensorError
from vattn.core.ops import installed_backends, is_supported, prefill
from vattn.core.ops.synthetic import group_views, make_prefill_batch

CUDA = torch.cuda.is_available()
TOL = {torch.float16: dict(rtol=1e-3, atol=1e-3), torch.bfloat16: dict(rtol=1e-2, atol=1e-2),
       torch.float32: dict(rtol=1e-5, atol=1e-5)}
CASES = [  # (q_lens, k_lens, kv_heads, gqa): full prompts, chunks on prefixes, single tokens
    ([1], [1], 2, 1), ([5, 97, 1], [5, 1029, 40], 2, 4), ([3] * 17, None, 1, 7), ([64], [1000], 4, 1)]


def naive_prefill(q, k, v, cu, slots, k_lens, scale, causal=True):
    out = torch.empty(q.shape, dtype=torch.float64)
    gqa = q.shape[1] // k.shape[2]
    for i, (s, n) in enumerate(zip(slots.tolist(), k_lens.tolist())):
        a, b = int(cu[i]), int(cu[i + 1])
        for h in range(q.shape[1]):
            qq = q[a:b, h].double()
            kk, vv = k[s, :n, h // gqa].double(), v[s, :n, h // gqa].double()
            sc = qq @ kk.T * scale
            if causal:
                allowed = torch.arange(n)[None, :] <= torch.arange(b - a)[:, None] + (n - (b - a))
                sc = sc.masked_fill(~allowed, float("-inf"))
            out[a:b, h] = torch.softmax(sc, dim=-1) @ vv
    return out


def _data(q_lens, k_lens, kv_heads, gqa, dtype, device, dim=40, rows=1536):
    g = torch.Generator().manual_seed(len(q_lens) * 7 + gqa)
    # tensors drawn where they live: on a GPU, filling GBs on the host would dominate the test
    gt = g if torch.device(device).type == "cpu" else torch.Generator(device=device).manual_seed(len(q_lens) * 7 + gqa)
    if k_lens is None:
        k_lens = [n + int(torch.randint(0, 300, (1,), generator=g)) for n in q_lens]
    num_slots = 2 * len(q_lens) + 3
    slots = torch.randperm(num_slots, generator=g)[:len(q_lens)].tolist()
    slots[0] = num_slots - 1
    k, v, keep = group_views(slots=num_slots, rows_per_slot=rows, group_size=3, kv_heads=kv_heads,
                             head_dim=dim, dtype=dtype, device=device, layer=2, generator=gt)
    pb = make_prefill_batch(slots=slots, q_lens=q_lens, k_lens=k_lens, q_heads=kv_heads * gqa,
                            head_dim=dim, dtype=dtype, device=device, generator=gt)
    return k, v, keep, pb


def _run(pb, k, v, **kw):
    return prefill(pb.q, k, v, cu_seqlens_q=pb.cu_seqlens_q, slots=pb.slots, seqlens_k=pb.seqlens_k,
                   max_seqlen_q=pb.max_seqlen_q, max_seqlen_k=pb.max_seqlen_k, **kw)


def _ref(pb, k, v, causal=True):
    return naive_prefill(pb.q.cpu(), k.cpu(), v.cpu(), pb.cu_seqlens_q.cpu(), pb.slots.cpu(),
                         pb.seqlens_k.cpu(), pb.q.shape[-1] ** -0.5, causal)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("q_lens,k_lens,kv_heads,gqa", CASES)
def test_prefill_cpu_matches_fp64(q_lens, k_lens, kv_heads, gqa, causal):
    k, v, _, pb = _data(q_lens, k_lens, kv_heads, gqa, torch.float32, "cpu")
    torch.testing.assert_close(_run(pb, k, v, causal=causal).double(), _ref(pb, k, v, causal),
                               **TOL[torch.float32])


def test_prefill_split_kv_views():
    g = torch.Generator().manual_seed(3)
    k, v, _ = group_views(slots=4, rows_per_slot=200, group_size=1, kv_heads=2, head_dim=16,
                          dtype=torch.float32, split_kv=True, generator=g)
    pb = make_prefill_batch(slots=[3, 0], q_lens=[7, 2], k_lens=[150, 2], q_heads=4, head_dim=16,
                            dtype=torch.float32, generator=g)
    torch.testing.assert_close(_run(pb, k, v).double(), _ref(pb, k, v), **TOL[torch.float32])


def test_prefill_errors():
    k, v, _, pb = _data([5, 97, 1], [5, 1029, 40], 2, 4, torch.float32, "cpu")
    with pytest.raises(TensorError, match="seqlens_k"):
        prefill(pb.q, k, v, cu_seqlens_q=pb.cu_seqlens_q, slots=pb.slots, seqlens_k=pb.seqlens_k[:2],
                max_seqlen_q=97, max_seqlen_k=1029)
    with pytest.raises(TensorError, match="max_seqlen_k"):
        prefill(pb.q, k, v, cu_seqlens_q=pb.cu_seqlens_q, slots=pb.slots, seqlens_k=pb.seqlens_k,
                max_seqlen_q=97, max_seqlen_k=0)
    with pytest.raises(TensorError, match="k_cache and v_cache"):
        prefill(pb.q, k, v[:-1], cu_seqlens_q=pb.cu_seqlens_q, slots=pb.slots,
                seqlens_k=pb.seqlens_k, max_seqlen_q=97, max_seqlen_k=1029)
    with pytest.raises(TensorError, match="head_dim"):
        prefill(pb.q[..., :32].contiguous(), k, v, cu_seqlens_q=pb.cu_seqlens_q, slots=pb.slots,
                seqlens_k=pb.seqlens_k, max_seqlen_q=97, max_seqlen_k=1029)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["torch_fa2", "vllm_fa3", "vllm_fa2", "sgl_fa3", "flash_attn"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("q_lens,k_lens,kv_heads,gqa", CASES + [([512, 300], [4096, 300], 8, 4)])
def test_prefill_cuda(backend, dtype, q_lens, k_lens, kv_heads, gqa):
    dim = 128
    cap = tuple(torch.cuda.get_device_capability())
    if not is_supported(backend, op="prefill", device_type="cuda", dtype=dtype, head_dim=dim,
                        capability=cap):
        pytest.skip(f"{backend} not installed / not supported here ({sorted(installed_backends())})")
    k, v, _, pb = _data(q_lens, k_lens, kv_heads, gqa, dtype, "cuda", dim=dim, rows=4096)
    torch.testing.assert_close(_run(pb, k, v, backend=backend).double().cpu(), _ref(pb, k, v),
                               **TOL[dtype])
