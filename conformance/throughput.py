"""Throughput: every mode of a runner on one workload, in one process, ratio vs the baseline."""

from __future__ import annotations

from .protocol import EngineRunner, RunResult
from .workloads import Workload

__all__ = ["run_modes", "summarize"]


def run_modes(runner: EngineRunner, workload: Workload, model_dir: str, *, device: str, dtype: str,
              logprobs: int = 0, repeats: int = 1, progress=None) -> dict[str, RunResult]:
    """Run ``workload`` on every mode of ``runner``; keep the fastest of ``repeats`` runs.

    Modes alternate within each repeat (stock, vattn, stock, vattn, ...) so drift hits both.
    ``progress`` is an optional tqdm bar advanced once per run (a line is written per run).
    """
    best: dict[str, RunResult] = {}
    for _ in range(repeats):
        for mode in runner.modes:
            result = runner.run(mode, model_dir, workload.prompts, workload.max_new_tokens,
                                logprobs=logprobs, device=device, dtype=dtype,
                                arrival_times=workload.arrival_times)
            if mode not in best or result.seconds < best[mode].seconds:
                best[mode] = result
            if progress is not None:
                if hasattr(progress, "write"):
                    progress.write(f"[conformance] {workload.name} {mode}: {result.seconds:.2f} s, "
                                   f"{result.num_generated_tokens} generated tokens")
                progress.update(1)
    return best


def summarize(results: dict[str, RunResult], baseline: str) -> dict:
    """Tokens/s per mode and the ratio of each mode to ``baseline`` (>1 = faster than baseline)."""
    rows = {}
    base = results[baseline]
    for mode, r in results.items():
        total = r.num_prompt_tokens + r.num_generated_tokens
        rows[mode] = {
            "seconds": round(r.seconds, 4),
            "generated_tok_s": round(r.num_generated_tokens / r.seconds, 2) if r.seconds else None,
            "total_tok_s": round(total / r.seconds, 2) if r.seconds else None,
            "ratio": round(base.seconds / r.seconds, 4) if r.seconds else None,
            "num_prompt_tokens": r.num_prompt_tokens,
            "num_generated_tokens": r.num_generated_tokens,
        }
    return rows
