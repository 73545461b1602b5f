"""JSON + Markdown conformance reports."""

from __future__ import annotations

import json
import os

__all__ = ["write_report", "render_markdown"]


def write_report(report: dict, out_dir: str) -> dict[str, str]:
    """Write ``conformance.json``, ``conformance.md`` and the PNG plots under ``out_dir``."""
    from .plots import write_plots
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, "conformance.json"), "md": os.path.join(out_dir, "conformance.md")}
    report = dict(report, plots=[os.path.basename(p) for p in write_plots(report, out_dir)])
    with open(paths["json"], "w") as f:
        json.dump(report, f, indent=2, default=str)
    with open(paths["md"], "w") as f:
        f.write(render_markdown(report))
    return paths


def render_markdown(report: dict) -> str:
    """A short human-readable summary of a report dict."""
    lines = [f"# vattn conformance: {report['engine']}", "",
             f"- model: `{report['model']}` ({report['dtype']}, {report['device']})",
             f"- modes: {', '.join(report['modes'])} (baseline: {report['modes'][0]})",
             f"- result: **{'PASS' if report['ok'] else 'FAIL'}**", ""]
    ident = report.get("identity")
    if ident:
        lines += ["## Identity", "",
                  f"- exact-match rate: {ident['exact_match_rate']:.3f} "
                  f"(token match before divergence {ident['token_match_rate']:.3f})",
                  f"- near-ties accepted: {ident['near_ties']}; worst gap: {ident['worst_gap']:.4f}",
                  f"- mismatches: {len(ident['mismatches'])}",
                  f"- degenerate-model check: {report['degenerate_check']}", ""]
        for m in ident["mismatches"][:10]:
            lines.append(f"  - prompt {m['prompt']} position {m['position']}: {m['base']} vs {m['cand']} "
                         f"(gap {m['gap']})")
    if report.get("throughput"):
        lines += ["## Throughput", ""]
        if str(report.get("device", "")).startswith("cpu"):
            lines += ["CPU run: vattn's side uses the per-request reference math of the correctness "
                      "path, so these times are not a performance claim (GPU numbers: BENCHMARKS.md).", ""]
        lines += ["| workload | mode | seconds | gen tok/s | total tok/s | ratio |", "|---|---|---|---|---|---|"]
        for name, rows in report["throughput"].items():
            for mode, r in rows.items():
                lines.append(f"| {name} | {mode} | {r['seconds']} | {r['generated_tok_s']} | "
                             f"{r['total_tok_s']} | {r['ratio']} |")
        lines.append("")
    for plot in report.get("plots", []):
        lines.append(f"![{plot}]({plot})")
    return "\n".join(lines) + "\n"
