"""vLLM's scheduler in miniature over :class:`.prefix_pool.PrefixBlockPool`: continuous batching
with preemption, to drive vattn's GPU runtime on the host backend under memory pressure.

Each step, as vLLM's V1 scheduler and V2 runner do it: running requests that cross a block get
one (when the pool has none, the request admitted last is preempted: its blocks are freed, still
cached, and it waits at the front of the queue with every token it has so far, to be recomputed);
then waiting requests are admitted while slots and blocks last (a preempted request hits its own
cached blocks if they were not evicted meanwhile); then the runner's calls in its order —
``release`` for the requests that left, ``on_blocks`` for the new and the grown, one ``apply`` —
and the device finishes a step (:meth:`LaggingFences.tick`). Each running request gains one
token per step (a prompt is prefilled in one step, within ``max_batched_tokens`` a step when
given: vLLM's token budget, which spreads a burst's admissions over several steps). Counts the VMM
calls and the fence waits.
"""

from __future__ import annotations

import time
from collections import deque

from .host_prefix import COUNTED, _generated
from .prefix_pool import PrefixBlockPool

__all__ = ["scheduled_generation", "SCHED_COUNTED"]

SCHED_COUNTED = COUNTED + ("pages_mapped_on_demand", "pages_retired", "page_sets_staged", "steps",
                           "preemptions")


class _Req:
    __slots__ = ("rid", "tokens", "done_at", "index", "blocks")

    def __init__(self, rid: int, tokens: list[int], done_at: int):
        self.rid, self.tokens, self.done_at = rid, tokens, done_at
        self.index, self.blocks = None, []


def scheduled_generation(rt, pool: PrefixBlockPool, prompts: list[list[int]], new: int, *,
                         max_running: int, fences=None, max_batched_tokens: int | None = None,
                         settle: bool = False, arrive_every: float = 0.0) -> dict:
    """One generation of ``prompts`` (``new`` tokens each) through the scheduler; ``{name: host
    seconds}`` of vattn's calls, ``calls`` (VMM calls, fence waits, steps, preemptions).

    ``max_running``: vLLM's ``max_num_seqs`` (request indices ``0 .. max_running - 1``);
    ``fences``: the :class:`~vattn.core.driver.lag.LaggingFences` under ``rt`` (ticked once per
    step), if any; ``max_batched_tokens``: tokens computed per step at most (running requests'
    one each, then new prompts' uncached tokens; the first prompt of a step always fits);
    ``settle``: the map-ahead worker finishes its work before the next step (a device step long
    enough to hide it). Every prompt arrives at once and waits for a slot and for blocks, or with
    ``arrive_every`` > 0 prompt ``i`` arrives at step ``int(i * arrive_every)`` (a server's
    stream of requests: ~40 req/s at ~7 ms a step is one every 3.6 steps). ``apply_us``: the
    host µs of each step's ``apply``. With
    ``rt.defer_mapping`` each step's forward is played as the backend plays it (``rt.ready`` per
    layer): ``issue`` is the host time of the deferred calls, ``first_range`` its part before
    the first layer (the part still on the step's path)."""
    before = rt.cache.metrics()
    waits0 = fences.waits if fences is not None else 0
    spent = {"on_blocks": 0.0, "apply": 0.0, "release": 0.0, "issue": 0.0, "first_range": 0.0}
    bs = rt.block_size
    if arrive_every < 0:
        raise ValueError(f"arrive_every must be >= 0, got {arrive_every}")
    pending = deque(_Req(i, list(p), len(p) + new) for i, p in enumerate(prompts))
    waiting: deque[_Req] = deque()
    running: list[_Req] = []
    free_idx = list(range(max_running - 1, -1, -1))
    steps = preemptions = 0
    step_apply: list[float] = []
    limit = 50 * (new + len(prompts)) + 1000 + int(len(prompts) * arrive_every)
    while pending or waiting or running:
        while pending and int(pending[0].rid * arrive_every) <= steps:
            waiting.append(pending.popleft())
        if not waiting and not running:                # idle until the next arrival
            steps += 1
            continue
        if steps > limit:
            raise RuntimeError(f"the scheduler made no progress in {limit} steps (pool of {len(pool.free)} "
                               f"free blocks, {len(waiting)} waiting, {len(running)} running)")
        left, grown, admitted = [], [], []
        for req in list(running):                      # decode: one token each
            if req not in running:                     # preempted below by an earlier request
                continue
            req.tokens.append(_generated(req.rid, len(req.tokens)))
            if len(req.tokens) >= req.done_at:
                running.remove(req)
                pool.cache_full(req.blocks, req.tokens)
                pool.finish(req.blocks)
                left.append(req.index)
                free_idx.append(req.index)
                continue
            if len(req.tokens) > len(req.blocks) * bs:
                while not pool.free:                   # vLLM preempts the request admitted last
                    victim = running[-1]               # (at worst this one itself)
                    running.pop()
                    pool.finish(victim.blocks)
                    left.append(victim.index)
                    free_idx.append(victim.index)
                    victim.blocks, victim.index = [], None
                    waiting.appendleft(victim)
                    preemptions += 1
                    if victim is req:
                        break
                if req.index is None:                  # preempted itself
                    continue
                req.blocks.append(pool.grow())
                grown.append(req)
            elif len(req.tokens) % bs == 0:
                pool.cache_full(req.blocks, req.tokens)
        budget = None if max_batched_tokens is None else max_batched_tokens - len(running)
        while waiting and free_idx and len(pool.free) >= -(-len(waiting[0].tokens) // bs) + 1:
            if budget is not None:
                cost = len(waiting[0].tokens) - len(pool.hit_blocks_for(waiting[0].tokens)) * bs
                if admitted and cost > budget:
                    break
                budget -= cost
            req = waiting.popleft()
            req.blocks, hits = pool.admit(req.tokens)
            req.index = free_idx.pop()
            running.append(req)
            admitted.append((req, hits))
        t0 = time.perf_counter()
        for index in left:
            rt.release(index)
        t1 = time.perf_counter()
        for req, hits in admitted:
            rt.on_blocks(req.index, len(req.blocks), new_request=True, block_ids=req.blocks, hits=hits)
        for req in grown:
            if req in running and req.index is not None:
                rt.on_blocks(req.index, len(req.blocks), new_request=False, block_ids=req.blocks[-1:])
        copies = pool.take_copies()
        if copies:
            rt.copy_blocks(copies)
        t2 = time.perf_counter()
        rt.apply()
        t3 = time.perf_counter()
        if rt.defer_mapping:                  # the forward: each layer's range before its layer
            rt.ready(0)
            t4 = time.perf_counter()
            for layer in range(1, rt.cache.config.num_layers):
                rt.ready(layer)
            spent["first_range"] += t4 - t3
            spent["issue"] += time.perf_counter() - t3
        if settle:
            rt.cache.wait()
        spent["release"] += t1 - t0
        spent["on_blocks"] += t2 - t1
        spent["apply"] += t3 - t2
        step_apply.append((t3 - t2) * 1e6)
        steps += 1
        if fences is not None:
            fences.tick()
    after = rt.cache.metrics()
    spent["calls"] = {k: after.get(k, 0) - before.get(k, 0)
                      for k in COUNTED + ("pages_mapped_on_demand", "pages_retired", "page_sets_staged",
                                          "packs_built", "pages_packed", "pack_unpacks")}
    spent["calls"]["fence_waits"] = (fences.waits - waits0) if fences is not None else spent["calls"]["fence_waits"]
    spent["calls"]["steps"], spent["calls"]["preemptions"] = steps, preemptions
    spent["apply_us"] = step_apply
    return spent
