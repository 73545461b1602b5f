"""The JSON records of ``vattn compare``: one per engine run (engine, workload, mode), or one
status record for an engine that did not run; written, read back and merged.

A run record holds everything the table needs, so records from other machines or days can be
merged (``vattn compare --results DIR ...``): the engine and its version, the mode, the model
shape's fingerprint, the workload's name, seed, sizes and a hash of its prompts, each round's
seconds (and its place in the alternated order), the first round's token ids (and log-probs) for
the identity check, a hash of every round's tokens, and the engine's metrics.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os

from vattn.core.errors import ConfigError

from .models import STAMP

__all__ = ["SCHEMA", "model_fingerprint", "workload_fingerprint", "tokens_sha256", "record_path",
           "write_record", "load_records", "merge", "clear_engine_records"]

SCHEMA = "vattn-compare/1"
#: the fields of a model that make two runs comparable (the preset's name is only a label)
MODEL_FIELDS = ("config", "dtype", "seed")
_CONFIG_KEYS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "intermediate_size", "vocab_size", "max_position_embeddings", "rope_theta")


def _sha256(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def tokens_sha256(token_ids: list[list[int]]) -> str:
    """A short hash of generated token ids (equal outputs, equal hashes)."""
    return _sha256([list(map(int, t)) for t in token_ids])


def model_fingerprint(model_dir: str, *, label: str, dtype: str) -> dict:
    """``{"label", "config": {...}, "dtype", "seed", "sha256"}`` of a model directory.

    ``config`` is the shape of ``config.json`` (layers, sizes, heads, vocabulary, positions);
    ``seed`` is the random weights' seed from the build stamp (``None`` for a model not built
    by :func:`vattn.conformance.models.build_model`).
    """
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    heads = cfg.get("num_attention_heads")
    config = {k: cfg.get(k) for k in _CONFIG_KEYS}
    config["head_dim"] = config["head_dim"] or (cfg["hidden_size"] // heads if heads else None)
    config["num_key_value_heads"] = config["num_key_value_heads"] or heads
    # transformers 5 writes rope_parameters, older versions rope_theta: one field either way
    config["rope_theta"] = config["rope_theta"] or (cfg.get("rope_parameters") or {}).get("rope_theta")
    seed = None
    stamp = os.path.join(model_dir, STAMP)
    if os.path.exists(stamp):
        with open(stamp) as f:
            seed = json.load(f).get("seed")
    found = {"config": config, "dtype": dtype, "seed": seed}
    return {"label": label, **found, "sha256": _sha256(found)}


def workload_fingerprint(workload, *, size: str, seed: int) -> dict:
    """Name, size, seed, prompt count and lengths, output length and a hash of the prompts."""
    lens = [len(p) for p in workload.prompts]
    return {"name": workload.name, "size": size, "seed": seed, "num_prompts": len(lens),
            "prompt_len": [min(lens), max(lens)], "prompt_tokens": sum(lens),
            "max_new_tokens": workload.max_new_tokens, "prompts_sha256": tokens_sha256(workload.prompts)}


def record_path(out_dir: str, record: dict) -> str:
    """``run_<engine>_<workload>_<mode>.json``, or ``status_<engine>[_<workload>].json``."""
    if record["status"] == "ok":
        name = f"run_{record['engine']}_{record['workload']['name']}_{record['mode']}.json"
    else:
        wl = (record.get("workload") or {}).get("name")
        name = f"status_{record['engine']}{'_' + wl if wl else ''}.json"
    return os.path.join(out_dir, name)


def write_record(out_dir: str, record: dict) -> str:
    """Write ``record`` (``schema`` added) under ``out_dir``; return its path."""
    os.makedirs(out_dir, exist_ok=True)
    record = {"schema": SCHEMA, **record}
    path = record_path(out_dir, record)
    with open(path, "w") as f:
        json.dump(record, f, indent=1, default=str)
    return path


def clear_engine_records(out_dir: str, engine: str) -> list[str]:
    """Remove ``engine``'s earlier compare records from ``out_dir`` (only files of this schema);
    return the paths removed. A run of an engine replaces its records, never adds to them."""
    removed = []
    for path in _candidates(out_dir):
        rec = _read(path, strict=False)
        if rec is not None and rec.get("engine") == engine:
            os.remove(path)
            removed.append(path)
    return removed


def _candidates(folder: str) -> list[str]:
    return sorted(glob.glob(os.path.join(folder, "run_*.json")) +
                  glob.glob(os.path.join(folder, "status_*.json")))


def _read(path: str, *, strict: bool) -> dict | None:
    try:
        with open(path) as f:
            rec = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        if strict:
            raise ConfigError(f"--results: expected a vattn compare JSON record, got {path!r} "
                              f"({type(exc).__name__}: {exc})") from exc
        return None
    if not isinstance(rec, dict) or rec.get("schema") != SCHEMA:
        if strict:
            raise ConfigError(f"--results: expected a record with schema {SCHEMA!r}, got {path!r} "
                              f"(schema {rec.get('schema') if isinstance(rec, dict) else None!r})")
        return None
    rec["_path"] = path
    return rec


def load_records(folders: list[str]) -> list[dict]:
    """Every compare record (``run_*.json``, ``status_*.json``) of ``folders``, each with its
    ``_path``.

    Raises
    ------
    ConfigError
        A folder is missing or holds no record, or a record is not valid JSON of this schema.
    """
    records = []
    for folder in folders:
        if not os.path.isdir(folder):
            raise ConfigError(f"--results: expected a folder of vattn compare records, got {folder!r} "
                              f"(no such folder)")
        found = [_read(p, strict=True) for p in _candidates(folder)]
        if not found:
            raise ConfigError(f"--results: expected run_*.json / status_*.json records of vattn compare "
                              f"in {folder!r}, found none")
        records += found
    return records


def merge(records: list[dict]) -> dict:
    """Group records for the table: ``{"runs": {(engine, workload): {mode: record}},
    "status": {engine: [record]}, "model": fingerprint, "workloads": {name: fingerprint}}``.

    A status record of an engine that also ran somewhere (e.g. not installed on one machine,
    run on another) is dropped.

    Raises
    ------
    ConfigError
        Runs of different model shapes (config, dtype or weight seed) or of different workloads
        (the same name with other sizes, seed or prompts; or engines that ran different sets of
        workloads), or one engine / workload / mode found twice. The message names the fields
        that differ and the files that hold them.
    """
    runs: dict[tuple, dict] = {}
    model, model_src, model_full, workloads, wl_src = None, None, None, {}, {}
    for rec in records:
        if rec.get("status") != "ok":
            continue
        fp = {k: rec["model"].get(k) for k in MODEL_FIELDS}
        if model is None:
            model, model_src, model_full = fp, rec["_path"], rec["model"]
        elif fp != model:
            raise ConfigError(f"cannot merge runs of different model shapes: {_diff(model, fp, 'model')} "
                              f"({model_src} vs {rec['_path']})")
        name = rec["workload"]["name"]
        if name not in workloads:
            workloads[name], wl_src[name] = rec["workload"], rec["_path"]
        elif rec["workload"] != workloads[name]:
            raise ConfigError(f"cannot merge runs of different workloads: "
                              f"{_diff(workloads[name], rec['workload'], 'workload')} "
                              f"({wl_src[name]} vs {rec['_path']})")
        key = (rec["engine"], name)
        if rec["mode"] in runs.get(key, {}):
            raise ConfigError(f"cannot merge: engine {rec['engine']!r} workload {name!r} mode "
                              f"{rec['mode']!r} is in both {runs[key][rec['mode']]['_path']} and "
                              f"{rec['_path']}; pass only one of their folders")
        runs.setdefault(key, {})[rec["mode"]] = rec
    attempted = {key: set(modes) for key, modes in runs.items()}
    for rec in records:     # a workload an engine tried and failed counts as run for the sets
        if rec.get("status") != "ok" and rec.get("workload"):
            attempted.setdefault((rec["engine"], rec["workload"]["name"]), set())
    _same_workload_sets(attempted)
    ran = {engine for engine, _ in runs}
    status: dict[str, list] = {}
    for rec in records:
        if rec.get("status") != "ok" and (rec["engine"] not in ran or rec.get("workload")):
            status.setdefault(rec["engine"], []).append(rec)
    return {"runs": runs, "status": status, "model": model_full, "workloads": workloads}


def _same_workload_sets(runs: dict) -> None:
    sets: dict[str, set] = {}
    for engine, name in runs:
        sets.setdefault(engine, set()).add(name)
    distinct = {frozenset(s) for s in sets.values()}
    if len(distinct) > 1:
        shown = "; ".join(f"{e}: {sorted(s)}" for e, s in sorted(sets.items()))
        raise ConfigError(f"cannot merge runs of different workloads: the engines ran different "
                          f"workload sets ({shown}); merge folders that ran the same --workload list")


def _diff(a: dict, b: dict, prefix: str) -> str:
    """``"model.config.num_hidden_layers: 2 vs 4, ..."``: the leaves of two dicts that differ."""
    out = []
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key), b.get(key)
        if isinstance(x, dict) and isinstance(y, dict):
            inner = _diff(x, y, f"{prefix}.{key}")
            if inner:
                out.append(inner)
        elif x != y:
            out.append(f"{prefix}.{key}: {x!r} vs {y!r}")
    return ", ".join(out)
