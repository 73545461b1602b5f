"""Per-layer KV tensors for TGI from a :class:`~vattn.core.VirtualKVCache`, and the attention
functions that read them.

Each layer gets a TGI ``KVCache`` object (built without its ``__init__``, which would
allocate blocks) whose ``kv_cache`` is ``(cache.k(l), cache.v(l))``: ``[slots + 1, C, H, D]``
strided views. With ``ATTENTION=flashdecoding`` TGI's own ``KVCache.store`` does
``key_cache.view(-1, H, D)[slots] = key``, which on these views writes row ``s * C + t``.
``attention`` / ``paged_attention`` have TGI v3.3.7's signatures and call
``vattn.core.ops.prefill`` / ``decode`` with the region in column 0 of ``block_tables``.
"""

from __future__ import annotations

import torch

from vattn.core import ops
from vattn.core.errors import UnsupportedError

from .regions import regions_of

__all__ = ["layer_caches", "attention", "paged_attention"]


def layer_caches(kv_cache_cls, cache) -> list:
    """One ``kv_cache_cls`` instance per layer wrapping the cache's K/V views (no allocation)."""
    out = []
    for layer in range(cache.config.num_layers):
        obj = kv_cache_cls.__new__(kv_cache_cls)
        obj.kv_cache = (cache.k(layer), cache.v(layer))
        out.append(obj)
    return out


def _check_scalars(softcap, window_size_left, kv_scales) -> None:
    if softcap is not None:
        raise UnsupportedError(f"softcap is not supported by vattn's TGI attention, got {softcap}")
    if window_size_left not in (None, -1):
        raise UnsupportedError(f"sliding windows are not supported yet, got window_size_left={window_size_left}")
    if kv_scales is not None and (kv_scales.key_scale_cpu != 1.0 or kv_scales.value_scale_cpu != 1.0):
        raise UnsupportedError("FP8 KV scales are not supported by vattn's TGI attention")


def _backend_dtype(q: torch.Tensor, kv) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    k, v = kv.kv_cache
    if q.device.type == "cpu":  # the reference path computes in float32
        return q.float(), k, v
    return q, k, v


def attention(*, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache,
              kv_scales, seqlen, block_tables: torch.Tensor, softmax_scale: float,
              window_size_left: int = -1, causal: bool = True, softcap=None) -> torch.Tensor:
    """Prefill (TGI's ``attention``): ``query`` ``[Nq, Hq, D]`` -> ``[Nq, Hq, D]``.

    New K/V have already been stored by ``KVCache.store``; keys are read from each request's
    region (``block_tables[:, 0]``), ``seqlen.cache_lengths + seqlen.input_lengths`` long.
    """
    _check_scalars(softcap, window_size_left, kv_scales)
    q, k, v = _backend_dtype(query, kv_cache)
    seqlens_k = (seqlen.cache_lengths + seqlen.input_lengths).to(torch.int32)
    out = ops.prefill(q, k, v, cu_seqlens_q=seqlen.cu_seqlen_q.to(torch.int32),
                      slots=regions_of(block_tables), seqlens_k=seqlens_k,
                      max_seqlen_q=int(seqlen.max_q), max_seqlen_k=int(seqlen.max_k),
                      scale=softmax_scale, causal=causal)
    return out.to(query.dtype)


def paged_attention(query: torch.Tensor, kv_cache, kv_head_mapping, softmax_scale: float,
                    block_tables: torch.Tensor, seqlen, max_s: int, *, kv_scales,
                    softcap=None, window_size_left=-1) -> torch.Tensor:
    """Decode (TGI's ``paged_attention``): ``query`` ``[B, Hq, D]``, one token per request."""
    _check_scalars(softcap, window_size_left, kv_scales)
    q, k, v = _backend_dtype(query, kv_cache)
    seqlens = (seqlen.cache_lengths + seqlen.input_lengths).to(torch.int32)
    out = ops.decode(q, k, v, slots=regions_of(block_tables), seqlens=seqlens,
                     max_seqlen_k=int(max_s), scale=softmax_scale)
    return out.to(query.dtype)
