"""The GPU patches (vLLM 0.26.0, V2 model runner ``vllm.v1.worker.gpu.model_runner``).

vLLM 0.26 runs dense decoder models (Llama & co.) on the V2 runner by default; the V1
``gpu_model_runner.GPUModelRunner`` is not patched (the CUSTOM backend refuses to build there).
Three runner methods are wrapped, and two names of the runner's module are swapped only for the
duration of ``initialize_kv_cache`` (so nothing outside that call sees them):

* ``GPUModelRunner.initialize_kv_cache``: refuse unsupported features, create the process's
  :class:`~.gpu_runtime.GpuRuntime` (page pool = ``num_blocks`` page-sets) *before* vLLM builds
  the attention metadata builders, then run vLLM's method with
  ``model_runner.BlockTables`` -> :class:`~.block_tables.VattnBlockTables` and
  ``model_runner.init_kv_cache`` -> :func:`bind_kv_views` (vLLM allocates no paged KV tensor:
  each layer is bound to vattn's virtual view instead);
* ``GPUModelRunner._remove_request``: release the request index's slot (event-fenced);
* ``GPUModelRunner.shutdown``: close the runtime (waits for fences, unmaps, frees VA);
* ``model_runner.copy_kv_cache_blocks_inplace`` (vLLM's copy-on-write of a prefix hit that ends
  inside a block, see :mod:`.fine_hits`): handed to :meth:`GpuRuntime.copy_blocks`, which copies
  page-sets once the step's blocks are bound (vLLM's version would index vattn's views by block);
* ``CudaGraphManager.run_fullgraph`` / ``ModelCudaGraphManager.run_fullgraph``: with deferred
  mapping, a full CUDA graph replay (no layer runs the backend's Python) first makes every VMM
  call the step deferred (:meth:`GpuRuntime.ready`).
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch

from vattn.core.config import defer_mapping, pack_mb, pack_sets, stage_prefixes
from vattn.core.errors import ConfigError, UnsupportedError

from . import gpu_layout
from . import runtime as rt

#: a child of vLLM's own ``vllm`` logger, so the start-up line prints with vLLM's log format
logger = logging.getLogger("vllm.vattn")

__all__ = ["install_gpu", "PATCHES", "bind_kv_views"]

PATCHES = ["GPUModelRunner.initialize_kv_cache", "GPUModelRunner._remove_request",
           "GPUModelRunner.shutdown", "model_runner.BlockTables (during initialize_kv_cache)",
           "model_runner.init_kv_cache (during initialize_kv_cache)",
           "model_runner.copy_kv_cache_blocks_inplace", "cudagraph_utils.CudaGraphManager.run_fullgraph",
           "cudagraph_utils.ModelCudaGraphManager.run_fullgraph"]
_MARK = "_vattn_patched"


def install_gpu() -> None:
    """Wrap the V2 runner's methods (idempotent). Raises if vLLM's layout is not the tested one."""
    from vllm.v1.worker.gpu import cudagraph_utils as cg
    from vllm.v1.worker.gpu import model_runner as mr
    runner = mr.GPUModelRunner
    if getattr(runner, _MARK, False):
        return
    for name in ("initialize_kv_cache", "_remove_request", "shutdown"):
        if not callable(getattr(runner, name, None)):
            raise UnsupportedError(f"vattn: vllm.v1.worker.gpu.model_runner.GPUModelRunner.{name} is missing")
    for name in ("BlockTables", "init_kv_cache", "copy_kv_cache_blocks_inplace"):
        if not hasattr(mr, name):
            raise UnsupportedError(f"vattn: vllm.v1.worker.gpu.model_runner.{name} is missing")
    for name in ("CudaGraphManager", "ModelCudaGraphManager"):
        if "run_fullgraph" not in vars(getattr(cg, name, object)):
            raise UnsupportedError(f"vattn: vllm.v1.worker.gpu.cudagraph_utils.{name}.run_fullgraph is missing")
    cg.CudaGraphManager.run_fullgraph = _wrap_fullgraph(cg.CudaGraphManager.run_fullgraph)
    cg.ModelCudaGraphManager.run_fullgraph = _wrap_fullgraph(vars(cg.ModelCudaGraphManager)["run_fullgraph"])
    runner.initialize_kv_cache = _wrap_init(runner.initialize_kv_cache, mr)
    mr.copy_kv_cache_blocks_inplace = _wrap_copies(mr.copy_kv_cache_blocks_inplace)
    runner._remove_request = _wrap_remove(runner._remove_request)
    runner.shutdown = _wrap_shutdown(runner.shutdown)
    setattr(runner, _MARK, True)


@contextlib.contextmanager
def _swapped(module, **names):
    saved = {name: getattr(module, name) for name in names}
    for name, value in names.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def _wrap_init(original, mr):
    @functools.wraps(original)
    def initialize_kv_cache(self, kv_cache_config):
        gpu_layout.check_engine_config(self.vllm_config)
        sharing = bool(getattr(self.vllm_config.cache_config, "enable_prefix_caching", False))
        # on by default (H100, 2026-12-07: the 8B shared-prefix burst 0.904x -> 0.979x / 0.974x
        # stock, identity exact with prefix caching); VATTN_DEFER_MAPPING=0 turns it off
        wanted = defer_mapping(True)
        defer, why_not = gpu_layout.defer_mapping_for(self.vllm_config)
        if wanted and not defer:
            logger.info("vattn: deferred mapping off for this engine configuration: %s", why_not)
        runtime = start_runtime(kv_cache_config, device=self.device, max_num_reqs=self.max_num_reqs,
                                max_model_len=self.max_model_len, max_num_tokens=self.max_num_tokens,
                                prefix_caching=sharing, defer=defer and wanted)
        from .block_tables import VattnBlockTables
        tables = functools.partial(VattnBlockTables, runtime=runtime, seq_lens=self.input_buffers.seq_lens,
                                   num_computed=self.req_states.num_computed_tokens_np)
        with _swapped(mr, BlockTables=tables, init_kv_cache=functools.partial(bind_kv_views, runtime)):
            return original(self, kv_cache_config)
    return initialize_kv_cache


def start_runtime(kv_cache_config, *, device, max_num_reqs: int, max_model_len: int,
                  max_num_tokens: int, prefix_caching: bool = False, defer: bool = False):
    """Create and install the process's :class:`GpuRuntime` for vLLM's ``KVCacheConfig``
    (``defer``: :attr:`GpuRuntime.defer_mapping`)."""
    from .gpu_runtime import GpuRuntime
    group = kv_cache_config.kv_cache_groups[0] if kv_cache_config.kv_cache_groups else None
    if group is None:
        raise ConfigError("vattn: the engine built no KV cache group")
    spec, names = group.kv_cache_spec, sorted(group.layer_names, key=rt.layer_index)
    exact = gpu_layout.exact_kernel_path()
    cfg = gpu_layout.cache_config(num_layers=len(names), num_kv_heads=spec.num_kv_heads,
                                  head_dim=spec.head_size, dtype=spec.dtype,
                                  num_blocks=kv_cache_config.num_blocks, max_num_reqs=max_num_reqs,
                                  max_model_len=max_model_len, device=str(device), exact=exact,
                                  pack_mb=pack_mb(gpu_layout.PACK_MB_DEFAULT) if prefix_caching else 0,
                                  pack_sets=pack_sets())
    page_set = cfg.num_layers // cfg.group_size * gpu_layout.PAGE_BYTES
    block = gpu_layout.tokens_per_page(num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                                       dtype=cfg.dtype, group_size=cfg.group_size)
    gpu_layout.check_kv_cache_config(kv_cache_config, block_size=block, page_set_bytes=page_set)
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()   # hand the profiling run's cached blocks back before cuMemCreate
    rt.uninstall()
    runtime = GpuRuntime(cfg, block_size=block, layer_names=names, max_num_tokens=max_num_tokens,
                         attn_margin=gpu_layout.EXACT_MARGIN if exact else 0, max_model_len=max_model_len,
                         prefix_caching=prefix_caching,
                         stage_prefixes=prefix_caching and stage_prefixes(False), defer_mapping=defer)
    rt.install(runtime)
    logger.info("%s (vLLM blocks of %d tokens = page-sets; prefix caching %s; a step's VMM calls %s)",
                runtime.cache.summary(prewarm_s=runtime.prewarm_s), block,
                "on: cached blocks are mapped into each request's region" if prefix_caching else "off",
                "made layer group by layer group in the forward" if defer else "made before the forward")
    return runtime


def bind_kv_views(runtime, runner_kv_caches, forward_context, kv_cache_config, attn_groups, device,
                  cache_dtype, kernel_block_sizes, vllm_config) -> dict:
    """Stand-in for ``attn_utils.init_kv_cache``: bind vattn's views, allocate nothing."""
    from vllm.v1.worker.gpu.attn_utils import get_shared_kv_cache_layers
    from vllm.v1.worker.utils import bind_kv_cache
    if get_shared_kv_cache_layers(vllm_config):
        raise UnsupportedError("vattn: cross-layer KV sharing is not supported")
    for group in (g for groups in attn_groups for g in groups):
        if group.backend.get_name() != "CUSTOM":
            raise ConfigError(f"vattn: layers {group.layer_names[:2]}... use {group.backend.get_name()}, "
                              f"not vattn's CUSTOM backend")
    kv_caches = {name: runtime.kv_view(index) for name, index in runtime.layer_of.items()}
    bind_kv_cache(kv_caches, forward_context, runner_kv_caches)
    return kv_caches


def _wrap_copies(original):
    @functools.wraps(original)
    def copy_kv_cache_blocks_inplace(kv_caches, num_blocks, kv_cache_block_copies) -> None:
        if not rt.installed():
            return original(kv_caches, num_blocks, kv_cache_block_copies)
        rt.current().copy_blocks(kv_cache_block_copies)
    return copy_kv_cache_blocks_inplace


def _wrap_fullgraph(original):
    @functools.wraps(original)
    def run_fullgraph(self, *args, **kwargs):
        if rt.installed():
            rt.current().ready()              # no layer's Python runs inside the graph
        return original(self, *args, **kwargs)
    return run_fullgraph


def _wrap_remove(original):
    @functools.wraps(original)
    def _remove_request(self, req_id: str) -> bool:
        index = self.req_states.req_id_to_index.get(req_id)
        removed = original(self, req_id)
        if removed and index is not None:
            rt.current().release(index)
        return removed
    return _remove_request


def _wrap_shutdown(original):
    @functools.wraps(original)
    def shutdown(self) -> None:
        try:
            original(self)
        finally:
            rt.uninstall()
    return shutdown
