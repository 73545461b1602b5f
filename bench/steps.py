"""``vattn bench steps``: a run's step traces (``VATTN_STEP_TRACE``) as a timeline per generation.

Each vattn engine of a GPU stage run with ``VATTN_TRACE_STEPS=1`` leaves ``steps/<pid>.json``
(:mod:`vattn.core.step_trace`): per engine step, when vattn's host section ran, how long the
device sat idle behind it, the requests it bound and the driver calls made in it; calls made
between two sections are the map-ahead worker's. With the stage's results folder the traces
are named by mode (the engine log names the pid) and cut into the generations the stage timed
(``wall_each``). Prints, per mode and generation, the totals and the steps that cost most,
and with ``VATTN_STEP_PROFILE=1`` the functions the sections spent their time in; ``--plot``
draws host and idle ms per step. With the engine core in the worker's process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) the stage also records when each step was scheduled, for
every mode (stock too): the time from one step's scheduling to the next's.
"""

from __future__ import annotations

import glob
import json
import os
import re

from vattn.core.errors import ConfigError

from .report import upper_quantile

__all__ = ["add_arguments", "run", "load_trace", "generations", "summarize", "schedule_gaps"]


def add_arguments(parser) -> None:
    parser.add_argument("--results", required=True,
                        help="a GPU stage's results folder (holding steps/ and logs/)")
    parser.add_argument("--top", type=int, default=8, help="steps listed per generation (most idle first)")
    parser.add_argument("--plot", default=None, help="write a PNG of host and idle ms per step here")


def load_trace(path: str) -> dict:
    """One trace file as a dict, its rows with the counter deltas of the section (``calls``) and
    of the worker since the previous section (``worker``), keyed by counter name."""
    try:
        with open(path) as f:
            trace = json.load(f)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--results: expected a step trace (JSON) in {path!r}, got invalid JSON ({exc})") from exc
    if not isinstance(trace, dict) or not isinstance(trace.get("rows"), list) or "counters" not in trace:
        raise ConfigError(f"--results: expected a step trace object with rows and counters in {path!r}")
    names, last = trace["counters"], None
    for row in trace["rows"]:
        row["calls"] = dict(zip(names, (b - a for a, b in zip(row["c0"], row["c1"]))))
        row["worker"] = dict(zip(names, (a - b for a, b in zip(row["c0"], last or row["c0"]))))
        last = row["c1"]
    return trace


def _modes_by_pid(results: str) -> dict[int, str]:
    """``{engine pid: mode}`` from vLLM's engine logs (``vllm_<workload>_<mode>.log``; SGLang's
    traces carry their mode in the header)."""
    found = {}
    for log in glob.glob(os.path.join(results, "logs", "*.log")):
        mode = os.path.basename(log)[:-4].split("_", 2)[-1]
        with open(log, errors="replace") as f:
            for line in f:
                m = re.search(r"\(EngineCore pid=(\d+)\)", line)
                if m:
                    found[int(m.group(1))] = mode
                    break
    return found


def _rows(results: str) -> dict[str, dict]:
    """``{mode: row}`` of the throughput stages' JSONs in ``results`` (vLLM's
    ``throughput_*.json`` rows, SGLang's ``<stage>.json`` modes)."""
    out = {}
    for path in glob.glob(os.path.join(results, "*.json")):
        with open(path) as f:
            try:
                stage = json.load(f)
            except json.JSONDecodeError:
                continue
        if isinstance(stage, dict):
            found = stage.get("rows") if os.path.basename(path).startswith("throughput_") else stage.get("modes")
            out |= found if isinstance(found, dict) else {}
    return out


def _walls(results: str) -> dict[str, list]:
    """``{mode: [[start, end], ...]}`` of the generations the throughput stages timed."""
    return {mode: row["wall_each"] for mode, row in _rows(results).items() if row.get("wall_each")}


def schedule_gaps(walls: list, generations: list) -> list[list[float]]:
    """Per timed generation, the ms from each engine step's scheduling to the next one's (the
    engine core's ``schedule`` calls, recorded when it runs in the worker's process)."""
    out = []
    for start, end in generations:
        inside = [t for t in walls if start <= t <= end]
        out.append([round((b - a) * 1e3, 1) for a, b in zip(inside, inside[1:])])
    return out


def _schedule_report(results: str, top: int) -> str:
    lines = []
    for mode, row in sorted(_rows(results).items()):
        if not row.get("schedule_walls") or not row.get("wall_each"):
            continue
        for i, gaps in enumerate(schedule_gaps(row["schedule_walls"], row["wall_each"])):
            long = sorted(gaps, reverse=True)[:top]
            lines.append(f"- {mode}, gen {i + 1}: {len(gaps) + 1} steps scheduled; ms between the first "
                         f"{min(len(gaps), 6)}: {gaps[:6]}; longest: {long}")
    return ("## when the engine core scheduled each step\n" + "\n".join(lines)) if lines else ""


