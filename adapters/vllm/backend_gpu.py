"""The vattn attention backend for vLLM 0.26.0 on GPU (``AttentionBackendEnum.CUSTOM``).

vLLM's own FlashAttention (FA3 on Hopper, via ``vllm.vllm_flash_attn``) in one-page-per-request
mode: the layer's KV is vattn's ``[2, max_slots + 1, rows_per_slot, H, D]`` strided view, the
block table holds one entry per request (its slot) and the page size is ``rows_per_slot``
(see :mod:`.slot_tables`). Store and attention are vLLM's own kernels with vLLM's own arguments,
only the cache tensors and the page size differ. Measured on the H200 (2026-12-04): outputs
equal stock ``FLASH_ATTN``'s up to near-ties, not bit for bit (BENCHMARKS.md). Graph-safe (nothing
is deferred while graphs are captured): ``forward`` and ``do_kv_cache_update`` launch kernels only.

What differs from stock ``FLASH_ATTN``:

* ``get_preferred_block_size`` -> tokens per 2 MiB page of the layer-group layout;
* the metadata builder schedules FA3 with ``page_size = attn_rows`` (the slot region, or with
  ``VATTN_VLLM_EXACT=1`` its first ``rows_per_slot - 16`` rows, so FA3 takes stock's non-TMA
  path: see :data:`.gpu_layout.EXACT_ENV`) and never uses cascade;
* ``forward`` / ``do_kv_cache_update`` first make the VMM calls vattn deferred for the layer's
  range (:meth:`~.gpu_runtime.GpuRuntime.ready`), then split vattn's view (vLLM 0.26's FA layout packs K and V of
  a head next to each other, vattn's keeps them ``H * D`` apart, so the stock split cannot be
  reused);
* decoder self-attention only: sliding window, ALiBi, soft-cap, sinks, fp8 KV, encoder,
  cross-attention and DCP are refused at construction.
"""

from __future__ import annotations

import torch
from vllm.utils.torch_utils import canonicalize_singleton_dim_strides
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends import fa_utils
from vllm.v1.attention.backends.flash_attn import (FlashAttentionBackend, FlashAttentionImpl,
                                                   FlashAttentionMetadataBuilder)

from vattn.core.errors import UnsupportedError, VattnError

from . import gpu_layout
from . import runtime as rt

__all__ = ["VattnFlashBackend", "VattnFlashImpl", "VattnFlashMetadataBuilder"]


def _runtime():
    try:
        return rt.current()
    except VattnError as exc:
        raise VattnError("the vattn CUSTOM backend was built but no vattn GPU runtime exists in "
                         "this process: it needs VATTN_VLLM=1 and vLLM's V2 model runner "
                         "(VLLM_USE_V2_MODEL_RUNNER=1)") from exc


