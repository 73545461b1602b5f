"""The GPU runner's half of the adapter: request index -> slot, pages per block, KV views.

Engine-free (vattn.core + torch only), so it runs on the host backend in CI. The hooks of
:mod:`.gpu_hooks` drive it from vLLM's V2 model runner:

* a request index receives blocks (``BlockTables.append_block_ids``) -> :meth:`GpuRuntime.on_blocks`
  (a new request first acquires a slot);
* once per step, before the inputs are prepared (``BlockTables.apply_staged_writes``) ->
  :meth:`GpuRuntime.apply`: one ``step`` (ensure, then one block mapped ahead in the
  background) for every request that got blocks, then the index -> slot table is uploaded;
* a request leaves (``GPUModelRunner._remove_request``) -> :meth:`GpuRuntime.release` (the core
  records a CUDA event on the current stream; pages stay warm and are unmapped only after it).

Everything here is host-side and may synchronize; none of it runs inside a CUDA graph.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
import torch

from vattn.core import KVCacheConfig, VirtualKVCache, snapshots, step_trace
from vattn.core.layout import cache_layout_row
from vattn.core.config import DRIVER_RETRIES_ENV, driver_retries, env_flag
from vattn.core.device_wait import DeviceWait
from vattn.core.errors import ConfigError, DriverRetry, VattnError
from vattn.core.metrics import Histogram
from vattn.core.requests import RequestSlots
from vattn.core.staging import PrefixBursts

from .gpu_layout import cold_slots as cold_slots_for
from .slot_tables import SlotTables

__all__ = ["GpuRuntime", "DEVICE_WAIT_ENV"]

#: ``0`` turns off the CUDA events that measure the device's idle time behind :meth:`GpuRuntime.apply`
DEVICE_WAIT_ENV = "VATTN_DEVICE_WAIT"


class GpuRuntime:
    """Slots, pages and KV views for one vLLM GPU worker.

    Parameters
    ----------
    config : KVCacheConfig
        From :func:`.gpu_layout.cache_config` (``max_slots`` = vLLM's ``max_num_seqs``).
    block_size : int
        vLLM's block size; must equal the tokens one page-set holds.
    layer_names : list[str]
        The KV group's attention layers; their order is the local layer index.
    max_num_tokens : int
        ``max_num_batched_tokens`` (length of the slot-mapping buffer).
    attn_margin : int
        Rows per slot hidden from the attention kernel: its page is ``attn_rows = rows_per_slot
        - attn_margin`` (0, or :data:`.gpu_layout.EXACT_MARGIN` for stock's FA3 kernel path).
    max_model_len : int, optional
        The longest request (vLLM's ``max_model_len``; default ``config.max_context``): it must
        fit the attention page.
    prefix_caching : bool
        vLLM's ``enable_prefix_caching``. On: every block a request receives is bound to the
        page-set that holds it (:meth:`VirtualKVCache.bind`, keyed by vLLM's block id), and a
        new request's prefix-cache hit maps the cached page-sets into its own region (shared,
        never copied); vLLM's block pool, hashing and eviction decide everything, vattn follows.
    stage_prefixes : bool
        With prefix caching: a prefix that new requests keep hitting (two or more in one step,
        or one in each of two steps running) is mapped ahead into as many empty idle slots as
        hit it in the step (:meth:`VirtualKVCache.stage_prefix`, on the map-ahead worker while
        the device computes), so the next requests with it find it in place instead of mapping
        it on the step's critical path (a burst sharing a system prompt). Only with map-ahead on.
    defer_mapping : bool
        :meth:`apply`'s VMM calls are queued per range (:meth:`VirtualKVCache.deferred`) and
        made by :meth:`ready` as the forward reaches each range's first layer, so the device
        computes the layers before it while the host maps (only range 0 stays on the step's
        path). The engine must call :meth:`ready` before every layer's KV is written or read
        and :meth:`ready` with no layer before a forward that does not (a full CUDA graph).
    cold_slots : int, optional
        With prefix caching: idle slots the pre-warm leaves empty for requests whose hit is
        mapped in (:meth:`VirtualKVCache.prewarm`); ``None``: ``$VATTN_COLD_SLOTS`` (default 0).
    """

    def __init__(self, config: KVCacheConfig, *, block_size: int, layer_names: list[str],
                 max_num_tokens: int, attn_margin: int = 0, max_model_len: int | None = None,
                 prefix_caching: bool = False, stage_prefixes: bool = False, driver=None,
                 retries: int | None = None, defer_mapping: bool = False, cold_slots: int | None = None):
        start = time.perf_counter()
        if len(layer_names) != config.num_layers:
            raise ConfigError(f"{len(layer_names)} layer names for a cache of {config.num_layers} layers")
        self.cache = VirtualKVCache(config, driver=driver)
        #: times a cache call whose driver call failed is retried within the step (default
        #: ``$VATTN_DRIVER_RETRIES`` or 2); past that the error propagates (no preemption path
        #: on the GPU runner yet)
        self._retry = DriverRetry(driver_retries(retries),
                                  f"{DRIVER_RETRIES_ENV}; the GPU runner has no preemption path for it yet")
        lay = self.cache.layout
        if lay.tokens_for(1) != block_size or lay.pages_for(block_size) != 1:
            raise ConfigError(f"block_size {block_size} is not one page-set ({lay.tokens_for(1)} tokens)")
        self.block_size = block_size
        self.rows_per_slot = lay.rows_per_slot
        #: the page size the attention kernel sees (one page per request): a slot's first rows
        self.attn_rows = lay.rows_per_slot - attn_margin
        longest = config.max_context if max_model_len is None else max_model_len
        if not 0 <= attn_margin < lay.rows_per_slot or self.attn_rows < longest:
            raise ConfigError(f"attn_margin {attn_margin} leaves {self.attn_rows} of {lay.rows_per_slot} "
                              f"rows per slot; requests need up to {longest}")
        self.layer_of = {name: i for i, name in enumerate(layer_names)}
        self.defer_mapping = defer_mapping
        self.tables = SlotTables(max_num_reqs=config.max_slots, max_num_tokens=max_num_tokens,
                                 rows_per_slot=lay.rows_per_slot, padding_slot=self.cache.padding_slot,
                                 device=config.torch_device, driver=self.cache.driver)
        self._slot = RequestSlots(self.cache)   # request index -> vattn slot
        self._new: dict[int, tuple] = {}       # new request index -> (tokens, hit blocks): a slot in apply
        self._pending: dict[int, int] = {}     # request index -> tokens its blocks cover
        self.sharing = prefix_caching
        self._binds: dict[int, list] = {}      # request index -> [first new block, new ids, hits]
        self._copies: list[tuple[int, int]] = []   # (cached block, the request's copy), this step
        # staging runs on the map-ahead worker (without one it would map on the step's path)
        self.staging = stage_prefixes and prefix_caching and config.map_ahead_tokens > 0
        self._bursts = PrefixBursts()          # which prefixes to stage (stage_prefixes)
        self._kv: dict[int, torch.Tensor] = {}
        self.step_us = Histogram()             # host time of apply() (ensure + upload) per step
        #: device idle time behind apply() per step: the part of step_us the GPU waited for
        #: ``$VATTN_STEP_TRACE``: one row per apply() (when, requests bound, driver calls)
        self.trace = step_trace.from_env(lambda: self.cache.counters)
        #: (CUDA events, the driver's with the GIL held where it holds it, else torch's, whose
        #: record releases it; ``$VATTN_DEVICE_WAIT=0`` turns them off)
        timed = env_flag(DEVICE_WAIT_ENV, True)
        self.device_wait = DeviceWait(config.torch_device.type == "cuda" and timed,
                                      sink=None if self.trace is None else self.trace.idle,
                                      make_event=getattr(self.cache.driver, "timing_event", None))
        self.blocks_us = Histogram()           # host time of on_blocks() (incl. acquire) per call
        # every slot starts with an even share of the pool mapped: vLLM hands out blocks of a
        # pool it sized up front, so mapping it now takes the VMM calls off the step's path;
        # requests that outgrow their share are served by map-ahead (see gpu_layout.cache_config)
        warm_start = time.perf_counter()
        if not prefix_caching:
            cold_slots = 0
        elif cold_slots is None:
            cold_slots = cold_slots_for(config.max_slots)
        self.prewarmed_pages = self.cache.prewarm(cold_slots=cold_slots)
        self.prewarm_s = time.perf_counter() - warm_start
        self.init_s = time.perf_counter() - start
        if self.trace is not None:
            self.trace.header |= {"cache": self.cache.summary(prewarm_s=self.prewarm_s),
                                  "sharing": self.sharing, "staging": self.staging}
        #: ``$VATTN_METRICS`` snapshots (each step, and with the page audit once idle for 1 s;
        #: the step trace is written with the idle ones only: off the step's path)
        self.snapshots = snapshots.from_env(self.snapshot, audit=self.cache.audit_when_quiet, idle_s=1.0,
                                            on_idle=self._write_trace)

    # -- host side ---------------------------------------------------------------------------
    def on_blocks(self, index: int, num_blocks: int, *, new_request: bool, block_ids=(),
                  hits: int = 0) -> None:
        """Request ``index`` now holds ``num_blocks`` blocks, the last ``len(block_ids)`` of them
        new; a new request takes a slot in :meth:`apply`, once the step's copies are known. With
        prefix caching, its first ``hits`` blocks are prefix-cache hits (whole blocks vLLM
        already holds) and it prefers the idle slot where the cached block its copy-on-write
        reads was mapped (a repeated prompt: its own block is in place there, so the copy is no
        copy), else where the last hit block was, else the one needing the fewest VMM calls."""
        start = time.perf_counter()
        tokens = min(num_blocks * self.block_size, self.cache.config.max_context)
        if new_request:
            if index in self._slot or index in self._new:   # re-added without a removal
                self.release(index)
            self._new[index] = (tokens, block_ids[:hits] if self.sharing and hits else ())
        elif index not in self._slot and index not in self._new:
            raise VattnError(f"request index {index} got blocks but holds no vattn slot")
        self._pending[index] = tokens
        if self.sharing and len(block_ids):
            pending = self._binds.get(index)
            if pending is None or new_request:
                self._binds[index] = [num_blocks - len(block_ids), list(block_ids), hits]
            else:                                       # twice in one step: one bind
                pending[1].extend(block_ids)
        self.blocks_us.observe((time.perf_counter() - start) * 1e6)

    def copy_blocks(self, copies) -> None:
        """vLLM's copy-on-write for this step (``(src_block_id, dst_block_id)`` pairs: a prefix
        hit that ends inside cached block ``src``, whose request got ``dst`` fresh): done by
        :meth:`apply`, once ``dst`` is bound, before the forward."""
        if not self.sharing:
            raise VattnError("vLLM asked for KV block copies with prefix caching off")
        self._copies.extend((int(src), int(dst)) for src, dst in copies)

    def apply(self) -> None:
        """Map the pages of every request that got blocks this step, copy what vLLM's
        copy-on-write asks for; upload the slot table.

        Raises
        ------
        VattnError
            A slot could not be grown. vLLM admitted the blocks, so this means vLLM's block count
            and vattn's page pool disagree (a bug), not memory pressure.
        """
        start = time.perf_counter()
        with step_trace.section(self.trace, self.device_wait, binds=len(self._binds),
                                copies=len(self._copies), steps=len(self._pending)):
            # a step that admits requests runs a prefill, layer by layer outside full graphs: its
            # page-set copies wait for their ranges there; a decode-only step replays a full
            # graph, which makes every range's calls before it starts (the core still queues
            # them where the driver batches copies)
            window = (self.cache.deferred(copies=bool(self._new)) if self.defer_mapping
                      else contextlib.nullcontext())
            with window:
                self._apply()
        self.step_us.observe((time.perf_counter() - start) * 1e6)
        if self.snapshots is not None:
            self.snapshots.step()

    def _take_slots(self) -> None:
        """The step's new requests take their slots: each prefers the home of the cached block
        its copy-on-write reads (the copy's destination is one of its fresh blocks), else its
        last hit block's."""
        reads = {dst: src for src, dst in self._copies}
        for index, (tokens, prefix) in self._new.items():
            binds = self._binds.get(index)
            fresh = binds[1][binds[2]:] if binds is not None else ()
            home = next((reads[b] for b in fresh if b in reads), None)
            slot = self._retry(lambda: self._slot.take(index, expected_len=tokens, prefix=prefix,
                                                       home=home))
            self.tables.assign(index, slot)
        self._new.clear()

    def _apply(self) -> None:
        stage: list[tuple[list, int]] = []     # (prefix blocks, idle copies wanted)
        if self._new:
            self._take_slots()
        if self._binds:
            # new requests come before running ones here (vLLM adds them first), but a new one
            # may hit a block a running one is given this step: bind_many orders them
            items = [(self._slot[index], first, ids, hits)
                     for index, (first, ids, hits) in self._binds.items()]
            failed = self._retry(lambda: self.cache.bind_many(items))
            self._binds.clear()
            if self.staging:
                stage = self._bursts.observe(items)
            if failed:
                raise VattnError(f"vattn could not map the page-sets of slots {failed} although vLLM "
                                 f"allocated their blocks; capacity: {self.cache.capacity()}")
        for src, dst in self._copies:
            if not self._retry(lambda: self.cache.copy_block(src, dst)):
                raise VattnError(f"vattn could not copy block {src} into block {dst}: block {src} is "
                                 f"mapped nowhere and no slot has room to map it")
        self._copies.clear()
        if self._pending:
            indices = list(self._pending)
            slots = self._slot.array(indices)
            lengths = np.fromiter(self._pending.values(), dtype=np.int64, count=len(indices))
            self._pending.clear()
            # ensure + one block mapped ahead in the background (a reused warm slot's surplus
            # stays reclaimable)
            failed = self._retry(lambda: self.cache.step(slots, lengths))
            if failed:
                raise VattnError(f"vattn could not map pages for slots {failed} although vLLM "
                                 f"allocated their blocks; capacity: {self.cache.capacity()}")
        self.tables.upload()
        for keys, copies in stage:                    # queued for the map-ahead worker
            self.cache.stage_prefix(keys, copies)

    def ready(self, layer: int | None = None) -> None:
        """Make the VMM calls :meth:`apply` deferred for the ranges ``layer`` reads (and those
        before them; every range with ``None``). Cheap when none wait."""
        self.cache.issue(layer)                 # a failure is final: no retry

    def release(self, index: int) -> None:
        """Request ``index`` left (finished, aborted or preempted): release its slot, fenced."""
        self._pending.pop(index, None)
        self._binds.pop(index, None)
        self._new.pop(index, None)
        if self._slot.drop(index) is not None:
            self.tables.clear(index)

    def slot(self, index: int) -> int | None:
        return self._slot.get(index)

    @property
    def padding_tokens(self) -> int:
        """Rows of the padding slot that are mapped (dummy runs must not read beyond them)."""
        return self.cache.layout.tokens_for(1)

    # -- views (fixed for the runtime's lifetime) ----------------------------------------------
    def kv_view(self, layer: int) -> torch.Tensor:
        """K and V of ``layer`` as one ``[2, max_slots + 1, rows_per_slot, H, D]`` strided tensor.

        ``view[0]`` is :meth:`VirtualKVCache.k`, ``view[1]`` :meth:`VirtualKVCache.v`; dim 0 steps
        from K to V inside the same VA reservation (last dim contiguous).
        """
        if layer not in self._kv:
            k, v = self.cache.k(layer), self.cache.v(layer)
            gap = v.storage_offset() - k.storage_offset()
            if gap <= 0 or k.stride() != v.stride() or k.untyped_storage().data_ptr() != \
                    v.untyped_storage().data_ptr():
                raise VattnError(f"layer {layer}: K and V views do not share one strided layout")
            self._kv[layer] = k.as_strided((2, *k.shape), (gap, *k.stride()), k.storage_offset())
        return self._kv[layer]

    # -- reporting ---------------------------------------------------------------------------------
    def metrics(self) -> dict:
        """Core metrics plus this adapter's step timing and the layout's worst-case waste (with
        ``$VATTN_STEP_TRACE``, the step trace is written too)."""
        self._write_trace()
        return self._counters()

    def _counters(self) -> dict:
        return self.cache.metrics() | {
            "apply_step_us": self.step_us.as_dict(), "on_blocks_us": self.blocks_us.as_dict(),
            "apply_device_wait_us": self.device_wait.collect().as_dict(),
            "prewarmed_pages": self.prewarmed_pages, "init_s": self.init_s,
            "driver_retries": self._retry.retried,
            "slot_upload_waits": self.tables.staging_waits,
            "slot_mapping": "triton" if self.tables.fused else f"torch ({self.tables.fused_error or 'not CUDA'})",
            "block_size": self.block_size, "rows_per_slot": self.rows_per_slot,
            "prefix_caching": self.sharing, "stage_prefixes": self.staging,
            "attn_page_rows": self.attn_rows,
            "layout": cache_layout_row(self.cache.config, self.cache.layout.page_bytes)}

    def snapshot(self) -> dict:
        """:meth:`metrics`'s counters plus the request indices holding a slot (for
        ``$VATTN_METRICS``; vLLM removes a finished request one step late, so an idle engine still
        lists its last batch). The step trace is not written here: a snapshot is taken on the
        step's path every few seconds; the idle ones write it (``on_idle``)."""
        return self._counters() | {"requests_holding_slots": len(self._slot)}

    def _write_trace(self) -> None:
        """Write ``$VATTN_STEP_TRACE`` with the idle times of every section completed so far."""
        if getattr(self, "trace", None) is not None:
            self.device_wait.collect()
            self.trace.write()

    def close(self) -> None:
        if getattr(self, "snapshots", None) is not None:
            self.snapshots.close()
        self._write_trace()
        self._kv.clear()
        self.cache.close()
