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

A request whose pages cannot be mapped (a driver call failing past its retries, or the pool dry)
loses its KV alone: :meth:`VattnRuntime.kill` leaves its rows out of the step and names it for
vLLM's scheduler, which preempts it or finishes it with an error (the hook in :mod:`.kv_hooks`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vattn.core import KVCacheConfig, VirtualKVCache
from vattn.core.errors import ConfigError, DriverError, SlotError, UnsupportedError, VattnError
from vattn.core import ops, snapshots
from vattn.core.requests import RequestSlots

from .faults import ERROR, PREEMPT, FaultBook
from .registry import current, driver_wrapper, install, installed, set_driver_wrapper, uninstall
from .sizing import CPU_KERNEL_BLOCK, config_from_vllm, layer_index

__all__ = ["VattnRuntime", "StepPlan", "current", "install", "uninstall", "layer_index",
           "config_from_vllm", "CPU_KERNEL_BLOCK", "FAILED_ATTR", "set_driver_wrapper", "installed"]


@dataclass(frozen=True, slots=True)
class StepPlan:
    """Per-step device inputs shared by every layer.

    ``slots``: ``[B]`` int64 slot of each batch row; ``rows``: ``[N]`` int64 cache row of each
    scheduled token (``slot * rows_per_slot + position``). When requests of the step lost their
    KV (:meth:`VattnRuntime.kill`), only the other rows are listed: ``tokens`` ``[N']`` int64 are
    the indices of their tokens among the step's, ``alive`` ``[B]`` bool marks their batch rows
    (both ``None`` when every request runs).
    """

    slots: torch.Tensor
    rows: torch.Tensor
    tokens: torch.Tensor | None = None
    alive: torch.Tensor | None = None


#: How vattn tells vLLM's scheduler (the hook on ``Scheduler.update_from_output``) about requests
#: it could not give pages: an attribute of the step's ``ModelRunnerOutput``,
#: ``{req_id: {"action": "preempt" | "error", "reason": str, "evict": [block ids], "throttle": bool}}``
#: (``throttle``: the pool ran dry, admit no more requests than run until one finishes).
FAILED_ATTR = "vattn_failed"


