"""``--attention-backend vattn``: SGLang attention over vattn's virtually contiguous KV.

The batch's ``req_pool_indices`` pick each request's vattn slot through the pool's
``req_slots`` table (``cache_batch_idx`` of a non-paged kernel); keys are the slot's first
``seq_lens[b]`` rows, so no ``req_to_token`` gather happens. New K/V are written with the pool's
own ``set_kv_buffer`` at ``out_cache_loc`` (= ``slot * C + position``).

``init_forward_metadata`` is host-side (may synchronize); ``forward_*`` launch only the store
and the attention op.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from vattn.core import ops
from vattn.core.errors import ConfigError, UnsupportedError


@dataclass
class VattnMetadata:
    """Per-batch attention inputs (device tensors int32 unless noted).

    slots : ``[B]`` vattn slot of each request; seqlens : ``[B]`` keys incl. new tokens;
    cu_seqlens_q : ``[B + 1]`` (extend only); max_seqlen_q / max_seqlen_k : host ints.
    """

    slots: torch.Tensor
    seqlens: torch.Tensor
    cu_seqlens_q: torch.Tensor | None
    max_seqlen_q: int
    max_seqlen_k: int


class VattnAttnBackend(AttentionBackend):
    """Attention backend reading K/V from a :class:`~.pool.VattnMHATokenToKVPool`.

    Parameters
    ----------
    model_runner
        SGLang ``ModelRunner`` (or any object with ``token_to_kv_pool`` and ``device``).
    op_backend : str
        Backend name for ``vattn.core.ops`` (``"auto"``: fastest installed; ``"reference"`` on CPU).
    """

    def __init__(self, model_runner, *, op_backend: str = "auto"):
        super().__init__()
        pool = model_runner.token_to_kv_pool
        if not hasattr(pool, "vattn_cache"):
            raise ConfigError("attention backend 'vattn' needs the vattn KV pool, got "
                              f"{type(pool).__name__}")
        self.pool = pool
        self.cache = pool.vattn_cache
        self.device = model_runner.device
        self.op_backend = op_backend
        self.forward_metadata: VattnMetadata | None = None

    def init_forward_metadata(self, forward_batch) -> None:
        """Host-side: slots, key lengths and q offsets of this batch."""
        slots = self.pool.req_slots[forward_batch.req_pool_indices.long()].to(torch.int32)
        seqlens = forward_batch.seq_lens.to(torch.int32)
        max_k = _host_max(forward_batch.seq_lens_cpu, forward_batch.seq_lens)
        cu_q, max_q = None, 1
        if forward_batch.forward_mode.is_extend():
            ext = forward_batch.extend_seq_lens.to(torch.int32)
            cu_q = torch.zeros(ext.numel() + 1, dtype=torch.int32, device=ext.device)
            torch.cumsum(ext, dim=0, out=cu_q[1:])
            max_q = _host_max(forward_batch.extend_seq_lens_cpu, ext)
        self.forward_metadata = VattnMetadata(slots, seqlens, cu_q, max_q, max_k)

    def _store(self, layer, k, v, forward_batch, save_kv_cache: bool) -> None:
        _check_layer(layer)
        if save_kv_cache and k is not None and v is not None:
            self.pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, None), k, v)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        """Prefill / chunked prefill. ``q``: ``[N, Hq * D]``; returns ``[N, Hq * D]``."""
        self._store(layer, k, v, forward_batch, save_kv_cache)
        md = self.forward_metadata
        q_ = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        o = ops.prefill(q_, self.cache.k(layer.layer_id), self.cache.v(layer.layer_id),
                        cu_seqlens_q=md.cu_seqlens_q, slots=md.slots, seqlens_k=md.seqlens,
                        max_seqlen_q=md.max_seqlen_q, max_seqlen_k=md.max_seqlen_k,
                        scale=layer.scaling, causal=True, backend=self.op_backend)
        return o.reshape(-1, layer.tp_q_head_num * layer.v_head_dim)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        """One token per request. ``q``: ``[B, Hq * D]``; returns ``[B, Hq * D]``."""
        self._store(layer, k, v, forward_batch, save_kv_cache)
        md = self.forward_metadata
        q_ = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        o = ops.decode(q_, self.cache.k(layer.layer_id), self.cache.v(layer.layer_id),
                       slots=md.slots, seqlens=md.seqlens, max_seqlen_k=md.max_seqlen_k,
                       scale=layer.scaling, backend=self.op_backend)
        return o.reshape(-1, layer.tp_q_head_num * layer.v_head_dim)

    def support_triton(self):
        return False


def _host_max(cpu_values, device_values) -> int:
    """Max of a batch field, from its host copy when SGLang provides one."""
    if cpu_values is not None:
        return int(max(cpu_values)) if len(cpu_values) else 0
    return int(device_values.max().item()) if device_values.numel() else 0


def _check_layer(layer) -> None:
    if layer.qk_head_dim != layer.v_head_dim:
        raise UnsupportedError("vattn backend needs qk_head_dim == v_head_dim, got "
                               f"{layer.qk_head_dim} and {layer.v_head_dim}")
    if layer.is_cross_attention:
        raise UnsupportedError("vattn backend does not support cross-attention")
    window = getattr(layer, "sliding_window_size", None)
    if window is not None and window > -1:
        raise UnsupportedError(f"vattn backend does not support sliding windows ({window})")
    if getattr(layer, "logit_cap", 0.0) and layer.logit_cap > 0:
        raise UnsupportedError(f"vattn backend does not support logit_cap ({layer.logit_cap})")
