"""``VllmRunner``: stock vLLM vs vLLM + vattn for ``vattn conformance --engine vllm``.

Every mode runs in a fresh Python process (:mod:`vattn.conformance.workers.vllm`); the vattn
mode sets ``VATTN_VLLM=1`` so the entry-point plugin activates itself in every vLLM process of
that run, the stock modes leave it unset so they are untouched stock vLLM. Modes:

* ``stock``: vLLM's paged KV (block 16), ``FLASH_ATTN`` on GPU, ``CPU_ATTN`` on CPU;
* ``ceiling`` (GPU only): stock vLLM with one block per request (``block_size = max_model_len``);
* ``vattn``: the vattn backend (``CUSTOM`` on GPU, the ``CPU_ATTN`` override on CPU);
* ``vattn-exact`` (GPU only): ``vattn`` with ``VATTN_VLLM_EXACT=1``, FA3 on stock's kernel path
  (see :data:`vattn.adapters.vllm.gpu_layout.EXACT_ENV`).

``MODE@N`` (e.g. ``stock@2``) runs a mode once more in a fresh engine: is it reproducible itself?
``vattn:gG`` (or ``vattn-exact:gG``) runs the vattn mode with ``G`` layers per VA range
(``VATTN_GROUP_SIZE=G`` in its engine): layouts compared side by side in one run, e.g.
``stock vattn vattn:g2 ceiling``; ``vattn:s1`` / ``vattn:s0`` runs it with prefix staging on /
off (``VATTN_STAGE_PREFIXES``; the GPU runner's default: off); ``vattn:p1024`` with 1,024 MiB
for packs of shared runs, ``vattn:p0`` without packs (``VATTN_PACK_MB``; the GPU runner's
default: 1,024 with prefix caching on); ``vattn:d0`` / ``vattn:d1`` with a step's VMM calls made
before the forward / deferred into it (``VATTN_DEFER_MAPPING``; the GPU runner's default: on
where the engine's graphs allow it); ``vattn:w0`` without the CUDA events that time the device's
idle time behind vattn's step (``VATTN_DEVICE_WAIT=0``: they release the GIL); ``vattn:r0`` /
``vattn:rN`` with no / ``N`` page-sets kept free for bursts (``VATTN_FREE_RESERVE``; the GPU
runner's default: none); ``vattn:c0`` / ``vattn:cN`` with no / ``N`` idle slots left empty by
the pre-warm for prefix-cache hits (``VATTN_COLD_SLOTS``; default: none); ``vattn:h1`` /
``vattn:h0`` with the step's driver calls holding / releasing the GIL (``VATTN_DRIVER_GIL=hold`` / ``release``), ``vattn:h2`` with the
slot-table uploads and device-wait events through the driver too (``hold-all``, the default);
``vattn:b1`` / ``vattn:b0`` with a step's page-set copies made as one ``cuMemcpyBatchAsync`` / one
call each (``VATTN_BATCH_COPIES``; default: 1). Variants
combine: ``vattn:g2:p0``.
"""

from __future__ import annotations

import os
import re

from vattn.conformance.protocol import RunResult
from vattn.core.errors import ConfigError, UnsupportedError

from .process import run_worker

__all__ = ["VllmRunner", "WORKER", "base_mode"]

#: the worker every mode's engine process runs
WORKER = "vattn.conformance.workers.vllm"

_CPU_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
# GPU: every mode on the V2 runner (vattn's hooks target it; Llama-like models use it by default),
# and callables allowed in collective_rpc so the vattn metrics can be read from the engine core
_GPU_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}


