"""``vattn bench layout``: which layer group G to use for a model shape (design decision 2).

For every layout (per layer with K/V split, G = 1, 2, 4, 8, ..., all layers) a real
``VirtualKVCache`` is built, a middle layer is filled, and decode (and prefill) run on its views
with the fastest installed kernel; a page-16 paged copy of the same data is the baseline (vLLM
FA3/FA2 when importable). Recommendation: the layout with the least worst-case waste whose time is
within ``--tolerance`` of the fastest layout.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from vattn import argtypes
from vattn.bench.limits import check_fits
from vattn.bench.paged_baselines import bench_us, paged_copy, paged_decoders, paged_prefillers
from vattn.core.errors import ConfigError
from vattn.core.ops import decode, prefill, resolve_backend

__all__ = ["add_arguments", "run", "build_cache", "parse_shape", "recommend", "peak_bytes",
           "resolve_cases", "DEFAULT_CASES"]

_SHAPES = {"llama3-8b": (32, 32, 8, 128), "yi-6b": (32, 32, 4, 128), "yi-34b": (60, 56, 8, 128)}
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: default cases per device type: the design sweep on CUDA, a small correctness sweep on the CPU
DEFAULT_CASES = {"cuda": {"decode_cases": ((128, 2048), (32, 8192)), "prefill_cases": ((1, 16384),)},
                 "cpu": {"decode_cases": ((4, 512),), "prefill_cases": ((1, 256),)}}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-shape", type=_shape_arg, default="llama3-8b",
                        help="a name (%s) or layers,q_heads,kv_heads,head_dim" % ",".join(_SHAPES))
    parser.add_argument("--groups", type=argtypes.name_list_or_ints(("split", "all")),
                        default=("split", "1", "2", "4", "8", "all"))
    parser.add_argument("--decode-cases", type=argtypes.cases, default=None,
                        help="BATCHxCONTEXT,... or '' for none (default: 128x2048,32x8192 on CUDA, "
                             "4x512 on CPU)")
    parser.add_argument("--prefill-cases", type=argtypes.cases, default=None,
                        help="BATCHxPROMPT,... or '' for none (default: 1x16384 on CUDA, 1x256 on CPU)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    parser.add_argument("--tolerance", type=argtypes.non_negative_float, default=0.01)
    parser.add_argument("--device", type=argtypes.device, default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=os.environ.get("OUT", "reports"))
    parser.add_argument("--no-report", action="store_true")


def parse_shape(text: str) -> tuple[int, int, int, int]:
    """``(layers, q_heads, kv_heads, head_dim)`` from a known name or ``"32,32,8,128"``.

    Raises
    ------
    ConfigError
        Neither a known name nor four ints >= 1 with ``q_heads`` a multiple of ``kv_heads``.
    """
    if text in _SHAPES:
        return _SHAPES[text]
    try:
        parts = tuple(int(x) for x in text.split(","))
    except ValueError:
        parts = ()
    if len(parts) != 4 or min(parts) < 1 or parts[1] % parts[2]:
        raise ConfigError(f"--model-shape: expected a name ({', '.join(_SHAPES)}) or "
                          f"layers,q_heads,kv_heads,head_dim (four ints >= 1, q_heads a multiple of "
                          f"kv_heads), got {text!r}")
    return parts


def _shape_arg(text: str) -> str:
    """``--model-shape``: checked by :func:`parse_shape`, kept as typed (it names the report)."""
    try:
        parse_shape(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--model-shape: ")) from exc
    return text


def _group(group: str, layers: int) -> int:
    """The group size of ``"split"``, ``"all"`` or an int string; ``ConfigError`` unless it divides
    ``layers``."""
    g = layers if group == "all" else 1 if group == "split" else int(group)
    if g < 1 or layers % g:
        raise ConfigError(f"--groups: expected 'split', 'all' or a divisor of the model's {layers} "
                          f"layers, got {group!r}")
    return g


def _budget(shape, group: str, batch: int, context: int, dtype) -> int:
    """Page budget of :func:`build_cache`: the KV plus one partly filled page per range and slot."""
    layers, _, hk, dim = shape
    g = _group(group, layers)
    elem = torch.tensor([], dtype=dtype).element_size()
    need = layers * batch * context * 2 * hk * dim * elem
    ranges = layers // g * (2 if group == "split" else 1)
    return need + 2 * ranges * batch * (2 << 20) + (64 << 20)


def build_cache(*, shape, group: str, batch: int, context: int, dtype, device):
    """The one place a cache is built: ``group`` is ``"split"``, ``"all"`` or an int string."""
    from vattn.core import KVCacheConfig, VirtualKVCache
    layers, _, hk, dim = shape
    g = _group(group, layers)
    cfg = KVCacheConfig(num_layers=layers, num_kv_heads=hk, head_dim=dim, dtype=dtype,
                        max_slots=batch, max_context=context, group_size=g,
                        split_kv=group == "split", page_budget=int(_budget(shape, group, batch, context, dtype)),
                        device=str(device), map_ahead_tokens=0, scrub="never")
    return VirtualKVCache(cfg), g


def peak_bytes(shape, group: str, op: str, batch: int, ctx: int, *, dtype, device) -> int:
    """Estimated peak memory of one measured case: the cache, q/out, the paged copy on CUDA or the
    reference path's fp32 temporaries on the CPU."""
    _, hq, hk, dim = shape
    elem = torch.tensor([], dtype=dtype).element_size()
    q_rows = batch * ctx if op == "prefill" else batch
    need = _budget(shape, group, batch, ctx, dtype) + 2 * q_rows * hq * dim * elem
    if torch.device(device).type == "cuda":
        return need + batch * ctx * 2 * hk * dim * elem
    q_len = ctx if op == "prefill" else 1
    return need + 4 * (2 * ctx * hq * dim + 3 * hq * q_len * ctx)


