"""What every GPU stage shares: its command line, the JSON it always leaves behind, and the
settings it reads from the environment.

Every mode of a stage runs in a fresh engine process through the engine's conformance runner
(:func:`vattn.conformance.stages.run_modes`: one failing mode is recorded, the others still
run, each capped by the stage's deadline).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

__all__ = ["main", "env_modes", "env_choice", "free_cuda"]


def env_modes(env: str, default: str) -> list[str]:
    """The modes named (space-separated) by environment variable ``env``, else ``default``'s."""
    return os.environ.get(env, default).split()


def env_choice(env: str, choices: tuple[str, ...]) -> str:
    """Environment variable ``env`` (default ``choices[0]``), refused unless one of ``choices``."""
    value = os.environ.get(env, choices[0])
    if value not in choices:
        raise SystemExit(f"{env} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def free_cuda() -> None:
    """Hand the model build's cached blocks back: every engine sizes its KV from free memory."""
    import gc

    import torch
    gc.collect()
    torch.cuda.empty_cache()


def _stop(signum, frame):
    raise SystemExit(128 + signum)


def main(prog: str, stages: dict, argv: list[str] | None = None, *, workloads=(),
         per_workload=(), models: str | None = None) -> int:
    """Run one stage, ``stages[STAGE](args)``, and write its report to ``--out``.

    Parameters
    ----------
    prog
        The command (``python -m vattn.bench.gpu.vllm_stages``).
    stages
        Stage name -> function of the parsed arguments returning the report (a dict with ``ok``).
    workloads
        The ``--workload`` choices (none: no such option).
    per_workload
        Stages whose JSON is named ``<stage>_<workload>.json`` (else ``<stage>.json``).
    models
        Default of ``--models``, where the stage builds its models (``None``: ``<out>/models``).

    The report is written even when the stage fails or is stopped by SIGTERM (``timeout``): then
    ``ok`` is false and ``errors["stage"]`` says why. Returns 0 when the report is ``ok``.
    """
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("stage", choices=sorted(stages))
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", default=models, help="where models are built (default: "
                                                          f"{models or '<out>/models'})")
    if workloads:
        parser.add_argument("--workload", choices=sorted(workloads), default="decode-heavy")
    args = parser.parse_args(argv)
    args.models = args.models or os.path.join(args.out, "models")
    os.makedirs(args.out, exist_ok=True)
    signal.signal(signal.SIGTERM, _stop)   # `timeout` stops us: still kill the engine processes
    start = time.perf_counter()
    try:
        report = stages[args.stage](args)
    except BaseException as exc:   # incl. SystemExit from SIGTERM: still leave a JSON behind
        import traceback
        report = {"ok": False, "errors": {"stage": f"{type(exc).__name__}: {exc}"},
                  "traceback": traceback.format_exc()[-4000:]}
    report["stage_s"] = round(time.perf_counter() - start, 1)
    report["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    name = args.stage + (f"_{args.workload}" if args.stage in per_workload else "")
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(report, f, indent=1, default=repr)
    # short: the GPU scripts' summary keeps this output's last 2500 characters (the JSON has it all)
    print(json.dumps({k: v for k, v in report.items() if k not in ("tokens", "errors", "traceback",
                                                                   "check")}, default=repr)[:1200])
    for name, error in (report.get("errors") or {}).items():
        print(f"--- {name}: {str(error)[-900:]}")
    return 0 if report.get("ok") else 1
