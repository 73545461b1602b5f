"""``vattn bench serve-rounds``: the rounds of several ``vattn bench serve`` runs in one table.

A server round of two 1B or 8B servers takes ~5 minutes on a GPU, so the alternated rounds an
acceptance asks for (stock, vattn, then vattn, stock, ...) come from separate calls, each with
its own results folder. This command reads their ``rows.json`` files, checks that they ran the
same engine version, model, device and workload, numbers their rounds one after another in the
order given, and renders the report ``bench serve`` writes (per-round ratios, medians and
spread, each round's order) with its plot.
"""

from __future__ import annotations

import json
import os

from vattn.core.errors import ConfigError

from .report import results_files
from .serve_report import markdown, plot, title_for

__all__ = ["add_arguments", "run", "load", "merge"]

#: what must match for two runs' rounds to be pooled
SAME = ("engine", "engine_version", "device", "model", "workload", "like_for_like", "engine_args")


def add_arguments(parser) -> None:
    parser.add_argument("--results", action="append", required=True,
                        help="a `bench serve --out` folder (or one above it) holding rows.json; "
                             "repeatable, rounds numbered in this order")
    parser.add_argument("--out", default=None, help="write report.md, rows.json and the plot here")


def load(folders: list[str]) -> list[tuple[str, dict]]:
    """``(path, {meta, rows, notes})`` of every ``rows.json`` under ``folders``, in their order."""
    found = []
    for path in results_files(folders, "rows.json", "rows.json (a `vattn bench serve` run)"):
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--results: {path!r} is not a `bench serve` rows.json "
                              f"({type(exc).__name__}: {exc})") from exc
        if not (isinstance(data, dict) and isinstance(data.get("meta"), dict)
                and isinstance(data["meta"].get("workload"), dict) and isinstance(data.get("rows"), list)):
            raise ConfigError(f"--results: {path!r} is not a `bench serve` rows.json (expected "
                              f"{{meta: {{workload: ...}}, rows: [...]}}, got {type(data).__name__})")
        found.append((path, data))
    return found


def _same(meta: dict) -> dict:
    out = {k: meta.get(k) for k in SAME}
    out["model"] = os.path.basename(str(out["model"]))   # a temporary folder per machine
    return out


def merge(runs: list[tuple[str, dict]]) -> tuple[list[dict], list[str]]:
    """The rows of ``runs`` with their rounds numbered one after another, and one note per run.

    Raises
    ------
    ConfigError
        Two runs differ in engine version, model, device or workload.
    """
    first_path, first = runs[0]
    base = _same(first["meta"])
    rows, notes, offset = [], [], 0
    for path, data in runs:
        this = _same(data["meta"])
        if this != base:
            diff = ", ".join(f"{k}: {base[k]!r} vs {this[k]!r}" for k in SAME if base[k] != this[k])
            raise ConfigError(f"cannot pool the rounds of {first_path!r} and {path!r}: they ran "
                              f"different configurations ({diff})")
        got = [dict(r) for r in data["rows"]]
        last = max((r["round"] for r in got), default=0)
        for r in got:
            r["round"] += offset
        notes.append(f"rounds {offset + 1}–{offset + last}: {path} ({data['meta'].get('date', '?')})"
                     if last > 1 else f"round {offset + 1}: {path} ({data['meta'].get('date', '?')})")
        notes += data.get("notes") or []
        rows += got
        offset += last
    return rows, notes


def run(args) -> int:
    """Print (and with ``--out`` write) the pooled report; 0 when every pooled run completed its
    requests and none failed, as ``bench serve``."""
    runs = load(args.results)
    rows, notes = merge(runs)
    text = markdown(rows, title=title_for(runs[0][1]["meta"]), notes=notes)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "report.md"), "w") as f:
            f.write(text)
        with open(os.path.join(args.out, "rows.json"), "w") as f:
            json.dump({"meta": runs[0][1]["meta"], "rows": rows, "notes": notes}, f, indent=1, default=repr)
        png = plot(rows, os.path.join(args.out, "serve_plot.png"), title=title_for(runs[0][1]["meta"]))
        print(f"report: {os.path.join(args.out, 'report.md')}" + (f"; plot: {png}" if png else
                                                                  "; no plot (matplotlib missing)"))
    ok = rows and all(not r.get("error") and r.get("completed") and not r.get("failed") for r in rows)
    return 0 if ok else 1
