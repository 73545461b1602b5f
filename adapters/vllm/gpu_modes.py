"""Running the modes of one GPU stage, each in a fresh engine process, within the stage's time."""

from __future__ import annotations

import os

from vattn.conformance.stages import run_modes as run_all

__all__ = ["make_runner", "env_modes", "run_all"]


def make_runner(out: str, tag: str, max_num_seqs: int, modes, *, engine_env=None, **engine_args):
    from vattn.adapters.vllm.conformance import VllmRunner
    if os.environ.get("VATTN_CUDAGRAPH_MODE"):   # e.g. PIECEWISE, to rule out FULL graphs
        engine_args["compilation_config"] = {"cudagraph_mode": os.environ["VATTN_CUDAGRAPH_MODE"]}
    return VllmRunner(device="cuda", max_num_seqs=max_num_seqs, timeout_s=float(os.environ.get(
        "VATTN_RUN_TIMEOUT", 420)), engine_args=engine_args, modes=tuple(modes),
        log_dir=os.path.join(out, "logs"), tag=tag, engine_env=engine_env)


def env_modes(env: str, default: str) -> list[str]:
    return os.environ.get(env, default).split()
