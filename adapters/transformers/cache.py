"""A continuous-batching cache whose K/V live in a :class:`vattn.core.VirtualKVCache`.

transformers' scheduler keeps counting blocks (so admission and preemption stay its own), but
each request owns one vattn *slot*: token ``t`` of the request is row ``slot * R + t`` of the
layer's rows view, pages are ensured before blocks are granted, and the slot is released when
the request's blocks are freed. A failed ``ensure`` returns ``None`` from ``allocate_blocks``,
which the manager turns into its own requeue.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
from transformers.generation.continuous_batching.cache import PagedAttentionCache

from vattn.core import KVCacheConfig, VirtualKVCache
from vattn.core.errors import ConfigError, SlotError, UnsupportedError
from vattn.core.ops import resolve_backend
from vattn.core.requests import RequestSlots

__all__ = ["VattnPagedCache", "Backends", "resolve_backends", "ATTN_NAME"]

ATTN_NAME = "paged|vattn"


@dataclass(frozen=True)
class Backends:
    """The op backends of one cache, resolved once (``vattn.core.ops.resolve_backend``)."""

    store: str
    prefill: str
    decode: str


def resolve_backends(device, dtype: torch.dtype, head_dim: int, *, prefill: str = "auto",
                     decode: str = "auto") -> Backends:
    """``"reference"`` on CPU; on CUDA the fastest installed (e.g. torch_fa2 prefill, triton decode).

    Raises
    ------
    UnsupportedError
        An explicit backend that cannot run here (the message says why).
    """
    device = torch.device(device)
    args = dict(device=device, dtype=dtype, head_dim=head_dim)
    store = "triton" if device.type == "cuda" and importlib.util.find_spec("triton") else "torch"
    return Backends(store=store, prefill=resolve_backend("prefill", backend=prefill, **args),
                    decode=resolve_backend("decode", backend=decode, **args))


class VattnPagedCache(PagedAttentionCache):
    """``PagedAttentionCache`` with vattn slots; stock behaviour unless the model uses ``paged|vattn``.

    Extra options are read from ``model.config.vattn_options`` (set by :func:`enable`):
    ``group_size``, ``page_budget``, ``map_ahead_tokens``, ``scrub``, ``max_slots``, ``max_context``,
    ``prefill_backend``, ``decode_backend``. Attributes used by the attention function:
    ``backends`` (:class:`Backends`), ``first_layer``, ``step_plan`` (set per forward),
    :meth:`layer_views`.
    """

    def __init__(self, config, continuous_batching_config, device, distributed_helper, tp_plan,
                 dtype=torch.float16) -> None:
        super().__init__(config, continuous_batching_config, device, distributed_helper, tp_plan, dtype)
        self.vattn = None
        if getattr(config, "_attn_implementation", None) != ATTN_NAME:
            return
        if self.num_sliding_attention_groups:
            raise UnsupportedError("paged|vattn supports full-attention models only (sliding window found)")
        self.use_prefix_sharing = False  # slots do not share blocks (prefix sharing comes later)
        opts = dict(getattr(config, "vattn_options", None) or {})
        self.backends = resolve_backends(device, dtype, self.head_dim,
                                         prefill=opts.get("prefill_backend", "auto"),
                                         decode=opts.get("decode_backend", "auto"))
        self.vattn = VirtualKVCache(_vattn_config(self, config, device, dtype))
        self._views = [(self.vattn.k(j), self.vattn.v(j)) for j in range(config.num_hidden_layers)]
        self.first_layer = min(self.layer_index_to_group_indices)
        self.step_plan = None
        # the stock pool is not used: free it, keeping one placeholder per layer of a group
        # (the offloading manager sizes its buffers from len(key_cache))
        stub = torch.empty(0, device=device, dtype=dtype)
        self.key_cache = [stub] * len(self.key_cache)
        self.value_cache = [stub] * len(self.value_cache)
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()  # hand the stock pool back before vattn maps its pages
        self._slots = RequestSlots(self.vattn)
        self._trash = self.vattn.acquire(tenant="__trash__", expected_len=2)
        if self.vattn.ensure({self._trash: 2}) or self.vattn.capacity().free_page_sets < 1:
            budget = self.vattn.config.page_budget
            self.vattn.close()
            raise ConfigError(f"page_budget={budget} holds no request beyond the scratch rows: "
                              f"need at least 2 page-sets of {self.vattn.layout.num_ranges} pages")
        base = self._trash * self.vattn.layout.rows_per_slot
        self.read_trash_index, self.write_trash_index = base, base + 1

    # -- block bookkeeping -> slots and pages (host side) ----------------------------------------
    def allocate_blocks(self, n_blocks: int, request_id: str, allocated_blocks: int) -> int | None:
        if self.vattn is None:
            return super().allocate_blocks(n_blocks, request_id, allocated_blocks)
        want = min((allocated_blocks + n_blocks) * self.block_size, self.vattn.config.max_context)
        slot = self._slots.get(request_id)
        fresh = slot is None
        if fresh:
            try:
                slot = self._slots.take(request_id, expected_len=want)
            except SlotError:
                return None  # every slot busy: the manager requeues
        if self.vattn.ensure({slot: want}):
            if fresh:
                self._slots.drop(request_id)
            return None  # out of pages: the manager's own requeue, never a crash
        granted = super().allocate_blocks(n_blocks, request_id, allocated_blocks)
        if granted is None and fresh:
            self._slots.drop(request_id)
        return granted

    def free_blocks(self, request_id: str) -> None:
        super().free_blocks(request_id)
        if self.vattn is not None:
            self._slots.drop(request_id)

    def free_all_requests(self) -> None:
        super().free_all_requests()
        if self.vattn is not None:
            self._slots.drop_all()

    def extend_read_and_write_indices(self, request_id, past_length, query_length, read_index, write_index):
        if self.vattn is None:
            return super().extend_read_and_write_indices(request_id, past_length, query_length,
                                                         read_index, write_index)
        # write rows only: paged|vattn reads the slot's rows in place, so no read index is built
        base = self._slots.base_row(request_id)
        for rows in write_index:
            rows.extend(range(base + past_length, base + past_length + query_length))

    def slot_of(self, request_id: str) -> int | None:
        """The vattn slot a running request holds (``None`` if it holds none)."""
        return self._slots.get(request_id) if self.vattn is not None else None

    def copy_cache(self, list_source_blocks, list_forked_blocks) -> None:
        if self.vattn is not None:
            raise UnsupportedError("paged|vattn does not support forking requests (num_return_sequences > 1)")
        super().copy_cache(list_source_blocks, list_forked_blocks)

    # -- the per-layer hot path ------------------------------------------------------------------
    def layer_views(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V views of a layer: ``[max_slots + 1, rows_per_slot, Hk, D]`` each (built once)."""
        return self._views[layer_idx]

    def update(self, key_states, value_states, layer_idx, read_index, write_index):
        """Stock gather path; with vattn the attention function reads the views itself."""
        if self.vattn is not None:
            raise UnsupportedError("the vattn cache is read in place by paged|vattn: cache.update (the stock "
                                   "gather) is not available; use attn_implementation='paged|vattn'")
        return super().update(key_states, value_states, layer_idx, read_index, write_index)

    def vattn_metrics(self) -> dict:
        return {} if self.vattn is None else self.vattn.metrics()


