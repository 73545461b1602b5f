"""FlashAttention-2 varlen shipped inside torch (CUDA only), run on the flattened rows views.

Request ``i``'s keys start at row ``slots[i] * rows_per_slot`` (``cu_seqlens_k[i]``) and count
``seqused_k[i]`` rows; gaps between requests are allowed, the causal mask is aligned bottom-right.
Graph-safe: the offsets are computed on the device, no value is read on the host.
"""

from __future__ import annotations

import torch

from .checks import check_int32_rows, flat_rows

__all__ = ["prefill_torch_fa2", "decode_torch_fa2", "slot_offsets"]


def slot_offsets(slots: torch.Tensor, rows_per_slot: int) -> torch.Tensor:
    """``cu_seqlens_k`` for FA varlen: ``[B + 1]`` int32, entry ``i`` = ``slots[i] * rows_per_slot``.

    The last entry is one region past the last request's start (unused when ``seqused_k`` is
    given). Callers must have checked that ``slots * rows_per_slot`` fits in int32.
    """
    starts = slots.to(torch.int64) * int(rows_per_slot)
    return torch.cat([starts, starts[-1:] + int(rows_per_slot)]).to(torch.int32)


def prefill_torch_fa2(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
                      cu_seqlens_q: torch.Tensor, slots: torch.Tensor, seqlens_k: torch.Tensor,
                      max_seqlen_q: int, max_seqlen_k: int, scale: float, causal: bool,
                      out: torch.Tensor | None) -> torch.Tensor:
    """Prefill / chunked prefill. Shapes as in :func:`vattn.core.ops.prefill`."""
    check_int32_rows(k_cache, "torch_fa2")
    k_rows, v_rows = flat_rows(k_cache), flat_rows(v_cache)
    cu_k = slot_offsets(slots, k_cache.shape[1])
    res = torch.ops.aten._flash_attention_forward(
        q, k_rows, v_rows, cu_seqlens_q.to(torch.int32), cu_k, int(max_seqlen_q), int(max_seqlen_k),
        0.0, bool(causal), False, scale=float(scale), seqused_k=seqlens_k.to(torch.int32))
    return _into(res[0], out)


def decode_torch_fa2(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
                     slots: torch.Tensor, seqlens: torch.Tensor, max_seqlen_k: int, scale: float,
                     out: torch.Tensor | None) -> torch.Tensor:
    """Decode as varlen prefill with one query per request (no split-KV: the slow fallback)."""
    batch = q.shape[0]
    cu_q = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
    return prefill_torch_fa2(q, k_cache, v_cache, cu_seqlens_q=cu_q, slots=slots, seqlens_k=seqlens,
                             max_seqlen_q=1, max_seqlen_k=max_seqlen_k, scale=scale, causal=False,
                             out=out)


def _into(result: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return result
    out.copy_(result)
    return out