class VattnFlashMetadataBuilder(FlashAttentionMetadataBuilder):
    """Stock FA metadata; FA3's ahead-of-time scheduler planned for one page per request."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = _runtime().attn_rows   # the page size FA3 sees (scheduler metadata)

    def use_cascade_attention(self, *args, **kwargs) -> bool:
        return False


class VattnFlashImpl(FlashAttentionImpl):
    """FlashAttention on vattn's views; ``kv_cache`` is ``[2, slots + 1, rows_per_slot, H, D]``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        refused = {"sliding window": self.sliding_window != (-1, -1),
                   "ALiBi": self.alibi_slopes is not None,
                   "logits soft-cap": bool(self.logits_soft_cap),
                   "attention sinks": self.sinks is not None,
                   "a quantized KV cache": self.kv_cache_dtype not in ("auto", "bfloat16", "float16"),
                   f"attention type {self.attn_type}": self.attn_type != AttentionType.DECODER,
                   "decode context parallelism": self.dcp_world_size > 1}
        found = [name for name, on in refused.items() if on]
        if found:
            raise UnsupportedError(f"vattn's CUSTOM backend does not support {', '.join(found)}")
        self._views: tuple | None = None   # (kv_cache, (k, v) to store, (k, v) to attend), built once

    def _split(self, kv_cache: torch.Tensor, *, attend: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[slots + 1, rows, H, D]`` of the layer: the whole slot regions to store into,
        or (``attend``) the first ``attn_rows`` of each, the page the attention kernel sees."""
        views = self._views
        if views is None or views[0] is not kv_cache:
            if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
                raise VattnError(f"vattn expects a [2, slots, rows, H, D] KV view, got "
                                 f"{tuple(kv_cache.shape)}: are the vattn KV hooks installed?")
            k, v = (canonicalize_singleton_dim_strides(x) for x in kv_cache.unbind(0))
            rows = _runtime().attn_rows
            views = self._views = (kv_cache, (k, v), (k[:, :rows], v[:, :rows]))
        return views[2] if attend else views[1]

    def _ready(self, layer) -> None:
        """Make the VMM calls vattn deferred for this layer's range (its pages mapped before
        its KV is written or read; cheap when none wait)."""
        runtime = _runtime()
        if runtime.cache.calls_queued:
            runtime.ready(runtime.layer_of[layer.layer_name])

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        """Store ``key``/``value`` ``[N, H, D]`` at rows ``slot_mapping`` (``-1`` = skip)."""
        self._ready(layer)
        key_cache, value_cache = self._split(kv_cache)
        fa_utils.reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping,
                                         self.kv_cache_dtype, layer._k_scale, layer._v_scale)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None) -> torch.Tensor:
        """``query [N, Hq, D]`` -> ``output [N, Hq, D]`` in place (the stock non-cascade FA call)."""
        if output_scale is not None or output_block_scale is not None:
            raise UnsupportedError("vattn: fused output quantization is not supported")
        if attn_metadata is None:          # vLLM's memory-profiling pass, as stock
            return output.fill_(0)
        self._ready(layer)
        key_cache, value_cache = self._split(kv_cache, attend=True)
        md = attn_metadata
        n = md.num_actual_tokens
        cu_seqlens_q = md.query_start_loc
        descale_shape = (cu_seqlens_q.shape[0] - 1, self.num_kv_heads)
        q_descale = layer._q_scale.expand(descale_shape) if self.supports_quant_query_input else None
        window = md.sliding_window if md.sliding_window is not None else self.sliding_window
        fa_utils.flash_attn_varlen_func(
            q=query[:n], k=key_cache, v=value_cache, out=output[:n], cu_seqlens_q=cu_seqlens_q,
            max_seqlen_q=md.max_query_len, seqused_k=md.seq_lens, max_seqlen_k=md.max_seq_len,
            softmax_scale=self.scale, causal=md.causal, alibi_slopes=None,
            window_size=list(window), block_table=md.block_table, softcap=self.logits_soft_cap,
            scheduler_metadata=md.scheduler_metadata, fa_version=self.vllm_flash_attn_version,
            q_descale=q_descale, k_descale=layer._k_scale.expand(descale_shape),
            v_descale=layer._v_scale.expand(descale_shape), num_splits=md.max_num_splits)
        return output


class VattnFlashBackend(FlashAttentionBackend):
    """``CUSTOM``: FLASH_ATTN on vattn's virtually contiguous KV."""

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[VattnFlashImpl]:
        return VattnFlashImpl

    @staticmethod
    def get_builder_cls() -> type[VattnFlashMetadataBuilder]:
        return VattnFlashMetadataBuilder

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int = 16) -> int:
        """Tokens per page-set of this model's layout (vLLM calls this with the config current)."""
        from vllm.config import get_current_vllm_config
        return gpu_layout.block_size_for_vllm(get_current_vllm_config())

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return False

    @classmethod
    def supports_non_causal(cls) -> bool:
        return False

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype) -> bool:
        return kv_cache_dtype in (None, "auto", "bfloat16", "float16")

    @classmethod
    def supports_sink(cls) -> bool:
        return False

    @classmethod
    def supports_mm_prefix(cls) -> bool:
        return False
