"""The engine-version-independent half of the adapter: request -> slot, paging, store, attention.

The hook layer (:mod:`.kv_hooks`, one small patch per vLLM version) tells a :class:`VattnRuntime`
what the model runner did each step; the attention backend asks it for the step's slots and runs
store + attention on the virtually contiguous views of a :class:`vattn.core.VirtualKVCache`.
Token ``p`` of a request in slot ``s`` is row ``s * rows_per_slot + p`` of every layer view.

One runtime exists per worker process (it is the process's KV cache, like vLLM's own); it is
created by the hook when the runner starts and looked up by the backend with :func:`current`.

With vLLM's prefix caching on, one vLLM block is one vattn page-set (one page per VA range, see
:func:`config_from_vllm`) and every block a request receives is bound to the page-set that holds
it (:meth:`VirtualKVCache.bind`, keyed by vLLM's block id): a new request's prefix-cache hit maps
the cached page-sets into its own region, shared, never copied (:meth:`VattnRuntime.bind_blocks`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass

import torch

from vattn.core import KVCacheConfig, VirtualKVCache
from vattn.core.errors import ConfigError, SlotError, UnsupportedError, VattnError
from vattn.core import ops
from vattn.core.layout import KVLayout

__all__ = ["VattnRuntime", "StepPlan", "current", "install", "uninstall", "layer_index",
           "config_from_vllm", "CPU_KERNEL_BLOCK"]

#: vLLM's ``CPU_ATTN`` backend supports kernel block sizes that are multiples of 32
#: (``CPUAttentionBackend.get_supported_kernel_block_sizes``): block sizes vattn suggests are too
CPU_KERNEL_BLOCK = 32

_RUNTIME: list["VattnRuntime"] = []   # the worker process's runtime (at most one)


@dataclass(frozen=True, slots=True)
class StepPlan:
    """Per-step device inputs shared by every layer.

    ``slots``: ``[B]`` int64 slot of each batch row; ``rows``: ``[N]`` int64 cache row of each
    scheduled token (``slot * rows_per_slot + position``).
    """

    slots: torch.Tensor
    rows: torch.Tensor


class VattnRuntime:
    """Slots, paging and attention for one vLLM worker.

    Parameters
    ----------
    config : KVCacheConfig
        Built by :func:`config_from_vllm` from the engine's model / scheduler config.
    block_size : int, optional
        vLLM's block size when its prefix caching is on (``None``: off). It must be the tokens
        one page-set holds; requests then get their page-sets from :meth:`bind_blocks`.
    """

    def __init__(self, config: KVCacheConfig, *, block_size: int | None = None):
        self.cache = VirtualKVCache(config)
        lay = self.cache.layout
        if block_size is not None and (lay.tokens_for(1) != block_size or lay.pages_for(block_size) != 1):
            self.cache.close()
            raise ConfigError(f"block_size {block_size} is not one page-set ({lay.tokens_for(1)} "
                              f"tokens of {lay.page_bytes} bytes per range)")
        self.block_size = block_size
        self.rows_per_slot = lay.rows_per_slot
        self._slot_of: dict[str, int] = {}
        self._blocks: dict[str, int] = {}      # req_id -> blocks bound (prefix caching)
        self._plan: StepPlan | None = None
        self._backend: dict[str, str] = {}

    @property
    def sharing(self) -> bool:
        """Whether vLLM's prefix caching is on (blocks are bound to page-sets)."""
        return self.block_size is not None

    # -- host side: called by the hook once per step --------------------------------------------
    def finish(self, req_ids) -> None:
        """Release the slots of requests that left (finished, aborted or preempted)."""
        for req_id in req_ids:
            slot = self._slot_of.pop(req_id, None)
            self._blocks.pop(req_id, None)
            if slot is not None:
                self.cache.release(slot)

    def bind_blocks(self, new: list[tuple[str, list[int], int]],
                    running: list[tuple[str, list[int]]]) -> None:
        """Prefix caching: give this step's requests the page-sets of the blocks vLLM gave them.

        Parameters
        ----------
        new : list of (req_id, block_ids, num_computed_tokens)
            Requests that start (new, or resumed after preemption: released first by
            :meth:`finish`) with all their block ids. Their first ``num_computed_tokens //
            block_size`` blocks are vLLM's prefix-cache hit: those page-sets are mapped into the
            request's region as they are (shared); the request takes the idle slot where the
            last hit block was mapped when there is one (a repeated prompt finds its prefix in
            place). ``num_computed_tokens`` must be whole blocks.
        running : list of (req_id, new_block_ids)
            Requests that hold a slot and got more blocks: bound after the ones they hold.

        Running requests are bound first, then the new ones; a new request whose hit names a
        block another request of this step receives fresh (vLLM caches a block when it is
        scheduled, so a request admitted later in the same step can hit it: the KV is written
        by the same forward pass, before attention reads it) is bound after that request.

        Raises
        ------
        UnsupportedError
            A hit that ends inside a block.
        VattnError
            A hit on a block no request received, an unknown running request, or pages
            short although vLLM allocated the blocks (vattn's budget holds vLLM's whole pool).
        """
        if not self.sharing:
            raise VattnError("bind_blocks needs the runtime built with block_size (prefix caching on)")
        starts = [(req_id, ids, self._hits(req_id, ids, done)) for req_id, ids, done in new]
        given = {b for req_id, ids in running for b in ids} | {
            b for _, ids, hits in starts for b in ids[hits:]}
        for req_id, ids, hits in starts:          # before anything is acquired: nothing to undo
            lost = [b for b in ids[:hits] if b not in given and not self.cache.holds(b)]
            if lost:
                raise VattnError(f"request {req_id!r} hits blocks {lost} that no request received "
                                 f"(vLLM's block ids and vattn's keys disagree)")
        items, owners = [], []
        for req_id, ids in running:
            if not ids:
                continue
            if req_id not in self._slot_of:
                raise VattnError(f"request {req_id!r} got blocks {ids} but holds no vattn slot")
            items.append((self._slot_of[req_id], self._blocks[req_id], ids, 0))
            owners.append(req_id)
        for req_id, ids, hits in starts:
            if req_id in self._slot_of:           # re-added without a removal: a new request
                self.finish([req_id])
            tokens = min(len(ids) * self.block_size, self.cache.config.max_context)
            prefer = ids[hits - 1] if hits else None
            self._slot_of[req_id] = self.cache.acquire(expected_len=tokens, prefer=prefer)
            self._blocks[req_id] = 0
            items.append((self._slot_of[req_id], 0, ids, hits))
            owners.append(req_id)
        failed = set(self.cache.bind_many(items))   # hits on blocks given this step wait for them
        for req_id, (slot, start, ids, _) in zip(owners, items):
            if slot in failed:
                raise VattnError(f"vattn could not map the page-sets of vLLM blocks {ids} of "
                                 f"request {req_id!r} although vLLM allocated them; capacity: "
                                 f"{self.cache.capacity()}")
            self._blocks[req_id] = start + len(ids)

    def _hits(self, req_id: str, block_ids: list[int], num_computed: int) -> int:
        """Whole blocks of a starting request's prefix-cache hit."""
        hits, partial = divmod(num_computed, self.block_size)
        if partial or hits > len(block_ids):
            raise UnsupportedError(f"request {req_id!r}: a prefix-cache hit of {num_computed} tokens "
                                   f"is not {hits} whole blocks of {self.block_size} tokens out of "
                                   f"{len(block_ids)}: vattn shares whole blocks only")
        return hits

    def blocks(self, req_id: str) -> int:
        """Blocks bound to ``req_id``'s slot so far (prefix caching)."""
        return self._blocks.get(req_id, 0)

    def plan_step(self, batch: list[tuple[str, int, int]]) -> list[str]:
        """Map pages for this step and build the per-token rows.

        Parameters
        ----------
        batch : list of (req_id, num_computed_tokens, num_scheduled_tokens)
            In batch-row order (the order of the attention metadata rows).

        Returns
        -------
        list[str]
            Requests whose pages could not be mapped (the engine must preempt them).
        """
        lengths, slots, rows = {}, [], []
        for req_id, done, new in batch:
            slot = self._slot_of.get(req_id)
            if slot is None:
                if self.sharing:     # its blocks were never bound: attention would read nothing
                    raise VattnError(f"request {req_id!r} is scheduled but got no blocks from "
                                     f"bind_blocks (prefix caching)")
                slot = self._slot_of[req_id] = self.cache.acquire(expected_len=done + new)
            lengths[slot] = done + new
            slots.append(slot)
            base = slot * self.rows_per_slot + done
            rows.extend(range(base, base + new))
        failed = set(self.cache.step(lengths))
        device = self.cache.config.torch_device
        self._plan = StepPlan(torch.tensor(slots, dtype=torch.int64, device=device),
                              torch.tensor(rows, dtype=torch.int64, device=device))
        return [req_id for req_id, _, _ in batch if self._slot_of[req_id] in failed]

    def has_plan(self) -> bool:
        """Whether a step is being executed (False during vLLM's dummy/profile runs)."""
        return self._plan is not None

    def end_step(self) -> None:
        self._plan = None

    def slot(self, req_id: str) -> int:
        if req_id not in self._slot_of:
            raise SlotError(f"request {req_id!r} holds no vattn slot")
        return self._slot_of[req_id]

    # -- device side: called by every attention layer --------------------------------------------
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               query_start_loc: torch.Tensor, seq_lens: torch.Tensor, max_query_len: int,
               max_seq_len: int, scale: float, out: torch.Tensor) -> torch.Tensor:
        """Store this step's K/V of ``layer`` and attend (prefill and decode rows mixed).

        Parameters
        ----------
        q : ``[N, Hq, D]``; k, v : ``[N, Hk, D]`` (``N`` = scheduled tokens, padding excluded).
        query_start_loc : ``[B + 1]`` int32; seq_lens : ``[B]`` int32 (keys incl. new tokens).
        out : ``[N, Hq, D]`` written in place and returned.
        """
        plan = self._plan
        if plan is None:
            raise VattnError("attention ran before the hook planned the step")
        n = plan.rows.shape[0]
        cache = self.cache
        ops.store(cache.k_rows(layer), cache.v_rows(layer), k[:n].to(cache.config.dtype),
                  v[:n].to(cache.config.dtype), plan.rows)
        name = self._backend.get("prefill")
        if name is None:
            name = self._backend["prefill"] = ops.resolve_backend(
                "prefill", device=q.device, dtype=q.dtype, head_dim=q.shape[-1])
        return ops.prefill(q[:n], cache.k(layer), cache.v(layer), cu_seqlens_q=query_start_loc,
                           slots=plan.slots, seqlens_k=seq_lens, max_seqlen_q=max_query_len,
                           max_seqlen_k=max_seq_len, scale=scale, causal=True, backend=name,
                           out=out[:n])

    def close(self) -> None:
        self.cache.close()


