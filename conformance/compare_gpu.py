"""``vattn compare --shape``: the GPU stages' model shapes and workloads, and what each engine is
started with.

One definition with :mod:`vattn.bench.gpu`: the model is a shape of
:data:`vattn.bench.gpu.workloads.SHAPES` (``llama3-8b-shape`` with 131,072 positions,
``llama-1b-shape``) written as a config-only folder (no weight file); the workloads are rows of
:data:`vattn.bench.gpu.workloads.WORKLOADS`, their prompts seeded, the same for every engine.

Every engine starts with its own defaults; stock and vattn differ only by vattn's activation:

* vLLM: ``load_format="dummy"``, vLLM's own sizing (``max_model_len`` = the model's positions,
  its ``max_num_seqs``, batch and memory sizing) and prefix caching as it defaults (on), CUDA
  graphs; stock on ``FLASH_ATTN`` (its 16-token blocks), vattn on the ``CUSTOM`` backend with
  ``VATTN_VLLM=1`` (:func:`vattn.conformance.workers.vllm.engine_kwargs`, as ``tools/gpu/vllm.sh``
  with ``VATTN_SIZING=defaults``);
* SGLang: ``load_format="dummy"``, SGLang's own sizing and radix cache; stock on ``fa3``, vattn on
  ``--attention-backend vattn`` with ``VATTN_SGLANG=1``; prefill eager in both modes
  (:func:`vattn.conformance.workers.sglang.engine_kwargs`, as ``tools/gpu/sglang.sh``);
* transformers: the seeded weights drawn on the GPU, continuous batching with 256-token blocks
  and 2,048 batch tokens (``tools/gpu/conformance.sh``), ``paged|sdpa`` vs ``paged|vattn``;
* TGI: its runner (not wired on CUDA: a row says so).

``--engine-option ENGINE:KEY=VALUE`` adds arguments to both modes of one engine: ``LLM(...)``
keyword arguments for vLLM, ``sglang.Engine(...)`` ones for SGLang, runner options for
transformers and TGI. :func:`describe` shows the result without starting anything
(``vattn compare --dry-run``).
"""

from __future__ import annotations

import inspect
import os

from vattn.bench.gpu import workloads as _gpu
from vattn.core.errors import ConfigError, VattnError

from .workloads import Workload

__all__ = ["SHAPES", "WORKLOADS", "VLLM_ARGS", "SGLANG_ARGS", "TRANSFORMERS_OPTIONS", "model_dir",
           "build_model_dir", "workload", "runner_options", "check_engine_args", "weights", "describe"]


#: name -> config fields of the shapes ``--shape`` takes
SHAPES: dict[str, dict] = _gpu.SHAPES
#: the workloads ``--workloads`` takes with ``--shape`` (``multi-turn`` is left out: each of its
#: rounds is the next turn of the engine's own replies, vLLM's paired stage)
WORKLOADS: tuple[str, ...] = tuple(n for n in _gpu.WORKLOADS if n != "multi-turn")
#: modes of every runner, baseline first
PAIR = ("stock", "vattn")
#: vLLM worker-spec keys of both modes: dummy weights, vLLM's own sizing and prefix caching
VLLM_ARGS = {"load_format": "dummy", "sizing": "defaults", "prefix_caching": "default"}
#: ``sglang.Engine`` arguments of both modes (everything else SGLang's own)
SGLANG_ARGS = {"load_format": "dummy"}
#: transformers runner options (its continuous batching's block size; the batch tokens of the
#: transformers H200 runs, ``tools/gpu/conformance.sh``)
TRANSFORMERS_OPTIONS = {"block_size": 256, "max_batch_tokens": 2048}


def shape_fields(spec: dict) -> dict:
    """The config fields of ``spec["shape"]`` (``spec["layers"]`` overrides the layer count)."""
    fields = dict(SHAPES[spec["shape"]])
    if spec.get("layers") is not None:
        fields["num_hidden_layers"] = int(spec["layers"])
    return fields


def model_dir(spec: dict) -> str:
    """Where ``spec``'s config-only model folder is (see :func:`build_model_dir`)."""
    import tempfile
    root = spec.get("models_dir") or os.path.join(tempfile.gettempdir(), "vattn-models")
    layers = "" if spec.get("layers") is None else f"-{spec['layers']}l"
    return os.path.join(root, f"{spec['shape']}{layers}-config-seed{spec['seed']}")


def build_model_dir(spec: dict) -> str:
    """Write the config-only ``LlamaForCausalLM`` folder of ``spec`` (reused when it exists):
    vLLM and SGLang load it with dummy weights, transformers draws the seed's weights on the GPU."""
    return _gpu.llama_model(model_dir(spec), shape_fields(spec), seed=spec["seed"])


def workload(name: str, *, vocab_size: int, seed: int, num: int | None = None) -> Workload:
    """Workload ``name`` of the GPU stages' table, its prompts seeded (the first ``num`` of them
    when given), every request at once, exactly the table's new tokens each."""
    if name not in WORKLOADS:
        raise ConfigError(f"--workloads with --shape: expected names from {', '.join(WORKLOADS)}, "
                          f"got {name!r}")
    prompts = _gpu.workload_prompts(name, vocab_size, seed=seed)
    if num is not None:
        prompts = prompts[:num]
    return Workload(name=name, prompts=prompts, max_new_tokens=_gpu.WORKLOADS[name][2])


