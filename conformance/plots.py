"""PNG plots of a conformance report (matplotlib, optional)."""

from __future__ import annotations

import os

__all__ = ["write_plots"]


def write_plots(report: dict, out_dir: str) -> list[str]:
    """Write ``throughput_ratio.png`` and ``divergence.png``; return the paths written.

    Returns an empty list when matplotlib is not installed.
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    paths = []
    tput = report.get("throughput", {})
    if tput:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        names, modes = list(tput), [m for m in report["modes"][1:]]
        width = 0.8 / max(len(modes), 1)
        for j, mode in enumerate(modes):
            ax.bar([i + j * width for i in range(len(names))],
                   [tput[n][mode]["ratio"] or 0 for n in names], width, label=mode)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xticks([i + width * (len(modes) - 1) / 2 for i in range(len(names))], names)
        ax.set_ylabel(f"speed vs {report['modes'][0]} (×)")
        ax.set_title(f"{report['engine']}: throughput ratio per workload")
        ax.legend()
        paths.append(_save(fig, out_dir, "throughput_ratio.png"))
    ident = report.get("identity")
    if ident:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        firsts = [p for p in ident["first_divergence"] if p is not None]
        horizon = report["identity_max_new_tokens"]
        ax.hist(firsts, bins=min(32, horizon), range=(0, horizon))
        same = sum(p is None for p in ident["first_divergence"])
        ax.set_title(f"first divergence position ({same}/{len(ident['first_divergence'])} identical)")
        ax.set_xlabel("generated position")
        ax.set_ylabel("prompts")
        paths.append(_save(fig, out_dir, "divergence.png"))
    return paths


def _save(fig, out_dir: str, name: str) -> str:
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return path
