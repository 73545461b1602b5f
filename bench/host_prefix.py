"""``vattn bench host --prefix-caching``: vattn's host work with vLLM's prefix caching on.

Drives :class:`vattn.adapters.vllm.gpu_runtime.GpuRuntime` (``prefix_caching=True``) with the
block ids a vLLM block pool would hand out (:class:`.prefix_pool.PrefixBlockPool`): every request
is admitted with its prefix-cache hit, then each step one ``apply``, a request receiving a block
whenever its length crosses one, full blocks cached as they fill, every request freed at the end.
Generations repeat the same prompts, as a benchmark (or a chat re-sent) does: from the second
one, each request hits its own cached prompt; with ``multi-turn`` each generation is the next turn
of the conversations instead (the last prompt, the reply and new user tokens). Counts the VMM
calls each generation makes.
"""

from __future__ import annotations

import random
import time

from .prefix_pool import PrefixBlockPool

__all__ = ["prompts_for", "prefix_generation", "COUNTED"]

COUNTED = ("map_calls", "unmap_calls", "set_access_calls", "page_sets_moved", "prefix_hits",
           "pages_aliased", "keys_bound", "fence_waits", "blocks_copied", "copies_elided")


def prompts_for(workload: str, *, batch: int, prompt: int, shared: int, seed: int = 0) -> list[list[int]]:
    """``decode-heavy`` and ``multi-turn`` (its first turn): distinct random prompts;
    ``shared-prefix``: one ``shared``-token system prompt + ``prompt - shared`` tokens of each
    request's own."""
    rng = random.Random(seed)
    head = [rng.randrange(1, 32000) for _ in range(shared)] if workload == "shared-prefix" else []
    return [head + [rng.randrange(1, 32000) for _ in range(prompt - len(head))] for _ in range(batch)]


def _generated(request: int, position: int) -> int:
    """The token greedy decoding produces: the same in every generation of a request."""
    return 1 + hash((request, position)) % 31999


def prefix_generation(rt, pool: PrefixBlockPool, prompts: list[list[int]], new: int) -> dict:
    """One generation; ``{name: host seconds}`` plus the VMM calls it made (``calls``)."""
    before = rt.cache.metrics()
    spent = {"on_blocks": 0.0, "apply": 0.0, "release": 0.0}
    bs = rt.block_size
    tokens = [list(p) for p in prompts]
    blocks = []
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        ids, hits = pool.admit(prompt)
        blocks.append(ids)
        rt.on_blocks(i, len(ids), new_request=True, block_ids=ids, hits=hits)
    copies = pool.take_copies()
    if copies:
        rt.copy_blocks(copies)
    spent["on_blocks"] += time.perf_counter() - t0
    for step in range(new):
        t0 = time.perf_counter()
        for i, toks in enumerate(tokens):
            toks.append(_generated(i, len(toks)))
            if len(toks) > len(blocks[i]) * bs:
                blocks[i].append(pool.grow())
                rt.on_blocks(i, len(blocks[i]), new_request=False, block_ids=blocks[i][-1:])
            elif len(toks) % bs == 0:
                pool.cache_full(blocks[i], toks)
        t1 = time.perf_counter()
        rt.apply()
        spent["on_blocks"] += t1 - t0
        spent["apply"] += time.perf_counter() - t1
    t0 = time.perf_counter()
    for i in range(len(prompts)):
        pool.finish(blocks[i])
        rt.release(i)
    spent["release"] = time.perf_counter() - t0
    after = rt.cache.metrics()
    spent["calls"] = {k: after.get(k, 0) - before.get(k, 0) for k in COUNTED}   # older cores lack some
    spent["tokens"] = tokens                    # prompts + replies: the next turn starts from them
    return spent


def next_turn(tokens: list[list[int]], user: int, turn: int) -> list[list[int]]:
    """The conversations' next prompts: all so far plus ``user`` new tokens each (seeded)."""
    out = []
    for i, toks in enumerate(tokens):
        rng = random.Random(i * 1_000_003 + turn)
        out.append(toks + [rng.randrange(1, 32000) for _ in range(user)])
    return out
