"""The table and plot of ``vattn compare``: one row per engine and workload, stock vs vattn.

Every cell comes from the records (:mod:`.compare_records`); a value a record does not carry is
written ``n/a`` with the reason, never estimated.
"""

from __future__ import annotations

import os
import statistics

from .identity import compare
from .models import check_not_degenerate, decode_traffic_bytes
from .protocol import RunResult

__all__ = ["table_rows", "markdown", "plot", "identity_cell"]

#: per engine, the vattn host-time histograms on a step's critical path (vLLM's GPU runtime,
#: SGLang's allocator); any other engine: the core's ensure() time
_CRITICAL_PATH = {"vllm": ("apply_step_us", "on_blocks_us"),
                  "sglang": ("alloc_extend_us", "alloc_decode_us", "free_us")}
_ORDER = ("transformers", "vllm", "sglang", "tgi")


def _result(rec: dict) -> RunResult:
    lps = rec.get("logprobs")
    if lps is not None:
        lps = [[{int(t): v for t, v in pos.items()} for pos in req] for req in lps]
    return RunResult(token_ids=rec["token_ids"], logprobs=lps, seconds=rec["rounds"][0]["seconds"],
                     num_prompt_tokens=rec["num_prompt_tokens"],
                     num_generated_tokens=rec["num_generated_tokens"])


def identity_cell(base_rec: dict, cand_rec: dict, *, max_gap: float = 0.1) -> tuple[str, bool]:
    """``(verdict text, ok)`` of vattn's first-round tokens against the baseline's
    (:func:`vattn.conformance.identity.compare`; a near-tie needs recorded log-probs)."""
    base, cand = _result(base_rec), _result(cand_rec)
    rep = compare(base, cand, max_gap=max_gap)
    n = len(base.token_ids)
    if rep.exact:
        text = f"exact tokens ({n}/{n} prompts)"
    elif rep.ok:
        text = (f"near-ties only ({rep.near_ties} of {n} prompts diverge at a near-tie, worst gap "
                f"{rep.worst_gap:.3f} nats)")
    else:
        text = f"**FAIL**: {len(rep.mismatches)} of {n} prompts diverge beyond a near-tie"
        if not base_rec.get("logprobs_k"):
            text += " (no log-probs recorded: a near-tie cannot be told)"
    degenerate = check_not_degenerate(base.token_ids)
    if not degenerate["ok"]:
        text += f"; outputs degenerate ({degenerate['reason']})"
    for rec in (base_rec, cand_rec):
        if len({r["tokens_sha256"] for r in rec["rounds"]}) > 1:
            text += f"; {rec['mode']}'s tokens differ between rounds"
    return text, rep.ok and degenerate["ok"]


def _secs(rec: dict) -> list[float]:
    return [r["seconds"] for r in sorted(rec["rounds"], key=lambda r: r["round"])]


def _time_cell(secs: list[float]) -> str:
    return f"{statistics.median(secs):.3f} ({min(secs):.3f}–{max(secs):.3f})"


def _total_ms(h: dict | None) -> float:
    return (h or {}).get("mean_us", 0.0) * (h or {}).get("count", 0) / 1e3


def _waste_cell(rec: dict) -> str:
    waste = ((rec.get("metrics") or {}).get("layout") or {}).get("worst_waste_bytes")
    if waste is None:
        return f"n/a (not in {rec['engine']}'s vattn metrics)"
    return f"{waste / 2**20:.2f} MiB"


def _vmm_cell(rec: dict) -> str:
    if not str(rec.get("device", "")).startswith("cuda"):
        return "n/a (CPU: host backend, no VMM)"
    metrics = rec.get("metrics") or {}
    keys = [k for k in _CRITICAL_PATH.get(rec["engine"], ()) if k in metrics] or \
        [k for k in ("ensure_us",) if k in metrics]
    if not keys:
        return f"n/a (not in {rec['engine']}'s vattn metrics)"
    ms = sum(_total_ms(metrics[k]) for k in keys)
    last = max(rec["rounds"], key=lambda r: r["round"])["seconds"]     # the metrics' own run
    return f"{100 * ms / 1e3 / last:.2f} % ({ms:.1f} ms of {', '.join(k[:-3] for k in keys)})"


