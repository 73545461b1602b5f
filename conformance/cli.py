"""``vattn conformance``: token identity and throughput of vattn vs an engine's paged path.

With no arguments: the transformers engine, the tiny random model, the host backend on CPU
(CUDA when a GPU exists); identity + small decode-/prefill-heavy workloads; a few minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time

import torch

from vattn import argtypes
from vattn.core.errors import ConfigError

from .engines import ENGINES, load_runner
from .identity import compare, fill_divergence_logprobs
from .models import PRESETS, build_model, check_not_degenerate, model_shape
from .report import write_report
from .stages import fastest, run_rounds
from .throughput import summarize
from .workloads import WORKLOADS, make_workload

__all__ = ["add_arguments", "add_scale_options", "run"]



def add_scale_options(parser) -> None:
    """``--size``, ``--device`` and ``--dtype``: shared by ``vattn conformance`` and ``vattn compare``."""
    parser.add_argument("--size", choices=("cpu", "gpu"), default=None,
                        help="workload scale (default: gpu on CUDA with an 8B-shaped model, else cpu)")
    parser.add_argument("--device", type=argtypes.device, default=None,
                        help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="float32 (CPU default) or bfloat16 (CUDA default)")

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", choices=sorted(ENGINES), default="transformers")
    parser.add_argument("--model", default=None,
                        help=f"a preset ({', '.join(PRESETS)}) or a model directory; default tiny "
                             "(llama3-8b-shape with --size gpu)")
    parser.add_argument("--workload", action="append", choices=WORKLOADS, default=None,
                        help="repeatable; default: identity, decode-heavy, prefill-heavy")
    parser.add_argument("--num-requests", type=argtypes.positive_int, default=None,
                        help="override the number of prompts of every workload")
    parser.add_argument("--layers", type=argtypes.positive_int, default=None,
                        help="override the preset's num_hidden_layers (e.g. 8 for a faster 8B-shaped run)")
    parser.add_argument("--weights", choices=("file", "instantiate"), default=None,
                        help="file: write model.safetensors; instantiate: draw the seeded weights on the "
                             "device at load (default for transformers on CUDA: no multi-GB file)")
    add_scale_options(parser)
    parser.add_argument("--seed", type=argtypes.non_negative_int, default=0)
    parser.add_argument("--repeats", type=argtypes.positive_int, default=1,
                        help="throughput runs per mode (fastest kept)")
    parser.add_argument("--max-gap", type=argtypes.non_negative_float, default=0.1,
                        help="near-tie log-prob gap (nats)")
    parser.add_argument("--require-exact", action="store_true",
                        help="fail on any divergence (default for the transformers engine)")
    parser.add_argument("--models-dir", default=None, help="where random models are built (default: temp)")
    parser.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                        help="runner constructor option (JSON value), e.g. max_batch_tokens=2048 or "
                             'vattn_options=\'{"group_size": 4}\'')
    parser.add_argument("--out", default=os.path.join("reports", "conformance"))


def run(args: argparse.Namespace) -> int:
    """Run the conformance suite; 0 when identity passes (and the model is not degenerate).

    Raises
    ------
    VattnError
        A bad option, an engine that is not installed here, or a failed engine run (checked in
        that order: the engine before the model is built).
    """
    from tqdm import tqdm
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    preset = args.model or ("llama3-8b-shape" if args.size == "gpu" else "tiny")
    size = args.size or ("gpu" if preset == "llama3-8b-shape" and device.startswith("cuda") else "cpu")
    workloads = args.workload or ["identity", "decode-heavy", "prefill-heavy"]
    runner = load_runner(args.engine, **_engine_options(args.engine_option))
    start = time.perf_counter()
    model_dir = _model_dir(preset, args, dtype=dtype, device=device)
    shape = model_shape(model_dir)
    print(f"[conformance] model {preset} ({shape.num_layers} layers) at {model_dir}: "
          f"{time.perf_counter() - start:.1f} s; workloads {workloads}", flush=True)
    report = {"engine": args.engine, "model": preset, "num_layers": shape.num_layers, "device": device,
              "dtype": dtype, "size": size, "num_requests": args.num_requests,
              "modes": list(runner.modes), "versions": _versions(), "throughput": {}, "ok": True}
    total = len(workloads) * len(runner.modes) * args.repeats
    with tqdm(total=total, desc=f"conformance[{args.engine}]", unit="run") as bar:
        for name in workloads:
            bar.set_postfix_str(name)
            wl = make_workload(name, size=size, vocab_size=shape.vocab_size, seed=args.seed,
                               max_context=shape.max_position, num=args.num_requests)
            lens = [len(p) for p in wl.prompts]
            bar.write(f"[conformance] {name}: {len(lens)} prompts of {min(lens)}-{max(lens)} tokens, "
                      f"{wl.max_new_tokens} new tokens each")
            if name == "identity":
                _identity(report, runner, wl, model_dir, args, device=device, dtype=dtype, bar=bar)
            else:
                # modes alternate within each repeat (stock, vattn, stock, ...): drift hits both
                res, _ = run_rounds(runner, model_dir, wl.prompts, wl.max_new_tokens,
                                    rounds=args.repeats, device=device, dtype=dtype,
                                    arrival_times=wl.arrival_times, record_errors=False,
                                    on_run=_progress(bar, name))
                report["throughput"][name] = summarize(fastest(res), runner.modes[0])
    paths = write_report(report, args.out)
    _print_summary(report, paths)
    return 0 if report["ok"] else 1


def _progress(bar, workload: str):
    """``on_run`` of :func:`run_rounds`: a line per run, the bar advanced by one."""
    def on_run(mode, result, error, seconds):
        bar.write(f"[conformance] {workload} {mode}: " + (error if result is None else
                  f"{result.seconds:.2f} s, {result.num_generated_tokens} generated tokens"))
        bar.update(1)
    return on_run


def _identity(report, runner, wl, model_dir, args, *, device, dtype, bar) -> None:
    results = {}
    for mode in runner.modes:
        results[mode] = runner.run(mode, model_dir, wl.prompts, wl.max_new_tokens, logprobs=5,
                                   device=device, dtype=dtype)
        bar.write(f"[conformance] identity {mode}: {results[mode].seconds:.2f} s")
        bar.update(1)
    base = results[runner.modes[0]]
    # same fp32 math on both sides on CPU: tokens must match exactly; on CUDA the kernel families
    # differ (SDPA vs FlashAttention / Triton), so a divergence may only be a near-tie
    exact = args.require_exact or (args.engine == "transformers" and not device.startswith("cuda"))
    if not exact:
        fill_divergence_logprobs(runner, wl.prompts, results, runner.modes[0])
    checks = {m: compare(base, r, require_exact=exact, max_gap=args.max_gap) for m, r in results.items()
              if m != runner.modes[0]}
    degenerate = check_not_degenerate(base.token_ids)
    report["identity"] = checks[runner.modes[-1]].to_dict()
    report["identity_all"] = {m: c.to_dict() for m, c in checks.items()}
    report["identity_max_new_tokens"] = wl.max_new_tokens
    report["identity_require_exact"] = exact
    report["degenerate_check"] = degenerate
    report["throughput"]["identity"] = summarize(results, runner.modes[0])
    report["extra"] = {m: r.extra for m, r in results.items()}
    report["ok"] = report["ok"] and degenerate["ok"] and all(c.ok for c in checks.values())


def _engine_options(items: list[str]) -> dict:
    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--engine-option must be KEY=VALUE, got {item!r}")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def _model_dir(preset: str, args, *, dtype: str, device: str) -> str:
    if os.path.isdir(preset):
        return preset
    root = args.models_dir or os.path.join(tempfile.gettempdir(), "vattn-models")
    weights = args.weights or ("instantiate" if args.engine == "transformers" and device.startswith("cuda")
                               else "file")
    layers = "" if args.layers is None else f"-{args.layers}l"
    out = os.path.join(root, f"{preset}{layers}-{dtype}-seed{args.seed}-{weights}")
    return build_model(preset, out, seed=args.seed, dtype=dtype, device=device,
                       save_weights=weights == "file", num_layers=args.layers)


def _versions() -> dict:
    found = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("transformers", "vllm", "sglang"):
        try:
            found[name] = __import__(name).__version__
        except ImportError:
            pass
    if torch.cuda.is_available():
        found["gpu"] = torch.cuda.get_device_name()
    return found


def _print_summary(report: dict, paths: dict) -> None:
    ident = report.get("identity")
    if ident:
        print(f"identity: {'PASS' if ident['ok'] else 'FAIL'} exact-match {ident['exact_match_rate']:.3f} "
              f"mismatches {len(ident['mismatches'])} degenerate-check {report['degenerate_check']['ok']}")
    for name, rows in report["throughput"].items():
        ratios = ", ".join(f"{m} {r['ratio']}x" for m, r in rows.items() if m != report["modes"][0])
        print(f"{name}: {ratios}")
    print(f"report: {paths['md']} {paths['json']}")
