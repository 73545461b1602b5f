"""SGLang KV pool whose per-layer buffers are vattn's virtually contiguous row views.

SGLang names KV by page ids (``page_id * page_size + offset`` in ``out_cache_loc``,
``req_to_token`` and the radix tree); one SGLang page is one vattn page-set. Token ``t`` of the
request held in vattn slot ``s`` lives at row ``s * C + t`` (``C = layout.rows_per_slot``) of the
flattened rows view ``cache.k_rows(layer)``, which is ``k_buffer[layer]`` here; the attention
backend writes new K/V at those rows (:meth:`VattnMHATokenToKVPool.store`) after
:class:`~.requests.RowSlots` mapped each request's page ids into its region. Slot 0 is held for
the pool's lifetime: CUDA-graph padding rows write and read its first row.

Inside SGLang the vattn platform (:mod:`.platform`) hands this class to ``KVCacheConfigurator``,
which constructs it with its own arguments; direct use: :meth:`VattnMHATokenToKVPool.from_cache`.
"""

from __future__ import annotations

import logging
import time

import torch
from sglang.srt.mem_cache.memory_pool import KVWriteLoc, MHATokenToKVPool

from vattn.core import KVCacheConfig, VirtualKVCache
from vattn.core.errors import ConfigError, UnsupportedError

from .requests import PAD_SLOT, RowSlots

logger = logging.getLogger(__name__)


def make_cache(*, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
               max_requests: int, max_context: int, device: str, group_size: int = 1,
               page_budget=0.9, map_ahead_tokens: int = 0, page_bytes: int | None = None,
               driver=None, pack_pages: int = 0, pack_sets: int | tuple[int, ...] = 8) -> VirtualKVCache:
    """Build the :class:`VirtualKVCache` behind a pool: ``max_requests`` slots plus the pad slot
    (``driver``: the cache's driver, default the device's; ``pack_pages`` / ``pack_sets``: packs
    of shared runs, see :class:`~vattn.core.KVCacheConfig`)."""
    cfg = KVCacheConfig(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                        dtype=dtype, max_slots=max_requests + 1, max_context=max_context,
                        group_size=group_size, page_budget=page_budget, device=device,
                        map_ahead_tokens=map_ahead_tokens, page_bytes=page_bytes,
                        pack_pages=pack_pages, pack_sets=pack_sets)
    return VirtualKVCache(cfg, driver=driver)