def runner_options(engine: str, spec: dict) -> dict:
    """The constructor options of ``engine``'s conformance runner in a ``--shape`` run of
    ``spec`` (``spec["engine_args"]``: that engine's ``--engine-option`` values)."""
    extra = dict(spec.get("engine_args") or {})
    logs = os.path.join(spec["out_dir"], "logs")
    if engine == "vllm":
        args = dict(VLLM_ARGS, **({"llm_kwargs": extra} if extra else {}))
        return dict(device=spec["device"], modes=PAIR, engine_args=args, log_dir=logs, tag="compare")
    if engine == "sglang":
        return dict(modes=PAIR, engine_args=dict(SGLANG_ARGS, **extra), log_dir=logs)
    if engine == "transformers":
        return dict(TRANSFORMERS_OPTIONS, **extra)
    return extra


def _runner_class(engine: str):
    import importlib

    from .engines import ENGINES
    module, _, cls = ENGINES[engine].partition(":")
    return getattr(importlib.import_module(module), cls)


def check_engine_args(engine: str, args: dict) -> None:
    """Refuse ``--engine-option`` keys the runner of a runner-option engine (transformers, TGI)
    does not take; vLLM's and SGLang's are the engine's own arguments, checked when it starts.

    Raises
    ------
    ConfigError
        A key the runner does not take.
    """
    if engine in ("vllm", "sglang") or not args:
        return
    try:
        params = inspect.signature(_runner_class(engine)).parameters
    except ImportError:      # checked by the worker, where the engine is installed
        return
    bad = sorted(set(args) - set(params))
    if bad:
        raise ConfigError(f"--engine-option {engine}: expected options of its runner "
                          f"({', '.join(p for p in params if p != 'self')}), got {bad}")


def weights(engine: str, spec: dict) -> str:
    """How ``engine``'s model got its weights in a run of ``spec``: ``"dummy"`` (the engine's
    ``load_format="dummy"``) or ``"seeded"`` (normal(0, 0.02) of the model's seed)."""
    if spec.get("shape") and engine in ("vllm", "sglang"):
        fmt = ((spec.get("engine_args") or {}).get("load_format")
               or (VLLM_ARGS if engine == "vllm" else SGLANG_ARGS)["load_format"])
        return "dummy" if fmt == "dummy" else f"load_format={fmt}"
    return "seeded"


def _env_change(env: dict) -> dict:
    """``env`` against this process's environment: what it sets, and ``None`` for what it unsets."""
    changed = {k: v for k, v in env.items() if os.environ.get(k) != v}
    changed.update({k: None for k in os.environ if k not in env})
    return dict(sorted(changed.items()))


def describe(engine: str, options: dict, **run) -> dict:
    """:func:`_describe`; an engine whose runner cannot be built here (its library missing or
    of another version) says why instead."""
    try:
        return _describe(engine, options, **run)
    except VattnError as exc:
        return {"runner": options, "not described here": f"{type(exc).__name__}: {exc}"}


def _describe(engine: str, options: dict, *, model: str, prompts: list[list[int]], max_new_tokens: int,
              device: str, dtype: str, logprobs: int) -> dict:
    """What each mode of ``engine`` would be started with, starting nothing: per mode the engine's
    keyword arguments (vLLM's ``LLM(...)``, SGLang's ``sglang.Engine(...)``, transformers' calls)
    and the environment it changes (``null``: unset), from the runner built with ``options``."""
    if engine == "vllm":
        from .runners.vllm import VllmRunner
        from .workers.vllm import engine_kwargs
        runner = VllmRunner(**dict({"device": device}, **options))
        modes = {}
        for mode in runner.modes:
            spec = runner.spec_for(mode, model, prompts, max_new_tokens, logprobs=logprobs, device=device,
                                   dtype=dtype)
            modes[mode] = {"LLM": engine_kwargs(spec), "env": _env_change(runner.env_for(spec))}
        return {"runner": options, "modes": modes}
    if engine == "sglang":
        from .runners.sglang import SglangRunner
        from .workers.sglang import engine_kwargs
        runner = SglangRunner(**options)
        modes = {}
        for mode in runner.modes:
            spec = runner.spec_for(mode, model, prompts, max_new_tokens, logprobs=logprobs, dtype=dtype)
            modes[mode] = {"sglang.Engine": engine_kwargs(mode, model, spec["engine_args"]),
                           "env": _env_change(runner.env_for(mode))}
        return {"runner": options, "modes": modes}
    if engine == "transformers":
        from .runners.transformers import TransformersRunner
        runner = TransformersRunner(**options)
        cb = runner.cb_kwargs(prompts, max_new_tokens, logprobs=logprobs > 0, device=device)
        return {"runner": options, "modes": {
            "stock": {"attn_implementation": "paged|sdpa", "ContinuousBatchingConfig": cb},
            "vattn": {"attn_implementation": "paged|vattn", "ContinuousBatchingConfig": cb,
                      "vattn.adapters.transformers.enable": runner.enable_kwargs(prompts, max_new_tokens)}}}
    if engine == "tgi" and str(device).startswith("cuda"):
        return {"runner": options, "unsupported": _TGI_CUDA}
    return {"runner": options}


_TGI_CUDA = ("TGI's runner runs on the CPU only: its CUDA path needs TGI's Hub kernels "
             "(conformance/runners/tgi.py); on CUDA its row says so")
