"""Running every mode of a runner, one engine run each, alternated over rounds (engine-agnostic).

One definition for ``vattn conformance`` (an engine's failure raises) and the GPU stages of
:mod:`vattn.bench.gpu` (a failing mode is recorded and the others still run).
``VATTN_STAGE_DEADLINE`` (epoch seconds, set by ``tools/gpu/engine_lib.sh``) caps each mode's
``runner.timeout_s`` so a hung engine is killed in time for the stage to write its JSON.
"""

from __future__ import annotations

import os
import statistics
import time

__all__ = ["run_modes", "run_rounds", "rounds_summary", "fastest"]


def _time_left() -> float | None:
    deadline = os.environ.get("VATTN_STAGE_DEADLINE")
    return None if not deadline else float(deadline) - time.time()


def _print_run(tag: str, mode: str, result, error: str | None, seconds: float | None) -> None:
    """The default ``on_run``: one status line per run, a failure's tail after it."""
    if seconds is None:
        print(f"[{tag}] {mode}: SKIPPED (no time left)", flush=True)
        return
    print(f"[{tag}] {mode}: {'FAILED' if error else 'ok'} ({seconds:.0f} s incl. engine start)",
          flush=True)
    if error:   # the log's tail, so the stage summary shows why
        print(error[-1500:], flush=True)


def run_modes(runner, model, prompts, new_tokens, *, logprobs: int, device: str = "cuda",
              dtype: str = "bfloat16", arrival_times: list[float] | None = None,
              record_errors: bool = True, on_run=None) -> tuple[dict, dict]:
    """Every mode of ``runner.modes`` once: ``({mode: RunResult}, {mode: error text})``.

    Parameters
    ----------
    record_errors
        ``True``: a failing run is recorded (its first line and its tail) and the next mode
        runs; ``False``: its exception propagates.
    on_run
        ``on_run(mode, result, error, seconds)`` after each run (``result`` ``None`` when it
        failed; ``seconds`` ``None`` when it was skipped for the deadline); default: a status
        line on stdout tagged with ``runner.tag``.
    """
    tag = getattr(runner, "tag", None) or "stage"
    on_run = on_run or (lambda *a: _print_run(tag, *a))
    extra = {} if arrival_times is None else {"arrival_times": arrival_times}
    results, errors, base_timeout = {}, {}, getattr(runner, "timeout_s", None)
    try:
        for mode in runner.modes:
            start, left = time.perf_counter(), _time_left()
            if left is not None and base_timeout is not None:
                runner.timeout_s = min(base_timeout, left - 15)
                if runner.timeout_s < 30:
                    errors[mode] = f"skipped: {left:.0f} s left before the stage's deadline"
                    on_run(mode, None, errors[mode], None)
                    continue
            try:
                results[mode] = runner.run(mode, model, prompts, new_tokens, logprobs=logprobs,
                                           device=device, dtype=dtype, **extra)
            except Exception as exc:  # record and go on: one failing mode must not hide the others
                if not record_errors:
                    raise
                errors[mode] = f"{type(exc).__name__}: {_head_and_tail(str(exc))}"
            on_run(mode, results.get(mode), errors.get(mode), time.perf_counter() - start)
    finally:
        if base_timeout is not None:
            runner.timeout_s = base_timeout
    return results, errors


def _head_and_tail(text: str, limit: int = 3000) -> str:
    """``text`` cut to about ``limit`` characters keeping its first line (what failed, e.g. "timed
    out after 90 s") and its tail (the root cause, last in engine logs)."""
    if len(text) <= limit:
        return text
    head = text.splitlines()[0][:300]
    return f"{head}\n[...]\n{text[-(limit - len(head)):]}"


def run_rounds(runner, model, prompts, new_tokens, *, rounds: int, logprobs: int = 0,
               **options) -> tuple[dict, dict]:
    """Every mode ``rounds`` times, alternated (A B, A B, ...: the machine warms up over a
    session, so each mode meets every phase): ``({mode: [RunResult per round]}, {mode: [errors]})``.
    ``options`` go to :func:`run_modes`."""
    results, errors = {m: [] for m in runner.modes}, {}
    for r in range(rounds):
        got, errs = run_modes(runner, model, prompts, new_tokens, logprobs=logprobs, **options)
        for mode, res in got.items():
            results[mode].append(res)
        for mode, err in errs.items():
            errors.setdefault(mode, []).append(f"round {r + 1}: {err}")
    return results, errors


def fastest(results: dict) -> dict:
    """``{mode: [RunResult per round]}`` -> each mode's fastest run."""
    return {mode: min(runs, key=lambda r: r.seconds) for mode, runs in results.items() if runs}


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
