"""The vLLM GPU stages behind ``tools/gpu/vllm.sh`` (vLLM 0.26.0 on one H200).

``python -m vattn.bench.gpu.vllm_stages STAGE --out DIR [--workload NAME]``; STAGE is

* ``smoke``: first the checks (version gate, entry point visible, GPU modules import), then a
  tiny random model, ``stock`` vs ``vattn`` eager, a few tokens each, compared;
* ``identity``: 8-layer model with Llama-3-8B attention shapes and random weights (std 0.02),
  modes of ``VATTN_IDENTITY_MODES`` (default ``stock vattn-exact vattn ceiling``; ``MODE@N`` runs
  a mode again in a fresh engine, compared with its first run), CUDA graphs
  unless ``VATTN_IDENTITY_EAGER=1``, the engine core in the worker process unless
  ``VATTN_IDENTITY_INPROC=0`` (vLLM's engine loop steps as soon as it holds a request, so with
  an engine process of its own the first batches depend on when the prompts reach it; run so,
  stock against a second stock engine was exact on 4 of 16 prompts, 2026-12-04),
  ``VATTN_IDENTITY_KV_BYTES=N`` gives every mode N bytes of KV (vLLM's
  ``kv_cache_memory_bytes``; e.g. 167772160, ~5K tokens of this model, for memory pressure:
  vLLM preempts, vattn retires pages of just-released slots), ``VATTN_IDENTITY_PREFIX=1`` the
  prompts on 4 shared prefixes with prefix caching on (``nocache``: the same prompts with it
  off, the control); every mode
  judged against stock by
  :func:`vattn.conformance.identity.compare`, and ``vattn`` against ``ceiling`` (both run FA3's
  TMA prefill path, stock and ``vattn-exact`` its non-TMA one: see
  :data:`vattn.adapters.vllm.gpu_layout.EXACT_ENV`);
* ``throughput``: the ``VATTN_SHAPE`` preset (default the Llama-3-8B shape with 131,072
  positions; ``llama-1b-shape``), ``load_format="dummy"``, the engine's own sizing unless
  ``VATTN_SIZING=tuned`` (the ceiling mode needs ``tuned``), modes ``stock vattn ceiling`` (or
  ``VATTN_MODES``; the ceiling last: it is the column to lose if time runs out) on one of
  :data:`.workloads.WORKLOADS`; each engine runs the batch ``VATTN_REPEATS`` times (default 2) and reports
  the median (of 2: the faster), every run's time kept in ``seconds_each``; with re-runs
  (``VATTN_MODES="stock vattn ceiling stock@2 vattn@2 ceiling@2"``: interleaved engines, so a
  drift of the machine hits every mode alike) ``pooled`` has each mode's median over all its
  engines' generations;
* ``paired``: two modes as two engines up at once, generations alternated (:func:`stage_paired`);
* ``profile``: the throughput setup, each mode once more under vLLM's torch profiler for a
  window of engine steps: GPU time per kernel family (attention, KV store, GEMM, vattn's slot
  tables, other) and the top kernels, to find where a mode loses time.

Each stage writes ``DIR/<stage>[_<workload>].json`` and the engine logs under ``DIR/logs``.
``VATTN_CUDAGRAPH_MODE`` (e.g. ``PIECEWISE``) sets vLLM's ``cudagraph_mode`` for every mode alike.
"""

from __future__ import annotations

import os
import subprocess
import sys

from vattn.conformance.runners.vllm import VllmRunner
from vattn.conformance.stages import run_modes

from . import stage
from .report import (PROFILER_TABLE, jit_during_inference, pool_engines, profiler_kernels,
                     vattn_columns, waste_per_request)
from .stage import env_choice, env_modes, free_cuda
from .workloads import (IDENTITY_MODELS, LLAMA3_8B_LONG, MULTI_TURN_USER, WORKLOADS, env_shape,
                        llama_model, workload_prompts)

__all__ = ["STAGES", "make_runner", "main"]

IDENTITY_MODEL = IDENTITY_MODELS["vllm"]


