"""Throughput: tokens/s of every mode of a runner on one workload and its ratio to the baseline
(the runs themselves: :func:`vattn.conformance.stages.run_rounds`)."""

from __future__ import annotations

from .protocol import RunResult

__all__ = ["summarize"]


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
