"""``vattn bench engine``: the end-to-end engine runs of a GPU machine, as a BENCHMARKS section.

The engine stages (``tools/gpu/vllm.sh``, ``tools/gpu/sglang.sh``) run each mode in a fresh
engine process, side by side in one call, and leave one JSON per stage plus ``env.txt``. This
command reads them and writes what a reader compares: per workload the wall time of every mode
(``stock`` paged, ``ceiling`` = one block per request, ``vattn``), vattn's ratio to stock and to
the ceiling, the worst-case KV waste per request, the VMM time vattn spent on the step's critical
path, plus the identity verdict — and a PNG of the ratios.

Example::

    vattn bench engine --results runs/vllm --engine vllm --png docs/img/vllm_e2e_h200.png
"""

from __future__ import annotations

import argparse
import glob
import os

from vattn import argtypes
from vattn.bench.engine_profile import load_profiles, profile_markdown, read_stage_json
from vattn.conformance.models import PRESETS, decode_traffic_bytes
from vattn.core.errors import ConfigError

__all__ = ["add_arguments", "run", "load_results", "markdown", "plot", "decode_bandwidth", "hits_line", "work_line",
           "generations_line", "rounds_line", "round_ratios", "variants_line"]

_ORDER = ("decode-heavy", "prefill-heavy", "long-context")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--results", required=True, action="append",
                        help="folder holding the stage JSONs (throughput_*.json, identity.json, env.txt); "
                             "repeat it for rounds run in separate calls (e.g. stock@3 vattn@3 after "
                             "stock vattn stock@2 vattn@2): their modes are merged per workload")
    parser.add_argument("--engine", choices=("vllm", "sglang"), default="vllm")
    parser.add_argument("--title", default=None, help="BENCHMARKS section title")
    parser.add_argument("--command", default=None, help="the GPU command(s) that produced the results")
    parser.add_argument("--hbm-tbps", type=argtypes.positive_float, default=None,
                        help="measured HBM copy bandwidth (TB/s) for the decode-heavy share column")
    parser.add_argument("--png", default=None, help="write the ratio plot here")
    parser.add_argument("--date", default=None, help="when the run was made (default: the stage JSONs' "
                                                     "own date, if they have one)")
    parser.add_argument("--benchmarks", default="BENCHMARKS.md")
    parser.add_argument("--notes", default=None, help="a markdown file appended to the section (the reading)")
    parser.add_argument("--no-report", action="store_true", help="print only, leave BENCHMARKS.md")


def load_results(folders: str | list[str]) -> dict:
    """``{"identity": dict | None, "workloads": {name: report}, "env": str}`` from one results
    folder, or several merged (a workload's modes from every folder, a mode run again in the
    n-th folder named ``MODE@n``; the first folder's identity, profiles and environment; engines
    of one mode pooled again over all folders).

    Raises
    ------
    ConfigError
        A folder is missing, holds no stage JSON, a stage JSON is not valid, two folders ran
        the same ``MODE@N`` of a workload, or ran it on different model shapes.
    """
    if isinstance(folders, str):
        return _load_folder(folders)
    merged = None
    for n, folder in enumerate(folders, start=1):
        res = _load_folder(folder)
        if merged is None:
            merged = res
            continue
        for name, report in res["workloads"].items():
            have = merged["workloads"].setdefault(name, report)
            if have is report:
                continue
            shapes = [r.get("model_preset") for r in (have, report)]
            if shapes[0] != shapes[1]:
                raise ConfigError(f"--results: workload {name!r} ran on model shape {shapes[0]!r} in "
                                  f"{folders[0]!r} and on {shapes[1]!r} in {folder!r}: rounds of one "
                                  "table must share the shape (render each shape on its own)")
            rows = {(f"{mode}@{n}" if mode in _rows(have) and "@" not in mode else mode): row
                    for mode, row in _rows(report).items()}     # a re-run in folder n: MODE@n
            same = set(_rows(have)) & set(rows)
            if same:
                raise ConfigError(f"--results: workload {name!r} ran mode(s) {sorted(same)} in more than one "
                                  f"folder ({folder!r} among them); name re-runs MODE@N")
            _rows(have).update(rows)
    if merged is None:
        raise ConfigError("--results: expected at least one folder")
    from vattn.bench.gpu.report import pool_engines
    for report in merged["workloads"].values():
        if "rows" in report:
            report["pooled"] = pool_engines(report["rows"])
    return merged