def make_runner(out: str, tag: str, max_num_seqs: int, modes, *, engine_env=None, **engine_args):
    """A GPU :class:`VllmRunner` of ``modes`` logging to ``out/logs``; ``VATTN_CUDAGRAPH_MODE``
    (e.g. ``PIECEWISE``) sets vLLM's ``cudagraph_mode`` of every mode, ``VATTN_TP`` its
    ``tensor_parallel_size`` (a machine with that many GPUs), ``VATTN_RUN_TIMEOUT`` (default
    420 s) caps one engine run."""
    if os.environ.get("VATTN_CUDAGRAPH_MODE"):   # e.g. PIECEWISE, to rule out FULL graphs
        engine_args["compilation_config"] = {"cudagraph_mode": os.environ["VATTN_CUDAGRAPH_MODE"]}
    tp = int(os.environ.get("VATTN_TP", "1"))
    if tp != 1:                                  # tensor parallelism: every mode alike
        engine_args["llm_kwargs"] = {**engine_args.get("llm_kwargs", {}), "tensor_parallel_size": tp}
    return VllmRunner(device="cuda", max_num_seqs=max_num_seqs, timeout_s=float(os.environ.get(
        "VATTN_RUN_TIMEOUT", 420)), engine_args=engine_args, modes=tuple(modes),
        log_dir=os.path.join(out, "logs"), tag=tag, engine_env=engine_env)


def stage_check(args) -> dict:
    from importlib import metadata
    from vattn.adapters.vllm.version import check_version, vllm_version
    eps = [ep.value for ep in metadata.entry_points(group="vllm.general_plugins")]
    visible = any(v.startswith("vattn.adapters.vllm.plugin") for v in eps)
    # in a child: importing vLLM's FA backend initializes CUDA, which this process must not hold
    code = "import vattn.adapters.vllm.backend_gpu, vattn.adapters.vllm.gpu_hooks as h; h.install_gpu()"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=150)
    return {"vllm": vllm_version(), "family": check_version(), "entry_points": eps,
            "plugin_visible": visible, "gpu_modules_import": child.returncode == 0,
            "import_error": child.stderr[-3000:] if child.returncode else None,
            "ok": visible and child.returncode == 0}


def stage_smoke(args) -> dict:
    from vattn.conformance.identity import compare
    from vattn.conformance.models import build_model, random_prompts
    check = stage_check(args)
    if not check["ok"]:
        why = (f"GPU modules failed to import:\n{check['import_error']}" if check["import_error"] else
               f"vattn's vllm.general_plugins entry point is not visible (found {check['entry_points']}):"
               " install vattn or put a dist-info shim on PYTHONPATH")
        return {"ok": False, "check": check, "errors": {"check": why}}
    model = build_model("tiny", os.path.join(args.models, "tiny-bf16"), seed=3, dtype="bfloat16",
                        device="cpu")
    prompts = random_prompts(6, [5, 17, 40, 64, 90, 130], vocab_size=1024, seed=11)
    runner = make_runner(args.out, "smoke", 4, ("stock", "vattn"), enforce_eager=True,
                         gpu_memory_utilization=0.25)
    results, errors = run_modes(runner, model, prompts, 8, logprobs=5)
    same = None
    if "stock" in results and "vattn" in results:   # exact expected; a near-tie is not a failure
        cmp = compare(results["stock"], results["vattn"]).to_dict()
        same = {k: cmp[k] for k in ("ok", "exact", "token_match_rate", "near_ties", "mismatches")}
    return {"ok": bool(same and same["ok"]) and not errors, "check": check, "vs_stock": same,
            "errors": errors, "tokens": {m: r.token_ids for m, r in results.items()},
            "vattn_metrics": results["vattn"].extra.get("vattn_metrics") if "vattn" in results else None}