def _hbm_cell(rec: dict, model: dict, hbm_tbps: float | None) -> str:
    if not str(rec.get("device", "")).startswith("cuda"):
        return "n/a (CPU)"
    wl = rec["workload"]
    if wl["name"] != "decode-heavy":
        return "n/a (decode-heavy only)"
    elem = {"bfloat16": 2, "float16": 2}.get(model.get("dtype"))
    if elem is None:
        return f"n/a ({model.get('dtype')} weights)"
    mean_prompt = wl["prompt_tokens"] / wl["num_prompts"]
    moved = decode_traffic_bytes(model["config"], wl["num_prompts"], mean_prompt, wl["max_new_tokens"])
    rate = moved / statistics.median(_secs(rec))
    if not hbm_tbps:
        return f"≥ {rate / 1e12:.2f} TB/s (pass --hbm-tbps for the share)"
    return f"{100 * rate / (hbm_tbps * 1e12):.0f} % (≥ {rate / 1e12:.2f} of {hbm_tbps} TB/s)"


def _engine_key(engine: str) -> tuple:
    return (_ORDER.index(engine) if engine in _ORDER else len(_ORDER), engine)


def table_rows(merged: dict, *, engines: list[str] | None = None, hbm_tbps: float | None = None,
               max_gap: float = 0.1) -> list[dict]:
    """One dict per engine and workload (``cells``: the Markdown cells; ``ratios``, ``ok``,
    ``status``), engines in ``engines`` order (default: every engine of ``merged``)."""
    names = engines or sorted({e for e, _ in merged["runs"]} | set(merged["status"]), key=_engine_key)
    rows = []
    for engine in names:
        for (eng, wl), modes in sorted(merged["runs"].items()):
            if eng != engine:
                continue
            cand = modes.get("vattn")
            base = next((r for m, r in modes.items() if m != "vattn"), None)
            if base is None or cand is None:
                rows.append(_status_row(engine, wl, "incomplete",
                                        f"only the {', '.join(modes)} record(s) were found"))
                continue
            rows.append(_run_row(base, cand, merged["model"], hbm_tbps, max_gap))
        for rec in merged["status"].get(engine, []):
            rows.append(_status_row(engine, (rec.get("workload") or {}).get("name"), rec["status"],
                                    rec.get("reason", ""), hint=rec.get("install_hint")))
    return rows


def _run_row(base: dict, cand: dict, model: dict, hbm_tbps, max_gap) -> dict:
    sb, sv = _secs(base), _secs(cand)
    ratios = [b / v for b, v in zip(sb, sv)]
    ident, ok = identity_cell(base, cand, max_gap=max_gap)
    med = statistics.median(ratios)
    engine = f"{base['engine']} {base.get('engine_version') or ''}".strip()
    if base["mode"] != "stock":
        engine += f" (baseline: {base['mode']})"
    cells = [engine, base["workload"]["name"], _time_cell(sb), _time_cell(sv),
             f"**{med:.3f}×** ({min(ratios):.3f}–{max(ratios):.3f}, {len(ratios)} rounds)", ident,
             _waste_cell(cand), _vmm_cell(cand), _hbm_cell(cand, model, hbm_tbps)]
    return {"engine": base["engine"], "workload": base["workload"]["name"], "status": "ok",
            "ok": ok, "ratios": ratios, "cells": cells, "records": (base, cand)}


def _status_row(engine: str, workload: str | None, status: str, reason: str, *, hint=None) -> dict:
    text = _one_line(reason)
    cell = f"**{status}**: {text}" + (f" ({hint})" if hint else "")
    return {"engine": engine, "workload": workload, "status": status, "ok": False, "ratios": [],
            "cells": [engine, workload or "—", cell, "—", "—", "—", "—", "—", "—"]}


def _one_line(text: str, limit: int = 300) -> str:
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    line = lines[0] if len(lines) <= 1 else f"{lines[0]} ... {lines[-1]}"
    line = line.replace("|", "\\|")
    return line if len(line) <= limit else line[:limit - 3] + "..."


