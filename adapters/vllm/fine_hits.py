"""Prefix-cache hits finer than vattn's block: vLLM's ``prefix_match_unit`` for one KV cache group.

vattn's vLLM block is a page-set (128 tokens for Llama-3-8B on the GPU path), stock vLLM's is 16
tokens, and vLLM's prefix cache hits whole blocks: a repeated 512-token prompt hits 496 tokens
on stock, 384 on vattn. vLLM has hits finer than its block already, for hybrid models: block
hashes every ``prefix_match_unit`` tokens, partial-block entries in its block pool, and
copy-on-write of a hit that ends inside a block (the scheduler sends ``kv_cache_block_copies``
to the worker, which copies the cached block into the request's own before the forward). It
keeps them off for a model with one KV cache group. Two engine-core patches turn them on with
vattn, and change nothing else in vLLM's cache (its hashing, LRU, eviction and CoW decide):

* ``vllm.v1.engine.core.resolve_kv_cache_block_sizes``: with prefix caching on and one KV cache
  group, requests are hashed every ``unit`` tokens (``--prefix-match-unit``; default
  :data:`GPU_UNIT` on the GPU path, stock vLLM's CUDA block; the block size on the CPU path,
  where vattn's block is the engine's);
* ``vllm.v1.core.kv_cache_coordinator.UnitaryKVCacheCoordinator`` -> a subclass
  (:func:`fine_coordinator`): hits land on ``unit`` boundaries, and every ``unit`` boundary of
  a block is registered as a partial entry once its tokens are scheduled (vLLM registers only a
  prompt's last one), so a prefix ending inside a block hits as it would with stock's 16-token
  blocks. A hit ending inside a block that the same step writes is cut back to the whole blocks
  before it: its copy would run before the forward that writes it. While a request decodes, the
  block it fills gets its boundaries when it is full or when the request leaves, and a decode
  step that fills no block skips the cache bookkeeping (vLLM would re-register the prompt's tail
  entry of every request every step): the engine core does less per generation than stock's
  16-token blocks need (``vattn bench sched``).

The copies reach vattn through the runners (GPU: ``GpuRuntime.copy_blocks``; CPU: the blocks
bound each step), which copy the cached page-set into the request's fresh one
(:meth:`vattn.core.VirtualKVCache.copy_block`).
"""

from __future__ import annotations

import functools

from vattn.core.errors import ConfigError

__all__ = ["install_fine_hits", "GPU_UNIT", "PATCHES", "resolve_unit"]

#: the default hit unit on the GPU path: stock vLLM's block size on CUDA
GPU_UNIT = 16
PATCHES = ["vllm.v1.engine.core.resolve_kv_cache_block_sizes",
           "vllm.v1.core.kv_cache_coordinator.UnitaryKVCacheCoordinator"]
_INSTALLED: list[bool] = []      # set once the patches are in (once per process)


def resolve_unit(block_size: int, requested: int | None, default: int | None) -> int:
    """The hit unit for vattn's ``block_size``: ``requested`` (``--prefix-match-unit``), else
    ``default`` (``None``: the block size); it must divide the block size.

    Raises
    ------
    ConfigError
        A unit that is not a positive divisor of the block size.
    """
    unit = requested or min(default or block_size, block_size)
    if not isinstance(unit, int) or unit <= 0 or block_size % unit:
        raise ConfigError(f"vattn: prefix_match_unit must divide vattn's block size {block_size} "
                          f"(a page-set), got {unit}")
    return unit


def install_fine_hits(default_unit: int | None) -> None:
    """Install both patches once per process (idempotent); ``default_unit``: see
    :func:`resolve_unit`."""
    from vllm.v1.core import kv_cache_coordinator
    from vllm.v1.engine import core
    if _INSTALLED:
        return
    core.resolve_kv_cache_block_sizes = _wrap_resolve(core.resolve_kv_cache_block_sizes, default_unit)
    kv_cache_coordinator.UnitaryKVCacheCoordinator = fine_coordinator()
    _INSTALLED.append(True)


def _wrap_resolve(original, default_unit: int | None):
    @functools.wraps(original)
    def resolve_kv_cache_block_sizes(kv_cache_config, vllm_config):
        cache = vllm_config.cache_config
        groups = list(kv_cache_config.kv_cache_groups)
        dcp = int(getattr(vllm_config.parallel_config, "decode_context_parallel_size", 1) or 1)
        if not cache.enable_prefix_caching or len(groups) != 1 or dcp != 1:
            return original(kv_cache_config, vllm_config)
        block = int(groups[0].kv_cache_spec.block_size)
        return block, resolve_unit(block, cache.prefix_match_unit, default_unit)
    return resolve_kv_cache_block_sizes


