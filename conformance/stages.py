"""Running the modes of one GPU stage within the stage's time (engine-agnostic).

Every mode runs through ``runner.run`` (one fresh engine process each); one failing mode is
recorded and the others still run. ``VATTN_STAGE_DEADLINE`` (epoch seconds, set by
``tools/gpu/engine_lib.sh``) caps each mode's ``runner.timeout_s`` so a hung engine is killed in
time for the stage to write its JSON.
"""

from __future__ import annotations

import os
import statistics
import time

__all__ = ["run_modes", "run_rounds", "rounds_summary"]


def _time_left() -> float | None:
    deadline = os.environ.get("VATTN_STAGE_DEADLINE")
    return None if not deadline else float(deadline) - time.time()


def run_modes(runner, model, prompts, new_tokens, *, logprobs: int) -> tuple[dict, dict]:
    """``({mode: RunResult}, {mode: error text})`` for every mode of ``runner.modes``."""
    results, errors, base_timeout = {}, {}, runner.timeout_s
    tag = getattr(runner, "tag", None) or "stage"
    for mode in runner.modes:
        start = time.perf_counter()
        left = _time_left()
        if left is not None:
            runner.timeout_s = min(base_timeout, left - 15)
            if runner.timeout_s < 30:
                errors[mode] = f"skipped: {left:.0f} s left before the stage's deadline"
                print(f"[{tag}] {mode}: SKIPPED (no time left)", flush=True)
                continue
        try:
            results[mode] = runner.run(mode, model, prompts, new_tokens, logprobs=logprobs,
                                       device="cuda", dtype="bfloat16")
        except Exception as exc:  # record and go on: one failing mode must not hide the others
            errors[mode] = f"{type(exc).__name__}: {_head_and_tail(str(exc))}"
        print(f"[{tag}] {mode}: {'ok' if mode in results else 'FAILED'} "
              f"({time.perf_counter() - start:.0f} s incl. engine start)", flush=True)
        if mode in errors:   # the log's tail, so the stage summary shows why
            print(errors[mode][-1500:], flush=True)
    runner.timeout_s = base_timeout
    return results, errors


def _head_and_tail(text: str, limit: int = 3000) -> str:
    """``text`` cut to about ``limit`` characters keeping its first line (what failed, e.g. "timed
    out after 90 s") and its tail (the root cause, last in engine logs)."""
    if len(text) <= limit:
        return text
    head = text.splitlines()[0][:300]
    return f"{head}\n[...]\n{text[-(limit - len(head)):]}"


def run_rounds(runner, model, prompts, new_tokens, *, rounds: int, logprobs: int = 0
               ) -> tuple[dict, dict]:
    """Every mode ``rounds`` times, alternated (A B, A B, ...: the machine warms up over a
    session, so each mode meets every phase): ``({mode: [RunResult per round]}, {mode: [errors]})``."""
    results, errors = {m: [] for m in runner.modes}, {}
    for r in range(rounds):
        got, errs = run_modes(runner, model, prompts, new_tokens, logprobs=logprobs)
        for mode, res in got.items():
            results[mode].append(res)
        for mode, err in errs.items():
            errors.setdefault(mode, []).append(f"round {r + 1}: {err}")
    return results, errors


def rounds_summary(results: dict, baseline: str) -> dict:
    """Per mode: each round's seconds, their median / min / max, the median ratio to
    ``baseline`` (>1: faster) and each round's own ratio (rounds paired in order)."""
    rows, base = {}, [r.seconds for r in results.get(baseline, [])]
    for mode, runs in results.items():
        secs = [r.seconds for r in runs]
        if not secs:
            continue
        row = {"round_s": secs, "seconds": statistics.median(secs), "min_s": min(secs),
               "max_s": max(secs),
               "generation_s": [r.extra.get("generation_s") for r in runs],
               "generated_tok_s": runs[0].num_generated_tokens / statistics.median(secs)}
        if base:
            row["ratio_vs_" + baseline] = statistics.median(base) / row["seconds"]
            row["round_ratios"] = [b / s for b, s in zip(base, secs)]
        rows[mode] = row
    return rows
