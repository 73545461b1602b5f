"""One vLLM run in a fresh process: ``python -m vattn.conformance.workers.vllm IN.json OUT.json``.

Each mode runs in its own process so the plugin's state (and, on CPU, the ``CPU_ATTN``
override) never leaks from a vattn run into a stock one; the plugin itself is loaded by vLLM
through the entry point, never imported here.
"""

from __future__ import annotations

import os
import sys
import time

from . import main as _main

__all__ = ["engine_kwargs", "generate", "worker_metrics", "schedule_difference",
           "generation_counters", "main"]

STOCK_BLOCK_SIZE = 16   # the paged baseline of the design notes


def engine_kwargs(spec: dict) -> dict:
    """``LLM(...)`` arguments for a mode: ``stock`` (paged), ``ceiling`` (one block per request), ``vattn``.

    ``prefix_caching``: ``False`` (default), ``True``, or ``"default"`` (vLLM's own: on).
    ``sizing="defaults"`` in the spec leaves ``max_model_len``, ``max_num_seqs``,
    ``max_num_batched_tokens`` and (unless given) ``gpu_memory_utilization`` to vLLM, as a user
    who only turns vattn on would. On GPU: ``stock`` is ``FLASH_ATTN`` with 16-token blocks, ``ceiling`` the same kernel with one
    ``max_model_len`` block per request (``num_gpu_blocks_override = max_num_seqs + 1``, block 0
    being vLLM's null block), ``vattn`` the ``CUSTOM`` backend with the block size it prefers
    (tokens per page-set). On CPU ``block_size`` in the spec sets vLLM's block size in every mode.
    ``vattn_block_size`` in the spec sets the vattn modes' own (GPU and CPU). ``llm_kwargs`` in the spec: ``LLM(...)``
    arguments added last, over everything above (``vattn compare --engine-option vllm:KEY=VALUE``).
    """
    mode, gpu = spec["mode"], spec["device"].startswith("cuda")
    max_len, max_seqs = spec["max_model_len"], spec["max_num_seqs"]
    kw = dict(model=spec["model_dir"], skip_tokenizer_init=True, dtype=spec["dtype"], seed=0,
              enforce_eager=spec.get("enforce_eager", not gpu), load_format=spec.get("load_format", "auto"))
    # prefix caching: off unless the spec says; "default" leaves it to vLLM (on), as a user who
    # only turns vattn on would run
    if spec.get("prefix_caching", False) != "default":
        kw["enable_prefix_caching"] = bool(spec.get("prefix_caching", False))
    if not gpu and spec.get("block_size"):   # CPU: both modes (vLLM's CPU default is 128)
        kw["block_size"] = spec["block_size"]
    if spec.get("sizing") != "defaults":    # else vLLM's own: the model's length, its batch sizes
        kw.update(max_model_len=max_len, max_num_seqs=max_seqs,
                  max_num_batched_tokens=spec.get("max_num_batched_tokens", max(max_len, 2048)))
    if gpu:
        if spec.get("sizing") != "defaults" or "gpu_memory_utilization" in spec:
            kw["gpu_memory_utilization"] = spec.get("gpu_memory_utilization", 0.85)
        kw["attention_backend"] = "CUSTOM" if mode.startswith("vattn") else "FLASH_ATTN"
        if mode == "stock":
            kw["block_size"] = STOCK_BLOCK_SIZE
        if spec.get("compilation_config") is not None:
            kw["compilation_config"] = spec["compilation_config"]
        if spec.get("profile_dir"):   # vLLM's torch profiler in the engine core, a window of steps
            kw["profiler_config"] = dict(
                profiler="torch", torch_profiler_dir=spec["profile_dir"], ignore_frontend=True,
                torch_profiler_with_stack=False, delay_iterations=spec.get("profile_delay", 0),
                max_iterations=spec.get("profile_steps", 0))
    if mode.startswith("vattn") and spec.get("vattn_block_size"):
        kw["block_size"] = spec["vattn_block_size"]
    if mode == "ceiling":
        if spec.get("sizing") == "defaults":
            raise ValueError("the ceiling mode sizes one block per request: it needs "
                             "max_model_len and max_num_seqs (VATTN_SIZING=tuned)")
        kw["block_size"] = max_len
        kw["num_gpu_blocks_override"] = max_seqs + 1
    kw.update(spec.get("llm_kwargs") or {})
    return kw