def _load_folder(folder: str) -> dict:
    if not os.path.isdir(folder):
        raise ConfigError(f"--results: expected a folder of stage JSONs, got {folder!r} (no such folder)")
    workloads = {}
    for path in sorted(glob.glob(os.path.join(folder, "throughput_*.json")) +
                       glob.glob(os.path.join(folder, "*-heavy.json"))):
        if os.path.basename(path).startswith(("paired_", "profile_")):
            continue        # read below / by load_profiles, not a one-engine-at-a-time run
        report = read_stage_json(path)
        name = report.get("workload") or report.get("stage")
        if isinstance(name, dict) or not name:
            name = os.path.basename(path)[:-5].removeprefix("throughput_")
        workloads[name] = report
    for path in sorted(glob.glob(os.path.join(folder, "paired_*.json"))):   # two engines up at once
        report = read_stage_json(path)
        workloads[f"{report.get('workload') or os.path.basename(path)[7:-5]} (paired)"] = report
    identity = None
    if os.path.exists(os.path.join(folder, "identity.json")):
        identity = read_stage_json(os.path.join(folder, "identity.json"))
    profiles = load_profiles(folder)
    if not workloads and identity is None and not profiles:
        raise ConfigError(f"--results: {folder!r} holds no throughput_*.json, profile_*.json "
                          f"nor identity.json")
    env = ""
    if os.path.exists(os.path.join(folder, "env.txt")):
        with open(os.path.join(folder, "env.txt")) as f:
            env = " · ".join(line.strip() for line in f if line.strip())
    return {"identity": identity, "workloads": workloads, "env": env, "profiles": profiles}


def _rows(report: dict) -> dict:
    return report.get("rows") or report.get("modes") or {}


def decode_bandwidth(report: dict, mode: str) -> float | None:
    """Lower bound of the bytes/s a decode-heavy run moved (the report's ``model_preset``,
    default the Llama-3-8B shape), or None.

    Every decode step reads all weights once and the KV of every running request; prefill and
    sampling are counted as free, so this understates what the GPU moved.
    """
    shape = report.get("shape") or []
    work = report.get("workload")
    if not shape and isinstance(work, dict):     # SGLang's runner: {"num", "prompt_len", "new_tokens"}
        shape = [work.get("num"), work.get("prompt_len"), work.get("new_tokens")]
        shape = shape if all(isinstance(x, int) for x in shape) else []
    secs = _seconds(report, mode)
    if len(shape) < 3 or not secs:
        return None
    preset = PRESETS.get(report.get("model_preset") or "llama3-8b-shape")
    return decode_traffic_bytes(preset, *shape[:3]) / secs


def _fmt(x, spec=".2f", none="—"):
    return none if x is None else format(x, spec)


def _seconds(report: dict, mode: str) -> float | None:
    """A mode's time: the median over its engines when it ran in several (``pooled``), else its
    one engine's median."""
    pooled = (report.get("pooled") or {}).get(mode) or {}
    return pooled.get("median_s") or (_rows(report).get(mode) or {}).get("seconds")


