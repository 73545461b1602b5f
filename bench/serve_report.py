"""Rows of ``vattn bench serve`` -> per-mode medians and spreads, vattn/stock per round, a plot.

A row is one run (one fresh server + one client run): ``mode``, ``round`` and the metrics of
:data:`vattn.bench.serve_clients.METRICS`, or ``error`` for a run that failed. Rounds alternate
the modes (stock, vattn, stock, vattn, ...), so the runs of one round ran next to each other.
Every mode other than ``stock`` (``vattn`` or a vattn variant such as ``vattn:h1``) gets its own
column and its ratio to stock of the same round.
"""

from __future__ import annotations

import os
import statistics

from .engine_profile import FAMILIES as PROFILE_FAMILIES
from .serve_clients import METRICS

__all__ = ["TABLE_METRICS", "LOWER_IS_BETTER", "modes_in", "summarize", "round_ratios", "title_for", "markdown", "plot"]

#: (key, label) of the table's rows, in order
TABLE_METRICS = (
    ("request_throughput", "requests/s"), ("output_throughput", "output tok/s"),
    ("ttft_mean_ms", "TTFT mean (ms)"), ("ttft_p50_ms", "TTFT p50 (ms)"), ("ttft_p99_ms", "TTFT p99 (ms)"),
    ("tpot_mean_ms", "TPOT mean (ms)"), ("tpot_p50_ms", "TPOT p50 (ms)"), ("tpot_p99_ms", "TPOT p99 (ms)"),
    ("itl_mean_ms", "ITL mean (ms)"), ("itl_p50_ms", "ITL p50 (ms)"), ("itl_p99_ms", "ITL p99 (ms)"),
    ("completed", "completed"), ("failed", "failed"))
LOWER_IS_BETTER = {key for key in METRICS if key.endswith("_ms")} | {"failed", "duration_s"}


def _ok(rows: list[dict], mode: str) -> list[dict]:
    return sorted((r for r in rows if r.get("mode") == mode and not r.get("error")),
                  key=lambda r: r["round"])


def modes_in(rows: list[dict]) -> list[str]:
    """``stock`` first, then the other modes of ``rows`` in the order they ran (``vattn`` when
    there is none)."""
    others = list(dict.fromkeys(r["mode"] for r in rows if r.get("mode") not in (None, "stock")))
    return ["stock"] + (others or ["vattn"])


def summarize(rows: list[dict], modes=None) -> dict:
    """``{mode: {metric: {"median", "min", "max", "n"}}}`` over the mode's successful rounds
    (``modes``: :func:`modes_in` of the rows)."""
    out = {}
    for mode in modes or modes_in(rows):
        good = _ok(rows, mode)
        out[mode] = {}
        for key in METRICS:
            values = [r[key] for r in good if r.get(key) is not None]
            if values:
                out[mode][key] = {"median": statistics.median(values), "min": min(values),
                                  "max": max(values), "n": len(values)}
    return out


def round_ratios(rows: list[dict], key: str, base: str = "stock", other: str = "vattn") -> list[tuple[int, float]]:
    """``[(round, other / base), ...]`` of ``key`` for every round where both modes ran."""
    by_round = {}
    for mode in (base, other):
        for r in _ok(rows, mode):
            by_round.setdefault(r["round"], {})[mode] = r.get(key)
    out = []
    for rnd in sorted(by_round):
        pair = by_round[rnd]
        if pair.get(base) and pair.get(other) is not None:
            out.append((rnd, pair[other] / pair[base]))
    return out


def _num(value: float) -> str:
    if value is None:
        return "–"
    if float(value).is_integer() and abs(value) >= 1:
        return f"{int(value)}"
    return f"{value:.3g}" if abs(value) < 100 else f"{value:.1f}"


def title_for(meta: dict) -> str:
    """The report's title for a run's ``meta`` (as ``bench serve`` writes it)."""
    w = meta["workload"]
    return (f"{meta['engine']} {meta['engine_version']} serve, {os.path.basename(meta['model'])}, "
            f"{w['dataset']} {w['input_len']} in / {w['output_len']} out"
            + (f" (prefix {w['prefix_len']} x {w['num_prefixes']})" if w["dataset"] == "shared-prefix" else "")
            + f", {w['num_prompts']} prompts at {w['rate']:g} req/s, {meta['device']}")


