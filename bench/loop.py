"""``vattn bench loop``: two engines' profiled loop windows side by side, per step and function.

A server run with ``VATTN_ENGINE_PROFILE`` (``tools/gpu/serve.sh`` with ``VATTN_LOOP_PROFILE=1``)
leaves, per engine, ``<pid>.prof``, ``<pid>.json`` and ``<pid>.txt``
(:mod:`vattn.core.window_profile`): a ``cProfile`` of the same window of steps of the engine's
loop, labelled with the run's mode, and the unprofiled steps before it. This command finds them
under the results folders, averages the runs of each mode, times the steps before the window by
kind side by side, and lists the functions whose own time per step differs most between the
base mode (``stock``) and each other mode: where a slower engine's steps go. Times are those of
profiled code (every Python call is counted, which slows Python down); compare them with each
other, not with an unprofiled step.
"""

from __future__ import annotations

import json
import pstats
import re
import statistics

from vattn.core.errors import ConfigError

from .report import results_files

__all__ = ["add_arguments", "run", "load_window", "per_step", "compare", "driver_calls"]

#: the driver's calls a step makes, by method (``core/driver``): the VMM calls, then the copies
VMM_CALLS = ("map", "unmap", "set_access")
COPY_CALLS = ("copy_many", "copy", "copy_from_host", "zero")
_DRIVER = re.compile(r"driver/(?:cuda|cuda_direct|host)\.py:\d+\((\w+)\)$")

def add_arguments(parser) -> None:
    parser.add_argument("--results", action="append", required=True,
                        help="a results folder holding the windows' .prof/.json pairs (repeatable)")
    parser.add_argument("--base", default="stock", help="the mode the others are compared with")
    parser.add_argument("--top", type=int, default=25, help="functions listed per mode")


def load_window(prof_path: str) -> dict:
    """One window: its summary (``PATH.json``: label, skip, steps, wall / CPU / gc ms, the
    unprofiled timeline before it) with the profile's ``stats`` (``PATH.prof``)."""
    path = prof_path[:-len(".prof")] + ".json"
    try:
        with open(path) as f:
            window = json.load(f)
        window = {"run": window["label"] or "-", "steps": int(window["steps"]), "skip": int(window["skip"]),
                  "wall_ms": float(window["wall_ms"]), "cpu_ms": window.get("cpu_ms"),
                  "gc": window.get("gc"), "timeline": list(window.get("timeline") or ())}
    except OSError as exc:
        raise ConfigError(f"--results: {prof_path!r} has no readable window summary {path!r} ({exc})") from exc
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"--results: {path!r} is not a loop window summary ({type(exc).__name__})") from exc
    try:
        window["stats"] = pstats.Stats(prof_path).stats
    except Exception as exc:  # noqa: BLE001 - marshal/EOF errors of a truncated or foreign file
        raise ConfigError(f"--results: {prof_path!r} is not a readable profile ({type(exc).__name__})") from exc
    return window


def step_kinds(windows: list[dict]) -> dict:
    """The unprofiled timeline's steps by kind: ``{kind: (steps, mean ms, median ms)}`` for
    ``"decode only"`` (no new request scheduled), ``"with new requests"`` and ``"all"``."""
    rows = [r for w in windows for r in w.get("timeline", ())]
    kinds = {"decode only": [r["ms"] for r in rows if r.get("new") == 0],
             "with new requests": [r["ms"] for r in rows if r.get("new", 0) > 0],
             "all": [r["ms"] for r in rows]}
    return {k: (len(v), statistics.fmean(v), statistics.median(v)) for k, v in kinds.items() if v}


def _extras(windows: list[dict]) -> str:
    """The thread's CPU and the collector's time per step, averaged, where the windows have them."""
    parts = []
    cpu = [w["cpu_ms"] * 1e3 / w["steps"] for w in windows if w.get("cpu_ms") is not None]
    if cpu:
        parts.append(f"thread CPU {sum(cpu) / len(cpu):.0f} µs")
    collected = [w for w in windows if w.get("gc")]
    if collected:
        steps = sum(w["steps"] for w in collected)
        gen2 = sum(w["gc"]["collections"][2] for w in collected)
        parts.append(f"gc {1e3 * sum(w['gc']['ms'] for w in collected) / steps:.1f} µs ({gen2} full collections)")
    return ", ".join(parts) or "no CPU / gc lines"


def _name(key) -> str:
    path, line, func = key
    if path == "~":
        return func                                   # a builtin: "<method 'x' of 'y' objects>"
    parts = path.replace("\\", "/").split("/")
    return f"{'/'.join(parts[-2:])}:{line}({func})"


def per_step(windows: list[dict]) -> dict:
    """``{function: (own µs, cumulative µs, calls)}`` per step, averaged over ``windows`` (the
    runs of one mode), plus ``"__step__": (profiled wall µs per step, 0, 1)``."""
    total: dict[str, list[float]] = {}
    for w in windows:
        for key, (_cc, calls, own, cum, _callers) in w["stats"].items():
            acc = total.setdefault(_name(key), [0.0, 0.0, 0.0])
            acc[0] += own * 1e6 / w["steps"]
            acc[1] += cum * 1e6 / w["steps"]
            acc[2] += calls / w["steps"]
    n = len(windows)
    out = {name: (own / n, cum / n, calls / n) for name, (own, cum, calls) in total.items()}
    out["__step__"] = (sum(w["wall_ms"] * 1e3 / w["steps"] for w in windows) / n, 0.0, 1.0)
    return out