def stage_identity(args) -> dict:
    from vattn.conformance.identity import compare
    from vattn.conformance.models import build_model, check_not_degenerate, random_prompts
    from vattn.conformance.workers.vllm import schedule_difference
    model = build_model(IDENTITY_MODEL, os.path.join(args.models, "identity-8l"), seed=0,
                        dtype="bfloat16", device="cuda")
    free_cuda()
    lengths = [64 + (i * 389) % 1800 for i in range(16)]          # crosses many 128-token pages
    prompts = random_prompts(16, lengths, vocab_size=IDENTITY_MODEL["vocab_size"], seed=5)
    # 1: shared prefixes, prefix caching as the engine's sizing has it (on); nocache: the same
    # prompts with prefix caching off (the control: is a near-tie the cache's, or the prompts'?)
    prefix = env_choice("VATTN_IDENTITY_PREFIX", ("0", "1", "nocache"))
    shared, cached = prefix != "0", prefix == "1"
    if shared:   # 4 prefixes of lengths that are no multiple of a block, each shared by 4 prompts
        bases = random_prompts(4, [300, 777, 1100, 1500], vocab_size=IDENTITY_MODEL["vocab_size"], seed=9)
        prompts = [bases[i % 4] + p[:40 + 37 * i] for i, p in enumerate(prompts)]
    eager = os.environ.get("VATTN_IDENTITY_EAGER", "0") == "1"
    # in-process engine core: every prompt is queued before the first step, so the batches (and
    # the chunking of each prompt) do not depend on when requests reach a separate engine process
    inproc = os.environ.get("VATTN_IDENTITY_INPROC", "1") == "1"
    # memory pressure: the same KV bytes for every mode, too few for the batch, so vLLM preempts
    # and vattn hands pages of just-released slots on before their fence (stream_ordered)
    kv_bytes = int(os.environ.get("VATTN_IDENTITY_KV_BYTES", "0"))
    runner = make_runner(args.out, "identity", 8, env_modes("VATTN_IDENTITY_MODES",
                                                            "stock vattn-exact vattn ceiling"),
                         enforce_eager=eager,
                         engine_env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if inproc else None,
                         prefix_caching=_sizing()["prefix_caching"] if cached else False,
                         **({"llm_kwargs": {"kv_cache_memory_bytes": kv_bytes}} if kv_bytes else {}))
    results, errors = run_modes(runner, model, prompts, 48, logprobs=5)
    report = {"eager": eager, "inproc": inproc, "shared_prefixes": shared, "prefix_caching": cached,
              "errors": errors,
              "kv_cache_memory_bytes": kv_bytes or None,
              "num_gpu_blocks": {m: r.extra.get("num_gpu_blocks") for m, r in results.items()},
              # prompt tokens each mode served from vLLM's prefix cache (shared prefixes: the
              # same hit rate is expected of every mode, vattn hitting inside its page-sets)
              "cached_tokens": {m: sum(c or 0 for c in r.extra.get("num_cached_tokens") or ())
                                for m, r in results.items()},
              "modes": list(results), "ok": not errors}
    if "stock" in results:
        report["not_degenerate"] = check_not_degenerate(results["stock"].token_ids)
        report["ok"] &= report["not_degenerate"]["ok"]
    again = [(m.split("@")[0], m) for m in results if "@" in m]   # MODE@N: the same mode re-run
    pairs = [("stock", m) for m in results if m != "stock"] + [("ceiling", "vattn")] + again
    # same FA3 instantiation (or the same mode again): bit-exact expected
    same_path = {("stock", "vattn-exact"), ("ceiling", "vattn"), *again}
    report["same_path_exact"] = {}
    for base, mode in pairs:
        if base in results and mode in results:
            cmp = compare(results[base], results[mode]).to_dict()
            report[f"{mode}_vs_{base}"] = {k: cmp[k] for k in (
                "ok", "exact", "exact_match_rate", "token_match_rate", "near_ties", "mismatches",
                "worst_gap", "first_divergence")}
            # the same steps with the same tokens (in-process engines): {} equal, None unknown
            report[f"{mode}_vs_{base}"]["schedule_difference"] = schedule_difference(
                results[base].extra.get("schedule"), results[mode].extra.get("schedule"))
            report["ok"] &= cmp["ok"]
            if (base, mode) in same_path:
                report["same_path_exact"][f"{mode}_vs_{base}"] = cmp["exact"]
    names = list(results)   # every pair, exact or not: which runs agree with which
    report["exact_pairs"] = {f"{b}_vs_{a}": results[a].token_ids == results[b].token_ids
                             for i, a in enumerate(names) for b in names[i + 1:]}
    report["jit_during_inference"] = {m: jit_during_inference(runner.log_path(m)) for m in results}
    for mode in ("vattn", "vattn-exact"):
        if mode in results:
            report[f"{mode}_metrics"] = results[mode].extra.get("vattn_metrics")
    return report