HEADER = ("| engine | workload | stock s (median, min–max) | vattn s (median, min–max) | "
          "vattn speed / stock (median, spread of per-round ratios) | identity (vattn vs stock) | "
          "vattn worst waste / request | VMM critical-path share | HBM share (decode lower bound) |")


def markdown(merged: dict, rows: list[dict], *, png: str | None = None) -> str:
    """The table, then where each engine ran and the model / workloads compared."""
    model = merged["model"] or {}
    lines = []
    if png:
        lines += [f"![vattn speed over stock per engine]({png})", ""]
    lines += [HEADER, "|" + "---|" * 9]
    lines += ["| " + " | ".join(r["cells"]) + " |" for r in rows]
    lines.append("")
    if model:
        cfg = model.get("config") or {}
        lines.append(f"Model `{model.get('label')}`: {cfg.get('num_hidden_layers')} layers, hidden "
                     f"{cfg.get('hidden_size')}, {cfg.get('num_attention_heads')} heads / "
                     f"{cfg.get('num_key_value_heads')} KV heads × {cfg.get('head_dim')}, vocabulary "
                     f"{cfg.get('vocab_size')}, {model.get('dtype')}, random weights (seed {model.get('seed')}).")
    for name, wl in merged["workloads"].items():
        lines.append(f"Workload `{name}` ({wl['size']} size, seed {wl['seed']}): {wl['num_prompts']} prompts "
                     f"of {wl['prompt_len'][0]}–{wl['prompt_len'][1]} tokens, {wl['max_new_tokens']} new "
                     f"tokens each, greedy; prompts sha256 {wl['prompts_sha256']}.")
    lines.append("")
    if any(str(r["records"][1].get("device", "")).startswith("cpu") for r in rows if r["status"] == "ok"):
        lines += ["CPU rows check identity and the plumbing: vattn's CPU attention is the per-request "
                  "reference math of the correctness path, so their times are no performance claim.", ""]
    lines.append("Rounds alternate stock and vattn (stock, vattn, stock, vattn, ...); a ratio above 1 "
                 "means vattn was faster. Where each engine ran:")
    seen = set()
    for row in rows:
        if row["status"] != "ok" or row["engine"] in seen:
            continue
        seen.add(row["engine"])
        rec = row["records"][1]
        gpu = f" ({rec['gpu']})" if rec.get("gpu") else ""
        lines.append(f"- {rec['engine']} {rec.get('engine_version')}: {rec['device']}{gpu}, host "
                     f"{rec.get('host')} ({rec.get('cpu_count')} CPUs), Python {rec.get('python_version')}, "
                     f"torch {rec.get('torch')}, {rec.get('date')}")
    return "\n".join(lines).rstrip() + "\n"


def plot(rows: list[dict], path: str, *, title: str) -> str | None:
    """Bars of vattn's median speed over stock per engine and workload, whiskers at the
    per-round min / max; engines that did not run are labelled. ``None`` with no rows."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(max(5.0, 1.3 * len(rows) + 2), 3.6))
    for i, row in enumerate(rows):
        if row["ratios"]:
            med = statistics.median(row["ratios"])
            err = [[med - min(row["ratios"])], [max(row["ratios"]) - med]]
            ax.bar(i, med, 0.6, yerr=err, capsize=4, color="#2a6" if row["ok"] else "#c44")
            ax.text(i, max(row["ratios"]), f"{med:.3f}", ha="center", va="bottom", fontsize=8)
        else:
            ax.text(i, 1.0, row["status"].replace(" ", "\n"), ha="center", va="bottom", fontsize=8,
                    color="0.4")
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    labels = [row["engine"] + (f"\n{row['workload']}" if row["workload"] else "") for row in rows]
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylabel("vattn speed / stock (same engine)")
    ax.set_title(title, fontsize=10)
    values = [v for row in rows for v in row["ratios"]] or [1.0]
    ax.set_ylim(0, max(values + [1.0]) * 1.2)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