class VllmRunner:
    """Runs vLLM in a subprocess per mode.

    Parameters
    ----------
    device : str, optional
        ``"cpu"`` (vllm-cpu) or ``"cuda"``; decides the modes offered. Default: ``"cuda"`` if
        torch sees a GPU, else ``"cpu"``.
    max_num_seqs : int
        Concurrent requests (= vattn slots).
    timeout_s : float
        Per-mode limit for the subprocess.
    engine_args : dict, optional
        Extra keys of the worker spec (``load_format``, ``gpu_memory_utilization``, ...).
    modes : tuple of str, optional
        A subset of the device's modes to offer (e.g. ``("stock", "vattn")``).
    log_dir : str, optional
        Where each run's full stdout/stderr is written (``vllm_<tag>_<mode>.log``).
    tag : str
        Names the log files of this runner's runs.
    engine_env : dict, optional
        Environment of every engine process on top of this one's (e.g.
        ``{"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}``: the engine core in the worker process, so
        all prompts are queued before its first step).
    """

    name = "vllm"

    def __init__(self, *, device: str | None = None, max_num_seqs: int = 16, timeout_s: float = 900.0,
                 engine_args: dict | None = None, modes: tuple[str, ...] | None = None,
                 log_dir: str | None = None, tag: str = "run", engine_env: dict | None = None):
        if device is None:
            import torch
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = device
        offered = (("stock", "ceiling", "vattn", "vattn-exact") if device.startswith("cuda")
                   else ("stock", "vattn"))
        if modes is not None and (not modes or not {_base(m) for m in modes} <= set(offered)):
            raise ConfigError(f"vllm modes must be a non-empty subset of {offered} on {device} "
                              f"(a mode again in a fresh engine as MODE@N, e.g. stock@2; vattn with G layers per "
                              f"VA range as vattn:gG, with prefix staging on / off as vattn:s1 / vattn:s0, with N "
                              f"MiB of packs as vattn:pN, deferred mapping on / off as vattn:d1 / vattn:d0), "
                              f"got {modes}")
        self.modes = tuple(modes) if modes is not None else offered
        self.log_dir, self.tag = log_dir, tag
        self.max_num_seqs = max_num_seqs
        self.timeout_s = timeout_s
        self.engine_args = dict(engine_args or {})
        self.engine_env = {str(k): str(v) for k, v in (engine_env or {}).items()}

    def run(self, mode: str, model_dir: str, prompts: list[list[int]], max_new_tokens: int, *,
            logprobs: int = 5, device: str = "cpu", dtype: str = "float32",
            arrival_times: list[float] | None = None) -> RunResult:
        """Generate greedily in a fresh vLLM process (see :class:`EngineRunner`)."""
        if arrival_times is not None:
            raise UnsupportedError("the vLLM runner submits all prompts at once (offline LLM); "
                                   "arrival_times are not supported")
        spec = self.spec_for(mode, model_dir, prompts, max_new_tokens, logprobs=logprobs,
                             device=device, dtype=dtype)
        return run_worker(WORKER, spec, env=self.env_for(spec), timeout_s=self.timeout_s,
                          what=f"vLLM {spec['mode']}", log=self.log_path(mode))

    def spec_for(self, mode: str, model_dir: str, prompts: list[list[int]], max_new_tokens: int, *,
                 logprobs: int = 5, device: str = "cpu", dtype: str = "float32") -> dict:
        """The worker spec of one run of ``mode`` (what :data:`WORKER` reads)."""
        if mode not in self.modes:
            raise ConfigError(f"vllm mode must be one of {self.modes} on {self.device}, got {mode!r}")
        longest = max(len(p) for p in prompts) + max_new_tokens
        spec = dict(mode=_base(mode), run_name=mode, device=device, model_dir=str(model_dir), dtype=dtype,
                    prompts=prompts, max_new_tokens=max_new_tokens, logprobs=logprobs,
                    max_model_len=_round_up(longest, 256), max_num_seqs=self.max_num_seqs)
        spec.update(self.engine_args)
        if spec.get("sizing") == "defaults":      # the engine sizes itself (see workers.vllm.engine_kwargs)
            spec["max_model_len"] = spec["max_num_seqs"] = None
        return spec

    def env_for(self, spec: dict) -> dict:
        """The environment of the engine process of ``spec`` (the plugin on for vattn modes only)."""
        env = dict(os.environ) | self.engine_env
        env.pop("VATTN_VLLM", None)
        env.pop("VATTN_VLLM_EXACT", None)
        for name in _SWITCH_ENV.values():            # only a mode's variant sets them
            env.pop(name, None)
        run = spec.get("run_name", spec["mode"])
        if env.get("VATTN_STEP_TRACE") or env.get("VATTN_ENGINE_PROFILE"):
            env["VATTN_RUN_NAME"] = run              # names the engine's step trace / loop profile
        for letter, name in {**_SWITCH_ENV, "g": "VATTN_GROUP_SIZE"}.items():
            value = _switch(run, letter)
            if value is not None:
                env[name] = _DRIVER_GIL[value] if letter == "h" else value
        if spec["mode"] in ("vattn", "vattn-exact"):
            env["VATTN_VLLM"] = "1"
            exact = spec["mode"] == "vattn-exact" or _switch(run, "e") == "1"
            env["VATTN_VLLM_EXACT"] = "1" if exact else "0"
        for key, value in (_GPU_ENV if spec["device"].startswith("cuda") else _CPU_ENV).items():
            env.setdefault(key, value)
        return env

    def log_path(self, mode: str) -> str | None:
        if self.log_dir is None:
            return None
        os.makedirs(self.log_dir, exist_ok=True)
        return os.path.join(self.log_dir, f"vllm_{self.tag}_{mode}.log")


