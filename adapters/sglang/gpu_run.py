"""The GPU stages behind ``tools/gpu/sglang.sh`` (SGLang 0.5.17 on one H200).

``python -m vattn.adapters.sglang.gpu_run STAGE --out DIR``; STAGE is

* ``identity``: a small random Llama (4 layers, hidden 2048, 16 q / 8 kv heads, d=128, std 0.02,
  bf16 safetensors built by :func:`vattn.conformance.models.build_model`), 32 prompts of 64-448
  tokens, 32 new tokens, ``stock`` vs ``vattn``; judged by :func:`vattn.conformance.identity.compare`
  (near-ties allowed; exact on the H200, 2026-12-04) and :func:`check_not_degenerate`;
* ``decode-heavy`` (256 x 512 in / 512 out) and ``prefill-heavy`` (32 x 16K in / 64 out):
  a ``VATTN_SHAPE`` preset (Llama-3-8B or 1B shape), ``load_format="dummy"``, SGLang's own
  sizing (``VATTN_SIZING``), ``VATTN_ROUNDS`` alternated rounds of every mode in ``VATTN_MODES``
  (default ``stock vattn``; ``stock-eager`` / ``vattn-eager``: the same without CUDA graphs);
  vattn rows add the allocator's metrics from SGLang's scheduler (:mod:`.metrics`): worst waste
  per request, host time of ``alloc_extend`` / ``alloc_decode`` / ``free``, pages mapped on demand.

Each stage writes ``DIR/<stage>.json``; engine logs go to ``DIR/logs``. ``VATTN_RUN_TIMEOUT``
(seconds, default 200) limits one engine run; ``VATTN_SGLANG_ENGINE_ARGS`` (JSON) adds
``sglang.Engine`` arguments to every mode.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from vattn.conformance.identity import compare
from vattn.conformance.models import (PRESETS, build_model, check_not_degenerate,
                                      decode_traffic_bytes, random_prompts)
from vattn.conformance.stages import rounds_summary, run_modes, run_rounds

from .conformance import SglangRunner
from .metrics import critical_path_summary

#: name -> (num prompts, prompt length, new tokens)
WORKLOADS = {"decode-heavy": (256, 512, 512), "prefill-heavy": (32, 16384, 64)}
IDENTITY_MODEL = dict(num_hidden_layers=4, hidden_size=2048, num_attention_heads=16,
                      num_key_value_heads=8, head_dim=128, intermediate_size=4096,
                      vocab_size=32000, max_position_embeddings=4096)


def _model(out: str, name: str, fields: dict, *, weights: bool) -> str:
    path = build_model(fields, os.path.join(out, "models", name), dtype="bfloat16",
                       device="cuda", save_weights=weights)
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    if not cfg.get("architectures"):                 # SGLang picks the model class from it
        cfg["architectures"] = ["LlamaForCausalLM"]
        with open(cfg_path, "w") as f:
            json.dump(cfg, f, indent=2)
    return path


def _runner(out: str, modes, generations: int = 1, **engine_args) -> SglangRunner:
    engine_args.update(json.loads(os.environ.get("VATTN_SGLANG_ENGINE_ARGS", "{}")))
    return SglangRunner(modes=tuple(modes), engine_args=engine_args,
                        timeout_s=float(os.environ.get("VATTN_RUN_TIMEOUT", 200)),
                        log_dir=os.path.join(out, "logs"), generations=generations)


def identity(out: str) -> dict:
    """Stock vs vattn tokens on a small non-degenerate random model."""
    model = _model(out, "identity-4l", IDENTITY_MODEL, weights=True)
    lens = [64 + 12 * i for i in range(32)]
    prompts = random_prompts(32, lens, vocab_size=IDENTITY_MODEL["vocab_size"], seed=0)
    runner = _runner(out, ("stock", "vattn"), max_running_requests=32, context_length=1024)
    results, errors = run_modes(runner, model, prompts, 32, logprobs=5)
    report = {"stage": "identity", "errors": errors, "ok": False}
    if "stock" in results:
        report["degenerate_check"] = check_not_degenerate(results["stock"].token_ids)
    if len(results) == 2:
        check = compare(results["stock"], results["vattn"], require_exact=False)
        report["identity"] = check.to_dict()
        report["ok"] = bool(check.ok and report["degenerate_check"]["ok"])
    report["seconds"] = {m: r.seconds for m, r in results.items()}
    return report


def throughput(out: str, workload: str) -> dict:
    """Tokens/s of every mode, ``VATTN_ROUNDS`` rounds alternated, on a dummy-weight model.

    ``VATTN_SHAPE`` picks the preset (default ``llama3-8b-shape``; ``llama-1b-shape``).
    ``VATTN_SIZING=defaults`` (default) leaves SGLang's sizing alone (``mem_fraction_static``,
    ``max_running_requests``, the model's context length): only vattn's activation differs
    between modes; ``tuned`` trims them to the workload. ``VATTN_GENERATIONS`` timed
    generations per engine (default 2; each round counts its best).
    """
    num, length, new = WORKLOADS[workload]
    preset = os.environ.get("VATTN_SHAPE", "llama3-8b-shape")
    if preset not in PRESETS:
        raise SystemExit(f"VATTN_SHAPE must be one of {sorted(PRESETS)}, got {preset!r}")
    fields = PRESETS[preset]
    model = _model(out, preset, fields, weights=False)
    prompts = random_prompts(num, length, vocab_size=fields["vocab_size"], seed=1)
    modes = os.environ.get("VATTN_MODES", "stock vattn").split()
    sizing = os.environ.get("VATTN_SIZING", "defaults")
    args = dict(load_format="dummy")
    if sizing == "tuned":
        args.update(max_running_requests=num, context_length=length + new + 64,
                    mem_fraction_static=0.85)
    elif sizing != "defaults":
        raise SystemExit(f"VATTN_SIZING must be 'defaults' or 'tuned', got {sizing!r}")
    runner = _runner(out, modes, generations=int(os.environ.get("VATTN_GENERATIONS", 2)), **args)
    rounds = int(os.environ.get("VATTN_ROUNDS", 1))
    results, errors = run_rounds(runner, model, prompts, new, rounds=rounds)
    rows = rounds_summary(results, modes[0])
    traffic = decode_traffic_bytes(fields, num, length, new)
    for mode, row in rows.items():
        row["decode_lower_bound_GBps"] = traffic / row["seconds"] / 1e9
        row.update(_vattn_columns(results[mode][-1].extra.get("vattn_metrics")))
        row["init_s"] = [r.extra.get("init_s") for r in results[mode]]
    return {"stage": workload, "model_preset": preset, "sizing": sizing, "rounds": rounds,
            "engine_args": args, "workload": dict(num=num, prompt_len=length, new_tokens=new),
            "modes": rows, "errors": errors, "ok": not errors}


def _vattn_columns(metrics: dict | None) -> dict:
    """A vattn row's waste and critical-path columns, from the allocator's metrics."""
    if not metrics:
        return {}
    if "error" in metrics:
        return {"vattn_metrics_error": metrics["error"]}
    waste = (metrics.get("layout") or {}).get("worst_waste_bytes")
    return {"worst_waste_MiB_per_request": None if waste is None else waste / 2**20,
            "vmm_critical_path": critical_path_summary(metrics), "vattn_metrics": metrics}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vattn.adapters.sglang.gpu_run")
    parser.add_argument("stage", choices=["identity", *WORKLOADS])
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    report = identity(args.out) if args.stage == "identity" else throughput(args.out, args.stage)
    with open(os.path.join(args.out, f"{args.stage}.json"), "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2)[-4000:], flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