class VattnMHATokenToKVPool(MHATokenToKVPool):
    """``MHATokenToKVPool`` over a :class:`VirtualKVCache` (no KV tensors allocated here).

    The constructor takes exactly what SGLang 0.5.17's ``KVCacheConfigurator`` passes to an
    out-of-tree platform's MHA pool class (``_build_oot_mha_kv_pool``); without ``cache`` it builds
    the cache from them (:func:`.sizing.cache_config`, bounds from SGLang's published server args).

    Parameters
    ----------
    size : int or None
        SGLang's token budget (``max_total_num_tokens``); ``None``: what the cache physically holds.
    page_size : int
        SGLang's page size: the tokens of one vattn page-set (:func:`.sizing.page_size_for`).
    dtype : torch.dtype
        KV dtype; ``head_num`` / ``head_dim`` / ``layer_num`` are the KV heads, head size and
        layers of this rank; ``device`` ``"cuda[:N]"`` (VMM) or ``"cpu"`` (host backend).
    enable_memory_saver : bool
        Must be False (the pages are not torch allocations).
    start_layer, end_layer : int, optional
        Must cover layers ``0 .. layer_num`` (no pipeline parallelism).
    cache : VirtualKVCache, optional
        Use this cache (its shape must match the arguments); see :meth:`from_cache`.
    """

    def __init__(self, size, *, page_size, dtype, head_num, head_dim, layer_num, device,
                 enable_memory_saver=False, start_layer=None, end_layer=None, cache=None,
                 **unsupported):
        if unsupported:
            raise UnsupportedError(f"vattn pool: unsupported SGLang pool arguments "
                                   f"{sorted(unsupported)} (hybrid / SWA / quantized pools are "
                                   "not supported)")
        if enable_memory_saver:
            raise UnsupportedError("vattn pool does not support --enable-memory-saver")
        if start_layer not in (None, 0) or end_layer not in (None, layer_num):
            raise UnsupportedError(f"vattn pool needs all {layer_num} layers on this rank "
                                   f"(no pipeline parallelism), got {start_layer}..{end_layer}")
        if cache is None:
            from .sizing import cache_config, sglang_bounds
            context, reqs = sglang_bounds(int(size))
            cache = VirtualKVCache(cache_config(
                num_tokens=size, dtype=dtype, head_num=head_num, head_dim=head_dim,
                layer_num=layer_num, device=str(device), max_context=context, max_requests=reqs,
                page_size=page_size))
        cfg = cache.config
        got = (layer_num, head_num, head_dim, dtype)
        if got != (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.dtype):
            raise ConfigError(f"vattn pool: (layers, kv heads, head dim, dtype) {got} do not match "
                              f"the cache's {(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.dtype)}")
        self.requests = RowSlots(cache, page_size=page_size)
        self.vattn_cache = cache
        self.rows_per_slot = cache.layout.rows_per_slot
        self._hold_pad_slot(cache)
        # SGLang sizes its token pool up front: map it now (an even share per slot, at least
        # 2,048 tokens deep: fewer slots when the share would be thinner), so admitting
        # a request reuses warm pages instead of mapping on the step's critical path (the pages
        # stay reclaimable, so the physical available size below is unchanged)
        start = time.perf_counter()
        self.prewarmed_pages = cache.prewarm()
        logger.info(cache.summary(prewarm_s=time.perf_counter() - start))
        cap = cache.capacity()
        #: requests the cache can hold at once: its slots, and physically (one page-set each)
        self.max_requests = cfg.max_slots - 1
        self.max_requests_physical = cap.free_page_sets
        #: SGLang's token budget (what the allocator reports when idle)
        self.token_budget = int(cap.free_tokens if size is None else size)
        super().__init__(size=cfg.max_slots * self.rows_per_slot - page_size,
                         page_size=page_size, dtype=cfg.dtype, head_num=cfg.num_kv_heads,
                         head_dim=cfg.head_dim, layer_num=cfg.num_layers,
                         device=str(cfg.torch_device), enable_memory_saver=False,
                         enable_alt_stream=False)

    @classmethod
    def from_cache(cls, cache: VirtualKVCache, *, page_size: int) -> "VattnMHATokenToKVPool":
        """A pool over an existing (fresh) cache; its token budget is what the cache holds."""
        cfg = cache.config
        return cls(None, page_size=page_size, dtype=cfg.dtype, head_num=cfg.num_kv_heads,
                   head_dim=cfg.head_dim, layer_num=cfg.num_layers, device=str(cfg.torch_device),
                   cache=cache)

    @staticmethod
    def _hold_pad_slot(cache: VirtualKVCache) -> None:
        slot = cache.acquire(tenant="__pad__", expected_len=1)
        if slot != PAD_SLOT:
            cache.release(slot)
            raise ConfigError(f"vattn pool needs a fresh cache (pad slot expected {PAD_SLOT}, "
                              f"got {slot})")
        if cache.ensure({slot: 1}):
            raise ConfigError("vattn pool: no physical page left for the pad slot")

    def _create_buffers(self):
        if self.is_quantized_kv_cache:
            raise UnsupportedError("vattn pool does not support quantized KV caches")
        if getattr(self, "post_capture_active", False):
            raise UnsupportedError("vattn pool does not support post-capture KV backing")
        self.k_scale_buffer = self.v_scale_buffer = None
        self.dq_k_buffer = self.dq_v_buffer = None
        cache = self.vattn_cache
        self.k_buffer = [cache.k_rows(layer) for layer in range(self.layer_num)]
        self.v_buffer = [cache.v_rows(layer) for layer in range(self.layer_num)]
        self._kv_buffer_descs = self._build_kv_buffer_descs()
        self._init_data_ptrs_and_strides()

    def _clear_buffers(self):
        self.k_buffer = self.v_buffer = None

    def get_kv_size_bytes(self):
        """Bytes of physical pages currently mapped (not the virtual reservation)."""
        m = self.vattn_cache.metrics()
        return m.get("mapped_bytes", 0), 0

    def store(self, layer, rows: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor) -> None:
        """Write new K/V of ``layer`` at slot rows ``rows`` (``slot * C + position``)."""
        super().set_kv_buffer(layer, KVWriteLoc(rows, None), cache_k, cache_v)

    def _store_kv_layer(self, layer_idx, loc, cache_k, cache_v):
        """SGLang's per-layer write; on the host backend (CPU) a plain indexed store: SGLang picks
        its store kernel by how it was built (a CUDA build takes its CUDA kernel), not by the
        tensors' device, and that kernel given host tensors crashed the CPU suite on a GPU machine."""
        k, v = self.k_buffer[layer_idx], self.v_buffer[layer_idx]
        if k.is_cuda:
            return super()._store_kv_layer(layer_idx, loc, cache_k, cache_v)
        k[loc], v[loc] = cache_k, cache_v

    def set_kv_buffer(self, layer, loc_info, cache_k, cache_v, *args, **kwargs):
        raise UnsupportedError("vattn pool: KV is written by the vattn attention backend "
                               "(SGLang page ids do not address rows here); another writer of "
                               "set_kv_buffer is not supported")

    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor):
        raise UnsupportedError("vattn pool does not move KV between slots")