def markdown(rows: list[dict], *, title: str = "vattn bench serve", notes: list[str] | None = None) -> str:
    """The Markdown report: the medians table, each run's status, notes (skipped rounds, ...)."""
    modes = modes_in(rows)
    others = modes[1:]
    stats = summarize(rows, modes)
    lines = [f"### {title}", ""]
    ran = ", ".join(f"{m} {len(_ok(rows, m))}" for m in modes)
    orders = {}
    for r in rows:
        orders.setdefault(r.get("round"), []).append(r["mode"])
    if len({tuple(o) for o in orders.values()}) > 1:    # merged rounds of alternated calls
        order = "; ".join(f"r{rnd}: {', '.join(o)}" for rnd, o in orders.items())
    else:
        order = f"{', '.join(orders.get(1) or modes)} per round"
    lines += [f"Rounds that ran: {ran} (order {order}, a fresh server per "
              f"run). Ratio = mode / stock of the same round; ↑ higher is better, ↓ lower is "
              f"better.", "",
              "| metric | " + " | ".join(f"{m} median (min–max)" for m in modes) + " | "
              + " | ".join(f"{m}/stock per round | median ratio" for m in others) + " |",
              "|---" * (1 + len(modes) + 2 * len(others)) + "|"]
    for key, label in TABLE_METRICS:
        cells = []
        for mode in modes:
            s = stats[mode].get(key)
            cells.append("–" if s is None else f"{_num(s['median'])} ({_num(s['min'])}–{_num(s['max'])})")
        for mode in others:
            ratios = round_ratios(rows, key, other=mode)
            cells.append(", ".join(f"r{r}: {v:.3f}" for r, v in ratios) or "–")
            cells.append(f"{statistics.median(v for _, v in ratios):.3f}" if ratios else "–")
        arrow = "↓" if key in LOWER_IS_BETTER else "↑"
        lines.append(f"| {label} {arrow} | " + " | ".join(cells) + " |")
    lines += ["", "| run | round | mode | server start (s) | status |", "|---|---|---|---|---|"]
    for i, r in enumerate(rows, 1):
        status = "ok" if not r.get("error") else f"FAILED: {str(r['error']).splitlines()[0][:160]}"
        start = r.get("server_start_s")
        lines.append(f"| {i} | {r['round']} | {r['mode']} | {'–' if start is None else f'{start:.0f}'} "
                     f"| {status} |")
    lines += _vattn_table(rows)
    lines += _profile_table(rows)
    if notes:
        lines += [""] + [f"- {note}" for note in notes]
    return "\n".join(lines) + "\n"


#: (key in a row's ``["vattn"]["vmm_critical_path"]``, label) of the per-run vattn table
VATTN_COLUMNS = (("steps", "engine steps"), ("host_us_per_step", "host µs a step (all calls)"),
                 ("step_mean_us", "µs per step call (mean)"), ("step_p99_us", "p99"),
                 ("fence_waits", "fence waits"), ("pages_retired", "pages retired"), ("map_calls", "map calls"),
                 ("unmap_calls", "unmap calls"), ("page_sets_moved", "page-sets moved"),
                 ("prefix_hits", "prefix hits"), ("device_reads", "device reads"))