def _measure(shape, group, op, batch, ctx, *, dtype, device) -> dict:
    layers, hq, hk, dim = shape
    cache, g = build_cache(shape=shape, group=group, batch=batch, context=ctx, dtype=dtype, device=device)
    try:
        slots = [cache.acquire() for _ in range(batch)]
        failed = cache.ensure({s: ctx for s in slots})
        if failed:
            raise RuntimeError(f"could not map {len(failed)} slots for layout {group}")
        layer = layers // 2
        k, v = cache.k(layer), cache.v(layer)
        st = torch.tensor(slots, device=device)
        gen = torch.Generator(device=device).manual_seed(0)   # drawn on the device: GBs of KV
        for s in slots:
            k[s, :ctx] = torch.randn(ctx, hk, dim, generator=gen, device=device).to(dtype)
            v[s, :ctx] = torch.randn(ctx, hk, dim, generator=gen, device=device).to(dtype)
        us, paged = _time_op(op, k, v, st, batch, ctx, hq, dtype, device)
        from vattn.core import layout_report
        rep = layout_report(num_layers=layers, num_kv_heads=hk, head_dim=dim, dtype=dtype,
                            group_size=g, split_kv=group == "split")
        return {"layout": group, "op": op, "batch": batch, "context": ctx, "us": us, "paged": paged,
                "tokens_per_page": rep.tokens_per_page, "worst_waste_MiB": rep.worst_waste_bytes / 2**20}
    finally:
        cache.close()


def _time_op(op, k, v, slots, batch, ctx, hq, dtype, device):
    dim = k.shape[-1]
    be = resolve_backend(op, device=device, dtype=dtype, head_dim=dim)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    s32 = slots.to(torch.int32)     # per-step metadata built once, as for the paged baseline
    if op == "decode":
        q = torch.randn(batch, hq, dim, device=device).to(dtype)
        cu = torch.arange(batch + 1, dtype=torch.int32, device=device)
        fn = lambda: decode(q, k, v, slots=s32, seqlens=lens, max_seqlen_k=ctx, backend=be,
                            cu_seqlens_q=cu)
    else:
        q = torch.randn(batch * ctx, hq, dim, device=device).to(dtype)
        cu = torch.arange(batch + 1, dtype=torch.int32, device=device) * ctx
        fn = lambda: prefill(q, k, v, cu_seqlens_q=cu, slots=s32, seqlens_k=lens,
                             max_seqlen_q=ctx, max_seqlen_k=ctx, backend=be)
    us = {be: bench_us(fn, device=device)}
    paged = {}
    if torch.device(device).type == "cuda":
        pk = paged_copy(k, v, slots, ctx)
        runs = (paged_decoders(pk, q, lens, max_len=ctx, scale=dim ** -0.5) if op == "decode" else
                paged_prefillers(pk, q, cu, lens, max_q=ctx, max_len=ctx, scale=dim ** -0.5))
        paged = {name: bench_us(f, device=device) for name, f in runs.items() if name == be}
        del pk
    return us, paged