def compare(base: dict, other: dict, top: int) -> list[tuple]:
    """Rows ``(function, base own µs, other own µs, difference, base calls, other calls)`` of the
    ``top`` functions whose own time per step differs most."""
    names = (set(base) | set(other)) - {"__step__"}
    rows = []
    for name in names:
        b, o = base.get(name, (0.0, 0.0, 0.0)), other.get(name, (0.0, 0.0, 0.0))
        rows.append((name, b[0], o[0], o[0] - b[0], b[2], o[2]))
    rows.sort(key=lambda r: -abs(r[3]))
    return rows[:top]


def driver_calls(steps: dict) -> dict:
    """``{method: (calls, µs)}`` per step of the driver's VMM calls and copies in a mode's
    :func:`per_step` table (the time of each call, which ``cProfile`` barely inflates: one C call
    each); methods the windows never called are left out."""
    out: dict[str, list[float]] = {}
    for name, (_own, cum, calls) in steps.items():
        m = _DRIVER.search(name)
        if m and m.group(1) in VMM_CALLS + COPY_CALLS:
            acc = out.setdefault(m.group(1), [0.0, 0.0])
            acc[0] += calls
            acc[1] += cum
    return {k: tuple(out[k]) for k in VMM_CALLS + COPY_CALLS if k in out}


def _driver_table(mode: str, calls: dict, step_ms: float, *, unprofiled: bool) -> None:
    """The table of :func:`driver_calls`, each call's share of a step of ``step_ms``: the mean
    unprofiled step where the windows timed one, else the profiled step."""
    if not calls or step_ms <= 0:
        return
    where = f"the mean {'unprofiled' if unprofiled else 'profiled'} step ({step_ms:.2f} ms)"
    print(f"| {mode}'s driver call | calls/step | µs/call | µs/step | share of {where} |")
    print("|---|---|---|---|---|")
    for kinds, label in ((VMM_CALLS, "VMM calls"), (COPY_CALLS, "copies")):
        rows = [(k, *calls[k]) for k in kinds if k in calls]
        for k, n, us in rows:
            print(f"| `{k}` | {n:.2f} | {us / n if n else 0:.1f} | {us:.1f} | {100 * us / (step_ms * 1e3):.1f} % |")
        if rows:
            n, us = sum(r[1] for r in rows), sum(r[2] for r in rows)
            print(f"| **{label}** | {n:.2f} | | {us:.1f} | **{100 * us / (step_ms * 1e3):.1f} %** |")
    print()


def run(args) -> int:
    paths = results_files(args.results, "*.prof", "profiled loop window (*.prof)")
    by_run: dict[str, list[dict]] = {}
    for path in paths:
        window = load_window(path)
        by_run.setdefault(window["run"], []).append(window)
    if args.base not in by_run:
        raise ConfigError(f"--base {args.base!r}: no window of that mode; found {', '.join(sorted(by_run))}")
    base = per_step(by_run[args.base])
    for mode in sorted(set(by_run) - {args.base}):
        other = per_step(by_run[mode])
        b, o = base["__step__"][0], other["__step__"][0]
        print(f"## {mode} vs {args.base}: {o:.0f} vs {b:.0f} µs a profiled step ({o / b:.3f}×; "
              f"{len(by_run[mode])} / {len(by_run[args.base])} windows)\n")
        print(f"- per step, {mode}: {_extras(by_run[mode])}; {args.base}: {_extras(by_run[args.base])}\n")
        kinds_b, kinds_o = step_kinds(by_run[args.base]), step_kinds(by_run[mode])
        if kinds_b and kinds_o:
            print(f"| steps before the window, unprofiled | {args.base}: steps, mean / p50 ms | "
                  f"{mode}: steps, mean / p50 ms | mean {mode} / {args.base} |")
            print("|---|---|---|---|")
            for kind in ("decode only", "with new requests", "all"):
                if kind in kinds_b and kind in kinds_o:
                    (nb, mb, pb), (no, mo, po) = kinds_b[kind], kinds_o[kind]
                    print(f"| {kind} | {nb}, {mb:.2f} / {pb:.2f} | {no}, {mo:.2f} / {po:.2f} | {mo / mb:.3f} |")
            print()
        all_o = kinds_o.get("all")
        _driver_table(mode, driver_calls(other), all_o[1] if all_o else o / 1e3, unprofiled=bool(all_o))
        print(f"| function | {args.base} own µs/step | {mode} own µs/step | difference | "
              f"calls/step {args.base} | calls/step {mode} |")
        print("|---|---|---|---|---|---|")
        for name, bu, ou, d, bc, oc in compare(base, other, args.top):
            print(f"| `{name}` | {bu:.1f} | {ou:.1f} | {d:+.1f} | {bc:.1f} | {oc:.1f} |")
        print()
    return 0
