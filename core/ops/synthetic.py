"""Plain-tensor stand-ins for the cache's views, for tests and kernel benchmarks.

``group_views`` allocates an ordinary tensor shaped like one VA range
``[slots, rows_per_slot, G, 2, H, D]`` and returns layer ``j``'s K and V views with exactly the
strides ``VirtualKVCache.k(layer)`` has. No virtual memory is involved.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["group_views", "DecodeBatch", "PrefillBatch", "make_decode_batch", "make_prefill_batch"]


def group_views(*, slots: int, rows_per_slot: int, group_size: int, kv_heads: int, head_dim: int,
                dtype: torch.dtype, device: torch.device | str = "cpu", layer: int = 0,
                split_kv: bool = False, generator: torch.Generator | None = None):
    """Random K/V layer views ``[slots, rows_per_slot, H, D]`` (strided like the cache's).

    Returns ``(k, v, storage)``; keep ``storage`` alive while using the views.
    """
    if split_kv:
        shape = (2, slots, rows_per_slot, kv_heads, head_dim)
        storage = _randn(shape, dtype, device, generator)
        return storage[0], storage[1], storage
    shape = (slots, rows_per_slot, group_size, 2, kv_heads, head_dim)
    storage = _randn(shape, dtype, device, generator)
    return storage[:, :, layer, 0], storage[:, :, layer, 1], storage


_FILL_CHUNK = 1 << 26   # elements drawn per float32 temporary (256 MiB)


def _randn(shape, dtype, device, generator):
    """Standard-normal ``shape`` in ``dtype``: drawn in float32, then cast, so a seed gives the
    same values for every dtype. Drawn where ``generator`` lives (CPU when none is given; a
    generator on the target device keeps multi-GB benchmark fills off the host), in chunks
    along dim 0 so the float32 temporary stays small."""
    out = torch.empty(shape, dtype=dtype, device=device)
    src = generator.device if generator is not None else torch.device("cpu")
    flat = out.view(out.shape[0], -1) if out.dim() > 1 else out.view(-1, 1)
    step = max(1, _FILL_CHUNK // max(1, flat.shape[1]))
    for start in range(0, flat.shape[0], step):
        part = flat[start:start + step]
        part.copy_(torch.randn(part.shape, generator=generator, dtype=torch.float32, device=src))
    return out


@dataclass
class DecodeBatch:
    """Inputs of one decode step: ``q [B, Hq, D]``, ``slots [B]`` int64, ``seqlens [B]`` int32."""

    q: torch.Tensor
    slots: torch.Tensor
    seqlens: torch.Tensor


@dataclass
class PrefillBatch:
    """Inputs of one (chunked) prefill: varlen ``q [Nq, Hq, D]`` and ``cu_seqlens_q [B + 1]``."""

    q: torch.Tensor
    cu_seqlens_q: torch.Tensor
    slots: torch.Tensor
    seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


def make_decode_batch(*, slots: list[int], seqlens: list[int], q_heads: int, head_dim: int,
                      dtype: torch.dtype, device="cpu", generator=None) -> DecodeBatch:
    q = _randn((len(slots), q_heads, head_dim), dtype, device, generator)
    return DecodeBatch(q, torch.tensor(slots, dtype=torch.int64, device=device),
                       torch.tensor(seqlens, dtype=torch.int32, device=device))


def make_prefill_batch(*, slots: list[int], q_lens: list[int], k_lens: list[int], q_heads: int,
                       head_dim: int, dtype: torch.dtype, device="cpu",
                       generator=None) -> PrefillBatch:
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    q = _randn((cu[-1], q_heads, head_dim), dtype, device, generator)
    return PrefillBatch(q, torch.tensor(cu, dtype=torch.int32, device=device),
                        torch.tensor(slots, dtype=torch.int64, device=device),
                        torch.tensor(k_lens, dtype=torch.int32, device=device),
                        max(q_lens), max(k_lens))
