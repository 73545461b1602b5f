"""The ``profile`` stage of an engine GPU run as a table: GPU time per kernel family and mode.

The stage (``tools/gpu/vllm.sh``, ``VATTN_STAGES=profile``) runs each mode once timed and once
under the engine's torch profiler for a window of steps; its JSON holds, per mode, the summed
GPU time of each kernel family in that window (``families_us``) and the timed run's seconds.
"""

from __future__ import annotations

import glob
import json
import os

from vattn.core.errors import ConfigError

__all__ = ["load_profiles", "profile_markdown", "read_stage_json", "FAMILIES"]

#: the kernel families of the profile tables, in the order they are shown
FAMILIES = ("attention", "gemm", "kv store", "slot tables", "other")


def load_profiles(folder: str) -> dict:
    """``{workload: report}`` of the ``profile_*.json`` files in ``folder`` (empty if none)."""
    found = {}
    for path in sorted(glob.glob(os.path.join(folder, "profile_*.json"))):
        report = read_stage_json(path)
        found[report.get("workload") or os.path.basename(path)[8:-5]] = report
    return found


def read_stage_json(path: str) -> dict:
    """One stage JSON as a dict.

    Raises
    ------
    ConfigError
        The file is not a JSON object (a stage cut off mid-write, or another file of that name).
    """
    with open(path) as f:
        try:
            report = json.load(f)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--results: expected stage JSON in {path!r}, got invalid JSON ({exc}); "
                              f"re-run the stage or move the file away") from exc
    if not isinstance(report, dict):
        raise ConfigError(f"--results: expected a JSON object in {path!r}, got {type(report).__name__}")
    return report


def _ratio(a, b) -> str:
    return f"{a / b:.4f}" if a and b else "—"


def profile_markdown(name: str, report: dict) -> str:
    """One table: per mode, the timed run, the GPU time of the profiled window per kernel family
    (ms) and that GPU time against stock's and the ceiling's (< 1 = less GPU time)."""
    modes = report.get("modes") or {}
    if not modes:
        return f"Profile {name}: no table (errors: {list(report.get('errors') or {})})\n"
    total = {m: r.get("total_us") for m, r in modes.items()}
    head = ("| mode | timed run s | " + " | ".join(f"{f} ms" for f in FAMILIES) +
            " | GPU total ms | GPU time / stock | GPU time / ceiling | attention / stock |")
    lines = [f"Profile {name}: {report.get('steps')} engine steps after {report.get('delay')} "
             f"(vLLM's torch profiler), GPU time summed over kernels", "", head,
             "|---" * (len(FAMILIES) + 6) + "|"]
    att = {m: (r.get("families_us") or {}).get("attention") for m, r in modes.items()}
    for mode, r in modes.items():
        fam = r.get("families_us") or {}
        cells = [f"{fam[f] / 1e3:.1f}" if f in fam else "—" for f in FAMILIES]
        secs = r.get("seconds")
        lines.append(f"| {mode} | {secs:.3f} | " if secs else f"| {mode} | — | ")
        lines[-1] += " | ".join(cells) + (
            f" | {total[mode] / 1e3:.1f} | {_ratio(total[mode], total.get('stock'))} | "
            f"{_ratio(total[mode], total.get('ceiling'))} | {_ratio(att[mode], att.get('stock'))} |")
    for mode, err in (report.get("errors") or {}).items():
        lines.append(f"- {mode} failed: `{str(err).strip().splitlines()[0][:300]}`")
    return "\n".join(lines) + "\n"
