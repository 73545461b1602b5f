"""``vattn bench vmm``: cost of the VMM calls and of ``ensure()`` on a decode loop's critical path."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch
from tqdm import tqdm

from .. import argtypes
from ..core import KVCacheConfig, VirtualKVCache
from ..core.driver import get_driver
from ..core.errors import UnsupportedError
from .limits import check_fits
from .report import command_line, upper_quantile, write_section

__all__ = ["add_arguments", "run", "call_latency", "decode_loop", "model_shape"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", type=argtypes.device, default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--pages", type=argtypes.positive_int, default=256, help="pages per latency measurement")
    parser.add_argument("--batches", type=argtypes.int_list, default=(1, 64, 256), help="decode batch sizes")
    parser.add_argument("--steps", type=argtypes.positive_int, default=300, help="decode steps per loop")
    parser.add_argument("--step-ms", type=argtypes.positive_float, default=10.0,
                        help="simulated GPU time per step")
    parser.add_argument("--prompt", type=argtypes.positive_int, default=512, help="mean prompt length of the loop")
    parser.add_argument("--model-shape", type=model_shape, default=None,
                        help="layers,kv_heads,head_dim,group (default: Llama-3-8B G=4 on CUDA, tiny on CPU)")
    parser.add_argument("--busy-ms", type=argtypes.non_negative_float, default=20.0,
                        help="CUDA: also time each call while a kernel of this many ms runs (0: skip)")
    parser.add_argument("--busy-only", action="store_true",
                        help="only the calls-while-busy table (no latency sweep, no decode loops; "
                             "the same as --only busy)")
    parser.add_argument("--alias-threads", type=argtypes.int_list, default=(),
                        help="also map one set of shared pages into many regions with each of these "
                             "thread counts (e.g. 1,2,4,8; empty: skip)")
    parser.add_argument("--alias-pages", type=argtypes.positive_int, default=32,
                        help="shared pages per region of the aliasing table (a 4,096-token prefix "
                             "of Llama-3-8B at G=4: 32 per range)")
    parser.add_argument("--alias-regions", type=argtypes.positive_int, default=64,
                        help="regions the shared pages are mapped into")
    parser.add_argument("--alias-chunk", type=argtypes.positive_int, default=1,
                        help="pages per physical allocation of the aliasing table, each mapped with "
                             "one call (must divide --alias-pages; 1: one call per page, as vattn maps)")
    parser.add_argument("--only", choices=("busy", "alias", "contended"), default=None,
                        help="only the calls-while-busy table, the aliasing table, or the table of "
                             "each call with a Python thread busy beside it (GIL contention)")
    parser.add_argument("--benchmarks", default="BENCHMARKS.md", help="file to write the section to")
    parser.add_argument("--json", default=None, help="also write the raw numbers here")


def model_shape(text: str) -> tuple[int, int, int, int]:
    """``"layers,kv_heads,head_dim,group"`` -> four ints >= 1, ``group`` dividing ``layers``."""
    try:
        shape = tuple(int(x) for x in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 4 or min(shape) < 1 or shape[0] % shape[3]:
        raise argparse.ArgumentTypeError(f"expected layers,kv_heads,head_dim,group: four ints >= 1 with "
                                         f"group dividing layers (e.g. 32,8,128,4), got {text!r}")
    return shape


def _median_us(xs: list[float]) -> float:
    return statistics.median(xs) * 1e6 if xs else 0.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def call_latency(device: str, num_pages: int) -> dict:
    """Per-page create / map / set-access / unmap / release latency, unbatched and batched."""
    drv = get_driver(device)
    page, dev = drv.granularity, torch.device(device)
    base = drv.reserve(num_pages * page)
    times: dict[str, list[float]] = {k: [] for k in ("create", "map", "set_access", "unmap", "release")}
    handles = []
    for i in range(num_pages):
        t0 = time.perf_counter(); h = drv.create(page); t1 = time.perf_counter()
        drv.map(base + i * page, page, h); t2 = time.perf_counter()
        drv.set_access(base + i * page, page); t3 = time.perf_counter()
        handles.append(h)
        times["create"].append(t1 - t0); times["map"].append(t2 - t1); times["set_access"].append(t3 - t2)
    _sync(dev)
    for i in range(num_pages):
        t0 = time.perf_counter(); drv.unmap(base + i * page, page); times["unmap"].append(time.perf_counter() - t0)
    t_batch = time.perf_counter()
    for i, h in enumerate(handles):                       # pooled handles, batched access
        drv.map(base + i * page, page, h)
    drv.set_access(base, num_pages * page)
    _sync(dev)
    t_batch = time.perf_counter() - t_batch
    for i in range(num_pages):
        drv.unmap(base + i * page, page)
    for h in handles:
        t0 = time.perf_counter(); drv.release(h); times["release"].append(time.perf_counter() - t0)
    drv.free_va(base, num_pages * page)
    out = {f"{k}_us": _median_us(v) for k, v in times.items()}
    unbatched = out["map_us"] + out["set_access_us"]
    out.update(page_bytes=page, num_pages=num_pages, map_access_unbatched_us=unbatched,
               map_access_batched_us=t_batch / num_pages * 1e6,
               map_gbps_unbatched=page / (unbatched * 1e-6) / 1e9,
               map_gbps_batched=page / (t_batch / num_pages) / 1e9)
    return out


def _shape(args) -> tuple[int, int, int, int]:
    if args.model_shape:
        return tuple(args.model_shape)
    return (32, 8, 128, 4) if args.device.startswith("cuda") else (4, 2, 64, 2)


def _gpu_step(device: torch.device, ms: float) -> None:
    """Stand-in for a decode step's kernels: a GPU busy kernel and a synchronize, as an engine does."""
    if device.type == "cuda":
        torch.cuda._sleep(int(ms * 1.4e6))         # ~clock cycles per ms on a 1.4-2 GHz SM clock
        torch.cuda.synchronize(device)
    else:
        time.sleep(ms / 1e3)