class VattnRuntime:
    """Slots, paging and attention for one vLLM worker.

    Parameters
    ----------
    config : KVCacheConfig
        Built by :func:`config_from_vllm` from the engine's model / scheduler config.
    block_size : int, optional
        vLLM's block size when its prefix caching is on (``None``: off). It must be the tokens
        one page-set holds; requests then get their page-sets from :meth:`bind_blocks`.
    retries : int
        Times a failed driver call (a :class:`DriverError` out of the cache) is retried within
        the step before the request it was for loses its KV (the cache's record stays exact, so
        a retry continues where the call failed).
    max_preemptions : int
        Preemptions for driver faults after which a request is finished with an error instead
        (a driver that stays broken for it must not make it loop forever).
    exchange : callable, optional
        Tensor parallelism: ``{req_id: failure}`` of this rank's kills this step -> every rank's
        (a collective over the TP group, :func:`.kv_hooks._tp_exchange`); every rank then kills
        the union before it builds the step's rows.

    Faults and shortfalls
    ---------------------
    A request whose pages cannot be mapped this step (a driver call failed ``retries + 1``
    times, or the pool is dry) is *killed* (:meth:`kill`): its slot is released, its rows are
    left out of this step's store and attention, and :meth:`take_failures` hands vLLM's
    scheduler the request to preempt (vLLM's own recompute preemption, its output of this step
    dropped) or, when it can never run, to finish with an error. The other requests of the step
    run as if nothing happened.
    """

    def __init__(self, config: KVCacheConfig, *, block_size: int | None = None,
                 retries: int = 2, max_preemptions: int = 3, exchange=None):
        self.faults = FaultBook(retries, max_preemptions)
        driver, wrap = None, driver_wrapper()
        if wrap is not None:
            from vattn.core.driver import get_driver
            driver = wrap(get_driver(config.torch_device, granularity=config.page_bytes))
        self._driver = driver                  # closed with the runtime (the cache does not own it)
        try:
            self.cache = VirtualKVCache(config, driver=driver)
        except BaseException:
            self._close_driver()
            raise
        lay = self.cache.layout
        if block_size is not None and (lay.tokens_for(1) != block_size or lay.pages_for(block_size) != 1):
            self.close()
            raise ConfigError(f"block_size {block_size} is not one page-set ({lay.tokens_for(1)} "
                              f"tokens of {lay.page_bytes} bytes per range)")
        self.block_size = block_size
        self.rows_per_slot = lay.rows_per_slot
        self._slot_of = RequestSlots(self.cache)
        self._blocks: dict[str, int] = {}      # req_id -> blocks bound (prefix caching)
        self._block_ids: dict[str, list[int]] = {}   # req_id -> its vLLM block ids (prefix caching)
        self._plan: StepPlan | None = None
        self._backend: dict[str, str] = {}
        self._step_hits: dict[str, set] = {}   # this step's prefix-cache hits per new request
        #: tensor parallelism: ``local kills -> every rank's kills`` (a collective; the hooks
        #: pass it when the TP group has more than one rank), so all ranks leave the same rows out
        self.exchange = exchange
        #: ``$VATTN_METRICS`` snapshots (each step, and with the page audit once idle for 1 s)
        self.snapshots = snapshots.from_env(self.snapshot, audit=self.cache.audit_when_quiet, idle_s=1.0)

    @property
    def counts(self) -> dict:
        """The fault counters (:class:`.faults.FaultBook`)."""
        return self.faults.counts

    @property
    def events(self):
        """The latest kills (:class:`.faults.FaultBook`)."""
        return self.faults.events

    @property
    def sharing(self) -> bool:
        """Whether vLLM's prefix caching is on (blocks are bound to page-sets)."""
        return self.block_size is not None

    def requests(self) -> list[str]:
        """The requests that hold a slot (vLLM reports a finished request one step later: after
        the engine's last step, those still listed are done and :meth:`finish` may release them)."""
        return list(self._slot_of)

    def metrics(self) -> dict:
        """The cache's metrics plus the runtime's fault counters (``driver_retries``: failed
        driver calls retried; ``requests_preempted`` / ``requests_failed``: requests handed to
        vLLM's scheduler to preempt / to finish with an error; ``pool_shortfalls``;
        ``preemptions``: every preemption vLLM reported, its own included)."""
        return self.cache.metrics() | self.counts

    def snapshot(self) -> dict:
        """:meth:`metrics` plus the requests holding a slot (for ``$VATTN_METRICS``; vLLM reports
        a finished request one step late, so an idle engine still lists its last batch)."""
        return self.metrics() | {"requests_holding_slots": len(self._slot_of)}

    # -- host side: called by the hook once per step --------------------------------------------
    def finish(self, req_ids, *, finished=(), preempted=()) -> None:
        """Release the slots of requests that left (finished, aborted or preempted); those in
        ``finished`` are gone for good (their fault count is dropped too), ``preempted`` are
        counted (``preemptions``: vLLM's own and those vattn asked for). vLLM hands the ids over
        as sets (their order differs per process); the core makes the order of one run of
        releases irrelevant (``SlotTable.clock``)."""
        self.counts["preemptions"] += len(preempted)
        for req_id in req_ids:
            self._slot_of.drop(req_id)
            self._blocks.pop(req_id, None)
            self._block_ids.pop(req_id, None)
            self.faults.left(req_id, finished=False)
        for req_id in finished:
            self.faults.left(req_id, finished=True)

    def bind_blocks(self, new: list[tuple[str, list[int], int]], running: list[tuple],
                    copies=()) -> list[str]:
        """Prefix caching: give this step's requests the page-sets of the blocks vLLM gave them.

        Parameters
        ----------
        new : list of (req_id, block_ids, num_computed_tokens)
            Requests that start (new, or resumed after preemption: released first by
            :meth:`finish`) with all their block ids. Their first ``num_computed_tokens //
            block_size`` blocks are vLLM's prefix-cache hit: those page-sets are mapped into the
            request's region as they are (shared); the request takes the idle slot where the
            last hit block was mapped when there is one (a repeated prompt finds its prefix in
            place). A hit that ends inside a block comes with vLLM's copy-on-write of it.
        running : list of (req_id, new_block_ids[, num_computed_tokens])
            Requests that hold a slot and got more blocks: bound after the ones they hold.
        copies : list of (src_block_id, dst_block_id)
            vLLM's copy-on-write this step (``kv_cache_block_copies``, see :mod:`.fine_hits`): a
            new request's hit ends inside cached block ``src``; its own fresh block ``dst`` gets a
            copy of it once bound (:meth:`VirtualKVCache.copy_block`). A request whose copy fails
            (driver faults past the retries; ``src`` mapped nowhere and no room to map it) is killed.

        Running requests are bound first, then the new ones; a new request whose hit names a
        block another request of this step receives fresh (vLLM caches a block when it is
        scheduled, so a request admitted later in the same step can hit it: the KV is written
        by the same forward pass, before attention reads it) is bound after that request.

        A request whose binding fails (a driver fault that outlives the retries, or no pages)
        is killed (:meth:`kill`), and so is every request of the step that hits one of its
        fresh blocks (nobody writes them this step). Returns the requests killed.

        Raises
        ------
        UnsupportedError
            A hit that ends inside a block without a copy of it.
        VattnError
            A hit on a block no request received, a hit longer than the request's blocks, or an
            unknown running request.
        """
        if not self.sharing:
            raise VattnError("bind_blocks needs the runtime built with block_size (prefix caching on)")
        copies = [(int(src), int(dst)) for src, dst in copies]
        source = {dst: src for src, dst in copies}
        starts = [(req_id, ids, self._hits(req_id, ids, done, source)) for req_id, ids, done in new]
        given = {b for r in running for b in r[1]} | {b for _, ids, hits in starts for b in ids[hits:]}
        for req_id, ids, hits in starts:          # before anything is acquired: nothing to undo
            copied = [source[ids[hits]]] if hits < len(ids) and ids[hits] in source else []
            lost = [b for b in ids[:hits] + copied if b not in given and not self.cache.holds(b)]
            if lost:
                raise VattnError(f"request {req_id!r} hits blocks {lost} that no request received "
                                 f"(vLLM's block ids and vattn's keys disagree)")
        self._step_hits = {}
        items: list[tuple[str, int, list[int], int]] = []     # (req_id, start, ids, hits)
        before: dict[str, int] = {}
        for req_id, ids, *done in running:
            if not ids or req_id in self.faults.dead:   # a killed request writes nothing until reset
                continue
            if req_id not in self._slot_of:
                raise VattnError(f"request {req_id!r} got blocks {ids} but holds no vattn slot")
            held = self._block_ids.setdefault(req_id, [])
            # without its computed tokens, its last block may be the one this step fills
            before[req_id] = done[0] if done else max(0, len(held) - 1) * self.block_size
            held.extend(ids)
            items.append((req_id, self._blocks[req_id], ids, 0))
        for req_id, ids, hits in starts:          # known before any is acquired (see kill)
            if req_id in self._slot_of:           # re-added without a removal: a new request
                self.finish([req_id])
            self._block_ids[req_id] = list(ids)
            self._step_hits[req_id] = set(ids[:hits])
            before[req_id] = hits * self.block_size
        killed_before = set(self.faults.failures)
        for req_id, ids, hits in starts:
            if req_id in self.faults.dead:              # hits a block of a request killed this step
                continue
            tokens = min(len(ids) * self.block_size, self.cache.config.max_context)
            if self._acquire(req_id, tokens, prefix=ids[:hits],
                             before=before[req_id]) is None:
                continue
            self._blocks[req_id] = 0
            items.append((req_id, 0, ids, hits))
        self._bind_in_order(items, before)
        self._copy(copies, {ids[hits]: req_id for req_id, ids, hits in starts if hits < len(ids)}, before)
        return [r for r in self.faults.failures if r not in killed_before]

    def _copy(self, copies: list[tuple[int, int]], owner: dict[int, str], before: dict[str, int]) -> None:
        """vLLM's copy-on-write: each ``(src, dst)`` into the request that got ``dst`` fresh (a
        request killed meanwhile is skipped; one whose copy fails is killed)."""
        for src, dst in copies:
            req_id = owner.get(dst)
            if req_id is None:
                raise VattnError(f"vLLM asked to copy block {src} into block {dst}, which no request "
                                 f"starting this step got as its first fresh block")
            if req_id in self.faults.dead:
                continue
            ok, why = self.faults.retry(lambda: self.cache.copy_block(src, dst))
            if why == "short":
                self.kill(req_id, f"block {src} to copy is mapped nowhere and no slot has room for it",
                          before=before[req_id], action=PREEMPT)
            elif not ok:
                self.kill(req_id, why, before=before[req_id], fault=True)


    def _bind_in_order(self, items: list[tuple[str, int, list[int], int]], before: dict[str, int]) -> None:
        """Bind the items (``(req_id, start, ids, hits)``) one at a time, a hit on a block another
        item binds fresh after that item (the order of :meth:`VirtualKVCache.bind_many`), so a
        failure is the failing request's alone."""
        fresh = {req_id: set(ids[hits:]) for req_id, _, ids, hits in items}
        pending = list(items)
        while pending:
            everyone = set().union(*(fresh[item[0]] for item in pending))
            wait = [bool((set(ids[:hits]) - fresh[req_id]) & everyone)
                    for req_id, _, ids, hits in pending]
            if all(wait):
                raise SlotError(f"prefix hits wait on each other's fresh blocks: "
                                f"{[ids[:hits] for _, _, ids, hits in pending]}")
            for (req_id, start, ids, hits), later in zip(pending, wait):
                if later or req_id in self.faults.dead:  # killed: it hit a killed request's block
                    continue
                slot = self._slot_of[req_id]
                ok, why = self.faults.retry(lambda: self.cache.bind(slot, start, ids, hits=hits))
                if ok:
                    self._blocks[req_id] = start + len(ids)
                else:
                    self._kill_unpaged(req_id, why, before[req_id], len(ids) * self.block_size)
            pending = [item for item, later in zip(pending, wait) if later]

    def _acquire(self, req_id: str, expected_len: int, *, prefix=(), before: int = 0) -> int | None:
        """A slot for ``req_id`` (recorded), or ``None`` after killing it: driver faults while the
        slot's pages were re-tagged, ``retries + 1`` times (a failed re-tag leaves the slot idle)."""
        def take() -> bool:
            self._slot_of.take(req_id, expected_len=expected_len, prefix=prefix)
            return True                 # done (no idle slot raises SlotError; driver faults are retried)
        ok, why = self.faults.retry(take)
        if not ok:
            self.kill(req_id, why, before=before, fault=True)
            return None
        return self._slot_of[req_id]

    def kill(self, req_id: str, reason: str, *, before: int = 0, action: str | None = None,
             fault: bool = False, throttle: bool = False, evict: list | None = None) -> None:
        """Drop ``req_id``'s KV: release its slot, leave its rows out of this step and hand it to
        vLLM's scheduler (:meth:`take_failures`) to preempt (``action`` default: preempt, or error
        once it was preempted ``max_preemptions`` times for driver faults: ``fault``). ``before``: tokens it
        had computed before this step; its blocks from there on (prefix caching) are evicted from
        vLLM's prefix cache and dropped from vattn's keys: this step's KV of them is never
        written. Requests of this step that hit one of those blocks are killed too.
        ``throttle``: the pool is dry,
        vLLM should admit no more requests than it runs until one finishes. ``evict``: the blocks
        to evict, as another rank decided them (instead of ``before``)."""
        if req_id in self.faults.dead:
            return
        action, reason = self.faults.decide(req_id, reason, action, fault)
        self._blocks.pop(req_id, None)
        if not self.sharing:
            evict = []
        elif evict is None:
            evict = self._block_ids.get(req_id, [])[before // self.block_size:]
        if evict:
            self.cache.forget(evict)
        self._slot_of.drop(req_id)
        self.faults.record(req_id, action, reason, evict, throttle)
        writes = set(evict)                    # the blocks it was to write this step
        for other, hits in list(self._step_hits.items()):
            if other != req_id and hits & writes:
                self.kill(other, f"hits block(s) {sorted(hits & writes)} of request {req_id!r}, "
                                 f"which lost its KV this step",
                          before=len(hits) * self.block_size, action=PREEMPT)

    def _kill_unpaged(self, req_id: str, why: str, before: int, tokens: int) -> None:
        """Kill a request that could not get pages: a driver fault (``why`` says), or the pool
        dry (preempted, or failed when even the whole pool is too small for its ``tokens``)."""
        if why != "short":
            self.kill(req_id, why, before=before, fault=True)
            return
        self.counts["pool_shortfalls"] += 1
        lay, m = self.cache.layout, self.cache.metrics()
        need = lay.pages_for(tokens) * lay.num_ranges
        room = m["pages_total"] - lay.num_ranges        # all but the padding slot's page-set
        if need > room:
            self.kill(req_id, f"{tokens} tokens need {need} pages, the whole pool holds {room} "
                              f"(raise VATTN_PAGE_BUDGET)", before=before, action=ERROR)
        else:
            self.kill(req_id, f"out of pages for {tokens} tokens (pool dry)", before=before, throttle=True)

    def _agree(self) -> None:
        """Tensor parallelism: kill what any rank killed this step, so that every rank leaves the
        same rows out and rank 0 (whose output the scheduler reads) reports every kill. The
        scheduler's output is the same on every rank, so a kill for pages decided the same way
        (the pool, prefix hits) happens everywhere already; a driver fault is one rank's own."""
        local = {r: {"action": f["action"], "reason": f["reason"], "evict": f["evict"]}
                 for r, f in self.faults.failures.items()}
        for theirs in self.exchange(local):
            for req_id, f in theirs.items():
                if req_id not in self.faults.dead:
                    reason = f["reason"].removeprefix("vattn: ")
                    self.kill(req_id, f"{reason} (on another tensor-parallel rank)",
                              action=f["action"], evict=f["evict"])

    def take_failures(self) -> dict[str, dict]:
        """The requests killed since the last call, for vLLM's scheduler (see :data:`FAILED_ATTR`)."""
        return self.faults.take()

    def _hits(self, req_id: str, block_ids: list[int], num_computed: int, copied: dict) -> int:
        """Whole blocks of a starting request's prefix-cache hit (a hit that ends inside the next
        block needs vLLM's copy of it into that block: ``copied``, dst -> src)."""
        hits, partial = divmod(num_computed, self.block_size)
        if -(-num_computed // self.block_size) > len(block_ids):
            raise VattnError(f"request {req_id!r}: a prefix-cache hit of {num_computed} tokens needs "
                             f"more than its {len(block_ids)} blocks of {self.block_size} tokens")
        if partial and block_ids[hits] not in copied:
            raise UnsupportedError(f"request {req_id!r}: a prefix-cache hit of {num_computed} tokens "
                                   f"ends inside block {hits} of {len(block_ids)} ({self.block_size} "
                                   f"tokens each) and vLLM sent no copy of the cached block into it")
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
            Requests killed this step (here or in :meth:`bind_blocks`): their rows are left
            out, :meth:`take_failures` names them for vLLM's scheduler. When the pool is dry the
            requests latest in the batch are killed, one at a time (their pages go back to the
            pool), until the others fit.
        """
        lengths: dict[int, int] = {}
        owner: dict[int, tuple[str, int, int]] = {}
        for req_id, done, new in batch:
            if req_id in self.faults.reported:     # its output was accepted: it would run on no KV
                raise VattnError(f"request {req_id!r} lost its KV in an earlier step and was handed "
                                 f"to vLLM's scheduler, which scheduled it again without preempting "
                                 f"it: the vattn hook on Scheduler.update_from_output is not active "
                                 f"in the engine core")
            if req_id in self.faults.dead:
                continue
            slot = self._slot_of.get(req_id)
            if slot is None:
                if self.sharing:     # its blocks were never bound: attention would read nothing
                    raise VattnError(f"request {req_id!r} is scheduled but got no blocks from "
                                     f"bind_blocks (prefix caching)")
                slot = self._acquire(req_id, done + new, before=done)
                if slot is None:
                    continue
            lengths[slot] = done + new
            owner[slot] = (req_id, done, new)
        while lengths:
            short, faulted = self._ensure(lengths)
            for slot, why in faulted.items():
                req_id, done, new = owner[slot]
                self.kill(req_id, why, before=done, fault=True)
                lengths.pop(slot)
            if not short:
                break
            # the pool is dry: the request latest in the batch goes (vLLM's own choice of a
            # victim: the last one it admitted), short of pages or not, until the others fit
            victim = list(lengths)[-1]
            req_id, done, new = owner[victim]
            self._kill_unpaged(req_id, "short", done, done + new)
            lengths.pop(victim)
        if self.exchange is not None:
            self._agree()
        self._plan = self._build_plan(batch)
        if self.snapshots is not None:
            self.snapshots.step()
        return [req_id for req_id, _, _ in batch if req_id in self.faults.dead]

    def _ensure(self, lengths: dict[int, int]) -> tuple[set[int], dict[int, str]]:
        """``cache.step(lengths)``; after a driver fault, slot by slot with retries. Returns the
        slots short of pages and the slots whose driver calls kept failing (with why)."""
        try:
            return set(self.cache.step(lengths)), {}
        except DriverError:
            self.counts["driver_retries"] += 1
        short, faulted = set(), {}
        for slot, n in lengths.items():
            ok, why = self.faults.retry(lambda: not self.cache.ensure({slot: n}))
            if not ok:
                if why == "short":
                    short.add(slot)
                else:
                    faulted[slot] = why
        return short, faulted

    def _build_plan(self, batch: list[tuple[str, int, int]]) -> StepPlan:
        slots, rows, tokens, alive = [], [], [], []
        first = 0
        for req_id, done, new in batch:
            live = req_id not in self.faults.dead
            alive.append(live)
            if live:
                slot = self._slot_of[req_id]
                slots.append(slot)
                base = slot * self.rows_per_slot + done
                rows.extend(range(base, base + new))
                tokens.extend(range(first, first + new))
            first += new
        device = self.cache.config.torch_device
        masked = not all(alive)
        return StepPlan(torch.tensor(slots, dtype=torch.int64, device=device),
                        torch.tensor(rows, dtype=torch.int64, device=device),
                        torch.tensor(tokens, dtype=torch.int64, device=device) if masked else None,
                        torch.tensor(alive, dtype=torch.bool, device=device) if masked else None)

    def has_plan(self) -> bool:
        """Whether a step is being executed (False during vLLM's dummy/profile runs)."""
        return self._plan is not None

    def end_step(self) -> None:
        self._plan = None
        self._step_hits = {}

    def slot(self, req_id: str) -> int:
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
        out : ``[N, Hq, D]`` written in place and returned. The rows of requests killed this
        step are zero (their output is dropped by vLLM's scheduler).
        """
        plan = self._plan
        if plan is None:
            raise VattnError("attention ran before the hook planned the step")
        if plan.tokens is not None:
            return self._attend_alive(layer, q, k, v, query_start_loc, seq_lens, scale, out)
        n = plan.rows.shape[0]
        cache = self.cache
        ops.store(cache.k_rows(layer), cache.v_rows(layer), k[:n].to(cache.config.dtype),
                  v[:n].to(cache.config.dtype), plan.rows)
        return ops.prefill(q[:n], cache.k(layer), cache.v(layer), cu_seqlens_q=query_start_loc,
                           slots=plan.slots, seqlens_k=seq_lens, max_seqlen_q=max_query_len,
                           max_seqlen_k=max_seq_len, scale=scale, causal=True,
                           backend=self._prefill_backend(q), out=out[:n])

    def _attend_alive(self, layer, q, k, v, query_start_loc, seq_lens, scale, out) -> torch.Tensor:
        """:meth:`attend` for the requests still alive this step; the others' rows are zero."""
        plan, cache = self._plan, self.cache
        n = q.shape[0]
        out[:n].zero_()
        if not plan.tokens.numel():
            return out[:n]
        sel = plan.tokens
        ops.store(cache.k_rows(layer), cache.v_rows(layer), k[:n][sel].to(cache.config.dtype),
                  v[:n][sel].to(cache.config.dtype), plan.rows)
        qsl = query_start_loc.to(torch.int64)
        chunks = (qsl[1:] - qsl[:-1])[plan.alive]
        cu = torch.zeros(chunks.numel() + 1, dtype=torch.int32, device=q.device)
        cu[1:] = torch.cumsum(chunks, 0)
        lens = seq_lens[plan.alive]
        o = ops.prefill(q[:n][sel], cache.k(layer), cache.v(layer), cu_seqlens_q=cu, slots=plan.slots,
                        seqlens_k=lens, max_seqlen_q=int(chunks.max()), max_seqlen_k=int(lens.max()),
                        scale=scale, causal=True, backend=self._prefill_backend(q))
        out[:n].index_copy_(0, sel, o.to(out.dtype))
        return out[:n]

    def _prefill_backend(self, q: torch.Tensor) -> str:
        name = self._backend.get("prefill")
        if name is None:
            name = self._backend["prefill"] = ops.resolve_backend(
                "prefill", device=q.device, dtype=q.dtype, head_dim=q.shape[-1])
        return name

    def close(self) -> None:
        if getattr(self, "snapshots", None) is not None:
            self.snapshots.close()
        try:
            self.cache.close()
        finally:
            self._close_driver()

    def _close_driver(self) -> None:
        if self._driver is not None and hasattr(self._driver, "close"):
            self._driver.close()
        self._driver = None