def _base(mode: str) -> str:
    """``stock@2`` -> ``stock``: the same mode once more, in a fresh engine (run-to-run check);
    ``vattn:g2`` (or ``vattn:g2@2``) -> ``vattn``: the vattn mode with another layer group size;
    ``vattn:s0`` / ``vattn:s1`` -> ``vattn`` with prefix staging off / on; ``vattn:p1024`` ->
    ``vattn`` with 1,024 MiB for packs; ``vattn:d0`` / ``vattn:d1`` -> ``vattn`` with deferred
    mapping off / on; ``vattn:w0`` -> ``vattn`` without the device-idle events; ``vattn:r0`` /
    ``vattn:r256`` -> ``vattn`` with no / 256 page-sets of free reserve; ``vattn:h1`` -> ``vattn``
    with the driver calls holding the GIL; ``vattn:b1`` -> ``vattn`` with batched copies;
    ``vattn:c128`` -> ``vattn`` with 128 cold slots; ``vattn:e1`` -> ``vattn`` on stock's FA3 kernel
    path (``VATTN_VLLM_EXACT=1``, as ``vattn-exact``; a name the servers accept too) (variants
    combine: ``vattn:g2:s0``)."""
    base, _, again = mode.partition("@")
    if again and not again.isdigit():
        return mode
    name, *variants = base.split(":")
    if variants:
        ok = name in ("vattn", "vattn-exact") and all(_VARIANT.fullmatch(v) for v in variants) \
            and len(set(v[0] for v in variants)) == len(variants)
        return name if ok else mode
    return base


#: variant letter -> the engine variable its digits set (``h``: through :data:`_DRIVER_GIL`);
#: each is removed from the environment a mode inherits. ``g`` (``VATTN_GROUP_SIZE``) is set by its
#: variant too, but an outer value reaches every mode
_SWITCH_ENV = {"s": "VATTN_STAGE_PREFIXES", "p": "VATTN_PACK_MB", "d": "VATTN_DEFER_MAPPING",
               "w": "VATTN_DEVICE_WAIT", "r": "VATTN_FREE_RESERVE", "c": "VATTN_COLD_SLOTS",
               "h": "VATTN_DRIVER_GIL", "b": "VATTN_BATCH_COPIES"}
_DRIVER_GIL = {"0": "release", "1": "hold", "2": "hold-all"}

#: the public name of :func:`_base` (``vattn bench serve`` checks its ``--modes`` with it)
base_mode = _base

_VARIANT = re.compile(r"g[1-9][0-9]*|s[01]|p[0-9]+|d[01]|w[01]|r[0-9]+|h[012]|b[01]|c[0-9]+|e[01]")


def _variants(mode: str) -> list[str]:
    """The ``:`` variants of a valid vattn mode (``[]`` for any other mode)."""
    return mode.partition("@")[0].split(":")[1:] if _base(mode) != mode else []


def _group(mode: str) -> int | None:
    """The layer group size of a ``vattn:gG`` mode, ``None`` for any other mode."""
    return next((int(v[1:]) for v in _variants(mode) if v.startswith("g")), None)


def _pack_mb(mode: str) -> int | None:
    """The pack budget (MiB) of a ``vattn:pN`` mode, ``None`` for any other mode."""
    return next((int(v[1:]) for v in _variants(mode) if v.startswith("p")), None)


def _staging(mode: str) -> str | None:
    """``"0"`` / ``"1"`` for a ``vattn:s0`` / ``vattn:s1`` variant (prefix staging off / on in its
    engine), ``None`` for any other mode (the engine's default)."""
    return _switch(mode, "s")


def _switch(mode: str, letter: str) -> str | None:
    """The digits of a ``vattn:<letter>N`` variant (``"0"`` / ``"1"`` for a switch), ``None`` for
    any other mode (the engine's default)."""
    return next((v[1:] for v in _variants(mode) if v.startswith(letter)), None)


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step
