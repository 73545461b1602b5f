"""Attention ops on virtually contiguous KV: store, prefill, decode; backend dispatch.

Views (``vattn.core.VirtualKVCache``): layer ``j``'s K view is ``[slots, rows_per_slot, H, D]``
with strides ``(rows_per_slot * row, row, D, 1)`` (``row = G * 2 * H * D`` elements for a layer
group of ``G``, ``H * D`` with ``split_kv``); token ``t`` of slot ``s`` is row
``s * rows_per_slot + t`` of the flattened rows view. Every op except the ``"reference"``
backend is CUDA-graph safe (no host synchronization); ``"reference"`` is the fp32 CPU path.

Example
-------
>>> be = resolve_backend("decode", device=q.device, dtype=q.dtype, head_dim=q.shape[-1])
>>> store(cache.k_rows(l), cache.v_rows(l), k_new, v_new, rows_for(tok_slots, tok_pos, R))
>>> o = decode(q, cache.k(l), cache.v(l), slots=slots, seqlens=lens, backend=be)
"""

from __future__ import annotations

from .attention import decode, prefill
from .dispatch import (BACKENDS, DECODE_ORDER, PREFILL_ORDER, installed_backends, is_supported,
                       resolve_backend)
from .store import rows_for, store

__all__ = ["store", "rows_for", "prefill", "decode", "resolve_backend", "is_supported",
           "installed_backends", "BACKENDS", "DECODE_ORDER", "PREFILL_ORDER"]
