"""``vattn bench serve``: an engine's own server and benchmark client, stock vs vattn, alternated.

Each run starts a fresh OpenAI-compatible server of the engine (:mod:`.serve_engines`), waits for
``/health``, runs the engine's own client against it (:mod:`.serve_clients`: ``vllm bench serve``
or SGLang's ``bench_serving``), parses its JSON into one row and kills the server's process
group. ``--rounds N`` runs stock, vattn, stock, vattn, ... (a machine warms up over a session:
each round's pair ran next to each other). Written under ``--out``: ``rows.json`` (every run,
failed ones with their error), ``report.md`` (per mode the median and min–max of each metric,
vattn/stock per round, :mod:`.serve_report`), ``serve_plot.png`` (TTFT / TPOT p50 and p99 per
round, with matplotlib) and ``runs/<round>-<mode>/`` (server log, client log, client JSON).

Random-weight models carry no tokenizer: a word-level one is written into the model directory
(:func:`vattn.conformance.tokenizer.write_tokenizer`) when it has none. ``--preset NAME`` builds
a config-only model of :data:`vattn.conformance.models.PRESETS` (loaded with dummy weights).

Example::

    vattn bench serve --engine vllm --preset llama-1b-shape --dataset random --rounds 2 \\
        --rate 24 --num-prompts 480 --input-len 1024 --output-len 256 --out runs/serve-1b
    vattn bench serve --engine vllm --model DIR --rounds 1 --rate 2 --num-prompts 8 \\
        --input-len 64 --output-len 16 --out runs/serve-tiny -- --max-num-seqs 8
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

from vattn import argtypes
from vattn.core.errors import ConfigError, UnsupportedError

from .serve_clients import (DATASETS, ClientError, Workload, check_vllm_version, client_command,
                            parse_result, read_result, run_client)
from .serve_engines import ENGINES, MODES, Server, free_port, mode_base, server_command
from .serve_report import markdown, plot, title_for

__all__ = ["add_arguments", "add_server_arguments", "run", "order", "modes_of", "prepare_model", "run_rounds",
           "await_idle_snapshot",
           "rate", "device_for", "sigterm_raises"]


def rate(text: str) -> float:
    """``--rate``: requests/s, a finite number > 0 or ``inf`` (every request at once)."""
    if text.strip().lower() == "inf":
        return float("inf")
    return argtypes.positive_float(text)


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of every command that starts an engine server (``serve``, ``soak``)."""
    parser.add_argument("--engine", choices=ENGINES, required=True)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", help="a model directory (config.json; weights or not)")
    which.add_argument("--preset", help="a config-only model preset of vattn.conformance.models, "
                                        "e.g. llama-1b-shape, llama3-8b-shape")
    parser.add_argument("--out", required=True, help="results folder")
    parser.add_argument("--models", default=None, help="where --preset models are built "
                                                       "(default OUT/models)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="the engine's platform (auto: cuda when torch sees a GPU)")
    parser.add_argument("--python", default=sys.executable,
                        help="the interpreter with the engine installed (default this one)")
    parser.add_argument("--server-timeout", type=argtypes.positive_float, default=900.0,
                        help="seconds a server may take to answer /health")
    parser.add_argument("engine_args", nargs="*", metavar="-- ENGINE_ARGS",
                        help="extra server arguments, after --")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_server_arguments(parser)
    parser.add_argument("--dataset", choices=DATASETS, default="random")
    parser.add_argument("--modes", nargs="+", default=list(MODES),
                        help="the modes of every round, in order (default: stock vattn; one of them "
                             "alone re-runs that side, with no ratio in the report; vLLM also takes "
                             "the conformance runner's vattn variants, e.g. vattn:h1 vattn:b0, "
                             "each compared with stock)")
    parser.add_argument("--rounds", type=argtypes.positive_int, default=2,
                        help="rounds of (stock, vattn), each a fresh server per mode")
    parser.add_argument("--rate", type=rate, default=8.0, help="requests/s (Poisson), or inf")
    parser.add_argument("--num-prompts", type=argtypes.positive_int, default=200)
    parser.add_argument("--input-len", type=argtypes.positive_int, default=1024)
    parser.add_argument("--output-len", type=argtypes.positive_int, default=256)
    parser.add_argument("--prefix-len", type=argtypes.positive_int, default=None,
                        help="shared-prefix: tokens of the shared prefix (default input-len / 2)")
    parser.add_argument("--num-prefixes", type=argtypes.positive_int, default=None,
                        help="shared-prefix: distinct prefixes (default 10; divides --num-prompts)")
    parser.add_argument("--like-for-like", action="store_true",
                        help="stock also gets the settings vattn forces (prefix caching off, "
                             "SGLang page size 16 and no prefill CUDA graph)")
    parser.add_argument("--warmups", type=argtypes.non_negative_int, default=1,
                        help="warm-up requests of the client before it measures")
    parser.add_argument("--seed", type=argtypes.non_negative_int, default=0)
    parser.add_argument("--client-timeout", type=argtypes.positive_float, default=1800.0)
    parser.add_argument("--budget-s", type=argtypes.positive_float, default=None,
                        help="wall budget: a round that would not fit (estimated from the runs "
                             "so far) is skipped, and the report says so")
    parser.add_argument("--profile-steps", type=argtypes.non_negative_int, default=0,
                        help="vLLM: profile this many engine steps of every run with vLLM's torch "
                             "profiler (the client's --profile), after --profile-delay steps; the "
                             "report gets GPU time per kernel family, GPU busy and idle time and "
                             "host synchronizations per run (0: no profiling)")
    parser.add_argument("--profile-delay", type=argtypes.non_negative_int, default=300,
                        help="engine steps after the client's start before the profiled window")


def order(rounds: int, modes=MODES) -> list[tuple[int, str]]:
    """``[(1, "stock"), (1, "vattn"), (2, "stock"), ...]``: the runs of ``rounds`` rounds."""
    if rounds < 1:
        raise ConfigError(f"rounds must be >= 1, got {rounds}")
    return [(r, mode) for r in range(1, rounds + 1) for mode in modes]


def modes_of(args) -> tuple[str, ...]:
    """``--modes`` (default every mode of :data:`MODES`), each at most once; for vLLM also vattn
    variants (:func:`~.serve_engines.mode_base`).

    Raises
    ------
    ConfigError
        A mode named twice, or one the engine's servers do not take.
    """
    modes = tuple(getattr(args, "modes", None) or MODES)
    if len(set(modes)) != len(modes):
        raise ConfigError(f"--modes: expected each mode at most once, got {' '.join(modes)}")
    for mode in modes:
        try:
            mode_base(getattr(args, "engine", "vllm"), mode)
        except ConfigError as exc:
            raise ConfigError(f"--modes: {exc}") from None
    return modes


def check_engine(engine: str, python: str) -> str:
    """The engine's version in ``python``.

    Raises
    ------
    UnsupportedError
        The engine is not importable there (or, for vLLM, a version whose client flags were not
        checked).
    """
    # abspath, not realpath: a virtual environment's python is a link to the base interpreter
    if os.path.abspath(python) == os.path.abspath(sys.executable):
        found = importlib.util.find_spec(engine) is not None
        version = _version(engine) if found else None
    else:
        try:
            proc = subprocess.run([python, "-c", _VERSION_CODE.format(engine=engine)],
                                  capture_output=True, text=True, timeout=60)
        except OSError as exc:
            raise UnsupportedError(f"--python: expected an interpreter that runs, got {python!r} "
                                   f"({exc})") from None
        found = proc.returncode == 0
        version = proc.stdout.strip() or None
    if not found:
        raise UnsupportedError(f"--engine {engine}: expected {engine} importable in {python}, "
                               f"it is not installed there (install it, or pass --python with "
                               f"the interpreter that has it)")
    if engine == "vllm" and version:
        check_vllm_version(version)
    return version or "unknown"


_VERSION_CODE = ("import importlib.util as u, sys\n"
                 "if u.find_spec({engine!r}) is None: sys.exit(3)\n"
                 "import importlib.metadata as m\n"
                 "names = [d.metadata['Name'] for d in m.distributions() "
                 "if (d.metadata['Name'] or '').lower().startswith({engine!r})]\n"
                 "print(m.version(sorted(names, key=len)[0]) if names else '')")


def _version(engine: str) -> str | None:
    from importlib import metadata
    names = sorted((d.metadata["Name"] for d in metadata.distributions()
                    if (d.metadata["Name"] or "").lower().startswith(engine)), key=len)
    return metadata.version(names[0]) if names else None


def prepare_model(args) -> str:
    """The model directory of ``--model`` / ``--preset``, with a tokenizer written if it has none.

    Raises
    ------
    ConfigError
        ``--model`` is not a directory with a ``config.json``, or ``--preset`` is unknown.
    """
    from vattn.conformance.models import PRESETS
    from vattn.conformance.tokenizer import has_tokenizer, write_tokenizer
    if args.preset is not None:
        if args.preset not in PRESETS:
            raise ConfigError(f"--preset: expected one of {sorted(PRESETS)}, got {args.preset!r}")
        from vattn.bench.gpu.workloads import llama_model
        root = args.models or os.path.join(args.out, "models")
        model = llama_model(os.path.abspath(os.path.join(root, args.preset)), PRESETS[args.preset])
    else:
        model = os.path.abspath(args.model)
        if not os.path.exists(os.path.join(model, "config.json")):
            raise ConfigError(f"--model: expected a model directory with a config.json, got "
                              f"{args.model!r}")
    if not has_tokenizer(model):
        write_tokenizer(model)
    return model


def device_for(choice: str) -> str:
    """``--device``: ``cpu`` / ``cuda`` as given, ``auto``: cuda when torch sees a GPU."""
    if choice != "auto":
        return choice
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def _workload(args) -> Workload:
    shared = args.dataset == "shared-prefix"
    if not shared and (args.prefix_len is not None or args.num_prefixes is not None):
        raise ConfigError(f"--prefix-len / --num-prefixes apply to --dataset shared-prefix only, "
                          f"got them with --dataset {args.dataset}")
    return Workload(dataset=args.dataset, num_prompts=args.num_prompts, input_len=args.input_len,
                    output_len=args.output_len, rate=args.rate,
                    prefix_len=(args.prefix_len or args.input_len // 2) if shared else 0,
                    num_prefixes=(args.num_prefixes or 10) if shared else 1, seed=args.seed,
                    warmups=args.warmups)


def run_rounds(args, model: str, workload: Workload, device: str, *, log=print,
               on_row=None) -> tuple[list[dict], list[str]]:
    """Every run of :func:`order`, one fresh server each; ``(rows, notes)``. ``on_row(rows,
    notes)`` is called after each run (the results so far survive an interruption)."""
    rows, notes, took = [], [], []
    start = time.monotonic()
    modes = modes_of(args)
    runs = order(args.rounds, modes)
    for i, (rnd, mode) in enumerate(runs):
        if args.budget_s is not None and mode == modes[0] and took:
            left = args.budget_s - (time.monotonic() - start)
            need = len(modes) * max(took)
            if need > left:
                skipped = sorted({r for r, _ in runs[i:]})
                notes.append(f"rounds {skipped} skipped: a round needs about {need:.0f} s "
                             f"(the slowest run so far x {len(modes)}), {left:.0f} s of the "
                             f"{args.budget_s:.0f} s budget were left")
                log(notes[-1])
                break
        t0 = time.monotonic()
        row = _one_run(args, model, workload, device, rnd, mode)
        took.append(time.monotonic() - t0)
        rows.append(row)
        if on_row is not None:
            on_row(rows, notes)
        log(f"round {rnd} {mode}: " + (f"FAILED {row['error'].splitlines()[0][:200]}" if row.get("error")
                                       else f"{row['request_throughput']:.3g} req/s, TTFT p50 "
                                            f"{row['ttft_p50_ms']:.1f} ms, TPOT p50 {row['tpot_p50_ms']:.2f} "
                                            f"ms, completed {row['completed']}, failed {row['failed']}"))
    return rows, notes


def _one_run(args, model: str, workload: Workload, device: str, rnd: int, mode: str) -> dict:
    run_dir = os.path.join(args.out, "runs", f"{rnd:02d}-{mode}")
    os.makedirs(run_dir, exist_ok=True)
    host, port = "127.0.0.1", free_port()
    spec = server_command(args.engine, mode, model, port=port, device=device,
                          extra_args=args.engine_args, like_for_like=args.like_for_like, host=host)
    result = os.path.join(run_dir, "client_result.json")
    if os.path.exists(result):
        os.remove(result)
    client = client_command(args.engine, workload, model_dir=model, host=host, port=port,
                            result_path=result)
    profile_dir = None
    if getattr(args, "profile_steps", 0):
        profile_dir = os.path.join(os.path.abspath(run_dir), "profile")
        spec.argv += profile_flags(profile_dir, steps=args.profile_steps, delay=args.profile_delay)
        client.append("--profile")
    row = {"engine": args.engine, "model": model, "dataset": workload.dataset, "round": rnd,
           "mode": mode, "server_argv": spec.argv,
           "server_env": {k: v for k, v in spec.env.items() if v is not None}}
    if mode_base(args.engine, mode) != "stock":
        # vattn's counters, written by the engine's worker (one file per rank), every 5 s while
        # it serves (a JSON dump on the step's path: rare enough not to count) and once idle
        spec.env["VATTN_METRICS"] = os.path.join(os.path.abspath(run_dir), "vattn_metrics_{pid}.json")
        spec.env.setdefault("VATTN_METRICS_EVERY_S", "5")
    client_env = None
    if args.engine == "sglang":      # its prompt cache is keyed by tokenizer class only
        client_env = {"HOME": os.path.abspath(os.path.join(args.out, "client_home",
                                                           os.path.basename(model)))}
    server = Server(spec, python=args.python, log_path=os.path.join(run_dir, "server.log"),
                    timeout_s=args.server_timeout, host=host)
    try:
        with server:
            row["server_start_s"] = round(server.start_s, 1)
            run_client(client, python=args.python, log_path=os.path.join(run_dir, "client.log"),
                       timeout_s=args.client_timeout, env=client_env)
            if mode_base(args.engine, mode) != "stock":
                row["idle_snapshot"] = await_idle_snapshot(run_dir, since=time.time() - 0.5)
        row.update(parse_result(args.engine, read_result(args.engine, result),
                                expected=workload.num_prompts))
        if mode_base(args.engine, mode) != "stock":
            row["vattn"] = vattn_counters(run_dir, args.engine)
        if profile_dir is not None:
            row["profile"] = profile_summary(profile_dir)
    except (ClientError, ConfigError, UnsupportedError) as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"
    except Exception as exc:      # ServerError and the like: keep the other runs going
        row["error"] = f"{type(exc).__name__}: {exc}"
    return row


def profile_flags(folder: str, *, steps: int, delay: int) -> list[str]:
    """vLLM server flags: its torch profiler writing into ``folder``, ``steps`` engine steps
    after ``delay`` steps from the client's ``/start_profile`` (worker only, no Python stacks)."""
    os.makedirs(folder, exist_ok=True)
    config = {"profiler": "torch", "torch_profiler_dir": folder, "ignore_frontend": True,
              "torch_profiler_with_stack": False, "delay_iterations": delay,
              "max_iterations": steps}
    return ["--profiler-config", json.dumps(config)]


def profile_summary(folder: str) -> dict:
    """A profiled run's kernel families (vLLM's profiler table) and trace window numbers
    (:func:`vattn.bench.trace.trace_summary`); ``profile_error`` says what is missing."""
    from vattn.bench.gpu.report import profiler_kernels
    from vattn.bench.trace import find_trace, trace_summary
    out: dict = {}
    try:
        trace = find_trace(folder)
        if trace is None:
            raise ConfigError(f"no trace file in {folder} (did the server get --profiler-config "
                              f"and the client call /start_profile?)")
        out["trace"] = trace_summary(trace)
    except ConfigError as exc:
        return {"profile_error": f"{type(exc).__name__}: {exc}"}
    try:   # a CPU engine's table has no CUDA columns: no kernel families then
        out["kernels"] = profiler_kernels(folder)
    except (OSError, ValueError) as exc:
        out["kernels"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return out


def vattn_counters(run_dir: str, engine: str) -> dict:
    """The vattn columns (host time on the step's path, page events, fence waits) of the last
    snapshot the server's worker wrote into ``run_dir`` (``vattn_metrics_error`` if none)."""
    from vattn.bench.gpu.report import vattn_columns
    from vattn.core.snapshots import read_snapshot
    files = sorted(glob.glob(os.path.join(run_dir, "vattn_metrics_*.json")))
    snaps = [s for s in map(read_snapshot, files) if s]
    if not snaps:
        return {"vattn_metrics_error": "the server wrote no vattn snapshot (VATTN_METRICS not honoured?)"}
    return vattn_columns(max(snaps, key=lambda s: s.get("time", 0)), engine)


def await_idle_snapshot(run_dir: str, *, since: float, timeout_s: float = 6.0, poll_s: float = 0.2,
                        clock=time.monotonic, sleep=time.sleep) -> bool:
    """Wait (at most ``timeout_s``) for a vattn server's idle snapshot newer than ``since`` (wall
    time): the engine writes it once no step came for a second, with the page audit and, under
    ``VATTN_STEP_TRACE``, the step trace; killing the server first would lose both. False when
    none came in time (the report then has the last step-path snapshot)."""
    end = clock() + timeout_s
    from vattn.core.snapshots import read_snapshot
    while True:
        for path in glob.glob(os.path.join(run_dir, "vattn_metrics_*.json")):
            snap = read_snapshot(path)
            if snap and snap.get("idle") and snap.get("time", 0) >= since:
                return True
        if clock() >= end:
            return False
        sleep(poll_s)


def run(args: argparse.Namespace) -> int:
    """Run ``vattn bench serve``; 0 when every run completed requests and none failed."""
    if getattr(args, "profile_steps", 0) and args.engine != "vllm":
        raise ConfigError(f"--profile-steps: expected --engine vllm (its server's torch profiler), "
                          f"got --engine {args.engine}")
    modes = modes_of(args)
    version = check_engine(args.engine, args.python)
    workload = _workload(args)
    os.makedirs(args.out, exist_ok=True)
    device = device_for(args.device)
    model = prepare_model(args)
    meta = {"engine": args.engine, "engine_version": version, "device": device, "model": model,
            "workload": workload.__dict__, "modes": list(modes), "rounds": args.rounds,
            "like_for_like": args.like_for_like,
            "engine_args": args.engine_args, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    title = title_for(meta)

    def write(rows, notes):
        with open(os.path.join(args.out, "rows.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows, "notes": notes}, f, indent=1, default=repr)
        text = markdown(rows, title=title, notes=notes + _flag_notes(rows))
        with open(os.path.join(args.out, "report.md"), "w") as f:
            f.write(text)
        return text

    previous = signal.signal(signal.SIGTERM, sigterm_raises)   # `timeout` stops us: still kill the servers
    try:
        rows, notes = run_rounds(args, model, workload, device, on_row=write)
    finally:
        signal.signal(signal.SIGTERM, previous)
    text = write(rows, notes)
    png = plot(rows, os.path.join(args.out, "serve_plot.png"), title=title)
    print(text)
    print(f"rows: {os.path.join(args.out, 'rows.json')}" + (f"; plot: {png}" if png else
                                                             "; no plot (matplotlib missing)"))
    ok = rows and all(not r.get("error") and r["completed"] and not r["failed"] for r in rows)
    return 0 if ok else 1


def sigterm_raises(signum, frame):
    """A SIGTERM handler raising ``SystemExit``, so ``with Server(...)`` still kills the server."""
    raise SystemExit(128 + signum)


def _flag_notes(rows: list[dict]) -> list[str]:
    """What each mode's server was started with (beyond the model, host and port)."""
    seen, notes = set(), []
    for r in rows:
        if r["mode"] in seen:
            continue
        seen.add(r["mode"])
        argv = r["server_argv"]
        flags = argv[argv.index("--port") + 2:] if "--port" in argv else argv
        env = " ".join(f"{k}={v}" for k, v in sorted(r["server_env"].items()))
        notes.append(f"{r['mode']} server: {' '.join(flags) or '(engine defaults)'}"
                     + (f"; env {env}" if env else ""))
    return notes
