"""``vattn bench attention``: decode and prefill on virtually contiguous KV vs paged baselines.

Identical K/V values on both sides: the vattn path reads strided layer-group views
``[slots, rows, Hk, D]`` (what ``VirtualKVCache.k(layer)`` returns), the paged baselines read a
page-16 shuffled copy (``bench.paged_baselines``) and, with ``--flex``, torch FlexAttention's
paged attention on a page-128 copy (``bench.flex_paged``). Reported: median µs, effective TB/s (KV bytes
read / time), % of the measured HBM copy bandwidth and ratio = paged time / vattn time.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from vattn import argtypes
from vattn.bench.flex_paged import FLEX_PAGE, flex_paged_runner
from vattn.bench.limits import check_fits
from vattn.bench.paged_baselines import bench_us, hbm_copy_tbps, paged_copy, paged_decoders, paged_prefillers
from vattn.bench.vmm_backed import on_vmm
from vattn.core.errors import ConfigError
from vattn.core.ops import DECODE_ORDER, PREFILL_ORDER, decode, is_supported, prefill
from vattn.core.ops.synthetic import group_views

__all__ = ["MODEL_SHAPES", "DEFAULT_SIZES", "add_arguments", "run", "measure_decode", "measure_prefill",
           "resolve_sizes", "peak_bytes"]

#: name -> (q_heads, kv_heads, head_dim): the paper's shapes, then a 1B-class Llama (head_dim 64,
#: the shape of the ``llama-1b-shape`` engine runs)
MODEL_SHAPES = {"llama3-8b": (32, 8, 128), "yi-6b": (32, 4, 128), "yi-34b": (56, 8, 128),
                "llama-1b": (32, 8, 64)}
#: the default grid: the paper's shapes
PAPER_MODELS = ("llama3-8b", "yi-6b", "yi-34b")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


#: default sizes per device type: the paper's grid on CUDA, a small correctness grid on the CPU
#: (the reference path holds a [heads, q, keys] fp32 score matrix per request)
DEFAULT_SIZES = {
    "cuda": {"contexts": (1024, 4096, 16384, 32768, 65536, 131072), "batches": (1, 16, 64, 256),
             "prefill_contexts": (4096, 16384, 32768)},
    "cpu": {"contexts": (256, 1024), "batches": (1, 4), "prefill_contexts": (256,)},
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sizes = lambda key: " / ".join(f"{','.join(map(str, s[key]))} on {d.upper()}"
                                   for d, s in DEFAULT_SIZES.items())
    parser.add_argument("--models", type=argtypes.name_list(MODEL_SHAPES), default=PAPER_MODELS,
                        help=f"model shapes, of {', '.join(MODEL_SHAPES)} (default: {','.join(PAPER_MODELS)})")
    parser.add_argument("--contexts", type=argtypes.int_list, default=None,
                        help=f"decode contexts (default: {sizes('contexts')})")
    parser.add_argument("--batches", type=argtypes.int_list, default=None,
                        help=f"decode batches (default: {sizes('batches')})")
    parser.add_argument("--prefill-contexts", type=argtypes.int_list, default=None,
                        help=f"prefill contexts (default: {sizes('prefill_contexts')})")
    parser.add_argument("--ops", type=argtypes.name_list(("decode", "prefill")), default=("decode", "prefill"))
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    parser.add_argument("--group-size", type=argtypes.positive_int, default=2, help="layer group G of the views")
    parser.add_argument("--max-tokens", type=argtypes.positive_int, default=2 << 20,
                        help="skip batch x context above")
    parser.add_argument("--device", type=argtypes.device, default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=os.environ.get("OUT", "reports"), help="output folder")
    parser.add_argument("--no-report", action="store_true", help="do not write BENCHMARKS.md")
    parser.add_argument("--budget-s", type=argtypes.non_negative_float, default=None,
                        help="start no new shape after this many seconds; the report lists the "
                             "shapes left out")
    parser.add_argument("--flex", action="store_true",
                        help="add torch FlexAttention paged (page 128) as a baseline: compiles per shape")
    parser.add_argument("--vmm", action="store_true",
                        help="also run every vattn kernel on a real VirtualKVCache (2 MiB pages mapped "
                             "one by one; rows named BACKEND@vmm) holding the same data: the cost of "
                             "the page mapping itself (TLB reach), apart from the layout")


def resolve_sizes(args) -> None:
    """Fill the size flags left unset with :data:`DEFAULT_SIZES` of ``args.device``'s type."""
    defaults = DEFAULT_SIZES["cuda" if torch.device(args.device).type == "cuda" else "cpu"]
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def peak_bytes(op: str, shape, batch: int, ctx: int, *, dtype, device, group: int,
               flex: bool = False, vmm: bool = False) -> int:
    """Estimated peak memory of one measured shape (views, q/out, copies, reference temporaries)."""
    hq, hk, dim = shape
    elem = torch.empty((), dtype=dtype).element_size()
    rows = -(-ctx // 256) * 256
    views = (batch + 1) * rows * group * 2 * hk * dim * elem
    kv = batch * ctx * 2 * hk * dim * elem                      # one copy of the KV read
    q_rows = batch * ctx if op == "prefill" else batch
    need = views * (2 if vmm else 1) + 2 * q_rows * hq * dim * elem
    if torch.device(device).type == "cuda":
        return need + kv * (2 if flex else 1)                   # the paged copies
    q_len = ctx if op == "prefill" else 1                       # reference: one request at a time,
    return need + 4 * (2 * ctx * hq * dim + 3 * hq * q_len * ctx)   # fp32 K/V per head, 3 score copies


def _views(shape, batch, ctx, dtype, device, group):
    _, hk, dim = shape
    rows = -(-ctx // 256) * 256
    k, v, keep = group_views(slots=batch + 1, rows_per_slot=rows, group_size=group, kv_heads=hk,
                             head_dim=dim, dtype=dtype, device=device, layer=group // 2,
                             generator=torch.Generator(device=device).manual_seed(batch * 7 + ctx))
    slots = torch.randperm(batch + 1, generator=torch.Generator().manual_seed(1))[:batch]
    return k, v, keep, slots.to(device)


def _vattn_backends(op: str, device, dtype, dim) -> list[str]:
    if torch.device(device).type != "cuda":
        return ["reference"]
    order = DECODE_ORDER if op == "decode" else PREFILL_ORDER
    cap = tuple(torch.cuda.get_device_capability(device))
    return [b for b in order if is_supported(b, op=op, device_type="cuda", dtype=dtype,
                                             head_dim=dim, capability=cap)]


def measure_decode(model, shape, batch, ctx, *, dtype, device, group, hbm, flex=False,
                   vmm=False) -> list[dict]:
    hq, hk, dim = shape
    k, v, keep, slots = _views(shape, batch, ctx, dtype, device, group)
    q = torch.randn(batch, hq, dim, device=device).to(dtype)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    kv_bytes = batch * ctx * hk * dim * 2 * k.element_size()
    times = {}
    # per-step metadata built once, outside the timed call, exactly as for the paged baselines
    s32 = slots.to(torch.int32)
    cu_q = torch.arange(batch + 1, dtype=torch.int32, device=device)
    for be in _vattn_backends("decode", device, dtype, dim):
        times[be] = bench_us(lambda be=be: decode(q, k, v, slots=s32, seqlens=lens, max_seqlen_k=ctx,
                                                  backend=be, cu_seqlens_q=cu_q), device=device)
    if vmm:
        times |= on_vmm(list(times), k, v, slots, ctx, group, lambda be, mk, mv, ms: decode(
            q, mk, mv, slots=ms, seqlens=lens, max_seqlen_k=ctx, backend=be, cu_seqlens_q=cu_q))
    paged = {}
    if torch.device(device).type == "cuda":
        pk = paged_copy(k, v, slots, ctx)
        for name, fn in paged_decoders(pk, q, lens, max_len=ctx, scale=dim ** -0.5).items():
            paged[name] = _try_bench(fn, device)
        del pk
        if flex:
            paged["flex_p128"] = _flex(k, v, slots, q, lens, 1, ctx, dim, False, device)
    del keep
    return _rows("decode", model, batch, ctx, times, paged, kv_bytes, hbm, flops=None)


def measure_prefill(model, shape, batch, ctx, *, dtype, device, group, hbm, flex=False,
                    vmm=False) -> list[dict]:
    hq, hk, dim = shape
    k, v, keep, slots = _views(shape, batch, ctx, dtype, device, group)
    q = torch.randn(batch * ctx, hq, dim, device=device).to(dtype)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=device) * ctx
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    s32 = slots.to(torch.int32)
    times = {}
    for be in _vattn_backends("prefill", device, dtype, dim):
        times[be] = bench_us(lambda be=be: prefill(
            q, k, v, cu_seqlens_q=cu, slots=s32, seqlens_k=lens, max_seqlen_q=ctx,
            max_seqlen_k=ctx, backend=be), device=device)
    if vmm:
        times |= on_vmm(list(times), k, v, slots, ctx, group, lambda be, mk, mv, ms: prefill(
            q, mk, mv, cu_seqlens_q=cu, slots=ms, seqlens_k=lens, max_seqlen_q=ctx,
            max_seqlen_k=ctx, backend=be))
    paged = {}
    if torch.device(device).type == "cuda":
        pk = paged_copy(k, v, slots, ctx)
        for name, fn in paged_prefillers(pk, q, cu, lens, max_q=ctx, max_len=ctx,
                                         scale=dim ** -0.5).items():
            paged[name] = _try_bench(fn, device)
        del pk
        if flex:
            paged["flex_p128"] = _flex(k, v, slots, q, lens, ctx, ctx, dim, True, device)
    del keep
    flops = 4 * hq * dim * batch * ctx * (ctx + 1) / 2
    kv_bytes = batch * ctx * hk * dim * 2 * k.element_size()
    return _rows("prefill", model, batch, ctx, times, paged, kv_bytes, hbm, flops=flops)


def _flex(k, v, slots, q, lens, q_len, ctx, dim, causal, device):
    try:
        pk = paged_copy(k, v, slots, ctx, page=FLEX_PAGE)
        fn = flex_paged_runner(pk, q, lens, q_len=q_len, scale=dim ** -0.5, causal=causal)
        return bench_us(fn, device=device, graph=False)   # torch.compile'd: no outer capture
    except Exception as exc:  # noqa: BLE001 - a compile failure is a result to report, not a crash
        return f"failed: {type(exc).__name__}: {str(exc)[:100]}"


def _try_bench(fn, device):
    try:
        return bench_us(fn, device=device)
    except (RuntimeError, TypeError, ValueError) as exc:  # a baseline that cannot run here
        return f"failed: {str(exc)[:120]}"


def _rows(op, model, batch, ctx, times, paged, kv_bytes, hbm, *, flops) -> list[dict]:
    ok_paged = {k: t for k, t in paged.items() if isinstance(t, float)}
    best_paged = min(ok_paged.values()) if ok_paged else None
    rows = []
    for be, us in times.items():
        same = ok_paged.get(be.split("@")[0])   # BACKEND@vmm: the same kernel on VMM pages
        tbps = kv_bytes / (us * 1e-6) / 1e12
        rows.append({
            "op": op, "model": model, "batch": batch, "context": ctx, "backend": be, "us": us,
            "TB/s": tbps, "%HBM": 100 * tbps / hbm if hbm else None,
            "TFLOP/s": flops / (us * 1e-6) / 1e12 if flops else None,
            "paged_same_kernel_us": same, "ratio_same_kernel": same / us if same else None,
            "ratio_vs_best_paged": best_paged / us if best_paged else None,
            "paged": paged})
    return rows


def _grid(args):
    dtype = _DTYPES[args.dtype]
    # prefill first (few shapes), so a run cut by --budget-s still has every model's prefill
    for model in args.models if "prefill" in args.ops else ():
        for ctx in args.prefill_contexts:
            yield measure_prefill, model, MODEL_SHAPES[model], 1, ctx, dtype
    for model in args.models if "decode" in args.ops else ():
        for ctx in args.contexts:
            for batch in args.batches:
                if batch * ctx <= args.max_tokens:
                    yield measure_decode, model, MODEL_SHAPES[model], batch, ctx, dtype


def _check_grid(args, grid) -> None:
    """Refuse an empty grid, or one whose largest shape does not fit in the device's memory."""
    if not grid:
        raise ConfigError(f"no shape to measure: every batch x context of --batches "
                          f"{_csv(args.batches)} and --contexts {_csv(args.contexts)} exceeds --max-tokens "
                          f"{args.max_tokens}")

    def need(item) -> int:
        fn, _, shape, batch, ctx, dtype = item
        return peak_bytes(_op(fn), shape, batch, ctx, dtype=dtype, device=args.device,
                          group=args.group_size, flex=args.flex, vmm=args.vmm)

    biggest = max(grid, key=need)
    fn, model, _, batch, ctx, _ = biggest
    hint = "pass smaller --contexts / --batches / --prefill-contexts (or --max-tokens)"
    if torch.device(args.device).type != "cuda":
        hint += ", or run on a GPU (--device cuda)"
    check_fits(f"{_op(fn)} {model} B={batch} ctx={ctx}", need(biggest), args.device, hint=hint)


def _op(measure) -> str:
    return measure.__name__.removeprefix("measure_")


def _csv(values) -> str:
    return ",".join(map(str, values))


def run(args) -> int:
    """Measure the grid of the flags; refused up front (``ConfigError``) if it cannot fit here."""
    resolve_sizes(args)
    grid = list(_grid(args))
    _check_grid(args, grid)
    device = torch.device(args.device)
    hbm = hbm_copy_tbps(device)
    print(f"measured copy bandwidth: {hbm:.2f} TB/s", flush=True)
    os.makedirs(args.out, exist_ok=True)
    partial = os.path.join(args.out, "attention.rows.jsonl")   # one line per row, as measured
    start, results, left_out = time.perf_counter(), [], []
    with open(partial, "w") as log:
        for i, (fn, model, shape, batch, ctx, dtype) in enumerate(grid):
            if i and args.budget_s is not None and time.perf_counter() - start > args.budget_s:
                left_out = [f"{_op(f)} {m} B={b} ctx={c}" for f, m, _, b, c, _ in grid[i:]]
                print(f"budget of {args.budget_s:.0f} s spent: {len(left_out)} shapes left out",
                      flush=True)
                break
            rows = fn(model, shape, batch, ctx, dtype=dtype, device=device, group=args.group_size,
                      hbm=hbm, flex=args.flex, vmm=args.vmm)
            for r in rows:
                print(_fmt_row(r), flush=True)
                log.write(json.dumps(r) + "\n")
            log.flush()
            results.extend(rows)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    _write(args, results, hbm, device, left_out)
    return 0


def _fmt_row(r) -> str:
    ratio = r["ratio_same_kernel"] or r["ratio_vs_best_paged"]
    return (f"{r['op']:7s} {r['model']:9s} B={r['batch']:<4d} ctx={r['context']:<6d} "
            f"{r['backend']:10s} {r['us']:10.1f} us {r['TB/s']:6.2f} TB/s "
            f"{(r['%HBM'] or 0):5.1f}% HBM  ratio {ratio if ratio is None else round(ratio, 3)}")


def markdown(results, hbm, device="cuda") -> str:
    head = ("| op | model | B | ctx | backend | µs | TB/s | % HBM | paged same kernel µs | ratio "
            "(same kernel) | ratio (vs best paged) |\n|---|---|---|---|---|---|---|---|---|---|---|\n")
    fmt = lambda x: "—" if x is None else (f"{x:.3f}" if isinstance(x, float) else str(x))
    body = "".join(
        f"| {r['op']} | {r['model']} | {r['batch']} | {r['context']} | {r['backend']} | {r['us']:.1f} "
        f"| {r['TB/s']:.2f} | {fmt(r['%HBM'])} | {fmt(r['paged_same_kernel_us'])} | "
        f"{fmt(r['ratio_same_kernel'])} | {fmt(r['ratio_vs_best_paged'])} |\n" for r in results)
    timing = ("Times are medians of CUDA graph replays (kernel time, no Python launch overhead; "
              "FlexAttention launched eagerly after torch.compile)." if torch.device(device).type ==
              "cuda" else "CPU wall-clock medians (correctness path, not a performance claim).")
    return f"Measured copy bandwidth: {hbm:.2f} TB/s (read + write). {timing}\n\n" + head + body


def _write(args, results, hbm, device, left_out=()) -> None:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "attention.json"), "w") as f:
        json.dump({"hbm_copy_TBps": hbm, "device": str(device), "results": results,
                   "left_out": list(left_out)}, f, indent=1)
    md = markdown(results, hbm, device)
    if targets(results):
        md = "Targets:\n\n" + targets(results) + "\n\n" + md
    if left_out:
        md += f"\nNot measured (time budget `--budget-s {args.budget_s:.0f}` spent): " + \
              ", ".join(left_out) + ".\n"
    with open(os.path.join(args.out, "attention.md"), "w") as f:
        f.write(md)
    _plot(results, args.out)
    if not args.no_report:
        from vattn.bench.report import write_section
        write_section("Attention kernels: virtually contiguous vs paged", md,
                      "vattn bench attention " + _command_args(args))