def generations(trace: dict, walls: list | None) -> list[tuple[str, list[dict]]]:
    """The rows cut into ``("before", rows)`` and one ``("gen N", rows)`` per timed generation
    (rows outside every window go to the nearest earlier part); all rows as one part without
    ``walls``."""
    rows = trace["rows"]
    if not walls:
        return [("all", rows)]
    wall0 = trace["header"].get("wall0", 0.0)
    parts = [("before", [])] + [(f"gen {i + 1}", []) for i in range(len(walls))]
    for row in rows:
        at = wall0 + row["t0"]
        k = sum(1 for start, _ in walls if at >= start)
        parts[k][1].append(row)
    return parts


def summarize(rows: list[dict]) -> dict:
    """Totals of a part: steps, host ms, device idle ms, requests bound, driver calls in the
    sections and by the worker between them."""
    host = sum(r["t1"] - r["t0"] for r in rows) * 1e3
    cpu = sum(r.get("cpu_ms", 0.0) for r in rows)     # (traces before 2026-12-07 have none)
    idle = sum(r["idle_us"] or 0.0 for r in rows) / 1e3
    calls = {k: sum(r["calls"].get(k, 0) for r in rows) for k in ("map_calls", "unmap_calls", "set_access_calls")}
    worker = {k: sum(r["worker"].get(k, 0) for r in rows) for k in ("map_calls", "unmap_calls", "issued_us")}
    span = (rows[-1]["t1"] - rows[0]["t0"]) * 1e3 if rows else 0.0
    per_step = [(r["t1"] - r["t0"]) * 1e6 for r in rows]
    # a step whose section spent >= 1 ms off its thread's CPU waited (the GIL, a driver sleep)
    waited = [r for r in rows if "cpu_ms" in r and (r["t1"] - r["t0"]) * 1e3 - r["cpu_ms"] >= 1.0]
    return {"steps": len(rows), "span_ms": round(span, 1), "host_ms": round(host, 1), "cpu_ms": round(cpu, 1),
            "host_p50_us": round(upper_quantile(per_step, 0.5), 1),
            "host_p99_us": round(upper_quantile(per_step, 0.99), 1),
            "waited_steps": len(waited),
            "waited_ms": round(sum((r["t1"] - r["t0"]) * 1e3 - r["cpu_ms"] for r in waited), 1),
            "idle_ms": round(idle, 1),
            "binds": sum(r.get("binds", 0) for r in rows), "calls": calls, "worker_calls": worker,
            # sections that began while the device still ran earlier work (None: not recorded): a
            # host-bound engine finds it idle at almost every step
            "busy_starts": sum(1 for r in rows if r.get("busy")),
            "busy_known": sum(1 for r in rows if r.get("busy") is not None),
            "period_ms": step_periods(rows),
            "deferred": sum(r["calls"].get("calls_deferred", 0) for r in rows)}


#: a longer time from one section to the next is the engine idle (no request), not a step
IDLE_MS = 1000.0


def step_periods(rows: list[dict]) -> dict:
    """Mean ms from one section's start to the next's, for the steps whose section bound requests
    (the step that admits a request, and its first growth) and for those that bound none:
    ``{"binding": (steps, mean ms), "none": (steps, mean ms)}`` (a kind with no step is left out).
    On a host-bound engine the period is the step's whole cost, wherever it went. A period over
    :data:`IDLE_MS` is the engine waiting for requests, not a step, and is left out."""
    kinds: dict[str, list[float]] = {"binding": [], "none": []}
    for a, b in zip(rows, rows[1:]):
        ms = (b["t0"] - a["t0"]) * 1e3
        if ms <= IDLE_MS:
            kinds["binding" if a.get("binds", 0) else "none"].append(ms)
    return {k: (len(v), round(sum(v) / len(v), 3)) for k, v in kinds.items() if v}