def _workload_row(name: str, report: dict, hbm_tbps: float | None) -> str:
    rows = _rows(report)
    secs = {m: _seconds(report, m) for m in ("stock", "ceiling", "vattn")}
    errors = report.get("errors") or {}
    cells = []
    for m in ("stock", "ceiling", "vattn"):
        row = rows.get(m) or {}
        tok = row.get("total_tok_s") and row["total_tok_s"] * row["seconds"] / secs[m]
        cells.append(f"{secs[m]:.2f} ({tok / 1e3:.1f}K tok/s)" if secs[m] and tok else
                     f"{secs[m]:.2f}" if secs[m] else ("failed" if m in errors else "not run"))
    v, s, c = secs["vattn"], secs["stock"], secs["ceiling"]
    vs_stock = f"**{s / v:.4f}×**" if v and s else "—"
    rounds = round_ratios(report)
    if rounds is not None:                      # per generation: pooling generations mixes kinds
        import statistics
        vs_stock = (" / ".join(f"**{statistics.median(r):.3f}×**" for r in zip(*rounds))
                    + f" (per generation, median of {len(rounds)} rounds)")
    vs_ceiling = f"{c / v:.4f}×" if v and c else "—"
    vattn = rows.get("vattn") or {}
    waste = vattn.get("worst_waste_MiB_per_request")
    vmm = vattn.get("vmm_critical_path") or {}
    host = vmm.get("host_ms") or {"apply": vmm.get("apply_total_ms"),        # SGLang | vLLM
                                   "on_blocks": vmm.get("on_blocks_total_ms")}
    crit = (" + ".join(f"{_fmt(ms, '.1f')} ms {name}" for name, ms in host.items()) +
            (f" (GPU idle behind it: {vmm['device_wait_ms']:.1f} ms)"
             if vmm.get("device_wait_ms") is not None else "") +
            f"; {vmm.get('pages_mapped_on_demand', '—')} pages mapped on demand" +
            (f"; {vmm['device_reads']} device reads" if vmm.get("device_reads") is not None else "")
            + (f"; {vmm['page_sets_staged']} page-sets staged ahead" if vmm.get("page_sets_staged") else "")
            ) if vmm else "—"
    bw = decode_bandwidth(report, "vattn") if name.split(" (")[0] == "decode-heavy" else None
    share = (f"{bw / 1e12:.2f} TB/s" + (f" ({100 * bw / (hbm_tbps * 1e12):.0f} %)" if hbm_tbps else "")
             if bw else "—")
    return (f"| {name} | {' | '.join(cells)} | {vs_stock} | {vs_ceiling} | "
            f"{_fmt(waste, '.1f')} | {crit} | {share} |")


def markdown(results: dict, *, hbm_tbps: float | None = None, png: str | None = None) -> str:
    """The section body: workload table, identity verdict, errors."""
    lines = []
    if png:
        lines += [f"![vattn and the ceiling against stock, per workload]({png})", ""]
    if results["workloads"]:
        lines += ["| workload | stock s (tokens in + out per s) | ceiling s (one block per request) | vattn s | vattn / stock "
                  "| vattn / ceiling | vattn worst waste / request (MiB) | vattn host time on the step's "
                  "critical path | decode-heavy bytes moved (lower bound; % of HBM copy) |",
                  "|---|---|---|---|---|---|---|---|---|"]
        names = sorted(results["workloads"], key=lambda n: (_ORDER.index(n) if n in _ORDER else 9, n))
        lines += [_workload_row(n, results["workloads"][n], hbm_tbps) for n in names]
        lines.append("")
    for name, report in (results.get("profiles") or {}).items():
        lines += [profile_markdown(name, report), ""]
    for name, report in results["workloads"].items():
        for mode, p in (report.get("pooled") or {}).items():
            lines.append(f"- {name} / {mode}: median of {len(p['seconds_all'])} generations over "
                         f"{p['engines']} engines, {p['median_s']:.3f} s (all: "
                         f"{', '.join(f'{t:.3f}' for t in p['seconds_all'])})")
    for name, report in results["workloads"].items():
        p = report.get("paired")
        if p:
            lines.append(f"- {name}: {p['other']}'s speed over {p['baseline']}'s per round "
                         f"({p['baseline']} s / {p['other']} s; engines up at once, order "
                         f"alternated): {', '.join(f'{r:.4f}' for r in p['ratios'])}; median "
                         f"**{p['median_ratio']:.4f}**")
    for name, report in results["workloads"].items():
        gens = rounds_line(name, report) or generations_line(name, report)
        if gens:
            lines.append(gens)
    for name, report in results["workloads"].items():
        for line in (variants_line(name, report, hbm_tbps), hits_line(name, report), work_line(name, report)):
            if line:
                lines.append(line)
    if any(r.get("pooled") or r.get("paired") or hits_line(n, r) or generations_line(n, r) or rounds_line(n, r)
           or variants_line(n, r) or work_line(n, r)
           for n, r in results["workloads"].items()):
        lines.append("")
    ident = results["identity"]
    if ident is not None:
        lines.append("Identity: " + _identity_text(ident))
        lines.append("")
    for name, report in results["workloads"].items():
        for mode, err in (report.get("errors") or {}).items():
            lines.append(f"- {name} / {mode} failed: `{str(err).strip().splitlines()[0][:300]}`")
    return "\n".join(lines).rstrip() + "\n"