def _command_args(args) -> str:
    """The run's arguments as a command line (flags that are off and unset values left out)."""
    parts = []
    for key, value in vars(args).items():
        if key in ("out", "func", "command", "bench") or key.startswith("_") or value is None \
                or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        shown = _csv(value) if isinstance(value, (tuple, list)) else value
        parts.append(flag if value is True else f"{flag} {shown}")
    return " ".join(parts)


def targets(results, *, fa3="vllm_fa3", triton="triton") -> str:
    """The issue's targets read off the rows: decode >= 1.00x FA3 paged at every shape, prefill
    >= 1.10x at 16K-32K, Triton decode >= 85 % of copy bandwidth at batch x context >= 256K."""
    def ratios(op, pred=lambda r: True):
        return [(r["ratio_same_kernel"], r) for r in results if r["op"] == op and r["backend"] == fa3
                and r["ratio_same_kernel"] and pred(r)]
    lines = []
    dec = ratios("decode")
    if dec:
        worst = min(dec, key=lambda x: x[0])
        under = [x for x in dec if x[0] < 1.0]
        lines.append(f"- decode, {fa3} on vattn vs {fa3} paged: {min(x[0] for x in dec):.3f}–"
                     f"{max(x[0] for x in dec):.3f}× over {len(dec)} shapes; {len(under)} below 1.00× "
                     f"(worst {worst[1]['model']} B={worst[1]['batch']} ctx={worst[1]['context']}: "
                     f"{worst[0]:.3f}×, missed by {100 * (1 - worst[0]):.1f} %)" if under else
                     f"- decode, {fa3} on vattn vs {fa3} paged: {min(x[0] for x in dec):.3f}–"
                     f"{max(x[0] for x in dec):.3f}× over {len(dec)} shapes: target ≥ 1.00× met")
    pre = ratios("prefill", lambda r: 16384 <= r["context"] <= 32768)
    if pre:
        low = min(x[0] for x in pre)
        lines.append(f"- prefill 16K–32K, {fa3}: {low:.3f}–{max(x[0] for x in pre):.3f}× "
                     + ("(target ≥ 1.10× met)" if low >= 1.10 else
                        f"(target ≥ 1.10× missed by {100 * (1.10 - low):.1f} points)"))
    big = [r for r in results if r["op"] == "decode" and r["backend"] == triton and r["%HBM"]
           and r["batch"] * r["context"] >= 256 * 1024]
    if big:
        low = min(r["%HBM"] for r in big)
        lines.append(f"- Triton decode at batch × context ≥ 256K tokens: {low:.0f}–"
                     f"{max(r['%HBM'] for r in big):.0f} % of copy bandwidth over {len(big)} shapes "
                     + ("(target ≥ 85 % met)" if low >= 85 else f"(target ≥ 85 % missed by {85 - low:.0f} points)"))
    return "\n".join(lines)


