"""The SGLang GPU stages behind ``tools/gpu/sglang.sh`` (SGLang 0.5.17 on one H200).

``python -m vattn.bench.gpu.sglang_stages STAGE --out DIR``; STAGE is

* ``identity``: a small random Llama (:data:`.workloads.IDENTITY_MODELS` ``["sglang"]``: 4
  layers, hidden 2048, 16 q / 8 kv heads, d=128, std 0.02, bf16 safetensors), 32 prompts of
  64-448 tokens after one of 4 shared prefixes of 300-1,500 tokens (``VATTN_IDENTITY_PREFIX=0``:
  no prefixes), 32 new tokens, ``stock`` vs ``vattn``, the radix cache on in both, two
  generations per engine (the second hits every prompt the first cached: its tokens are judged
  with logprobs, the first's must match exactly, and both report the tokens served from the
  cache); judged by
  :func:`vattn.conformance.identity.compare` (near-ties allowed; exact on the H200, 2026-12-04)
  and :func:`~vattn.conformance.models.check_not_degenerate`;
* ``decode-heavy`` (256 x 512 in / 512 out), ``prefill-heavy`` (32 x 16K in / 64 out),
  ``long-context`` (8 x 64K / 64) and ``shared-prefix`` (128 x (4,096 shared + 256 own) / 128), of
  :data:`.workloads.WORKLOADS`: a ``VATTN_SHAPE`` preset (Llama-3-8B or 1B shape),
  ``load_format="dummy"``, SGLang's own sizing (``VATTN_SIZING``), ``VATTN_ROUNDS`` alternated
  rounds of every mode in ``VATTN_MODES`` (default ``stock vattn``; ``stock-eager`` /
  ``vattn-eager``: the same without CUDA graphs); vattn rows add the allocator's metrics from
  SGLang's scheduler (:mod:`vattn.adapters.sglang.metrics`): worst waste per request, host time
  of ``alloc_extend`` / ``alloc_decode`` / ``free``, pages mapped on demand.

Each stage writes ``DIR/<stage>.json`` (also when it fails); models are built under
``DIR/models``, engine logs go to ``DIR/logs``. ``VATTN_RUN_TIMEOUT`` (seconds, default 200)
limits one engine run; ``VATTN_SGLANG_ENGINE_ARGS`` (JSON) adds ``sglang.Engine`` arguments to
every mode. SGLang's radix cache stays at its default (on) in every mode;
``VATTN_PREFIX_CACHING=off`` turns it off in all of them.
"""

from __future__ import annotations

import json
import os
import sys

from vattn.conformance.identity import compare
from vattn.conformance.models import check_not_degenerate, decode_traffic_bytes, random_prompts
from vattn.conformance.runners.sglang import SglangRunner
from vattn.conformance.stages import rounds_summary, run_modes, run_rounds

from . import stage
from .report import vattn_columns
from .stage import env_choice, env_modes
from .workloads import IDENTITY_MODELS, WORKLOADS, env_shape, llama_model, workload_prompts

__all__ = ["STAGES", "identity", "throughput", "main"]

IDENTITY_MODEL = IDENTITY_MODELS["sglang"]
#: the throughput stages, named after their workloads
THROUGHPUT = ("decode-heavy", "prefill-heavy", "long-context", "shared-prefix", "decode-light")


def _runner(out: str, modes, generations: int = 1, **engine_args) -> SglangRunner:
    """Both modes with SGLang's radix cache as it defaults (on); ``VATTN_PREFIX_CACHING=off``
    turns it off in both; ``VATTN_SGLANG_ENGINE_ARGS`` (JSON) adds engine arguments."""
    if env_choice("VATTN_PREFIX_CACHING", ("default", "on", "off")) == "off":
        engine_args["disable_radix_cache"] = True
    engine_args.update(json.loads(os.environ.get("VATTN_SGLANG_ENGINE_ARGS", "{}")))
    return SglangRunner(modes=tuple(modes), engine_args=engine_args,
                        timeout_s=float(os.environ.get("VATTN_RUN_TIMEOUT", 200)),
                        log_dir=os.path.join(out, "logs"), generations=generations)


