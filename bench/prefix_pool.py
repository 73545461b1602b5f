"""vLLM's block pool with automatic prefix caching, in miniature, to drive vattn's runtime on CPU.

Faithful to what decides vattn's work: blocks ``1 .. num_blocks - 1`` (block 0 is vLLM's null
block); a free queue in least-recently-freed order; a full block is cached under the hash of its
tokens chained to its parent's; a new request hits the longest cached run of its full blocks
(at most ``len(prompt) - 1`` tokens, as vLLM computes at least one token); a block taken from
the free queue loses its cached content (eviction); a finished request frees its blocks last
block first, so its tail is evicted first. With ``unit`` (vattn's fine hits on the GPU path,
``adapters/vllm/fine_hits.py``: 16 tokens), a hit also reaches into the cached full block after
its whole-block hits, up to the last ``unit`` boundary it may use: the request's fresh block there
gets vLLM's copy-on-write of it (:meth:`PrefixBlockPool.take_copies`; a repeated prompt's last
block, every time). Partial-block entries of unfinished blocks are not modelled.
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["PrefixBlockPool"]


class PrefixBlockPool:
    """Blocks, their hashes and the free queue of one engine.

    Parameters
    ----------
    num_blocks : int
        vLLM's ``num_gpu_blocks`` (the null block included).
    block_size : int
        Tokens per block.
    unit : int, optional
        The prefix-match unit (tokens; dividing ``block_size``): hits ending inside a cached
        block, with a copy-on-write each. ``None``: whole blocks only.
    """

    def __init__(self, num_blocks: int, block_size: int, unit: int | None = None):
        if unit is not None and (unit <= 0 or block_size % unit):
            raise ValueError(f"unit must divide the block size {block_size}, got {unit}")
        self.block_size, self.unit = block_size, unit
        self.copies: list[tuple[int, int]] = []   # (cached block, fresh block) since take_copies
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self.hash_of: dict[int, int] = {}
        self.cached: dict[int, int] = {}
        self.refs: dict[int, int] = {}
        self.hit_blocks = self.new_blocks = 0

    def _hashes(self, tokens: list[int]) -> list[int]:
        out, parent, bs = [], 0, self.block_size
        for i in range(len(tokens) // bs):
            parent = hash((parent, tuple(tokens[i * bs:(i + 1) * bs])))
            out.append(parent)
        return out

    def _take(self) -> int:
        if not self.free:
            raise RuntimeError("the block pool is exhausted")
        block, _ = self.free.popitem(last=False)
        h = self.hash_of.pop(block, None)
        if h is not None and self.cached.get(h) == block:
            del self.cached[h]                   # evicted: its content is gone
        self.refs[block] = 1
        self.new_blocks += 1
        return block

    def hit_blocks_for(self, tokens: list[int], hashes: list[int] | None = None) -> list[int]:
        """The cached blocks a prompt would hit now (nothing changes); ``hashes``: its block
        hashes, if computed already."""
        hits = []
        hashes = self._hashes(tokens) if hashes is None else hashes
        for h in hashes[:(len(tokens) - 1) // self.block_size]:
            block = self.cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def admit(self, tokens: list[int]) -> tuple[list[int], int]:
        """Blocks for a new request's prompt and how many of them are prefix-cache hits."""
        hashes = self._hashes(tokens)
        hits = self.hit_blocks_for(tokens, hashes)
        for block in hits:
            if self.refs.get(block, 0) == 0:
                del self.free[block]
            self.refs[block] = self.refs.get(block, 0) + 1
        self.hit_blocks += len(hits)
        src = self._partial_hit(len(tokens), len(hits), hashes)
        held = src is not None and self.free.pop(src, False) is None    # not evicted by the takes below
        blocks = hits + [self._take() for _ in range(-(-len(tokens) // self.block_size) - len(hits))]
        if src is not None:
            if held:
                self.free[src] = None
            self.copies.append((src, blocks[len(hits)]))
        self.cache_full(blocks, tokens, hashes)
        return blocks, len(hits)

    def _partial_hit(self, n: int, k: int, hashes: list[int]) -> int | None:
        """With ``unit``: the cached block ``k`` a hit of ``k`` whole blocks of an ``n``-token
        prompt reaches into (at most ``n - 1`` tokens, down to a unit boundary), or ``None``."""
        if self.unit is None or k >= len(hashes):
            return None
        reach = min(n - 1, (k + 1) * self.block_size) - k * self.block_size
        if reach - reach % self.unit <= 0:
            return None
        return self.cached.get(hashes[k])

    def take_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write pairs of the requests admitted since the last call (vLLM's
        ``kv_cache_block_copies`` of a step)."""
        out, self.copies = self.copies, []
        return out

    def grow(self) -> int:
        """One more block for a running request."""
        return self._take()

    def cache_full(self, blocks: list[int], tokens: list[int], hashes: list[int] | None = None) -> None:
        """Cache the request's full blocks (those not cached yet) under their hashes."""
        for block, h in zip(blocks, self._hashes(tokens) if hashes is None else hashes):
            if block not in self.hash_of:
                self.hash_of[block] = h
                self.cached.setdefault(h, block)

    def finish(self, blocks: list[int]) -> None:
        """Free a finished request's blocks, last first (cached content stays until reused)."""
        for block in reversed(blocks):
            self.refs[block] -= 1
            if not self.refs[block]:
                self.free[block] = None