def recommend(rows: list[dict], tolerance: float) -> str:
    """Least-waste layout whose mean time over the cases is within ``tolerance`` of the best."""
    layouts = []
    for lay in dict.fromkeys(r["layout"] for r in rows):
        mine = [r for r in rows if r["layout"] == lay]
        layouts.append((lay, sum(next(iter(r["us"].values())) for r in mine) / len(mine),
                        mine[0]["worst_waste_MiB"]))
    best = min(t for _, t, _ in layouts)
    ok = [(waste, lay) for lay, t, waste in layouts if t <= best * (1 + tolerance)]
    return min(ok)[1]


def resolve_cases(args) -> None:
    """Fill the case flags left unset with :data:`DEFAULT_CASES` of ``args.device``'s type."""
    defaults = DEFAULT_CASES["cuda" if torch.device(args.device).type == "cuda" else "cpu"]
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def _plan(args, shape, dtype) -> list[tuple[str, int, int, str]]:
    """``(op, batch, context, group)`` of every case, refused up front (``ConfigError``) if a group
    does not divide the layers or the largest case does not fit in the device's memory."""
    resolve_cases(args)
    for group in args.groups:
        _group(group, shape[0])
    plan = [(op, batch, ctx, group) for op, cases in (("decode", args.decode_cases),
                                                       ("prefill", args.prefill_cases))
            for batch, ctx in cases for group in args.groups]
    if not plan:
        raise ConfigError("no case to measure: --decode-cases and --prefill-cases are both empty")
    need = lambda p: peak_bytes(shape, p[3], p[0], p[1], p[2], dtype=dtype, device=args.device)
    op, batch, ctx, group = biggest = max(plan, key=need)
    hint = "pass smaller --decode-cases / --prefill-cases"
    if torch.device(args.device).type != "cuda":
        hint += ", or run on a GPU (--device cuda)"
    check_fits(f"{op} B={batch} ctx={ctx} with layout {group}", need(biggest), args.device, hint=hint)
    return plan


def run(args) -> int:
    shape, dtype, device = parse_shape(args.model_shape), _DTYPES[args.dtype], torch.device(args.device)
    rows = []
    for op, batch, ctx, group in _plan(args, shape, dtype):
        r = _measure(shape, group, op, batch, ctx, dtype=dtype, device=device)
        print(json.dumps({k: r[k] for k in ("layout", "op", "batch", "context", "us", "paged")}), flush=True)
        rows.append(r)
    choice = recommend([r for r in rows if r["op"] == "decode"] or rows, args.tolerance)
    md = markdown(rows, shape) + f"\nRecommended group size: **{choice}** (least waste within " \
                                 f"{args.tolerance:.0%} of the fastest decode layout).\n"
    print(md)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "layout.json"), "w") as f:
        json.dump({"shape": shape, "recommended": choice, "rows": rows}, f, indent=1)
    with open(os.path.join(args.out, "layout.md"), "w") as f:
        f.write(md)
    if not args.no_report:
        from vattn.bench.report import write_section
        write_section(f"Layer-group layout sweep {args.model_shape}", md,
                      f"vattn bench layout --model-shape {args.model_shape} --groups {','.join(args.groups)} "
                      f"--decode-cases {_fmt_cases(args.decode_cases)} "
                      f"--prefill-cases {_fmt_cases(args.prefill_cases)}")
    return 0


def _fmt_cases(cases) -> str:
    return ",".join(f"{b}x{c}" for b, c in cases)


def markdown(rows, shape) -> str:
    cases = list(dict.fromkeys((r["op"], r["batch"], r["context"]) for r in rows))
    head = "| layout | tokens per page | worst waste / request (MiB) | " + " | ".join(
        f"{op} B={b} ctx={c}: µs (paged/this)" for op, b, c in cases) + " |\n"
    head += "|---" * (3 + len(cases)) + "|\n"
    body = ""
    for lay in dict.fromkeys(r["layout"] for r in rows):
        mine = {(r["op"], r["batch"], r["context"]): r for r in rows if r["layout"] == lay}
        first = next(iter(mine.values()))
        cells = []
        for key in cases:
            r = mine[key]
            us = next(iter(r["us"].values()))
            ratio = f"{next(iter(r['paged'].values())) / us:.3f}" if r["paged"] else "—"
            cells.append(f"{us:.1f} ({ratio})")
        name = "per layer, K/V split" if lay == "split" else f"G={lay}"
        body += f"| {name} | {first['tokens_per_page']:.1f} | {first['worst_waste_MiB']:.1f} | " \
                + " | ".join(cells) + " |\n"
    return f"Model shape (layers, q heads, kv heads, head dim) = {shape}\n\n" + head + body
