"""Running the modes of one GPU stage, each in a fresh engine process, within the stage's time."""

from __future__ import annotations

import os
import time

__all__ = ["make_runner", "env_modes", "run_all"]


def make_runner(out: str, tag: str, max_num_seqs: int, modes, **engine_args):
    from vattn.adapters.vllm.conformance import VllmRunner
    if os.environ.get("VATTN_CUDAGRAPH_MODE"):   # e.g. PIECEWISE, to rule out FULL graphs
        engine_args["compilation_config"] = {"cudagraph_mode": os.environ["VATTN_CUDAGRAPH_MODE"]}
    return VllmRunner(device="cuda", max_num_seqs=max_num_seqs, timeout_s=float(os.environ.get(
        "VATTN_RUN_TIMEOUT", 420)), engine_args=engine_args, modes=tuple(modes),
        log_dir=os.path.join(out, "logs"), tag=tag)


def env_modes(env: str, default: str) -> list[str]:
    return os.environ.get(env, default).split()


def _time_left() -> float | None:
    """Seconds to the stage's deadline (``VATTN_STAGE_DEADLINE``, epoch seconds; set by vllm.sh)."""
    deadline = os.environ.get("VATTN_STAGE_DEADLINE")
    return None if not deadline else float(deadline) - time.time()


def run_all(runner, model, prompts, new_tokens, *, logprobs: int) -> tuple[dict, dict]:
    results, errors, base_timeout = {}, {}, runner.timeout_s
    for mode in runner.modes:
        start = time.perf_counter()
        left = _time_left()
        if left is not None:   # a hung mode is killed by us, in time to write the stage's JSON
            runner.timeout_s = min(base_timeout, left - 15)
            if runner.timeout_s < 30:
                errors[mode] = f"skipped: {left:.0f} s left before the stage's deadline"
                print(f"[{runner.tag}] {mode}: SKIPPED (no time left)", flush=True)
                continue
        try:
            results[mode] = runner.run(mode, model, prompts, new_tokens, logprobs=logprobs,
                                       device="cuda", dtype="bfloat16")
        except Exception as exc:  # record and go on: one failing mode must not hide the others
            errors[mode] = f"{type(exc).__name__}: {str(exc)[-3000:]}"
        print(f"[{runner.tag}] {mode}: {'ok' if mode in results else 'FAILED'} "
              f"({time.perf_counter() - start:.0f} s incl. engine start)", flush=True)
        if mode in errors:   # the log's tail, so vllm.sh's summary shows why
            print(errors[mode][-1500:], flush=True)
    return results, errors