def _plot(results, out) -> None:
    """Per op: one panel per model, one line per batch (decode) or per model (prefill), of the
    same-kernel ratio (paged FA3 / FA3 on vattn) when vLLM's FA3 ran, else vs the best paged."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots")
        return
    for op in ("decode", "prefill"):
        rows = [r for r in results if r["op"] == op]
        same = [r for r in rows if r["backend"] == "vllm_fa3" and r["ratio_same_kernel"]]
        key, what = ("ratio_same_kernel", "FA3 paged / FA3 on vattn") if same else \
            ("ratio_vs_best_paged", "best paged / vattn")
        rows = same or [r for r in rows if r["ratio_vs_best_paged"]]
        if not rows:
            continue
        models = list(dict.fromkeys(r["model"] for r in rows))
        fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.6), squeeze=False,
                                 sharey=True)
        for ax, model in zip(axes[0], models):
            mine = [r for r in rows if r["model"] == model]
            for batch in sorted({r["batch"] for r in mine}):
                best = {}
                for r in (r for r in mine if r["batch"] == batch):   # one point per context
                    best[r["context"]] = max(best.get(r["context"], 0.0), r[key])
                pts = sorted(best.items())
                ax.plot([c for c, _ in pts], [v for _, v in pts], marker="o", label=f"B={batch}")
            ax.set_xscale("log", base=2)
            ax.axhline(1.0, color="gray", lw=0.8)
            ax.set_title(model)
            ax.set_xlabel("context length (tokens)")
            ax.legend(fontsize=7)
        axes[0][0].set_ylabel(f"{what} (> 1: vattn faster)")
        fig.suptitle(f"{op}: same data, CUDA-graph timing")
        fig.tight_layout()
        fig.savefig(os.path.join(out, f"attention_{op}_ratio.png"), dpi=110)
        plt.close(fig)