def identity(args) -> dict:
    """Stock vs vattn tokens on a small non-degenerate random model."""
    model = llama_model(os.path.join(args.models, "identity-4l"), IDENTITY_MODEL, weights=True)
    lens = [64 + 12 * i for i in range(32)]
    prompts = random_prompts(32, lens, vocab_size=IDENTITY_MODEL["vocab_size"], seed=0)
    if os.environ.get("VATTN_IDENTITY_PREFIX", "1") == "1":
        # 4 prefixes of lengths that are no multiple of a page, each shared by 8 prompts: with the
        # radix cache on (both modes), later prefill batches hit what earlier ones inserted
        bases = random_prompts(4, [300, 777, 1100, 1500], vocab_size=IDENTITY_MODEL["vocab_size"], seed=9)
        prompts = [bases[i % 4] + p for i, p in enumerate(prompts)]
    runner = _runner(args.out, ("stock", "vattn"), generations=2, max_running_requests=32,
                     context_length=4096)
    results, errors = run_modes(runner, model, prompts, 32, logprobs=5)
    report = {"stage": "identity", "errors": errors, "ok": False}
    if "stock" in results:
        report["degenerate_check"] = check_not_degenerate(results["stock"].token_ids)
    if len(results) == 2:
        check = compare(results["stock"], results["vattn"], require_exact=False)
        report["identity"] = check.to_dict()
        first = [a != b for a, b in zip(results["stock"].extra["earlier_token_ids"][0],
                                        results["vattn"].extra["earlier_token_ids"][0])]
        report["first_generation_mismatched_prompts"] = [i for i, bad in enumerate(first) if bad]
        report["ok"] = bool(check.ok and report["degenerate_check"]["ok"] and not any(first))
    report["cached_tokens"] = {m: r.extra.get("cached_tokens") for m, r in results.items()}
    report["seconds"] = {m: r.seconds for m, r in results.items()}
    return report


def throughput(args) -> dict:
    """Tokens/s of every mode, ``VATTN_ROUNDS`` rounds alternated, on a dummy-weight model.

    ``VATTN_SHAPE`` picks the preset (default ``llama3-8b-shape``; ``llama-1b-shape``).
    ``VATTN_SIZING=defaults`` (default) leaves SGLang's sizing alone (``mem_fraction_static``,
    ``max_running_requests``, the model's context length): only vattn's activation differs
    between modes; ``tuned`` trims them to the workload. ``VATTN_GENERATIONS`` timed
    generations per engine (default 2; each round counts its best).
    """
    workload = args.stage
    num, length, new = WORKLOADS[workload]
    preset, fields = env_shape()
    model = llama_model(os.path.join(args.models, preset), fields)
    prompts = workload_prompts(workload, fields["vocab_size"], seed=1)
    modes = env_modes("VATTN_MODES", "stock vattn")
    sizing = env_choice("VATTN_SIZING", ("defaults", "tuned"))
    engine_args = dict(load_format="dummy")
    if sizing == "tuned":
        engine_args.update(max_running_requests=num, context_length=length + new + 64,
                           mem_fraction_static=0.85)
    runner = _runner(args.out, modes, generations=int(os.environ.get("VATTN_GENERATIONS", 2)),
                     **engine_args)
    rounds = int(os.environ.get("VATTN_ROUNDS", 1))
    results, errors = run_rounds(runner, model, prompts, new, rounds=rounds)
    rows = rounds_summary(results, modes[0])
    traffic = decode_traffic_bytes(fields, num, length, new)
    for mode, row in rows.items():
        row["decode_lower_bound_GBps"] = traffic / row["seconds"] / 1e9
        metrics = results[mode][-1].extra.get("vattn_metrics")
        row.update(vattn_columns(metrics, "sglang"))
        if metrics and "error" not in metrics:
            row["vattn_metrics"] = metrics
        row["init_s"] = [r.extra.get("init_s") for r in results[mode]]
        row["wall_each"] = [w for r in results[mode] for w in r.extra.get("wall_each", [])]
        row["token_match_vs_" + modes[0]] = _token_match(results[mode], results.get(modes[0]))
    return {"stage": workload, "model_preset": preset, "sizing": sizing, "rounds": rounds,
            "engine_args": engine_args, "workload": dict(num=num, prompt_len=length, new_tokens=new),
            "modes": rows, "errors": errors, "ok": not errors}


def _token_match(runs, base) -> float | None:
    """Share of generated tokens equal to the first mode's (last rounds; a diagnostic: dummy
    weights leave near-ties everywhere, exact identity is the identity stage's)."""
    if not runs or not base:
        return None
    pairs = [(x, y) for a, b in zip(runs[-1].token_ids, base[-1].token_ids) for x, y in zip(a, b)]
    return sum(x == y for x, y in pairs) / len(pairs) if pairs else None


STAGES = {"identity": identity, **{name: throughput for name in THROUGHPUT}}


def main(argv: list[str] | None = None) -> int:
    return stage.main("python -m vattn.bench.gpu.sglang_stages", STAGES, argv)


if __name__ == "__main__":
    sys.exit(main())
