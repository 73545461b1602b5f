"""The vattn kernels on a real :class:`~vattn.core.VirtualKVCache` (``vattn bench attention --vmm``).

The attention grid's vattn side reads torch-allocated memory with the cache's strides; these
helpers copy the same rows into a cache whose 2 MiB pages are mapped one by one, so a time
difference between ``BACKEND`` and ``BACKEND@vmm`` is the page mapping's own (TLB reach).
"""

from __future__ import annotations

import torch

from vattn.bench.paged_baselines import bench_us

__all__ = ["vmm_copy", "on_vmm"]


def vmm_copy(k, v, slots, ctx, *, group: int):
    """The rows ``[:ctx]`` of ``k``/``v`` at ``slots`` copied into a real :class:`VirtualKVCache`
    of one layer group (same layout, pages mapped one by one): ``(k, v, slots, cache)``; close the
    cache when done. Its data equals the source's, so any time difference is the memory's."""
    from vattn.core import KVCacheConfig, VirtualKVCache
    batch, (_, rows, hk, dim) = slots.numel(), k.shape
    cache = VirtualKVCache(KVCacheConfig(
        num_layers=group, num_kv_heads=hk, head_dim=dim, dtype=k.dtype, max_slots=batch,
        max_context=rows, group_size=group, map_ahead_tokens=0, device=k.device,
        page_budget=(batch + 1) * rows * group * 2 * hk * dim * k.element_size() + (64 << 20)))
    got = [cache.acquire() for _ in range(batch)]
    failed = cache.ensure({s: ctx for s in got})
    if failed:
        cache.close()
        raise RuntimeError(f"vmm copy: could not map {ctx} tokens for slots {failed}")
    layer = group // 2                      # the layer the synthetic views read
    ck, cv = cache.k(layer), cache.v(layer)
    for dst, src in zip(got, slots.tolist()):
        ck[dst, :ctx].copy_(k[src, :ctx])
        cv[dst, :ctx].copy_(v[src, :ctx])
    return ck, cv, torch.tensor(got, dtype=torch.int32, device=k.device), cache


def on_vmm(backends, k, v, slots, ctx, group, call) -> dict:
    """``{BACKEND@vmm: µs}`` for each of ``backends``: ``call(backend, k, v, slots)`` timed on
    :func:`vmm_copy`'s views."""
    mk, mv, ms, cache = vmm_copy(k, v, slots, ctx, group=group)
    try:
        return {f"{be}@vmm": bench_us(lambda be=be: call(be, mk, mv, ms), device=k.device)
                for be in backends}
    finally:
        cache.close()