def generations_line(name: str, report: dict) -> str | None:
    """``- name: per generation ...``: stock's and vattn's seconds of each generation one engine
    ran (``seconds_each``) and vattn's speed over stock's per generation — whether repeated
    generations stay as flat as stock's (``None`` without two such lists of equal length > 1)."""
    rows = _rows(report)
    stock, vattn = ((rows.get(m) or {}).get("seconds_each") or [] for m in ("stock", "vattn"))
    if len(stock) < 2 or len(stock) != len(vattn) or not all(stock) or not all(vattn):
        return None
    return (f"- {name}: seconds per generation of one engine: stock {', '.join(f'{s:.2f}' for s in stock)}; "
            f"vattn {', '.join(f'{v:.2f}' for v in vattn)}; vattn / stock per generation "
            f"{', '.join(f'{s / v:.3f}×' for s, v in zip(stock, vattn))}")


def round_ratios(report: dict) -> list[list[float]] | None:
    """vattn's speed over stock's in every generation of each round (``stock``/``vattn``,
    ``stock@2``/``vattn@2``, ...; each a fresh engine of each mode, stock first), or ``None``
    with fewer than two complete rounds of equally many generations."""
    rows = _rows(report)
    rounds = []
    for name, row in rows.items():
        mode, _, tag = name.partition("@")
        other = rows.get("vattn" + ("@" + tag if tag else ""))
        if mode != "stock" or not other:
            continue
        stock, vattn = row.get("seconds_each") or [], other.get("seconds_each") or []
        if stock and len(stock) == len(vattn) and all(stock) and all(vattn):
            rounds.append([s / v for s, v in zip(stock, vattn)])
    if len(rounds) < 2 or len({len(r) for r in rounds}) != 1:
        return None
    return rounds


def rounds_line(name: str, report: dict) -> str | None:
    """``- name: vattn / stock per generation, median of N alternated rounds ...``: per
    generation the median over :func:`round_ratios` and its spread, then every round's ratios
    (``None`` without two complete rounds)."""
    import statistics
    rounds = round_ratios(report)
    if rounds is None:
        return None
    gens = [f"generation {g} **{statistics.median(r):.3f}×** ({min(r):.3f}–{max(r):.3f})"
            for g, r in enumerate(zip(*rounds), start=1)]
    each = "; ".join(", ".join(f"{r:.3f}×" for r in one) for one in rounds)
    return (f"- {name}: vattn / stock per generation, median of {len(rounds)} alternated rounds (a "
            f"fresh engine of each mode per round, stock first; spread in brackets): {', '.join(gens)}; "
            f"per round: {each}")


