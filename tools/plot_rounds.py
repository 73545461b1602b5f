"""Plot per-round vattn/stock speed ratios of GPU stage JSONs (one column per run).

    python tools/plot_rounds.py OUT.png "LABEL=path/to/stage.json[@BEFORE]" ...

Reads SGLang throughput JSONs (``modes.<mode>.round_s``) and vLLM paired JSONs
(``rows.<mode>.seconds_each``); each round's ratio is stock seconds / vattn seconds (> 1: vattn
faster), the bar is their median. ``@BEFORE`` marks an earlier ratio of the same run for comparison.
"""

from __future__ import annotations

import json
import statistics
import sys


def round_ratios(report: dict) -> list[float]:
    """stock / vattn seconds per round, rounds paired in order."""
    if "paired" in report:
        return list(report["paired"]["ratios"])
    modes = report["modes"]
    return [s / v for s, v in zip(modes["stock"]["round_s"], modes["vattn"]["round_s"])]


def main(argv: list[str]) -> int:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out, specs = argv[0], argv[1:]
    fig, ax = plt.subplots(figsize=(1.9 * len(specs) + 2, 3.6))
    for x, spec in enumerate(specs):
        label, _, rest = spec.partition("=")
        path, _, before = rest.partition("@")
        with open(path) as f:
            ratios = round_ratios(json.load(f))
        ax.bar(x, statistics.median(ratios), width=0.55, color="#4c72b0", alpha=0.6,
               label="median of rounds" if x == 0 else None)
        ax.scatter([x] * len(ratios), ratios, color="#1b2a49", zorder=3, s=18,
                   label="one round" if x == 0 else None)
        if before:
            ax.scatter([x], [float(before)], color="#c44e52", marker="x", s=60, zorder=3,
                       label="before this change" if x == 0 else None)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xticks(range(len(specs)), [s.partition("=")[0].replace("\\n", "\n") for s in specs], fontsize=8)
    ax.set_ylabel("vattn speed / stock speed")
    ax.set_ylim(0.45, 1.1)
    ax.set_title("engine defaults + vattn's activation only (H200)", fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
