"""``vattn compare``: one workload set on one model shape through every engine, stock and vattn,
into one Markdown table and one plot.

Each engine runs in the Python it is installed in (``--python ENGINE=PATH``; default: this one),
one engine at a time: a worker process (``vattn.conformance.compare_worker``) alternates the
engine's stock mode and vattn for ``--rounds`` rounds through the engine's conformance runner and
writes one JSON record per mode under ``--out``. The table is built from those records, so
``--results DIR [DIR ...]`` merges runs made elsewhere (other machines, other days) into the same
table; runs of different model shapes or workloads are refused. An engine that is not installed
gets a row saying so. Exit status 0 when an engine ran and none failed or diverged, else 1.

``--shape llama3-8b-shape|llama-1b-shape`` runs the GPU stages' setup (``vattn.bench.gpu``): a
config-only model of that shape (vLLM and SGLang load it with dummy weights, transformers draws
seeded weights on the GPU: no weight file), the workloads of their table (``--workloads
decode-heavy,shared-prefix,...``, the same seeded prompts for every engine), and every engine
with its own defaults (vLLM's and SGLang's sizing, prefix caching, CUDA graphs) plus vattn's
activation only; ``--engine-option ENGINE:KEY=VALUE`` adds an engine argument to both modes
(``vllm:max_model_len=32768``, ``sglang:mem_fraction_static=0.8``) and ``--dry-run`` prints what
each engine would be started with. On CUDA the HBM column divides each run's decode traffic by
the copy bandwidth measured on that GPU at the start (or ``--hbm-tbps``).
``VATTN_STAGE_DEADLINE`` (epoch seconds) stops starting rounds that would not end before it.

Example::

    vattn compare --engines transformers,vllm --python vllm=.venvs/vllm/bin/python --out runs/cmp
    vattn compare --results runs/cmp runs/cmp-gpu --out runs/merged
    vattn compare --shape llama-1b-shape --engines vllm --python vllm=PY --dry-run
    bash tools/gpu/compare.sh   # on a GPU: every engine in its own Python, one table (its header)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys

import torch

from vattn import argtypes
from vattn.core.errors import ConfigError, UnsupportedError

from . import compare_gpu
from .cli import add_scale_options
from .compare_records import clear_engine_records, load_records, merge, write_record
from .compare_table import markdown, plot, table_rows
from .engines import ENGINES, check_engine_installed
from .models import PRESETS
from .workloads import WORKLOADS

__all__ = ["add_arguments", "run", "read_records", "probe_gpu"]

_RUN_ONLY = ("engines", "python", "rounds", "engine_option", "model", "layers", "workload",
             "workloads", "shape", "num_requests", "size", "device", "dtype", "models_dir")
_ALL_WORKLOADS = tuple(dict.fromkeys(WORKLOADS + compare_gpu.WORKLOADS))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    names = tuple(ENGINES)
    parser.add_argument("--engines", type=argtypes.name_list(names), default=None,
                        help=f"comma-separated, run in this order (default: all: {','.join(names)})")
    parser.add_argument("--python", type=argtypes.name_path(names), action="append", default=None,
                        metavar="ENGINE=PATH",
                        help="run ENGINE under another Python (repeatable), e.g. vllm=.venvs/vllm/bin/python")
    parser.add_argument("--rounds", type=argtypes.int_at_least(3), default=None,
                        help="alternated rounds per engine and workload, stock then vattn each (default 3)")
    parser.add_argument("--shape", choices=tuple(compare_gpu.SHAPES), default=None,
                        help="the GPU setup: this model shape (config only; dummy weights in vLLM and "
                             "SGLang, seeded weights drawn on the GPU in transformers), the GPU stages' "
                             "workloads (--workloads), every engine with its own defaults plus vattn's "
                             "activation; default device cuda, bfloat16")
    parser.add_argument("--model", default=None,
                        help=f"a preset ({', '.join(PRESETS)}) or a model directory; default tiny "
                             "(llama3-8b-shape with --size gpu); not with --shape")
    parser.add_argument("--layers", type=argtypes.positive_int, default=None,
                        help="override the preset's (or the shape's) num_hidden_layers")
    parser.add_argument("--workloads", type=argtypes.name_list(_ALL_WORKLOADS), default=None,
                        help=f"comma-separated, in order; with --shape: {', '.join(compare_gpu.WORKLOADS)} "
                             f"(the GPU stages' table); else: {', '.join(WORKLOADS)}; default decode-heavy")
    parser.add_argument("--workload", action="append", choices=WORKLOADS, default=None,
                        help="repeatable, one workload of the CPU / conformance table (as --workloads "
                             "without --shape)")
    parser.add_argument("--num-requests", type=argtypes.positive_int, default=None,
                        help="override the number of prompts of every workload (with --shape: the "
                             "first N of the seeded prompts)")
    add_scale_options(parser)
    parser.add_argument("--seed", type=argtypes.non_negative_int, default=0,
                        help="seed of the weights and the prompts")
    parser.add_argument("--logprobs", type=argtypes.non_negative_int, default=5,
                        help="top-k log-probs asked for in every run, both modes (near-ties need them)")
    parser.add_argument("--max-gap", type=argtypes.non_negative_float, default=0.1,
                        help="near-tie log-prob gap (nats) of the identity verdict")
    parser.add_argument("--hbm-tbps", type=argtypes.positive_float, default=None,
                        help="HBM copy bandwidth (TB/s) for the decode-heavy HBM share (GPU); default: "
                             "measured on the GPU before the engines run (vattn.bench.paged_baselines."
                             "hbm_copy_tbps), or the records' own measurement with --results")
    parser.add_argument("--engine-option", action="append", default=None, metavar="ENGINE:KEY=VALUE",
                        help="repeatable, JSON value. With --shape: an argument of the engine itself, "
                             "added to both modes (vLLM's LLM(...), e.g. vllm:max_model_len=32768; "
                             "SGLang's sglang.Engine(...), e.g. sglang:mem_fraction_static=0.8; "
                             "transformers / tgi: their runner's options, e.g. "
                             "transformers:max_batch_tokens=8192). Without: an option of the engine's "
                             "conformance runner, e.g. vllm:max_num_seqs=64")
    parser.add_argument("--dry-run", action="store_true",
                        help="print what each engine would be started with (per mode: its arguments "
                             "and the environment it changes) as JSON; start nothing")
    parser.add_argument("--models-dir", default=None, help="where random models are built (default: temp)")
    parser.add_argument("--out", default=os.path.join("reports", "compare"),
                        help="records (run_*.json, status_*.json), compare.md and compare.png go here; "
                             "an engine run again replaces its earlier records there")
    parser.add_argument("--results", nargs="+", default=None, metavar="DIR",
                        help="run nothing: merge the records of these folders into one table (refused "
                             "for different model shapes or workloads)")


def run(args: argparse.Namespace) -> int:
    """Run (or merge) and write the table; 0 when at least one engine ran and no engine failed
    or diverged (not-installed engines do not count), else 1.

    Raises
    ------
    ConfigError
        Options that do not go together, or records that cannot be merged.
    """
    if args.results:
        given = [f"--{k.replace('_', '-')}" for k in _RUN_ONLY if getattr(args, k, None) is not None]
        given += ["--dry-run"] if getattr(args, "dry_run", False) else []
        if given:
            raise ConfigError(f"--results merges saved records and runs nothing: expected no run "
                              f"option with it, got {', '.join(given)}")
        merged = merge(load_records(args.results))
        return _render(merged, args, engines=None)
    engines = list(dict.fromkeys(args.engines or ENGINES))
    pythons = dict(args.python or [])
    extra = sorted(set(pythons) - set(engines))
    if extra:
        raise ConfigError(f"--python names {extra}, which --engines ({','.join(engines)}) leaves out")
    options = _engine_options(args.engine_option or [], engines)
    spec = _base_spec(args)
    key = "engine_args" if spec.get("shape") else "runner_options"
    if spec.get("shape"):
        for engine in engines:
            compare_gpu.check_engine_args(engine, options.get(engine, {}))
    if args.dry_run:
        print(json.dumps(_dry_run(spec, engines, options, pythons), indent=1, default=str))
        return 0
    if spec["device"].startswith("cuda"):
        spec.update(probe_gpu(measure=args.hbm_tbps is None))
        if args.hbm_tbps is not None:
            spec.update(hbm_copy_tbps=args.hbm_tbps, hbm_copy_source="given: --hbm-tbps")
    paths = []
    with _sigterm_raises():
        for engine in engines:
            clear_engine_records(args.out, engine)
            paths += _run_engine(dict(spec, engine=engine, **{key: options.get(engine, {})}),
                                 pythons.get(engine))
    merged = merge(read_records(paths))
    return _render(merged, args, engines=engines)


@contextlib.contextmanager
def _sigterm_raises():
    """SIGTERM (``timeout``) raises ``SystemExit`` while engines run, so the worker in flight is
    stopped in order (it keeps its finished rounds) instead of left behind."""
    import signal
    import threading
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise SystemExit(128 + signum)
    before = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


_PROBE = """
import json, torch
found = {"gpu": torch.cuda.get_device_name()}
if MEASURE:
    from vattn.bench.paged_baselines import hbm_copy_tbps
    found["hbm_copy_tbps"] = round(hbm_copy_tbps("cuda"), 3)
    found["hbm_copy_source"] = "measured: 4 GiB device-to-device copy"