def variants_line(name: str, report: dict, hbm_tbps: float | None = None) -> str | None:
    """``- name: other modes ...``: each mode run beside stock that is not stock, ceiling or vattn
    (e.g. ``vattn:s0``, prefix staging off; ``vattn:g2``), with its seconds per generation and
    stock's speed over it per generation, round by round (``MODE@N`` against ``stock@N``); for
    decode-heavy also the bytes per second each moved at least, and its share of ``hbm_tbps``."""
    rows = _rows(report)
    decode = name.split(" (")[0] == "decode-heavy"

    def moved(mode: str) -> str:
        bw = decode_bandwidth(report, mode) if decode else None
        return "" if not bw else (f"{bw / 1e12:.2f} TB/s" + (f" = {100 * bw / (hbm_tbps * 1e12):.0f} % of HBM copy"
                                                             if hbm_tbps else ""))
    cells = []
    for mode, row in rows.items():
        base, _, tag = mode.partition("@")
        if base in ("stock", "ceiling", "vattn"):
            continue
        stock = (rows.get("stock" + ("@" + tag if tag else "")) or {}).get("seconds_each") or []
        each = row.get("seconds_each") or []
        if not each or len(stock) != len(each) or not all(each):
            continue
        share = moved(mode)
        cells.append(f"{mode} {', '.join(f'{t:.2f}' for t in each)} s "
                     f"({', '.join(f'{s / t:.3f}×' for s, t in zip(stock, each))} stock"
                     + (f"; {share}" if share else "") + ")")
    share = moved("stock")
    if cells and share:
        cells.append(f"stock {share}")
    return f"- {name}: other modes per generation: {'; '.join(cells)}" if cells else None


def work_line(name: str, report: dict) -> str | None:
    """``- name: vattn's work per generation ...``: host ms of ``apply``, the GPU's idle ms
    behind it and pages aliased, each generation on its own (from the rows' cumulative
    ``vattn_each``, the first counted from ``vattn_before`` where a row has it, else from the
    engine's start; ``None`` when no row has them)."""
    cells = []
    for mode, row in _rows(report).items():
        each = [e for e in (row.get("vattn_each") or []) if e]
        if not each:
            continue
        prev, parts = row.get("vattn_before") or {}, []
        for e in each:
            d = {k: (e.get(k) or 0) - (prev.get(k) or 0)
                 for k in ("apply_ms", "device_wait_ms", "pages_aliased", "map_calls")}
            wait = f"{d['device_wait_ms']:.0f}" if e.get("device_wait_ms") is not None else "—"
            calls = f", {d['map_calls']:,} map calls" if e.get("map_calls") is not None else ""
            parts.append(f"{d['apply_ms']:.0f} / {wait} ms, {d['pages_aliased']:,} aliased{calls}")
            prev = e
        cells.append(f"{mode} " + "; ".join(parts))
    if not cells:
        return None
    return (f"- {name}: vattn's work per generation (host ms of `apply` / the GPU's idle ms behind "
            f"it, pages aliased, driver map calls; the first generation counts from the engine's "
            f"start where no count before it was taken): {' | '.join(cells)}")


def hits_line(name: str, report: dict) -> str | None:
    """``- name: prefix-cache hits per generation ...`` from the rows' ``cached_tokens_each`` /
    ``prompt_tokens_each`` (vLLM's stages; ``None`` when no mode reports a hit)."""
    cells = []
    for mode, row in _rows(report).items():
        cached, prompt = row.get("cached_tokens_each") or [], row.get("prompt_tokens_each") or []
        if not any(cached) or len(prompt) != len(cached):
            continue
        cells.append(f"{mode} " + ", ".join(f"{c:,} ({100 * c / p:.1f} %)" if p else f"{c:,}"
                                            for c, p in zip(cached, prompt)))
    if not cells:
        return None
    return (f"- {name}: prompt tokens served from the prefix cache per generation (share of the "
            f"prompt tokens): {'; '.join(cells)}")


def _schedule_note(diff) -> str:
    """The engines' recorded schedules (``schedule_difference``): equal, or where they part."""
    if diff is False or diff is None:                 # not in the record, or not recorded
        return ""
    if not diff:
        return "; the same schedule, step by step"
    return f"; schedules differ from step {diff['step']}: {diff['a'][:4]} vs {diff['b'][:4]}"