def decode_loop(args, batch: int, *, map_ahead: int) -> dict:
    """Simulated decode: every step each running slot grows by one token; GPU time is a sleep.

    Returns ensure()'s time per step (the critical path), on-demand vs ahead mapped pages.
    """
    layers, heads, dim, group = _shape(args)
    rng = random.Random(0)
    prompts = [max(1, int(rng.expovariate(1 / args.prompt))) for _ in range(batch)]
    max_ctx = max(prompts) + args.steps + 1
    page = 2 << 20
    sets = sum(-(-(p + args.steps + map_ahead + 1) * group * 2 * heads * dim * 2 // page) + 1 for p in prompts)
    budget = (sets + 1) * page * (layers // group)
    check_fits(f"the decode loop of batch {batch}", budget, args.device,
               hint="lower --batches, --prompt or --steps")
    cfg = KVCacheConfig(num_layers=layers, num_kv_heads=heads, head_dim=dim, dtype=torch.bfloat16,
                        max_slots=batch, max_context=max_ctx, group_size=group, page_budget=budget,
                        device=args.device, map_ahead_tokens=map_ahead, scrub="never")
    with VirtualKVCache(cfg) as cache:
        slots = [cache.acquire(expected_len=p) for p in prompts]
        lengths = dict(zip(slots, prompts))
        cache.ensure(lengths)                         # prefill: not part of the decode loop
        if map_ahead:
            cache.step(lengths)
            cache.wait()
        before = cache.metrics()
        per_step = []
        for _ in tqdm(range(args.steps), desc=f"decode B={batch} ahead={map_ahead}", leave=False):
            lengths = {s: n + 1 for s, n in lengths.items()}
            t0 = time.perf_counter()
            failed = cache.step(lengths) if map_ahead else cache.ensure(lengths)
            per_step.append(time.perf_counter() - t0)
            if failed:
                raise RuntimeError(f"benchmark budget too small: {len(failed)} slots failed")
            _gpu_step(cache.driver.device, args.step_ms)   # the GPU computes; the worker maps meanwhile
        m = cache.metrics()
    per_step.sort()
    return {"batch": batch, "map_ahead_tokens": map_ahead, "steps": args.steps,
            "ensure_median_us": _median_us(per_step), "ensure_p99_us": upper_quantile(per_step, 0.99) * 1e6,
            "ensure_max_us": per_step[-1] * 1e6, "ensure_mean_us": statistics.fmean(per_step) * 1e6,
            "share_of_step": statistics.fmean(per_step) * 1e3 / args.step_ms,
            "pages_on_demand": m["pages_mapped_on_demand"] - before["pages_mapped_on_demand"],
            "pages_ahead": m["pages_mapped_ahead"] - before["pages_mapped_ahead"]}


def _markdown(lat: dict, loops: list[dict], args) -> str:
    page_mb = lat["page_bytes"] / 2**20
    rows = [f"Per {page_mb:g} MiB page, median of {lat['num_pages']} (µs):", "",
            "| create | map | set-access | map+access (unbatched) | map+access (batched access) | unmap | release |",
            "|---|---|---|---|---|---|---|",
            f"| {lat['create_us']:.1f} | {lat['map_us']:.1f} | {lat['set_access_us']:.1f} | "
            f"{lat['map_access_unbatched_us']:.1f} | {lat['map_access_batched_us']:.1f} | {lat['unmap_us']:.1f} | "
            f"{lat['release_us']:.1f} |", "",
            f"Map throughput: {lat['map_gbps_unbatched']:.1f} GB/s unbatched, {lat['map_gbps_batched']:.1f} GB/s "
            "with access granted once per run.", "",
            f"ensure() per decode step (critical path), {args.steps} steps, simulated GPU step "
            f"{args.step_ms:g} ms, model shape {','.join(map(str, _shape(args)))} (layers,kv_heads,head_dim,G):", "",
            "| batch | map-ahead | median µs | mean µs | p99 µs | max µs | mean share of step | pages on demand | pages ahead |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in loops:
        rows.append(f"| {r['batch']} | {r['map_ahead_tokens'] or 'off'} | {r['ensure_median_us']:.1f} | "
                    f"{r['ensure_mean_us']:.1f} | {r['ensure_p99_us']:.1f} | {r['ensure_max_us']:.1f} | "
                    f"{r['share_of_step']:.2%} | {r['pages_on_demand']} | {r['pages_ahead']} |")
    return "\n".join(rows)


def _busy(args) -> tuple[dict, str] | None:
    """The calls-while-busy table (CUDA only; ``None`` without a kernel to be busy with)."""
    if not args.device.startswith("cuda") or not args.busy_ms:
        return None
    from .vmm_busy import busy_latency, cuda_busy, launch_stalls, markdown, stalls_markdown
    drv, dev = get_driver(args.device), torch.device(args.device)
    pages = min(args.pages, 32)
    idle = busy_latency(drv, pages, busy_ms=args.busy_ms, launch=None)
    kernels = {name: cuda_busy(dev, side_stream=side) for name, side in (("default stream", False),
                                                                        ("own stream", True))}
    busy = {name: busy_latency(drv, pages, busy_ms=args.busy_ms, launch=launch, running=running, idle=wait)
            for name, (launch, running, wait) in kernels.items()}
    launch, _, wait = kernels["default stream"]
    stalls = {w: launch_stalls(drv, launch, wait, worker=w) for w in (False, True)}
    body = markdown(idle, busy, args.busy_ms) + "\n\n" + stalls_markdown(stalls[False], stalls[True])
    return {"idle": idle, "busy": busy, "busy_ms": args.busy_ms, "launch_stalls": list(stalls.values())}, body


def _contended(args) -> tuple[list, str]:
    """The GIL-contention table: every driver path of the device (:mod:`.vmm_gil`)."""
    from .vmm_gil import contended, drivers, markdown, torch_calls
    dev = torch.device(args.device)
    rows = [(label, contended(drv, pages=min(args.pages, 16), sync=lambda: _sync(dev),
                              extras=torch_calls(args.device) if i == 0 else None))
            for i, (label, drv) in enumerate(drivers(args.device))]
    return rows, markdown(rows)


def run(args) -> int:
    page = get_driver(args.device).granularity          # UnsupportedError if the backend is missing
    check_fits(f"--pages {args.pages}", args.pages * page, args.device, hint="pass a smaller --pages")
    only = "busy" if args.busy_only else args.only
    if only == "busy" and not (args.device.startswith("cuda") and args.busy_ms):
        raise UnsupportedError(f"--busy-only needs a CUDA device and --busy-ms > 0, got --device "
                               f"{args.device} --busy-ms {args.busy_ms:g}")
    if only == "alias" and not args.alias_threads:
        raise UnsupportedError("--only alias needs --alias-threads (e.g. 1,2,4,8)")
    check_fits("the aliasing table", args.alias_pages * page, args.device, hint="pass a smaller --alias-pages")
    lat, loops = (call_latency(args.device, args.pages), []) if only is None else (None, [])
    for batch in args.batches if only is None else ():
        for ahead in (0, 256):
            loops.append(decode_loop(args, batch, map_ahead=ahead))
            print(json.dumps(loops[-1]))
    busy = _busy(args) if only in (None, "busy") else None
    alias = None
    if args.alias_threads and only in (None, "alias"):
        from .vmm_alias import alias_throughput, markdown
        if args.alias_chunk > 1 and not args.device.startswith("cuda"):
            raise UnsupportedError(f"--alias-chunk {args.alias_chunk} needs a CUDA device (the host "
                                   f"backend has one page per allocation), got --device {args.device}")
        if args.alias_pages % args.alias_chunk:
            raise UnsupportedError(f"--alias-chunk {args.alias_chunk} must divide --alias-pages "
                                   f"{args.alias_pages}")
        rows = alias_throughput(args.device, pages=args.alias_pages, regions=args.alias_regions,
                                threads=list(args.alias_threads), chunk=args.alias_chunk)
        alias = rows, markdown(rows, page)
    contended = _contended(args) if only in (None, "contended") else None
    body = "\n\n".join(([_markdown(lat, loops, args)] if lat else []) + ([busy[1]] if busy else []) +
                        ([alias[1]] if alias else []) + ([contended[1]] if contended else []))
    print(body)
    backend = "CUDA" if args.device.startswith("cuda") else "host"
    title = f"vmm ({backend} backend{f', {only}' if only else ''})"
    write_section(title, body, command_line(), path=args.benchmarks)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"latency": lat, "decode": loops, "busy": busy[0] if busy else None,
                       "alias": alias[0] if alias else None,
                       "contended": contended[0] if contended else None}, f, indent=2)
    return 0
