"""``vattn conformance --engine sglang``: SGLang stock (``fa3``) vs vattn through ``sglang.Engine``.

Each run is one engine in its own process (:mod:`vattn.conformance.workers.sglang`): SGLang
resolves its platform at import, so the vattn run is started with ``VATTN_SGLANG=1`` (the vattn
platform builds vattn's KV pool and allocator, ``--attention-backend vattn`` reads them) and the
stock run without it.

GPU only. On the CPU it raises :class:`UnsupportedError` (:data:`WHY_CPU`): SGLang 0.5.17 runs
an engine on the CPU only with ``SGLANG_USE_CPU_ENGINE=1``, which makes its modules import
``sgl_kernel``'s CPU ops at import time (e.g. ``mem_cache.allocation`` imports
``assign_req_to_token_pool_cpu``); that CPU build is not on PyPI (the ``sglang-kernel`` wheel
there is the CUDA build). The pool, allocator, platform and backend are checked on the CPU
through SGLang's own classes instead (``tests/adapters/sglang``).
"""

from __future__ import annotations

import os
import tempfile

from vattn.adapters.sglang.version import check_version
from vattn.conformance.protocol import RunResult
from vattn.conformance.workers.sglang import MODES
from vattn.core.errors import UnsupportedError

from .process import run_worker

__all__ = ["SglangRunner", "WHY_CPU", "WORKER"]

#: the worker every run's engine process runs
WORKER = "vattn.conformance.workers.sglang"

WHY_CPU = ("the SGLang end-to-end runner needs a CUDA GPU: SGLang 0.5.17's CPU engine "
           "(SGLANG_USE_CPU_ENGINE=1) imports sgl_kernel's CPU build, which is not on PyPI. "
           "Module-level identity vs torch_native on the CPU: pytest tests/adapters/sglang")


class SglangRunner:
    """SGLang ``fa3`` (stock) vs ``--attention-backend vattn``, one engine process per run.

    Parameters
    ----------
    modes : tuple of str
        Subset of :data:`~vattn.conformance.workers.sglang.MODES` (``vattn-nostage``,
        ``vattn-packs`` and ``vattn-defer``: prefix staging off); the first is the baseline.
    engine_args : dict, optional
        Extra ``sglang.Engine`` keyword arguments for every mode (e.g. ``load_format="dummy"``,
        ``max_running_requests``, ``context_length``, ``mem_fraction_static``).
    timeout_s : float
        Wall limit of one run (engine start included).
    log_dir : str, optional
        Where each run's stdout/stderr go (default: a temporary folder).
    generations : int
        Timed generations per engine (the result's ``seconds`` is the best; each is in
        ``extra["generation_s"]``).
    """

    name = "sglang"

    def __init__(self, *, modes=("stock", "vattn"), engine_args=None, timeout_s: float = 420,
                 log_dir: str | None = None, generations: int = 1):
        bad = [m for m in modes if m not in MODES]
        if bad or not modes:
            raise UnsupportedError(f"sglang runner modes must be among {MODES}, got {modes!r}")
        self.modes = tuple(modes)
        self.engine_args = dict(engine_args or {})
        self.timeout_s = float(timeout_s)
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="vattn-sglang-")
        self.generations = int(generations)
        self._runs = 0   # numbers the log files: one per run, never overwritten

    def run(self, mode, model_dir, prompts, max_new_tokens, *, logprobs=5, device="cpu",
            dtype="bfloat16", arrival_times=None) -> RunResult:
        """Generate ``prompts`` greedily in a fresh engine process of ``mode``.

        Raises
        ------
        UnsupportedError
            Not on CUDA (see :data:`WHY_CPU`), an unknown mode, or ``arrival_times`` given.
        VattnError
            The engine process failed or timed out (its log path is in the message).
        """
        check_version()
        if mode not in self.modes:
            raise UnsupportedError(f"sglang runner mode must be one of {self.modes}, got {mode!r}")
        import torch
        if not str(device).startswith("cuda") or not torch.cuda.is_available():
            raise UnsupportedError(WHY_CPU)
        if arrival_times is not None:
            raise UnsupportedError("the sglang runner submits all prompts at once (no arrivals)")
        return self._launch(mode, self.spec_for(mode, model_dir, prompts, max_new_tokens,
                                                logprobs=logprobs, dtype=dtype))

    def spec_for(self, mode: str, model_dir: str, prompts: list[list[int]], max_new_tokens: int, *,
                 logprobs: int = 5, dtype: str = "bfloat16") -> dict:
        """The worker spec of one run of ``mode`` (what :data:`WORKER` reads; its
        ``engine_kwargs`` turn it into ``sglang.Engine`` arguments)."""
        return dict(mode=mode, model_path=model_dir, prompts=prompts, logprobs=logprobs,
                    max_new_tokens=max_new_tokens, generations=self.generations,
                    engine_args=dict(self.engine_args, dtype=dtype))

    @staticmethod
    def env_for(mode: str) -> dict:
        """The environment of ``mode``'s engine process: this one's, SGLang's FA3 kernel chosen,
        ``VATTN_SGLANG=1`` (the vattn platform) for the vattn modes only, prefix staging off for
        ``vattn-nostage``, ``vattn-packs`` and ``vattn-defer``, 1 GiB of packs for the last two,
        deferred mapping for ``vattn-defer``."""
        env = dict(os.environ, SGLANG_USE_SGL_FA3_KERNEL="1")
        for name in ("VATTN_SGLANG", "VATTN_STAGE_PREFIXES", "VATTN_PACK_MB", "VATTN_DEFER_MAPPING"):
            env.pop(name, None)
        if mode.startswith("vattn"):
            env["VATTN_SGLANG"] = "1"
        if env.get("VATTN_STEP_TRACE"):
            env["VATTN_RUN_NAME"] = mode                 # names the scheduler's step trace
        if mode in ("vattn-nostage", "vattn-packs", "vattn-defer"):
            env["VATTN_STAGE_PREFIXES"] = "0"
        if mode in ("vattn-packs", "vattn-defer"):
            env["VATTN_PACK_MB"] = "1024"
        if mode == "vattn-defer":
            env["VATTN_DEFER_MAPPING"] = "1"
        return env

    def _launch(self, mode: str, spec: dict) -> RunResult:
        os.makedirs(self.log_dir, exist_ok=True)
        self._runs += 1
        log = os.path.join(self.log_dir, f"{mode}-{os.getpid()}-{self._runs}.log")
        return run_worker(WORKER, spec, env=self.env_for(mode), timeout_s=self.timeout_s,
                          what=f"sglang {mode}", log=log)