def _vattn_table(rows: list[dict]) -> list[str]:
    """vattn's own counters per vattn run (from the server's ``VATTN_METRICS`` snapshot)."""
    runs = [r for r in rows if r.get("vattn")]
    if not runs:
        return []
    lines = ["", "vattn's counters per run (its server's last metrics snapshot; the step call is "
             "vLLM's `apply` / SGLang's `alloc_decode`):", "",
             "| round | host ms on the step path | " + " | ".join(label for _, label in VATTN_COLUMNS) + " |",
             "|---" * (2 + len(VATTN_COLUMNS)) + "|"]
    for r in runs:
        v = r["vattn"]
        run = r["round"] if r.get("mode") in (None, "vattn") else f"{r['round']} {r['mode']}"
        if "vattn_metrics_error" in v:
            lines.append(f"| {run} | {v['vattn_metrics_error']} |" + " |" * len(VATTN_COLUMNS))
            continue
        path = v.get("vmm_critical_path") or {}
        host = ", ".join(f"{k} {ms:g}" for k, ms in (path.get("host_ms") or {}).items()) or "–"
        lines.append(f"| {run} | {host} | "
                     + " | ".join(_num(path.get(key)) if isinstance(path.get(key), (int, float)) else "–"
                                  for key, _ in VATTN_COLUMNS) + " |")
    return lines


def _profile_table(rows: list[dict]) -> list[str]:
    """Per profiled run: the window's GPU time per kernel family, busy vs idle, host waits."""
    runs = [r for r in rows if r.get("profile")]
    if not runs:
        return []
    lines = ["", "Profiled window per run (vLLM's torch profiler, the same number of engine steps "
             "in every run; ms summed over the window; idle = the share of the window the GPU ran "
             "nothing: the host fed it late). The profiler's start and stop stall the servers (up "
             "to 2 s, 2026-12-07), unevenly between modes: the latency table above carries those "
             "stalls, so take the verdict on latency from a run without --profile-steps.", "",
             "| round | mode | steps | window ms | GPU busy ms | idle | "
             + " | ".join(f"{f} ms" for f in PROFILE_FAMILIES)
             + " | host syncs (ms) | pinned allocs |", "|---" * (9 + len(PROFILE_FAMILIES)) + "|"]
    for r in runs:
        p = r["profile"]
        if "profile_error" in p:
            lines.append(f"| {r['round']} | {r['mode']} | {p['profile_error'][:160]} |"
                         + " |" * (6 + len(PROFILE_FAMILIES)))
            continue
        t, fam = p["trace"], (p.get("kernels") or {}).get("families_us") or {}
        cells = [f"{fam[f] / 1e3:.1f}" if f in fam else "–" for f in PROFILE_FAMILIES]
        gpu = ("– | – | –" if t["window_ms"] is None else
               f"{t['window_ms']:.1f} | {t['gpu_busy_ms']:.1f} | {t['gpu_idle_share']:.1%}")
        lines.append(f"| {r['round']} | {r['mode']} | {t['steps']} | {gpu} | " + " | ".join(cells)
                     + f" | {t['sync_calls']} ({t['sync_ms']:.1f}) | {t['host_alloc_calls']} |")
    for r in runs:
        top = (r["profile"].get("trace") or {}).get("runtime_top")
        if top:
            lines.append(f"- round {r['round']} {r['mode']}, the host's longest CUDA calls in the "
                         f"window: " + ", ".join(f"{n} ×{c} {ms:g} ms" for n, c, ms in top))
    return lines


def plot(rows: list[dict], path: str, *, title: str = "vattn bench serve") -> str | None:
    """TTFT and TPOT p50 / p99 per round, per mode, as a PNG at ``path``; ``None`` (nothing
    written) without matplotlib or without a successful run."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    if not any(not r.get("error") for r in rows):
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, lat in zip(axes, ("ttft", "tpot")):
        for mode, color in zip(modes_in(rows), ("tab:blue", "tab:orange", "tab:green", "tab:red",
                                                "tab:purple", "tab:brown")):
            good = _ok(rows, mode)
            for stat, style in (("p50", "-o"), ("p99", "--s")):
                xs = [r["round"] for r in good if r.get(f"{lat}_{stat}_ms") is not None]
                ys = [r[f"{lat}_{stat}_ms"] for r in good if r.get(f"{lat}_{stat}_ms") is not None]
                if xs:
                    ax.plot(xs, ys, style, color=color, label=f"{mode} {stat}")
        ax.set_xticks(sorted({r["round"] for r in rows}))
        ax.set_title(f"{lat.upper()} per round")
        ax.set_xlabel("round")
        ax.set_ylabel("ms")
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
