"""One ``sglang.Engine`` run in its own process: ``python -m vattn.conformance.workers.sglang SPEC OUT``.

SGLang resolves its platform once per process (at import), so stock and vattn runs each get a
fresh process; :class:`~vattn.conformance.runners.sglang.SglangRunner` starts it with
``VATTN_SGLANG=1`` for the vattn mode only. ``SPEC`` (JSON): ``mode``, ``model_path``, ``prompts`` (token ids),
``max_new_tokens``, ``logprobs`` (top-k, 0: none), ``engine_args`` (extra ``sglang.Engine``
keyword arguments). ``OUT`` (JSON): :class:`~vattn.conformance.protocol.RunResult` fields.

Both modes: SGLang's radix cache as it defaults (on; ``engine_args`` may set
``disable_radix_cache``), ``sampling_backend="pytorch"``, greedy, ``ignore_eos``; stock keeps
SGLang's page size, vattn gets the one its platform sets (one page-set). ``stock``: ``--attention-backend fa3`` with SGLang's decode CUDA graphs;
``stock-eager``: the same without CUDA graphs; ``vattn``: ``--attention-backend vattn`` with
SGLang's decode CUDA graphs (the backend's graph hooks); ``vattn-eager``: vattn without CUDA graphs;
``vattn-nostage``: vattn with prefix staging off (``VATTN_STAGE_PREFIXES=0``, set by the runner);
``vattn-packs``: that with 1 GiB of packs of shared runs (``VATTN_PACK_MB=1024``, the runner);
``vattn-defer``: ``vattn-packs`` with deferred mapping (``VATTN_DEFER_MAPPING=1``, the runner).
Every mode runs prefill eagerly (``disable_prefill_cuda_graph``): the vattn backend does not support
SGLang's prefill graphs yet, so stock runs without them too, like for like.
Timing: a short warm-up generate first, then ``generations`` (default 1) timed ``generate`` calls
of all prompts in the same engine; ``seconds`` is the best of them, ``extra["generation_s"]``
lists each (repeated generations show whether an engine stays as fast as it started);
``extra["wall_each"]`` their wall-clock ``[start, end]`` (a step trace is cut by them),
``extra["cached_tokens"]`` the prompt tokens SGLang served from its radix cache in each generation
and, with ``logprobs``, ``extra["earlier_token_ids"]`` the tokens of every generation but the last
(a later generation hits what an earlier one cached). vattn modes
also return the allocator's metrics from SGLang's scheduler process (``extra["vattn_metrics"]``,
:mod:`vattn.adapters.sglang.metrics`: written when the engine goes idle, so once inside the timed
window: one small JSON file write, not timed separately).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

from . import main as _main

__all__ = ["MODES", "engine_kwargs", "run", "main"]

MODES = ("stock", "stock-eager", "vattn", "vattn-eager", "vattn-nostage", "vattn-packs", "vattn-defer")
_BACKEND = {"stock": "fa3", "stock-eager": "fa3", "vattn": "vattn", "vattn-eager": "vattn",
            "vattn-nostage": "vattn", "vattn-packs": "vattn", "vattn-defer": "vattn"}


def engine_kwargs(mode: str, model_path: str, extra: dict) -> dict:
    """The ``sglang.Engine`` keyword arguments of ``mode`` (``extra`` wins)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    kw = dict(model_path=model_path, attention_backend=_BACKEND[mode],
              sampling_backend="pytorch", skip_tokenizer_init=True,
              dtype="bfloat16", log_level="error", random_seed=0,
              disable_prefill_cuda_graph=True)
    if mode.endswith("-eager"):
        kw["disable_cuda_graph"] = True
    kw.update(extra)
    return kw


def _top(entries) -> dict[int, float]:
    """SGLang's ``[(logprob, token_id, text), ...]`` of one position -> ``{token_id: logprob}``."""
    return {int(e[1]): float(e[0]) for e in (entries or []) if e is not None}


def _logprobs(out: dict) -> list[dict[int, float]]:
    meta = out.get("meta_info", {})
    tops = meta.get("output_top_logprobs") or []
    chosen = meta.get("output_token_logprobs") or []
    result = []
    for i, pos in enumerate(tops):
        d = _top(pos)
        if i < len(chosen) and chosen[i] is not None:
            d[int(chosen[i][1])] = float(chosen[i][0])
        result.append(d)
    return result


def run(spec: dict) -> dict:
    """Start the engine, warm up, time one generate; return the RunResult fields as a dict."""
    import sglang

    vattn = spec["mode"].startswith("vattn")
    if vattn and os.environ.get("VATTN_SGLANG") != "1":
        raise RuntimeError("vattn mode needs VATTN_SGLANG=1 in this process's environment")
    metrics_path = _metrics_path() if vattn else None
    t0 = time.perf_counter()
    engine = sglang.Engine(**engine_kwargs(spec["mode"], spec["model_path"],
                                           spec.get("engine_args", {})))
    init_s = time.perf_counter() - t0
    prompts, new, k = spec["prompts"], int(spec["max_new_tokens"]), int(spec.get("logprobs", 0))
    params = dict(temperature=0.0, max_new_tokens=new, ignore_eos=True)
    generation_s, cached, earlier, walls = [], [], [], []
    try:
        engine.generate(input_ids=prompts[:2], sampling_params=dict(params, max_new_tokens=4))
        for _ in range(max(1, int(spec.get("generations", 1)))):
            start, wall = time.perf_counter(), time.time()
            outs = engine.generate(input_ids=prompts, sampling_params=params,
                                   return_logprob=k > 0, top_logprobs_num=k if k > 0 else None)
            generation_s.append(time.perf_counter() - start)
            walls.append([wall, time.time()])
            cached.append(sum(int(o.get("meta_info", {}).get("cached_tokens", 0)) for o in outs))
            if k > 0:
                earlier.append([list(o["output_ids"]) for o in outs])
    finally:
        engine.shutdown()
    seconds = min(generation_s)
    ids = [list(o["output_ids"]) for o in outs]
    return dict(token_ids=ids, logprobs=[_logprobs(o) for o in outs] if k > 0 else None,
                seconds=seconds, num_prompt_tokens=sum(map(len, prompts)),
                num_generated_tokens=sum(map(len, ids)),
                extra=dict(init_s=init_s, mode=spec["mode"], generation_s=generation_s, wall_each=walls,
                           cached_tokens=cached, earlier_token_ids=earlier[:-1],
                           engine_args=engine_kwargs(spec["mode"], "", spec.get("engine_args", {})),
                           vattn_metrics=_read_metrics(metrics_path)))


def _metrics_path() -> str:
    """A fresh file name the scheduler process (spawned later, inheriting the environment) writes
    the allocator's metrics to (:data:`vattn.adapters.sglang.metrics.METRICS_ENV`)."""
    from vattn.adapters.sglang.metrics import METRICS_ENV
    path = os.path.join(tempfile.mkdtemp(prefix="vattn-sglang-"), "metrics.json")
    os.environ[METRICS_ENV] = path
    return path


def _read_metrics(path: str | None) -> dict | None:
    if path is None:
        return None
    if not os.path.exists(path):
        return {"error": f"the scheduler wrote no metrics to {path} (never idle after a batch?)"}
    with open(path) as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> int:
    return _main(run, argv)


if __name__ == "__main__":
    sys.exit(main())