print(json.dumps(found))
"""


def probe_gpu(*, measure: bool = True, python: str | None = None, timeout_s: float = 180) -> dict:
    """The GPU's name and (``measure``) its copy bandwidth, from a process of its own: this one
    (and every engine's worker) must hold no CUDA context, since the engines size their KV
    cache from free memory. ``{}`` (with a line saying why) when the probe fails."""
    try:
        proc = subprocess.run([python or sys.executable, "-c", _PROBE.replace("MEASURE", str(bool(measure)))],
                              capture_output=True, text=True, timeout=timeout_s)
        found = json.loads(proc.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, json.JSONDecodeError, IndexError, OSError) as exc:
        tail = locals().get("proc")
        print(f"[compare] GPU probe failed ({type(exc).__name__}): "
              f"{(tail.stderr[-500:] if tail is not None else '')}", flush=True)
        return {}
    if "hbm_copy_tbps" in found:
        print(f"[compare] {found['gpu']}: copy bandwidth {found['hbm_copy_tbps']} TB/s", flush=True)
    return found


def _dry_run(spec: dict, engines: list[str], options: dict, pythons: dict) -> dict:
    """What ``vattn compare`` would start, per engine and mode (:func:`compare_gpu.describe`), for
    the first workload's prompts; nothing is built or started."""
    from .compare_worker import PAIR
    name = spec["workloads"][0]
    if spec.get("shape"):
        fields = compare_gpu.shape_fields(spec)
        wl = compare_gpu.workload(name, vocab_size=fields["vocab_size"], seed=spec["seed"],
                                  num=spec.get("num_requests"))
        model = compare_gpu.model_dir(spec)
    else:
        from .models import _fields
        from .workloads import make_workload
        fields = _fields(spec["model"]) if spec["model"] in PRESETS else None
        if fields is None:
            from .models import model_shape
            shape = model_shape(spec["model"])
            vocab, max_pos = shape.vocab_size, shape.max_position
        else:
            vocab, max_pos = fields["vocab_size"], fields["max_position_embeddings"]
        wl = make_workload(name, size=spec["size"], vocab_size=vocab, seed=spec["seed"],
                           max_context=max_pos, num=spec.get("num_requests"))
        model = spec["model"]
    lens = [len(p) for p in wl.prompts]
    out = {"model": model, "model_label": spec["model_label"], "device": spec["device"], "dtype": spec["dtype"],
           "workload": {"name": name, "prompts": len(lens), "prompt_len": [min(lens), max(lens)],
                        "max_new_tokens": wl.max_new_tokens},
           "rounds": spec["rounds"], "engines": {}}
    for engine in engines:
        espec = dict(spec, engine_args=options.get(engine, {}))
        if spec.get("shape"):
            opts = compare_gpu.runner_options(engine, espec)
        else:
            opts = dict(options.get(engine, {}))
            if engine in ("vllm", "sglang"):
                opts.setdefault("modes", PAIR)
            if engine == "vllm":
                opts.setdefault("device", spec["device"])
        found = compare_gpu.describe(engine, opts, model=model, prompts=wl.prompts,
                                     max_new_tokens=wl.max_new_tokens, device=spec["device"],
                                     dtype=spec["dtype"], logprobs=spec["logprobs"])
        out["engines"][engine] = {"python": pythons.get(engine, sys.executable),
                                  "weights": compare_gpu.weights(engine, espec),
                                  **found}
    return out


def _workload_names(args, table: tuple[str, ...], flag: str) -> list[str]:
    if args.workloads is not None and args.workload is not None:
        raise ConfigError("--workloads and --workload name the same thing: expected one of them")
    names = list(dict.fromkeys(args.workloads or args.workload or ["decode-heavy"]))
    bad = [n for n in names if n not in table]
    if bad:
        raise ConfigError(f"--workloads {flag}: expected names from {', '.join(table)}, got {bad}")
    return names


def _shape_spec(args) -> dict:
    given = [f"--{k}" for k in ("model", "size", "workload") if getattr(args, k, None) is not None]
    if given:
        raise ConfigError(f"--shape picks the model and the workload table: expected no {', '.join(given)} "
                          "with it (--workloads names its workloads)")
    label = args.shape + ("" if args.layers is None else f" ({args.layers} layers)")
    return {"out_dir": os.path.abspath(args.out), "shape": args.shape, "model": args.shape, "model_label": label,
            "layers": args.layers, "models_dir": args.models_dir and os.path.abspath(args.models_dir),
            "device": args.device or "cuda", "dtype": args.dtype or "bfloat16", "size": "gpu-stages",
            "seed": args.seed, "workloads": _workload_names(args, compare_gpu.WORKLOADS, "with --shape"),
            "num_requests": args.num_requests, "rounds": args.rounds or 3, "logprobs": args.logprobs}


def _base_spec(args) -> dict:
    if args.shape:
        return _shape_spec(args)
    workloads = _workload_names(args, WORKLOADS, "without --shape")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    preset = args.model or ("llama3-8b-shape" if args.size == "gpu" else "tiny")
    if not os.path.isdir(preset) and preset not in PRESETS:
        raise ConfigError(f"--model: expected a preset ({', '.join(PRESETS)}) or a model directory, "
                          f"got {preset!r}")
    size = args.size or ("gpu" if preset == "llama3-8b-shape" and device.startswith("cuda") else "cpu")
    label = preset if preset in PRESETS else os.path.basename(os.path.normpath(preset))
    if args.layers is not None:
        label += f" ({args.layers} layers)"
    return {"out_dir": os.path.abspath(args.out), "model": os.path.abspath(preset) if os.path.isdir(preset)
            else preset, "model_label": label, "layers": args.layers,
            "models_dir": args.models_dir and os.path.abspath(args.models_dir), "device": device,
            "dtype": dtype, "size": size, "seed": args.seed, "workloads": workloads,
            "num_requests": args.num_requests, "rounds": args.rounds or 3, "logprobs": args.logprobs}


def _engine_options(items: list[str], engines: list[str]) -> dict:
    from .cli import _engine_options as parse
    found: dict[str, dict] = {}
    for item in items:
        engine, sep, rest = item.partition(":")
        if not sep or engine not in engines:
            raise ConfigError(f"--engine-option must be ENGINE:KEY=VALUE with ENGINE one of "
                              f"{','.join(engines)}, got {item!r}")
        found.setdefault(engine, {}).update(parse([rest]))
    return found


def _run_engine(spec: dict, python: str | None) -> list[str]:
    """Run one engine's worker (in ``python``, default this one); return its record paths."""
    from .compare_worker import not_installed
    engine = spec["engine"]
    if python is None:             # (a venv's python resolves to its base one: never compare paths)
        try:                       # cheap: no process to start for an engine that is not here
            check_engine_installed(engine)
        except UnsupportedError:
            path = write_record(spec["out_dir"], not_installed(spec))
            print(f"[compare] {engine}: not installed in {sys.executable}", flush=True)
            return [path]
    python = python or sys.executable
    logs = os.path.join(spec["out_dir"], "logs")
    os.makedirs(logs, exist_ok=True)
    spec_path, log_path = os.path.join(logs, f"spec_{engine}.json"), os.path.join(logs, f"compare_{engine}.log")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    print(f"[compare] {engine}: running under {python} (log: {log_path})", flush=True)
    last, code = _tee([python, "-m", "vattn.conformance.compare_worker", spec_path], log_path)
    try:
        return json.loads(last)["records"]
    except (json.JSONDecodeError, KeyError, TypeError):
        with open(log_path, errors="replace") as f:
            tail = f.read()[-2000:]
        from .compare_worker import _status
        rec = _status(spec, "failed", f"the worker under {python} exited {code} without its records "
                                      f"(log: {log_path}):\n{tail}")
        rec["python"] = python
        return [write_record(spec["out_dir"], rec)]


def _tee(cmd: list[str], log_path: str) -> tuple[str, int]:
    """Run ``cmd``, its output both to this stdout and ``log_path``; return its last
    ``{"records": ...}`` line (what an engine prints at exit may follow it) and exit status."""
    last = ""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace")
        try:
            for line in proc.stdout:
                log.write(line)
                sys.stdout.write(line)
                if line.startswith('{"records":'):
                    last = line.strip()
            proc.wait()
        except BaseException:   # SIGTERM (see run) or Ctrl-C: the worker keeps its finished rounds
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise
    sys.stdout.flush()
    return last, proc.returncode


def read_records(paths: list[str]) -> list[dict]:
    """The records at ``paths`` (each with its ``_path``)."""
    from .compare_records import _read
    return [_read(p, strict=True) for p in paths]


def _render(merged: dict, args, *, engines: list[str] | None) -> int:
    rows = table_rows(merged, engines=engines, hbm_tbps=args.hbm_tbps, max_gap=args.max_gap)
    os.makedirs(args.out, exist_ok=True)
    label = (merged["model"] or {}).get("label") or "no engine ran"
    png = None
    try:
        png = plot(rows, os.path.join(args.out, "compare.png"), title=f"stock vs vattn per engine: {label}")
    except ImportError as exc:
        print(f"[compare] no plot: {exc} (pip install matplotlib)", flush=True)
    body = markdown(merged, rows, png=png and os.path.basename(png))
    md = os.path.join(args.out, "compare.md")
    with open(md, "w") as f:
        f.write(body)
    print(body)
    print(f"table: {md}" + (f", plot: {png}" if png else ""))
    ran = [r for r in rows if r["status"] == "ok"]
    failed = [r for r in rows if r["status"] in ("failed", "incomplete")]
    return 0 if ran and not failed and all(r["ok"] for r in ran) else 1