def _vattn_config(cache: PagedAttentionCache, config, device, dtype) -> KVCacheConfig:
    opts = dict(getattr(config, "vattn_options", None) or {})
    token_bytes = 2 * cache.num_key_value_heads * cache.head_dim * torch.tensor([], dtype=dtype).element_size()
    pool = cache.num_blocks * cache.block_size * token_bytes * config.num_hidden_layers
    max_ctx = min(int(config.max_position_embeddings), cache.num_blocks * cache.block_size,
                  int(opts.get("max_context", 1 << 62)))
    max_slots = int(opts.get("max_slots", min(cache.num_blocks, 1024) + 1))
    # the stock pool's bytes plus one partly filled 2 MiB page per range and slot (worst-case waste),
    # counting the core's always-mapped padding slot
    slack = (max_slots + 1) * config.num_hidden_layers * (2 << 20)
    return KVCacheConfig(
        num_layers=config.num_hidden_layers, num_kv_heads=cache.num_key_value_heads,
        head_dim=cache.head_dim, dtype=dtype, device=str(device),
        max_slots=max_slots,
        max_context=max_ctx, group_size=int(opts.get("group_size", 1)),
        page_budget=opts.get("page_budget", pool + slack),
        scrub=opts.get("scrub", "never"), map_ahead_tokens=int(opts.get("map_ahead_tokens", 0)))