def generate(spec: dict) -> dict:
    """Run the prompts greedily, exactly ``max_new_tokens`` each; return RunResult fields."""
    from vllm import LLM, SamplingParams
    start = time.perf_counter()
    llm = LLM(**engine_kwargs(spec))
    init_s = time.perf_counter() - start
    n_new = spec["max_new_tokens"]
    params = SamplingParams(max_tokens=n_new, min_tokens=n_new, temperature=0.0, ignore_eos=True,
                            detokenize=False, logprobs=spec["logprobs"] or None)
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, detokenize=False), use_tqdm=False)  # warm-up
    steps = _schedule_recorder(llm)
    times, cached, each, walls = [], [], [], []
    vattn = os.environ.get("VATTN_VLLM") == "1"
    before = generation_counters(_metrics(llm)) if vattn else None   # start-up and warm-up
    for _ in range(max(1, int(spec.get("repeats", 1)))):   # the same batch again: run-to-run spread
        if steps is not None:
            steps.clear()                                   # the last run's schedule is kept
        start, wall = time.perf_counter(), time.time()
        outs = llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
        walls.append([round(wall, 4), round(time.time(), 4)])   # to place a step trace's rows
        cached.append(sum(o.num_cached_tokens or 0 for o in outs))   # prefix-cache hits
        if vattn:
            each.append(generation_counters(_metrics(llm)))
    seconds = sorted(times)[(len(times) - 1) // 2]          # the median (lower one of an even count)
    if spec.get("profile_dir"):    # once more, profiled (untimed): the kernel table of a step window
        llm.start_profile()
        llm.generate(prompts, params, use_tqdm=False)
        llm.stop_profile()
    token_ids = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = None
    if spec["logprobs"]:
        logprobs = [[{int(t): float(lp.logprob) for t, lp in pos.items()} for pos in o.outputs[0].logprobs]
                    for o in outs]
    cache_config = getattr(getattr(llm.llm_engine, "vllm_config", None), "cache_config", None)
    blocks = getattr(cache_config, "num_gpu_blocks", None)
    return dict(token_ids=token_ids, logprobs=logprobs, seconds=seconds,
                num_prompt_tokens=sum(len(p) for p in spec["prompts"]),
                num_generated_tokens=sum(len(t) for t in token_ids),
                extra={"mode": spec["mode"], "vattn": os.environ.get("VATTN_VLLM") == "1",
                       "init_s": round(init_s, 2), "num_gpu_blocks": blocks,
                       "seconds_each": [round(t, 4) for t in times], "cached_tokens_each": cached,
                       "wall_each": walls,
                       # per request, the prompt tokens vLLM's prefix cache served (None: not reported)
                       "num_cached_tokens": [o.num_cached_tokens for o in outs],
                       "schedule": _by_prompt(steps, outs),
                       "schedule_walls": None if steps is None else steps.walls,
                       # vattn's counters after each generation (cumulative; see generation_counters),
                       # and before the first (after start-up and the warm-up request)
                       "vattn_each": each or None, "vattn_before": before,
                       "engine_kwargs": {k: v for k, v in engine_kwargs(spec).items() if k != "model"},
                       "vattn_metrics": _metrics(llm)})


#: what :func:`generation_counters` keeps of the runtime's metrics: name -> (key, histogram?)
_EACH = {"apply_ms": ("apply_step_us", True), "device_wait_ms": ("apply_device_wait_us", True),
         "pages_aliased": ("pages_aliased", False), "map_calls": ("map_calls", False),
         "unmap_calls": ("unmap_calls", False), "page_sets_staged": ("page_sets_staged", False)}


def generation_counters(metrics: dict | None) -> dict | None:
    """The few cumulative numbers that tell one generation from the next (host ms of ``apply``,
    the GPU's idle ms behind it, pages aliased, driver calls); ``None`` without metrics."""
    if not metrics or "error" in metrics:
        return None
    out = {}
    for name, (key, hist) in _EACH.items():
        value = metrics.get(key)
        if hist and isinstance(value, dict):
            value = round(value.get("mean_us", 0) * value.get("count", 0) / 1e3, 2)
        out[name] = value
    return out


def _schedule_recorder(llm) -> list | None:
    """Record the engine core's schedule, one ``[(request id, tokens), ...]`` per step, when the
    engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); ``None`` otherwise.
    Two modes that batch the same tokens in the same steps run the same GEMM shapes, so their
    outputs may be compared bit for bit; a difference here explains a near-tie there."""
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    scheduler = getattr(core, "scheduler", None)
    if scheduler is None or not callable(getattr(scheduler, "schedule", None)):
        return None
    steps = _Schedule()
    original = scheduler.schedule

    def schedule(*args, **kwargs):
        out = original(*args, **kwargs)
        if out.num_scheduled_tokens:
            steps.append(sorted(out.num_scheduled_tokens.items()))
            steps.walls.append(round(time.time(), 4))
        return out
    scheduler.schedule = schedule     # this engine's instance only
    return steps


class _Schedule(list):
    """The recorded schedule (cleared per generation) and the wall-clock time of every
    non-empty step since the recording began (kept: to place the steps of a run's timeline,
    e.g. against a step trace)."""

    def __init__(self):
        super().__init__()
        self.walls: list[float] = []


def _by_prompt(steps: list | None, outs) -> list | None:
    """``steps`` with request ids replaced by the prompt's index (ids differ between engines)."""
    if steps is None:
        return None
    index = {o.request_id: i for i, o in enumerate(outs)}
    return [sorted((index.get(rid, -1), n) for rid, n in step) for step in steps]


def schedule_difference(a: list | None, b: list | None) -> dict | None:
    """Where two recorded schedules first differ: ``{"step", "a", "b"}``; ``{}`` when equal;
    ``None`` when either was not recorded."""
    if a is None or b is None:
        return None
    for step, (x, y) in enumerate(zip(a, b)):
        if [list(e) for e in x] != [list(e) for e in y]:
            return {"step": step, "a": x, "b": y}
    if len(a) != len(b):
        return {"step": min(len(a), len(b)), "a": a[len(b):][:1], "b": b[len(a):][:1]}
    return {}


def worker_metrics(worker=None) -> dict:
    """The vattn runtime's metrics in this process (JSON-able); run on vLLM workers by RPC."""
    from vattn.adapters.vllm import runtime as rt
    from vattn.core.metrics import jsonable
    runtime = rt.current()
    found = runtime.metrics() if hasattr(runtime, "metrics") else runtime.cache.metrics()
    found["kv_heads"] = runtime.cache.config.num_kv_heads     # this rank's share (tensor parallel)
    return jsonable(found)


def _metrics(llm) -> dict | None:
    if os.environ.get("VATTN_VLLM") != "1":
        return None
    from vattn.core.errors import VattnError
    try:
        return worker_metrics()                  # the engine runs in this process (CPU tests)
    except VattnError:
        pass
    from vattn.conformance.workers.vllm import worker_metrics as by_name   # pickled by reference
    try:
        found = llm.collective_rpc(by_name)      # the engine core runs in its own process
        if not found:
            return None
        # rank 0's, plus every rank's under tensor parallelism
        return found[0] | {"ranks": found} if len(found) > 1 else found[0]
    except Exception as exc:  # report, never lose the run's timing for want of metrics
        return {"error": repr(exc)}


def main(argv: list[str] | None = None) -> int:
    return _main(generate, argv)


if __name__ == "__main__":
    sys.exit(main())
