"""Paged baselines on the *same* KV data, plus the timing helpers of the kernel benchmarks.

``paged_copy`` copies the first ``max_len`` rows of each request's virtually contiguous region into a
page-16 pool with shuffled physical blocks and returns the block table, so a paged kernel and the
vattn path read identical K/V values. Kernels are imported lazily; a missing library yields no
baseline (never an error).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

__all__ = ["PagedKV", "paged_copy", "paged_decoders", "paged_prefillers", "bench_us",
           "hbm_copy_tbps"]


@dataclass
class PagedKV:
    """``k, v [num_blocks, page, Hk, D]``; ``block_table [B, max_len / page]`` int32."""

    k: torch.Tensor
    v: torch.Tensor
    block_table: torch.Tensor
    page: int


def paged_copy(k_cache, v_cache, slots: torch.Tensor, max_len: int, *, page: int = 16,
               seed: int = 0) -> PagedKV:
    """Page-``page`` copy of rows ``0 .. max_len - 1`` of each request's slot (shuffled blocks)."""
    batch, heads, dim = slots.shape[0], k_cache.shape[2], k_cache.shape[3]
    per = -(-max_len // page)
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(batch * per, generator=g).to(k_cache.device)
    kp = torch.zeros(batch * per, page, heads, dim, dtype=k_cache.dtype, device=k_cache.device)
    vp = torch.zeros_like(kp)
    n = per * page
    if n > k_cache.shape[1]:
        raise ValueError(f"max_len {max_len} rounded to pages ({n}) exceeds the slot region "
                         f"({k_cache.shape[1]} rows)")
    for i, s in enumerate(slots.tolist()):
        blocks = perm[i * per:(i + 1) * per]
        kp[blocks] = k_cache[s, :n].reshape(per, page, heads, dim)
        vp[blocks] = v_cache[s, :n].reshape(per, page, heads, dim)
    return PagedKV(kp, vp, perm.view(batch, per).to(torch.int32), page)


def paged_decoders(paged: PagedKV, q, seqlens, *, max_len: int, scale: float) -> dict:
    """name -> zero-argument callable running a paged decode kernel on ``paged`` (if installed)."""
    cu_q = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return paged_prefillers(paged, q, cu_q, seqlens, max_q=1, max_len=max_len, scale=scale,
                            causal=True, flashinfer=True)


def paged_prefillers(paged: PagedKV, q, cu_q, seqlens, *, max_q: int, max_len: int, scale: float,
                     causal: bool = True, flashinfer: bool = False) -> dict:
    """Paged varlen FlashAttention runs: vLLM FA3 / FA2 (if vllm is importable), FlashInfer decode."""
    runs = {}
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except ImportError:
        flash_attn_varlen_func = None
    if flash_attn_varlen_func is not None:
        for ver in (3, 2):
            runs[f"vllm_fa{ver}"] = (lambda ver=ver: flash_attn_varlen_func(
                q, paged.k, paged.v, max_q, cu_q, max_len, seqused_k=seqlens,
                block_table=paged.block_table, softmax_scale=scale, causal=causal, fa_version=ver))
    if flashinfer:
        fi = _flashinfer_paged(paged, q, seqlens, scale)
        if fi is not None:
            runs["flashinfer"] = fi
    return runs


def _flashinfer_paged(paged: PagedKV, q, seqlens, scale):
    try:
        import flashinfer
    except ImportError:
        return None
    batch, per = paged.block_table.shape
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=q.device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    used = (seqlens.to(torch.int64) + paged.page - 1) // paged.page
    indptr = torch.zeros(batch + 1, dtype=torch.int32, device=q.device)
    indptr[1:] = torch.cumsum(used, 0).to(torch.int32)
    mask = torch.arange(per, device=q.device)[None, :] < used[:, None]
    indices = paged.block_table[mask].to(torch.int32)
    last = (seqlens.to(torch.int64) - (used - 1) * paged.page).to(torch.int32)
    wrapper.plan(indptr, indices, last, q.shape[1], paged.k.shape[2], q.shape[2], paged.page,
                 q_data_type=q.dtype, kv_data_type=q.dtype, sm_scale=scale)
    return lambda: wrapper.run(q, (paged.k, paged.v))


def bench_us(fn, *, device: torch.device, graph: bool = True) -> float:
    """Median microseconds of ``fn()`` on the device (perf_counter on CPU).

    On CUDA ``graph=True`` (the default) replays ``fn`` from a CUDA graph
    (``triton.testing.do_bench_cudagraph``): kernel time without Python launch overhead, which is
    how engines run decode. A call that cannot be captured falls back to eager ``do_bench``.
    """
    if torch.device(device).type == "cuda":
        import triton.testing
        fn()                                    # compile / autotune outside any capture
        torch.cuda.synchronize(device)
        if graph:
            try:
                return float(triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")) * 1e3
            except RuntimeError:
                torch.cuda.synchronize(device)
        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")) * 1e3
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def hbm_copy_tbps(device: torch.device, *, nbytes: int = 4 << 30) -> float:
    """Measured device-to-device copy bandwidth, bytes read + written per second (TB/s)."""
    device = torch.device(device)
    if device.type != "cuda":
        nbytes = 64 << 20
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device).fill_(1)
    dst = torch.empty_like(src)
    # eager: on the H200 the same 4 GiB copy measured 4.24 TB/s launched eagerly but 2.78 TB/s
    # replayed from a CUDA graph (captured as a memcpy node), which is not the HBM limit
    us = bench_us(lambda: dst.copy_(src), device=device, graph=False)
    return 2 * nbytes / (us * 1e-6) / 1e12 if us > 0 else float("nan")