def config_from_vllm(vllm_config, *, device: str, num_blocks: int | None = None) -> KVCacheConfig:
    """A :class:`KVCacheConfig` for this rank: KV heads of the rank, slots = ``max_num_seqs``.

    Prefix caching off: pages of the driver's size (2 MiB), ``VATTN_PAGE_BUDGET`` bytes of them.
    Prefix caching on: one page-set holds exactly one vLLM block (``page_bytes = block_size *
    token_bytes`` of one range), and the budget is ``num_blocks + 1`` page-sets (vLLM's whole
    block pool, whose block 0 is its never-used null block, plus the padding slot's page-set):
    every block vLLM hands out is bound to a page-set and a cached one stays bound until vLLM
    hands its id out again, so vattn must be able to hold as many as vLLM has
    (``VATTN_PAGE_BUDGET`` is not used then). The host backend maps whole OS pages, so the
    block must be a multiple of the OS page (:class:`ConfigError` naming a block size that is).
    """
    model = vllm_config.model_config
    par = vllm_config.parallel_config
    num_layers = model.get_num_layers(par)
    budget = os.environ.get("VATTN_PAGE_BUDGET", "256MiB" if device == "cpu" else "0.5")
    cfg = KVCacheConfig(num_layers=num_layers, num_kv_heads=model.get_num_kv_heads(par),
                        head_dim=model.get_head_size(), dtype=model.dtype,
                        max_slots=vllm_config.scheduler_config.max_num_seqs,
                        max_context=model.max_model_len,
                        group_size=int(os.environ.get("VATTN_GROUP_SIZE", "1")),
                        page_budget=_parse_budget(budget), device=device,
                        map_ahead_tokens=0 if device == "cpu" else 256)
    if not getattr(vllm_config.cache_config, "enable_prefix_caching", False):
        return cfg
    block = vllm_config.cache_config.block_size
    lay = KVLayout.from_config(cfg, 1)
    page, os_page = block * lay.token_bytes, os.sysconf("SC_PAGE_SIZE")
    if page % os_page:
        step = math.lcm(os_page // math.gcd(lay.token_bytes, os_page), CPU_KERNEL_BLOCK)
        fits = -(-block // step) * step
        raise ConfigError(f"vattn with prefix caching maps one vLLM block as one page per VA range: "
                          f"block_size {block} x {lay.token_bytes} bytes per token and range = {page} "
                          f"bytes, not a multiple of the {os_page}-byte OS page; use --block-size "
                          f"{fits} (block_size={fits}), or turn prefix caching off "
                          f"(--no-enable-prefix-caching)")
    if num_blocks is None:
        return dataclasses.replace(cfg, page_bytes=page)
    return dataclasses.replace(cfg, page_bytes=page, page_budget=(num_blocks + 1) * page * lay.num_ranges)


def _parse_budget(text: str) -> int | float:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for suffix, mult in units.items():
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * mult)
    try:
        return float(text) if "." in text else int(text)
    except ValueError as exc:
        raise ConfigError(f"VATTN_PAGE_BUDGET must be bytes, '<n>MiB' or a fraction, got {text!r}") from exc


def layer_index(layer_name: str) -> int:
    """The layer number in a vLLM layer name (``model.layers.7.self_attn.attn`` -> 7)."""
    found = re.findall(r"\.(\d+)\.", f".{layer_name}.")
    if not found:
        raise ConfigError(f"cannot find a layer index in {layer_name!r}")
    return int(found[0])


def install(runtime: VattnRuntime) -> None:
    if _RUNTIME:
        raise VattnError("a vattn runtime is already installed in this process")
    _RUNTIME.append(runtime)


def uninstall() -> None:
    while _RUNTIME:
        _RUNTIME.pop().close()


def current() -> VattnRuntime:
    """The process's runtime; raises if the vattn hooks did not start one."""
    if not _RUNTIME:
        raise VattnError("the vattn attention backend is selected but the vattn KV hooks are not "
                         "active in this process (is VATTN_VLLM=1 set and the plugin installed?)")
    return _RUNTIME[0]