def _workload(args):
    """``(num, prompt_len, new, max_num_seqs, model_dir, prompts)`` of ``args.workload`` on the
    ``VATTN_SHAPE`` preset (a config-only model: ``load_format="dummy"``)."""
    num, plen, new = WORKLOADS[args.workload]
    name, fields = _shape()
    model = llama_model(os.path.join(args.models, name.replace("-shape", "-dummy")), fields)
    return num, plen, new, num, model, workload_prompts(args.workload, fields["vocab_size"], seed=7)


def _memory_columns(mode: str, metrics: dict | None, plen: int, new: int) -> dict:
    """A throughput row's waste and (vattn) critical-path columns."""
    max_len = -(-(plen + new) // 256) * 256
    row = {"worst_waste_MiB_per_request": waste_per_request(
        mode, max_model_len=max_len, shortest=plen + 1, metrics=metrics) / 2**20}
    return row | {k: v for k, v in vattn_columns(metrics, "vllm").items()   # waste: above, every mode
                  if k != "worst_waste_MiB_per_request"}


def _sizing() -> dict:
    """Engine arguments of ``VATTN_SIZING``: ``defaults`` (default; vLLM's own ``max_num_seqs``,
    ``max_model_len`` = the model's 131,072 positions, batch and memory sizing) or ``tuned``
    (trimmed to the workload, as the first GPU runs were)."""
    sizing = env_choice("VATTN_SIZING", ("defaults", "tuned"))
    caching = env_choice("VATTN_PREFIX_CACHING", ("default", "on", "off"))
    pc = {"prefix_caching": {"default": "default", "on": True, "off": False}[caching]}
    return pc | ({"sizing": "defaults"} if sizing == "defaults" else {"max_num_batched_tokens": 16384})


def stage_throughput(args) -> dict:
    from vattn.conformance.throughput import summarize
    num, plen, new, seqs, model, prompts = _workload(args)
    runner = make_runner(args.out, args.workload, seqs, env_modes("VATTN_MODES", "stock vattn ceiling"),
                         load_format="dummy", **_sizing(),
                         repeats=int(os.environ.get("VATTN_REPEATS", "2")))
    results, errors = run_modes(runner, model, prompts, new, logprobs=0)
    report = {"workload": args.workload, "model_preset": _shape()[0], "shape": [num, plen, new, seqs], "errors": errors,
              "ok": not errors, "rows": summarize(results, "stock") if "stock" in results else {}}
    for mode, res in results.items():
        row = report["rows"].setdefault(mode, {"seconds": res.seconds})
        row |= {"init_s": res.extra.get("init_s"), "num_gpu_blocks": res.extra.get("num_gpu_blocks"),
                "seconds_each": res.extra.get("seconds_each"), "wall_each": res.extra.get("wall_each"),
                "schedule_walls": res.extra.get("schedule_walls"),
                "cached_tokens_each": res.extra.get("cached_tokens_each"),
                "prompt_tokens_each": [res.num_prompt_tokens] * len(res.extra.get("cached_tokens_each") or []),
                "vattn_each": res.extra.get("vattn_each"), "vattn_before": res.extra.get("vattn_before"),
                "jit_during_inference": jit_during_inference(runner.log_path(mode))}
        row |= _memory_columns(mode, res.extra.get("vattn_metrics"), plen, new)
    report["pooled"] = pool_engines(report["rows"])   # MODE@N re-runs: every generation pooled
    return report


def stage_paired(args) -> dict:
    """Two modes (``VATTN_PAIR``, default ``stock vattn``) as two engines up at once, each with
    ``VATTN_PAIR_MEM`` of the GPU (default 0.44), their generations alternated for
    ``VATTN_ROUNDS`` rounds (default 4; see :mod:`.paired`): per-round ratios, no drift."""
    from . import paired
    num, plen, new, seqs, model, prompts = _workload(args)
    modes = env_modes("VATTN_PAIR", "stock vattn")
    runner = VllmRunner(device="cuda", max_num_seqs=seqs, modes=tuple(modes), tag=f"paired-{args.workload}",
                        log_dir=os.path.join(args.out, "logs"),
                        engine_args=dict(load_format="dummy", **_sizing(),
                                         **({"turn_tokens": MULTI_TURN_USER} if args.workload == "multi-turn" else {}),
                                         gpu_memory_utilization=float(os.environ.get("VATTN_PAIR_MEM", 0.44))))
    report = {"workload": args.workload, "model_preset": _shape()[0], "shape": [num, plen, new, seqs], "errors": {}, "ok": False,
              "rows": {}, "sizing": os.environ.get("VATTN_SIZING", "defaults")}
    out = paired.run_paired(runner, modes, model, prompts, new,
                            rounds=int(os.environ.get("VATTN_ROUNDS", 4)), device="cuda", dtype="bfloat16")
    summary = report["paired"] = paired.paired_summary(out, modes[0])
    for mode, res in out.items():
        median = summary["median_s"][mode]
        report["rows"][mode] = {
            "seconds": median, "seconds_each": res["seconds_each"], "init_s": res.get("init_s"),
            "cached_tokens_each": res.get("cached_tokens_each"),
            "prompt_tokens_each": res.get("prompt_tokens_each"),
            "ratio": round(summary["median_s"][modes[0]] / median, 4),
            "total_tok_s": round(num * (plen + new) / median, 2),
            **_memory_columns(mode, res.get("vattn_metrics"), plen, new)}
    report["ok"] = True
    return report


def stage_profile(args) -> dict:
    """One workload per mode (untimed, after one timed run) under vLLM's torch profiler for
    ``VATTN_PROFILE_STEPS`` engine steps after ``VATTN_PROFILE_DELAY`` (default 32 after 64:
    decode steps of decode-heavy): GPU time per kernel family and the top kernels, per mode."""
    import shutil
    num, plen, new, seqs, model, prompts = _workload(args)
    modes = env_modes("VATTN_MODES", "stock vattn ceiling")
    report = {"workload": args.workload, "model_preset": _shape()[0], "shape": [num, plen, new, seqs], "ok": True, "errors": {},
              "steps": int(os.environ.get("VATTN_PROFILE_STEPS", 32)),
              "delay": int(os.environ.get("VATTN_PROFILE_DELAY", 64)), "modes": {}}
    for mode in modes:   # one runner per mode: each its own profiler directory
        pdir = os.path.join(args.out, "profile", mode)
        shutil.rmtree(pdir, ignore_errors=True)
        os.makedirs(pdir)
        runner = make_runner(args.out, f"profile-{args.workload}", seqs, [mode], load_format="dummy",
                             max_num_batched_tokens=16384, profile_dir=pdir,
                             profile_steps=report["steps"], profile_delay=report["delay"])
        results, errors = run_modes(runner, model, prompts, new, logprobs=0)
        report["errors"] |= errors
        if mode in results and os.path.exists(os.path.join(pdir, PROFILER_TABLE)):
            report["modes"][mode] = profiler_kernels(pdir)
            report["modes"][mode]["seconds"] = results[mode].seconds
        elif mode in results:
            errors[mode] = report["errors"][mode] = f"no profiler table in {pdir}"
        for name in os.listdir(pdir):   # the traces are large: keep the table only
            path = os.path.join(pdir, name)
            if name != PROFILER_TABLE:
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    report["ok"] = not report["errors"] and bool(report["modes"])
    return report


def _shape() -> tuple[str, dict]:
    """``VATTN_SHAPE`` (default ``llama3-8b-shape``, with 131,072 positions; also
    ``llama-1b-shape``): the preset name and its config fields."""
    return env_shape({"llama3-8b-shape": LLAMA3_8B_LONG})


STAGES = {"smoke": stage_smoke, "identity": stage_identity, "throughput": stage_throughput,
          "paired": stage_paired, "profile": stage_profile}


def main(argv: list[str] | None = None) -> int:
    return stage.main("python -m vattn.bench.gpu.vllm_stages", STAGES, argv, workloads=WORKLOADS,
                      per_workload=("throughput", "profile", "paired"),
                      models=os.environ.get("VATTN_MODELS", "/tmp/vattn-models"))


if __name__ == "__main__":
    sys.exit(main())
