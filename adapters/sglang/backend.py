"""``--attention-backend vattn``: SGLang attention over vattn's virtually contiguous KV.

Before each forward the backend hands the batch to the pool's :class:`~.requests.RowSlots`,
which gives every request a vattn slot whose region holds, page-set by page-set, the pages SGLang
allocated to it or matched in its radix tree (one host copy of the batch's request rows, plus a
gather of the page ids that are new since the last forward). The slots are the one-entry page
tables of the kernel: keys are the slot's first ``seq_lens[b]`` rows. New K/V are written at rows
``slot * C + position`` (:meth:`~.pool.VattnMHATokenToKVPool.store`), not at SGLang's
``out_cache_loc`` (page ids name page-sets; they do not address rows here).

Op backends: ``"sdpa"`` runs SGLang ``torch_native``'s exact SDPA call on the slot rows
(:mod:`.sdpa`, bit-identical to ``torch_native``; the CPU default); every other name goes to
``vattn.core.ops`` (``"auto"`` on CUDA: the fastest installed kernel).

``init_forward_metadata`` is host-side (may synchronize); ``forward_*`` launch only the store
and the attention op (the ``"sdpa"`` path also reads lengths on the host), after making the VMM
calls the preparation deferred for the layer's VA range, when deferred mapping is on
(:attr:`~.requests.RowSlots.defer_mapping`; before a decode graph replay: all of them).

Decode CUDA graphs (SGLang's decode graph runner): ``init_cuda_graph_state`` allocates persistent
``slots`` / ``seqlens`` buffers; ``init_forward_metadata_out_graph`` (before capture and before
every replay, eager) writes the batch into them, padding rows -> the pad slot (always mapped; their
stale ``req_pool_indices`` could name a slot whose pages were reclaimed); the captured op reads the
buffers with ``max_seqlen_k`` = the slot length, fixed at capture. ``init_forward_metadata``
(eager steps) stays independent of these buffers.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from vattn.core import ops
from vattn.core.errors import ConfigError, UnsupportedError
from vattn.core.uploads import HostUploads

from .pool import PAD_SLOT
from .sdpa import decode_sdpa, extend_sdpa


@dataclass
class VattnMetadata:
    """Per-batch attention inputs (device tensors int32 unless noted).

    slots : ``[B]`` vattn slot of each request; seqlens : ``[B]`` keys incl. new tokens;
    rows : ``[N]`` int64 row of each new token (``slot * C + position``), where the store writes;
    cu_seqlens_q : ``[B + 1]`` query offsets (decode: ``0 .. B``, built once per batch rather than
    by the op in every layer); max_seqlen_q / max_seqlen_k : host ints;
    host : ``(bases, prefix_lens, seq_lens)`` host lists, only for the ``"sdpa"`` op backend.
    """

    slots: torch.Tensor
    seqlens: torch.Tensor
    cu_seqlens_q: torch.Tensor | None
    max_seqlen_q: int
    max_seqlen_k: int
    rows: torch.Tensor | None = None
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
        self.requests = pool.requests
        self.requests.attach(model_runner.req_to_token_pool)
        self.device = model_runner.device
        #: the step's slots / rows / lengths to the device: through the driver with the GIL held
        #: where it holds it for adapters (vattn.core.uploads), else torch's pinned copy
        self.uploads = HostUploads(self.device, getattr(self.cache, "driver", None))
        if op_backend == "auto" and torch.device(self.device).type == "cpu":
            op_backend = "sdpa"
        self.op_backend = op_backend
        self._resolved: dict[str, str] = {}              # op -> kernel, resolved at first use
        self.forward_metadata: VattnMetadata | None = None
        self._graph_slots: torch.Tensor | None = None     # decode CUDA graphs: persistent inputs
        self._graph_seqlens: torch.Tensor | None = None
        self._graph_cu_q: torch.Tensor | None = None
        self._graph_rows: torch.Tensor | None = None
        self._replay_rids: list | None = None            # see replaying()

    def _prepare(self, forward_batch, real: int, extend: bool) -> tuple[list, list, list]:
        """Map the batch's pages (:meth:`RowSlots.prepare`); host ``(slots, prefix, seq)``
        of its first ``real`` requests."""
        seq = _host_list(getattr(forward_batch, "seq_lens_cpu", None), forward_batch.seq_lens)[:real]
        rpi = forward_batch.req_pool_indices[:real]
        rids = getattr(forward_batch, "rids", None)
        if rids is None:
            rids = self._replay_rids
        rids = list(rids[:real]) if rids is not None and len(rids) >= real else None
        if extend:
            prefix = _host_list(getattr(forward_batch, "extend_prefix_lens_cpu", None),
                                forward_batch.extend_prefix_lens)[:real]
        else:
            prefix = [n - 1 for n in seq]
        slots = self.requests.prepare(rpi, seq, prefix if extend else None, rids=rids)
        return slots.tolist(), prefix, seq

    def _rows_of(self, slots: list, prefix: list, seq: list) -> np.ndarray:
        """Row of every new token: ``slot * C + position`` for positions ``prefix .. seq - 1``."""
        first = np.asarray(slots, dtype=np.int64) * self.rows_per_slot + np.asarray(prefix, dtype=np.int64)
        counts = np.asarray(seq, dtype=np.int64) - prefix
        if (counts == 1).all():
            rows = first
        else:
            rows = np.repeat(first - (np.cumsum(counts) - counts), counts) + np.arange(int(counts.sum()))
        return rows

    # -- decode CUDA graphs ------------------------------------------------------------------------
    @contextlib.contextmanager
    def replaying(self, rids):
        """While SGLang's decode CUDA-graph runner loads a batch whose request ids are ``rids``: the
        replay view it hands to :meth:`init_forward_metadata_out_graph` has none (used by the
        platform's graph runner, :func:`.platform.graph_runner_cls`)."""
        self._replay_rids = rids
        try:
            yield
        finally:
            self._replay_rids = None

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Persistent per-row inputs of the captured decode graphs (``max_bs`` rows)."""
        if self.op_backend == "sdpa":
            raise UnsupportedError("vattn backend: CUDA graphs need a vattn.core.ops op backend, not "
                                   "'sdpa' (it reads lengths on the host)")
        self._graph_slots = torch.full((max_bs,), PAD_SLOT, dtype=torch.int32, device=self.device)
        self._graph_seqlens = torch.ones(max_bs, dtype=torch.int32, device=self.device)
        self._graph_cu_q = torch.arange(max_bs + 1, dtype=torch.int32, device=self.device)
        self._graph_rows = torch.zeros(max_bs, dtype=torch.int64, device=self.device)

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
        real = 0 if in_capture else bs - int(getattr(forward_batch, "num_padding", 0) or 0)
        slots, prefix, seq = self._prepare(forward_batch, real, extend=False) if real else ([], [], [])
        pad = bs - real                                 # padding rows: row 0 of the pad slot
        dev_slots, dev_seq, dev_rows = self.uploads.to_device(
            np.asarray(slots + [PAD_SLOT] * pad), np.asarray(seq + [1] * pad),
            np.concatenate([self._rows_of(slots, prefix, seq), [PAD_SLOT * self.rows_per_slot] * pad]))
        self._graph_slots[:bs].copy_(dev_slots)
        self._graph_seqlens[:bs].copy_(dev_seq)
        self._graph_rows[:bs].copy_(dev_rows)
        self.requests.ready()                           # a replay runs no layer's Python
        self.forward_metadata = VattnMetadata(self._graph_slots[:bs], self._graph_seqlens[:bs],
                                              self._graph_cu_q[:bs + 1], 1, self.rows_per_slot,
                                              self._graph_rows[:bs])

    def init_forward_metadata_in_graph(self, forward_batch) -> None:
        """Nothing to record: the captured op reads the buffers written before each replay."""

    def init_forward_metadata(self, forward_batch) -> None:
        """Host-side: map the batch's pages; slots, key lengths, store rows and q offsets."""
        extend = forward_batch.forward_mode.is_extend()
        bs = int(forward_batch.batch_size)
        host_slots, prefix, seq = self._prepare(forward_batch, bs, extend)
        slots, rows = self.uploads.to_device(np.asarray(host_slots, dtype=np.int64),
                                             self._rows_of(host_slots, prefix, seq))
        slots = slots.to(torch.int32)
        seqlens = forward_batch.seq_lens.to(torch.int32)
        max_k = max(seq) if seq else 0
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
            host = ([s * self.rows_per_slot for s in host_slots], prefix, seq)
        self.forward_metadata = VattnMetadata(slots, seqlens, cu_q, max_q, max_k, rows, host)

    def _store(self, layer, k, v, forward_batch, save_kv_cache: bool) -> None:
        _check_layer(layer)
        if k is None or v is None:
            return
        if not save_kv_cache:
            # the model stored K/V itself (SGLang's fused RoPE + set_kv_buffer, e.g. Qwen3-MoE,
            # gpt-oss) at SGLang's indices, which name pages here, not rows
            raise UnsupportedError("vattn backend: this model writes its KV cache itself (fused "
                                   "RoPE + KV store at SGLang's indices); not supported with vattn")
        self.pool.store(layer, self.forward_metadata.rows, k, v)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        """Prefill / chunked prefill. ``q``: ``[N, Hq * D]``; returns ``[N, Hq * D]``."""
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache, decode=False)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        """One token per request. ``q``: ``[B, Hq * D]``; returns ``[B, Hq * D]``."""
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache, decode=True)

    def _attend(self, q, k, v, layer, forward_batch, save_kv_cache: bool, decode: bool):
        self.requests.ready(layer.layer_id)             # deferred VMM calls of its range first
        self._store(layer, k, v, forward_batch, save_kv_cache)
        md = self.forward_metadata
        q_ = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        if md.host is not None:
            bases, prefix, seq = md.host
            out = torch.empty_like(q_)
            if decode:
                o = decode_sdpa(q_, *self._rows(layer), bases=bases, seq_lens=seq,
                                scale=layer.scaling, out=out)
            else:
                o = extend_sdpa(q_, *self._rows(layer), bases=bases, prefix_lens=prefix,
                                seq_lens=seq, scale=layer.scaling, out=out)
        else:
            kv = (self.cache.k(layer.layer_id), self.cache.v(layer.layer_id))
            if decode:
                o = ops.decode(q_, *kv, slots=md.slots, seqlens=md.seqlens,
                               max_seqlen_k=md.max_seqlen_k, scale=layer.scaling,
                               cu_seqlens_q=md.cu_seqlens_q, backend=self._kernel("decode", q_))
            else:
                o = ops.prefill(q_, *kv, cu_seqlens_q=md.cu_seqlens_q, slots=md.slots,
                                seqlens_k=md.seqlens, max_seqlen_q=md.max_seqlen_q,
                                max_seqlen_k=md.max_seqlen_k, scale=layer.scaling, causal=True,
                                backend=self._kernel("prefill", q_))
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


def _host_list(cpu_values, device_values) -> list[int]:
    """A batch field as host ints, from its host copy when SGLang provides one."""
    values = cpu_values if cpu_values is not None else device_values
    return [int(x) for x in (values.tolist() if hasattr(values, "tolist") else values)]


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