def fine_coordinator() -> type:
    """vLLM's ``UnitaryKVCacheCoordinator`` with hits every ``hash_block_size`` tokens when that
    is finer than the block; as vLLM's otherwise."""
    from vllm.v1.core.kv_cache_coordinator import UnitaryKVCacheCoordinator

    class FineUnitaryCoordinator(UnitaryKVCacheCoordinator):
        def __init__(self, *args, hash_block_size: int, **kwargs):
            block = kwargs.get("scheduler_block_size", hash_block_size)
            super().__init__(*args, hash_block_size=block, **kwargs)
            self.unit = hash_block_size     # (only built with prefix caching on)
            self.fine = self.unit < self.block_size
            self.block_pool.hash_block_size = self.unit   # the pool's partial entries use it
            #: request id -> [tokens its boundaries are registered to, the request] (until it leaves)
            self._marked: dict[str, list] = {}
            self._written_now: set[int] = set()    # blocks whose tokens this step schedules

        def find_longest_cache_hit(self, block_hashes, max_cache_hit_length):
            if not self.fine:
                return super().find_longest_cache_hit(block_hashes, max_cache_hit_length)
            hit_blocks, length = self.single_type_managers[0].find_longest_cache_hit(
                block_hashes=block_hashes, max_length=max_cache_hit_length, kv_cache_group_ids=[0],
                block_pool=self.block_pool, kv_cache_spec=self.kv_cache_spec,
                drop_eagle_block=0 in self.eagle_group_ids, alignment_tokens=self.unit,
                dcp_world_size=self.dcp_world_size, pcp_world_size=self.pcp_world_size)
            blocks = hit_blocks[0]
            if length % self.block_size and blocks[-1].block_id in self._written_now:
                length -= length % self.block_size     # its copy would precede the write
                del blocks[length // self.block_size:]
            return hit_blocks, length, 0

        def cache_blocks(self, request, num_computed_tokens: int) -> None:
            if not self.fine:
                return super().cache_blocks(request, num_computed_tokens)
            rid, cached = request.request_id, self.single_type_managers[0].num_cached_block
            marked = self._marked.get(rid)
            if marked is None:                     # its hit's blocks are registered already
                self._marked[rid] = [cached.get(rid, 0) * self.block_size, request]
            elif (num_computed_tokens // self.block_size <= cached.get(rid, 0)
                  and marked[0] >= request.num_prompt_tokens // self.unit * self.unit):
                return    # a decode step filling no block: vLLM would only re-register the prompt's tail
            super().cache_blocks(request, num_computed_tokens)
            self._register_boundaries(request, num_computed_tokens)

        def _register_boundaries(self, request, num_tokens: int, *, final: bool = False) -> None:
            """Every ``unit`` boundary inside the request's blocks up to ``num_tokens`` becomes a
            partial entry of its block; per block from the largest down, so that the block's
            primary entry stays its largest (vLLM drops a block's entries when it registers one
            longer than its primary). While the request decodes, the block it fills is left
            until it is full or the request leaves (``final``): registering its boundaries every
            16 tokens would cost the engine core up to seven entries per request and step."""
            unit, size = self.unit, self.block_size
            top = min(num_tokens, len(request.block_hashes) * unit) // unit * unit
            if not final:
                prompt = min(top, request.num_prompt_tokens // unit * unit)
                top = max(top // size * size, prompt)
            marked = self._marked[request.request_id]
            if top <= marked[0]:
                return
            blocks = self.single_type_managers[0].req_to_blocks.get(request.request_id, ())
            for index in range(marked[0] // size, min(len(blocks), -(-top // size))):
                block = blocks[index]
                if block.is_null:
                    continue
                if not final:                      # this step's tokens: written by its forward
                    self._written_now.add(block.block_id)
                last = min(top, (index + 1) * size - unit)
                for boundary in range(last, index * size, -unit):
                    self.block_pool.cache_partial_block(request=request, block=block, num_tokens=boundary,
                                                        kv_cache_group_id=0, block_size=size)
            marked[0] = top

        def _leaving(self, request_id: str) -> None:
            """The request's blocks go back to the pool (finished or preempted): the block it was
            filling gets its boundaries now (up to its computed tokens)."""
            marked = self._marked.get(request_id)
            if marked is not None:
                self._register_boundaries(marked[1], marked[1].num_computed_tokens, final=True)
                del self._marked[request_id]

        def free(self, request_id: str) -> None:
            self._leaving(request_id)
            super().free(request_id)

        def pop_blocks_for_free(self, request_id: str):
            self._leaving(request_id)
            return super().pop_blocks_for_free(request_id)

        def new_step_starts(self) -> None:
            self._written_now.clear()
            super().new_step_starts()

    return FineUnitaryCoordinator
