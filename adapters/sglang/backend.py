"""``--attention-backend vattn``: SGLang attention over vattn's virtually contiguous KV.

Token ``t`` of a request in vattn slot ``s`` has SGLang index ``s * C + t``, so the batch's slots
(the one-entry page tables of the kernel) are ``req_to_token[req_pool_indices, 0] // C``: one
gather of ``B`` values, no per-token ``req_to_token`` gather. Keys are the slot's first
``seq_lens[b]`` rows. New K/V are written with the pool's own ``set_kv_buffer`` at
``out_cache_loc``.

Op backends: ``"sdpa"`` runs SGLang ``torch_native``'s exact SDPA call on the slot rows
(:mod:`.sdpa`, bit-identical to ``torch_native``; the CPU default); every other name goes to
``vattn.core.ops`` (``"auto"`` on CUDA: the fastest installed kernel).

``init_forward_metadata`` is host-side (may synchronize); ``forward_*`` launch only the store
and the attention op (the ``"sdpa"`` path also reads lengths on the host).

Decode CUDA graphs (SGLang's decode graph runner): ``init_cuda_graph_state`` allocates persistent
``slots`` / ``seqlens`` buffers; ``init_forward_metadata_out_graph`` (before capture and before
every replay, eager) writes the batch into them, padding rows -> the pad slot (always mapped; their
stale ``req_pool_indices`` could name a slot whose pages were reclaimed); the captured op reads the
buffers with ``max_seqlen_k`` = the slot length, fixed at capture. ``init_forward_metadata``
(eager steps) stays independent of these buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from vattn.core import ops
from vattn.core.errors import ConfigError, UnsupportedError

from .pool import PAD_SLOT
from .sdpa import decode_sdpa, extend_sdpa


@dataclass
class VattnMetadata:
    """Per-batch attention inputs (device tensors int32 unless noted).

    slots : ``[B]`` vattn slot of each request; seqlens : ``[B]`` keys incl. new tokens;
    cu_seqlens_q : ``[B + 1]`` query offsets (decode: ``0 .. B``, built once per batch rather than
    by the op in every layer); max_seqlen_q / max_seqlen_k : host ints;
    host : ``(bases, prefix_lens, seq_lens)`` host lists, only for the ``"sdpa"`` op backend.
    """

    slots: torch.Tensor
    seqlens: torch.Tensor
    cu_seqlens_q: torch.Tensor | None
    max_seqlen_q: int
    max_seqlen_k: int
    host: tuple | None = None


class VattnAttnBackend(AttentionBackend):
    """Attention backend reading K/V from a :class:`~.pool.VattnMHATokenToKVPool`.

    Parameters
    ----------
    model_runner
        SGLang ``ModelRunner`` (or any object with ``token_to_kv_pool``,
        ``req_to_token_pool`` and ``device``).
    op_backend : str
        ``"sdpa"`` (torch_native's math, bit-identical to it) or a ``vattn.core.ops`` backend;
        ``"auto"``: ``"sdpa"`` on CPU, the fastest installed ``vattn.core.ops`` kernel on CUDA.
    """

    def __init__(self, model_runner, *, op_backend: str = "auto"):
        super().__init__()
        pool = model_runner.token_to_kv_pool
        if not hasattr(pool, "vattn_cache"):
            raise ConfigError("attention backend 'vattn' needs the vattn KV pool, got "
                              f"{type(pool).__name__}")
        self.pool = pool
        self.cache = pool.vattn_cache
        self.rows_per_slot = pool.rows_per_slot
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.device = model_runner.device
        if op_backend == "auto" and torch.device(self.device).type == "cpu":
            op_backend = "sdpa"
        self.op_backend = op_backend
        self._resolved: dict[str, str] = {}              # op -> kernel, resolved at first use
        self.forward_metadata: VattnMetadata | None = None
        self._graph_slots: torch.Tensor | None = None     # decode CUDA graphs: persistent inputs
        self._graph_seqlens: torch.Tensor | None = None
        self._graph_cu_q: torch.Tensor | None = None

    def _slots(self, req_pool_indices: torch.Tensor) -> torch.Tensor:
        first = self.req_to_token[req_pool_indices.long(), 0].long()
        return torch.div(first, self.rows_per_slot, rounding_mode="floor").to(torch.int32)

    # -- decode CUDA graphs ------------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Persistent per-row inputs of the captured decode graphs (``max_bs`` rows)."""
        if self.op_backend == "sdpa":
            raise UnsupportedError("vattn backend: CUDA graphs need a vattn.core.ops op backend, not "
                                   "'sdpa' (it reads lengths on the host)")
        self._graph_slots = torch.full((max_bs,), PAD_SLOT, dtype=torch.int32, device=self.device)
        self._graph_seqlens = torch.ones(max_bs, dtype=torch.int32, device=self.device)
        self._graph_cu_q = torch.arange(max_bs + 1, dtype=torch.int32, device=self.device)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1      # padding rows read one row of the pad slot

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        """Before capture / replay: write the batch into the persistent buffers (eager ops)."""
        if self._graph_slots is None:
            raise ConfigError("vattn backend: init_cuda_graph_state was not called before capture")
        if not forward_batch.forward_mode.is_decode():
            raise UnsupportedError(f"vattn backend: CUDA graphs for {forward_batch.forward_mode} "
                                   "are not supported (decode only; run prefill eagerly)")
        bs = int(forward_batch.batch_size)
        if bs > self._graph_slots.numel():
            raise ConfigError(f"vattn backend: graph batch {bs} exceeds max_bs={self._graph_slots.numel()}")
        real = bs - int(getattr(forward_batch, "num_padding", 0) or 0)
        self._graph_slots[:real].copy_(self._slots(forward_batch.req_pool_indices[:real]))
        self._graph_slots[real:bs].fill_(PAD_SLOT)
        self._graph_seqlens[:bs].copy_(forward_batch.seq_lens[:bs])
        self._graph_seqlens[real:bs].clamp_(max=1)     # the pad slot maps its first page only
        self.forward_metadata = VattnMetadata(self._graph_slots[:bs], self._graph_seqlens[:bs],
                                              self._graph_cu_q[:bs + 1], 1, self.rows_per_slot)

    def init_forward_metadata_in_graph(self, forward_batch) -> None:
        """Nothing to record: the captured op reads the buffers written before each replay."""

    def init_forward_metadata(self, forward_batch) -> None:
        """Host-side: slots, key lengths and q offsets of this batch."""
        slots = self._slots(forward_batch.req_pool_indices)
        seqlens = forward_batch.seq_lens.to(torch.int32)
        max_k = _host_max(forward_batch.seq_lens_cpu, forward_batch.seq_lens)
        extend = forward_batch.forward_mode.is_extend()
        if extend:
            ext = forward_batch.extend_seq_lens.to(torch.int32)
            cu_q = torch.zeros(ext.numel() + 1, dtype=torch.int32, device=ext.device)
            torch.cumsum(ext, dim=0, out=cu_q[1:])
            max_q = _host_max(forward_batch.extend_seq_lens_cpu, ext)
        else:
            cu_q = torch.arange(slots.numel() + 1, dtype=torch.int32, device=slots.device)
            max_q = 1
        host = None
        if self.op_backend == "sdpa":
            seq = forward_batch.seq_lens.tolist()
            ext = (forward_batch.extend_seq_lens.tolist() if extend else [1] * len(seq))
            host = ([s * self.rows_per_slot for s in slots.tolist()],
                    [n - e for n, e in zip(seq, ext)], seq)
        self.forward_metadata = VattnMetadata(slots, seqlens, cu_q, max_q, max_k, host)

    def _store(self, layer, k, v, forward_batch, save_kv_cache: bool) -> None:
        _check_layer(layer)
        if save_kv_cache and k is not None and v is not None:
            self.pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, None), k, v)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        """Prefill / chunked prefill. ``q``: ``[N, Hq * D]``; returns ``[N, Hq * D]``."""
        self._store(layer, k, v, forward_batch, save_kv_cache)
        md = self.forward_metadata
        q_ = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        if md.host is not None:
            bases, prefix, seq = md.host
            o = extend_sdpa(q_, *self._rows(layer), bases=bases, prefix_lens=prefix,
                            seq_lens=seq, scale=layer.scaling, out=torch.empty_like(q_))
            return o.reshape(-1, layer.tp_q_head_num * layer.v_head_dim)
        o = ops.prefill(q_, self.cache.k(layer.layer_id), self.cache.v(layer.layer_id),
                        cu_seqlens_q=md.cu_seqlens_q, slots=md.slots, seqlens_k=md.seqlens,
                        max_seqlen_q=md.max_seqlen_q, max_seqlen_k=md.max_seqlen_k,
                        scale=layer.scaling, causal=True, backend=self._kernel("prefill", q_))
        return o.reshape(-1, layer.tp_q_head_num * layer.v_head_dim)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        """One token per request. ``q``: ``[B, Hq * D]``; returns ``[B, Hq * D]``."""
        self._store(layer, k, v, forward_batch, save_kv_cache)
        md = self.forward_metadata
        q_ = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        if md.host is not None:
            bases, _, seq = md.host
            o = decode_sdpa(q_, *self._rows(layer), bases=bases, seq_lens=seq,
                            scale=layer.scaling, out=torch.empty_like(q_))
            return o.reshape(-1, layer.tp_q_head_num * layer.v_head_dim)
        o = ops.decode(q_, self.cache.k(layer.layer_id), self.cache.v(layer.layer_id),
                       slots=md.slots, seqlens=md.seqlens, max_seqlen_k=md.max_seqlen_k,
                       scale=layer.scaling, cu_seqlens_q=md.cu_seqlens_q,
                       backend=self._kernel("decode", q_))
        return o.reshape(-1, layer.tp_q_head_num * layer.v_head_dim)

    def _kernel(self, op: str, q: torch.Tensor) -> str:
        """The ``vattn.core.ops`` kernel of ``op``, resolved once (not in every layer's call)."""
        name = self._resolved.get(op)
        if name is None:
            name = self._resolved[op] = ops.resolve_backend(
                op, device=q.device, dtype=q.dtype, head_dim=q.shape[-1], backend=self.op_backend)
        return name

    def _rows(self, layer):
        return self.pool.get_key_buffer(layer.layer_id), self.pool.get_value_buffer(layer.layer_id)

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
