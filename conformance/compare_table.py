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
    # the engines' dummy weights (uniform, tiny) may well give degenerate outputs: that says
    # nothing against vattn, only that the tokens are a weak check there (both modes load the
    # same dummy weights; the verdict above still compares them)
    dummy = base_rec.get("weights") == "dummy"
    if not degenerate["ok"]:
        text += f"; outputs degenerate ({degenerate['reason']})" + (
            ": dummy weights, a weak check" if dummy else "")
    for rec in (base_rec, cand_rec):
        if len({r["tokens_sha256"] for r in rec["rounds"]}) > 1:
            text += f"; {rec['mode']}'s tokens differ between rounds"
    return text, rep.ok and (degenerate["ok"] or dummy)


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
    """vattn's effective decode bandwidth (the lower bound of the bytes a decode-heavy run moves
    over its median time) as a share of the copy bandwidth: ``hbm_tbps`` (``--hbm-tbps``) or
    the one measured on the record's GPU."""
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
    copy = hbm_tbps or rec.get("hbm_copy_tbps")
    if not copy:
        return f"≥ {rate / 1e9:,.0f} GB/s (no copy bandwidth measured: pass --hbm-tbps for the share)"
    shown = hbm_tbps if hbm_tbps else f"{copy:.2f}"
    return f"{100 * rate / (copy * 1e12):.0f} % (≥ {rate / 1e9:,.0f} GB/s of {shown} TB/s)"


def _ratio_cell(ratios: list[float], cand: dict) -> str:
    cell = f"**{statistics.median(ratios):.3f}×** ({min(ratios):.3f}–{max(ratios):.3f}, {len(ratios)} rounds)"
    if cand.get("stopped"):
        cell += f"; {_one_line(cand['stopped'], 160)}"
    elif cand.get("rounds_planned") and len(ratios) < cand["rounds_planned"]:
        cell += f"; {len(ratios)} of {cand['rounds_planned']} rounds"
    return cell


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
    engine = f"{base['engine']} {base.get('engine_version') or ''}".strip()
    if base["mode"] != "stock":
        engine += f" (baseline: {base['mode']})"
    cells = [engine, base["workload"]["name"], _time_cell(sb), _time_cell(sv), _ratio_cell(ratios, cand), ident,
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
    ran = [r for r in rows if r["status"] == "ok"]
    if model:
        cfg = model.get("config") or {}
        kinds = {r["records"][0].get("weights", "seeded") for r in ran}
        weights = (f"random weights (seed {model.get('seed')})" if kinds <= {"seeded"} else
                   f"config only: {_weights_text(kinds, model)}")
        lines.append(f"Model `{model.get('label')}`: {cfg.get('num_hidden_layers')} layers, hidden "
                     f"{cfg.get('hidden_size')}, {cfg.get('num_attention_heads')} heads / "
                     f"{cfg.get('num_key_value_heads')} KV heads × {cfg.get('head_dim')}, vocabulary "
                     f"{cfg.get('vocab_size')}, {cfg.get('max_position_embeddings')} positions, "
                     f"{model.get('dtype')}, {weights}.")
    for name, wl in merged["workloads"].items():
        table = "the GPU stages' table" if wl["size"] == "gpu-stages" else f"{wl['size']} size"
        lines.append(f"Workload `{name}` ({table}, seed {wl['seed']}): {wl['num_prompts']} prompts "
                     f"of {wl['prompt_len'][0]}–{wl['prompt_len'][1]} tokens, {wl['max_new_tokens']} new "
                     f"tokens each, all at once, greedy; prompts sha256 {wl['prompts_sha256']}.")
    lines.append("")
    if any(str(r["records"][1].get("device", "")).startswith("cpu") for r in rows if r["status"] == "ok"):
        lines += ["CPU rows check identity and the plumbing: vattn's CPU attention is the per-request "
                  "reference math of the correctness path, so their times are no performance claim.", ""]
    if any(str(r["records"][1].get("device", "")).startswith("cuda") for r in ran):
        lines += ["GPU rows: vLLM and SGLang start a fresh engine for every run (its start is not "
                  "timed), transformers switches one loaded model between the modes; "
                  "VMM critical-path share = vattn's host time inside the engine's step (vLLM: "
                  "apply_step + on_blocks; SGLang: alloc_extend + alloc_decode + free) over the last "
                  "round's time; HBM share = the decode traffic's lower bound (every weight once per "
                  "step + every running request's KV) over the median time, against the GPU's "
                  "device-to-device copy bandwidth.", ""]
    lines.append("Rounds alternate stock and vattn (stock, vattn, stock, vattn, ...); a ratio above 1 "
                 "means vattn was faster. Where each engine ran:")
    seen = set()
    for row in rows:
        if row["status"] != "ok" or row["engine"] in seen:
            continue
        seen.add(row["engine"])
        rec = row["records"][1]
        gpu = f" ({rec['gpu']})" if rec.get("gpu") else ""
        copy = (f", copy bandwidth {rec['hbm_copy_tbps']} TB/s ({rec.get('hbm_copy_source')})"
                if rec.get("hbm_copy_tbps") else "")
        weights = f", weights: {_weights_text({rec['weights']}, None)}" if rec.get("weights") else ""
        lines.append(f"- {rec['engine']} {rec.get('engine_version')}: {rec['device']}{gpu}, host "
                     f"{rec.get('host')} ({rec.get('cpu_count')} CPUs), Python {rec.get('python_version')}, "
                     f"torch {rec.get('torch')}, {rec.get('date')}{weights}{copy}")
    return "\n".join(lines).rstrip() + "\n"


def _weights_text(kinds: set, model: dict | None) -> str:
    seed = f"seed {model.get('seed')}, " if model else ""
    words = {"dummy": "the engine's dummy weights (load_format=dummy)",
             "seeded": f"seeded random weights ({seed}std 0.02)"}
    return "; ".join(words.get(k, k) for k in sorted(kinds))


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