def _report(mode: str, trace: dict, walls, top: int) -> str:
    lines = [f"## {mode} (pid {trace['pid']}): {trace['header'].get('cache', '')}"]
    for name, rows in generations(trace, walls):
        s = summarize(rows)
        lines.append(f"- {name}: {s['steps']} steps over {s['span_ms']:.0f} ms; host {s['host_ms']:.1f} ms "
                     f"(its thread's CPU {s['cpu_ms']:.1f} ms), "
                     f"device idle behind it {s['idle_ms']:.1f} ms; {s['binds']} requests bound; in the "
                     f"sections map {s['calls']['map_calls']} / unmap {s['calls']['unmap_calls']} / access "
                     f"{s['calls']['set_access_calls']}; worker map {s['worker_calls']['map_calls']} / "
                     f"unmap {s['worker_calls']['unmap_calls']}"
                     + (f"; {s['deferred']} of the sections' calls deferred, made in the forward over "
                        f"{s['worker_calls']['issued_us'] / 1e3:.1f} ms" if s["deferred"] else "")
                     + f"; per step host p50 {s['host_p50_us']:.0f} µs / p99 {s['host_p99_us']:.0f} µs, "
                       f"{s['waited_steps']} steps off the CPU ≥ 1 ms ({s['waited_ms']:.1f} ms)"
                     + (f"; {s['busy_starts']} of {s['busy_known']} sections began with the device "
                        f"still busy" if s["busy_known"] else "")
                     + "".join(f"; steps that bound {'requests' if k == 'binding' else 'none'}: {n}, "
                               f"{ms:.2f} ms from one section to the next" for k, (n, ms) in s["period_ms"].items()))
        if name == "before":
            continue
        worst = sorted(rows, key=lambda r: -(r["idle_us"] or 0.0))[:top]
        for r in sorted(worst, key=lambda r: r["t0"]):
            gap = r["t0"] - rows[0]["t0"]
            busy = {True: "device busy at start", False: "device idle at start"}.get(r.get("busy"), "")
            lines.append(f"  - +{gap * 1e3:7.1f} ms: {busy}, host {(r['t1'] - r['t0']) * 1e3:6.1f} ms "
                         f"(CPU {r.get('cpu_ms', 0.0):6.1f}), idle "
                         f"{(r['idle_us'] or 0) / 1e3:6.1f} ms, binds {r.get('binds', 0)}, steps {r.get('steps', 0)}, "
                         f"map {r['calls']['map_calls']}, unmap {r['calls']['unmap_calls']}, worker map "
                         f"{r['worker']['map_calls']} since the last")
    return "\n".join(lines)


def _profile(path: str, top: int) -> str:
    """The functions the traced sections spent most time in (``VATTN_STEP_PROFILE=1``)."""
    import io
    import pstats
    out = io.StringIO()
    stats = pstats.Stats(path, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    body = out.getvalue()
    return "```\n" + body[body.find("ncalls") if "ncalls" in body else 0:].rstrip() + "\n```"


def _plot(traces: list[tuple[str, dict, list | None]], path: str) -> None:
    """One timeline per mode and generation: each step's start, vattn's host sections of 1 ms or
    more and the device idle time behind them (drawn at the section's end, where the device
    waited)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    gens = [(mode, name, rows) for mode, trace, walls in traces
            for name, rows in generations(trace, walls) if name != "before" and rows]
    fig, axes = plt.subplots(len(gens), 1, figsize=(10, 1.9 * len(gens)), squeeze=False)
    for ax, (mode, name, rows) in zip(axes[:, 0], gens):
        t0 = rows[0]["t0"]
        span = max((rows[-1]["t1"] - t0) * 1e3, 1.0)
        least = span / 1500                            # a drawn section stays visible
        host = [((r["t0"] - t0) * 1e3, max((r["t1"] - r["t0"]) * 1e3, least)) for r in rows
                if r["t1"] - r["t0"] >= 1e-3]          # sections under 1 ms are not drawn
        idle = [((r["t1"] - t0) * 1e3 - r["idle_us"] / 1e3, max(r["idle_us"] / 1e3, least))
                for r in rows if (r["idle_us"] or 0) >= 1e3]
        ax.broken_barh(host, (2, 0.8), color="tab:blue")
        ax.broken_barh(idle, (1, 0.8), color="tab:red")
        ax.vlines([(r["t0"] - t0) * 1e3 for r in rows], 0.1, 0.8, color="0.4", linewidth=0.5)
        ax.set_yticks([0.45, 1.4, 2.4], ["engine steps", "device idle", "vattn host"], fontsize=8)
        ax.set_ylim(0, 3)
        total = sum(r["idle_us"] or 0 for r in rows) / 1e3
        ax.set_title(f"{mode}, {name}: {len(rows)} steps, device idle behind vattn {total:.0f} ms", fontsize=9)
    axes[-1, 0].set_xlabel("ms since the generation's first step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args) -> int:
    if not os.path.isdir(args.results):
        raise ConfigError(f"--results: expected a GPU stage's results folder, got {args.results!r}")
    files = sorted(glob.glob(os.path.join(args.results, "steps", "*.json")))
    schedules = _schedule_report(args.results, args.top)
    if not files and not schedules:
        raise ConfigError(f"--results: no step traces in {os.path.join(args.results, 'steps')!r} and no "
                          f"schedule times; run the stage with VATTN_TRACE_STEPS=1 (and the engine core "
                          f"in-process, VLLM_ENABLE_V1_MULTIPROCESSING=0, for the schedule times)")
    if schedules:
        print(schedules)
    pids, walls = _modes_by_pid(args.results), _walls(args.results)
    traces = []
    for path in files:
        trace = load_trace(path)
        mode = trace["header"].get("run") or pids.get(trace["pid"], f"pid {trace['pid']}")
        traces.append((mode, trace, walls.get(mode)))
        print(_report(mode, trace, walls.get(mode), args.top))
        if os.path.exists(f"{path}.prof"):
            print(_profile(f"{path}.prof", args.top * 3))
    if args.plot:
        _plot(traces, args.plot)
        print(f"plot: {args.plot}")
    return 0