def _identity_text(ident: dict) -> str:
    """One line per comparison (``<mode>_vs_<base>`` keys of the vLLM stage, ``identity`` of SGLang's)."""
    pairs = {k.replace("_vs_", " vs "): v for k, v in ident.items() if "_vs_" in k and isinstance(v, dict)}
    if not pairs and isinstance(ident.get("identity"), dict):
        pairs = {"vattn vs stock": ident["identity"]}
    if not pairs:
        return f"no verdict (errors: {list((ident.get('errors') or {}))})"
    degenerate = (ident.get("not_degenerate") or ident.get("degenerate_check") or {}).get("ok")
    lines = [f"**{'PASS' if ident.get('ok') else 'FAIL'}** (outputs not degenerate: {degenerate})"]
    for name, cmp in pairs.items():
        rate = cmp.get("exact_match_rate", cmp.get("token_match_rate"))
        lines.append(f"- {name}: {'**exact**' if cmp.get('exact') else 'not exact'} (exact-match rate "
                     f"{_fmt(rate, '.3f')}, token match rate {_fmt(cmp.get('token_match_rate'), '.4f')}, "
                     f"near-ties {cmp.get('near_ties')}, mismatches {len(cmp.get('mismatches') or [])}, "
                     f"worst log-prob gap {_fmt(cmp.get('worst_gap'), '.4f')}"
                     f"{_schedule_note(cmp.get('schedule_difference', False))})")
    exact = ident.get("exact_pairs")
    if exact:
        lines.append("- every pair, exact or not: " + ", ".join(
            f"{k.replace('_vs_', ' vs ')} {'exact' if v else 'not exact'}" for k, v in exact.items()))
    same = ident.get("same_path_exact")
    if same:
        lines.append("- pairs expected bit-exact (same FA3 kernel path, or a mode re-run): " + ", ".join(
            f"{k.replace('_vs_', ' vs ')} {'exact' if v else '**not exact**'}" for k, v in same.items()))
    return "\n".join(lines)


def plot(results: dict, path: str) -> str | None:
    """Bars of ceiling / stock and vattn / stock per workload (throughput ratio); None if no data."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [n for n in _ORDER if n in results["workloads"]] + \
        sorted(n for n in results["workloads"] if n not in _ORDER)
    data = {}
    for n in names:
        report = results["workloads"][n]
        base = _seconds(report, "stock")
        data[n] = {m: base / _seconds(report, m) for m in ("ceiling", "vattn")
                   if base and _seconds(report, m)}
    if not any(data.values()):
        return None
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.36
    for i, (mode, color) in enumerate((("ceiling", "#9ab"), ("vattn", "#2a6"))):
        xs = [j + (i - 0.5) * width for j in range(len(names))]
        ys = [data[n].get(mode, 0) for n in names]
        bars = ax.bar(xs, ys, width, label=mode, color=color)
        ax.bar_label(bars, labels=[f"{y:.3f}" if y else "" for y in ys], fontsize=8)
        for x, y in zip(xs, ys):
            if not y:
                ax.text(x, 1.0, "not\nmeasured", ha="center", va="bottom", fontsize=7, color="0.4")
    ax.axhline(1.0, color="k", lw=0.8, ls="--", label="stock paged = 1")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("throughput / stock (same run)")
    values = [v for d in data.values() for v in d.values()]
    ax.set_ylim(min(0.9, min(values + [1.0]) - 0.02), max(values + [1.0]) + 0.05)
    ax.legend(fontsize=8, loc="upper left", ncol=3)
    ax.set_title("end to end, Llama-3-8B shape, bf16", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run(args) -> int:
    from vattn.bench.report import write_section
    if args.notes and not os.path.isfile(args.notes):
        raise ConfigError(f"--notes: expected a markdown file, got {args.notes!r} (no such file)")
    results = load_results(args.results)
    png = plot(results, args.png) if args.png else None
    body = markdown(results, hbm_tbps=args.hbm_tbps, png=png)
    if args.notes:
        with open(args.notes) as f:
            body += "\n" + f.read()
    print(body)
    if not args.no_report:
        title = args.title or f"{args.engine} end to end (stock vs ceiling vs vattn)"
        command = args.command or f"bash tools/gpu/{args.engine}.sh"
        dates = sorted({r.get("date") for r in [*results["workloads"].values(), results["identity"] or {},
                                                 *results["profiles"].values()] if r.get("date")})
        env = {"date": args.date or " – ".join(dates) or "not recorded", "machine": results["env"] or "not recorded"}
        write_section(title, body, command + f"\nvattn bench engine --results <dir> --engine {args.engine}",
                      path=args.benchmarks, env=env)
    return 0
