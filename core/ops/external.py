"""Installed FlashAttention-family kernels run on virtually contiguous KV (imported lazily).

Every wrapper runs the library's kernel in non-paged / one-page-per-request mode: the layer view
``[slots, rows_per_slot, H, D]`` *is* a paged cache whose page is a whole slot region, so the
block table of request ``i`` is the single entry ``slots[i]`` (or ``cache_batch_idx = slots``).
The kernels accept the strided layer-group views as they are (last dim contiguous).
Graph-safe except :class:`FlashInferDecode.plan`.
"""

from __future__ import annotations

import importlib

import torch

from ..errors import UnsupportedError

__all__ = ["run_vllm", "run_sgl", "decode_flash_attn", "prefill_flash_attn", "FlashInferDecode",
           "decode_flashinfer"]


def _import(module: str, backend: str):
    try:
        return importlib.import_module(module)
    except ImportError as exc:  # installed but broken (e.g. a CPU build without the CUDA ops)
        raise UnsupportedError(f"backend {backend!r}: importing {module} failed: {exc}") from exc


def _one_page_table(slots: torch.Tensor) -> torch.Tensor:
    return slots.to(torch.int32).view(-1, 1)


def run_vllm(q, k_cache, v_cache, *, cu_seqlens_q, slots, seqlens_k, max_seqlen_q, max_seqlen_k,
             scale, causal, out, fa_version: int):
    """vLLM's ``vllm_flash_attn.flash_attn_varlen_func`` with a one-entry block table per request.

    ``q [Nq, Hq, D]`` varlen (decode: ``cu_seqlens_q = arange(B + 1)``); returns ``[Nq, Hq, D]``.
    """
    fa = _import("vllm.vllm_flash_attn", f"vllm_fa{fa_version}")
    return fa.flash_attn_varlen_func(
        q, k_cache, v_cache, int(max_seqlen_q), cu_seqlens_q.to(torch.int32), int(max_seqlen_k),
        seqused_k=seqlens_k.to(torch.int32), block_table=_one_page_table(slots),
        softmax_scale=float(scale), causal=bool(causal), out=out, fa_version=fa_version)


def run_sgl(q, k_cache, v_cache, *, cu_seqlens_q, slots, seqlens_k, max_seqlen_q, max_seqlen_k,
            scale, causal, out):
    """SGLang's FA3 ``flash_attn_with_kvcache`` with a one-entry page table per request.

    Not ``cache_batch_idx``: with it, sgl-kernel 0.4.5's FA3 faults (illegal address) once the
    layer view spans more than 2**31 elements, which a serving-sized cache does (seen on the
    H200, 2026-12-04); the page-table path addresses the same rows with 64-bit offsets.
    """
    fa = _import("sgl_kernel.flash_attn", "sgl_fa3")
    res = fa.flash_attn_with_kvcache(
        q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=seqlens_k.to(torch.int32),
        page_table=_one_page_table(slots), cu_seqlens_q=cu_seqlens_q.to(torch.int32),
        max_seqlen_q=int(max_seqlen_q), softmax_scale=float(scale), causal=bool(causal))
    res = res[0] if isinstance(res, tuple) else res
    return _into(res, out)


def decode_flash_attn(q, k_cache, v_cache, *, slots, seqlens, scale, out):
    """flash-attn 2.x ``flash_attn_with_kvcache`` (``q [B, 1, Hq, D]``, ``cache_batch_idx``).

    Not yet run on a GPU past 2**31 elements per layer view (sgl-kernel's FA3 faults there with
    ``cache_batch_idx``; see :func:`run_sgl`): ``tests/core/test_ops_decode.py`` checks it.
    """
    fa = _import("flash_attn", "flash_attn")
    res = fa.flash_attn_with_kvcache(
        q.unsqueeze(1), k_cache, v_cache, cache_seqlens=seqlens.to(torch.int32),
        cache_batch_idx=slots.to(torch.int32), softmax_scale=float(scale), causal=False)
    return _into(res.squeeze(1), out)


def prefill_flash_attn(q, k_cache, v_cache, *, cu_seqlens_q, slots, seqlens_k, max_seqlen_q,
                       max_seqlen_k, scale, causal, out):
    """flash-attn 2.x varlen with a one-entry block table (needs ``rows_per_slot % 256 == 0``)."""
    if k_cache.shape[1] % 256:
        raise UnsupportedError(f"backend 'flash_attn' prefill needs rows_per_slot divisible by 256 "
                               f"(its paged-KV rule), got {k_cache.shape[1]}")
    fa = _import("flash_attn", "flash_attn")
    cu_k = torch.zeros(seqlens_k.shape[0] + 1, dtype=torch.int32, device=q.device)
    cu_k[1:] = torch.cumsum(seqlens_k.to(torch.int32), 0)
    res = fa.flash_attn_varlen_func(
        q, k_cache, v_cache, cu_seqlens_q.to(torch.int32), cu_k, int(max_seqlen_q),
        int(max_seqlen_k), softmax_scale=float(scale), causal=bool(causal),
        block_table=_one_page_table(slots))
    return _into(res, out)


class FlashInferDecode:
    """FlashInfer's paged decode with one page (the slot region) per request.

    ``plan(slots, seqlens)`` is host-side (reads the lengths: synchronizes, not graph-safe);
    ``run(q, k_cache, v_cache)`` is the per-layer kernel. Shapes as in :func:`vattn.core.ops.decode`.
    """

    def __init__(self, *, device: torch.device, workspace_bytes: int = 128 << 20):
        self._fi = _import("flashinfer", "flashinfer")
        ws = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
        self._wrapper = self._fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")

    def plan(self, *, slots, seqlens, num_qo_heads, num_kv_heads, head_dim, rows_per_slot,
             dtype, scale) -> None:
        batch = slots.shape[0]
        indptr = torch.arange(batch + 1, dtype=torch.int32, device=slots.device)
        self._wrapper.plan(indptr, slots.to(torch.int32), seqlens.to(torch.int32), num_qo_heads,
                           num_kv_heads, head_dim, rows_per_slot, q_data_type=dtype,
                           kv_data_type=dtype, sm_scale=float(scale))

    def run(self, q, k_cache, v_cache, *, out=None):
        return self._wrapper.run(q, (k_cache, v_cache), out=out)


def decode_flashinfer(q, k_cache, v_cache, *, slots, seqlens, scale, out):
    """One-shot plan + run (convenient, slow: plan per call). Prefer :class:`FlashInferDecode`."""
    dec = FlashInferDecode(device=q.device)
    dec.plan(slots=slots, seqlens=seqlens, num_qo_heads=q.shape[1], num_kv_heads=k_cache.shape[2],
             head_dim=q.shape[2], rows_per_slot=k_cache.shape[1], dtype=q.dtype, scale=scale)
    return dec.run(q, k_cache, v_cache, out=out)


def _into(result: torch.Tensor, out):
    if out is None:
        return result
    out.copy_(result)
    return out
