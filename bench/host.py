"""``vattn bench host``: the host time vattn's vLLM runtime adds to an engine step.

Drives :class:`vattn.adapters.vllm.gpu_runtime.GpuRuntime` (engine-free) through the calls
vLLM's V2 runner makes in a generation of the decode-heavy workload: every request receives its
prompt's blocks, then each step one ``apply`` and the slot tables (``gather_block_table``,
``compute_slot_mapping``), a request receiving a block whenever its length crosses one, and every
request released at the end. When an engine step is host-bound, this time adds to it one for one.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from tqdm import tqdm

from .. import argtypes
from ..core.errors import ConfigError
from ..core.metrics import Histogram
from .limits import check_fits
from .report import command_line, upper_quantile, write_section

__all__ = ["add_arguments", "run", "generation"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", type=argtypes.device, default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=argtypes.positive_int, default=256, help="requests of the generation")
    parser.add_argument("--prompt", type=argtypes.positive_int, default=512)
    parser.add_argument("--new", type=argtypes.positive_int, default=512, help="tokens generated per request")
    parser.add_argument("--generations", type=argtypes.positive_int, default=3,
                        help="timed generations (after one warm-up)")
    parser.add_argument("--benchmarks", default="BENCHMARKS.md", help="file to write the section to")
    parser.add_argument("--no-report", action="store_true", help="print only, leave BENCHMARKS.md")
    parser.add_argument("--json", default=None, help="also write the raw numbers here")
    parser.add_argument("--prefix-caching", action="store_true",
                        help="vLLM's prefix caching on: block ids from a vLLM-like block pool, "
                             "generations repeating their prompts; counts VMM calls per generation")
    parser.add_argument("--hit-unit", type=argtypes.non_negative_int, default=16,
                        help="with --prefix-caching: the prefix-match unit of vattn's fine hits (tokens, "
                             "as the GPU runner's default): a hit reaching into a cached block gets "
                             "vLLM's copy-on-write of it; 0: whole-block hits, no copies")
    parser.add_argument("--workload", choices=("decode-heavy", "shared-prefix", "multi-turn"),
                        default="decode-heavy",
                        help="with --prefix-caching: distinct prompts, one shared system prompt, or "
                             "conversations (each generation the next turn: + the reply + --user tokens)")
    parser.add_argument("--user", type=argtypes.positive_int, default=256,
                        help="multi-turn: new user tokens per turn")
    parser.add_argument("--shared", type=argtypes.positive_int, default=4096,
                        help="shared-prefix: tokens of the shared system prompt (within --prompt)")
    parser.add_argument("--pool-fraction", type=argtypes.positive_float, default=1.0,
                        help="with --prefix-caching: the KV pool as a share of what every request's "
                             "whole length needs (at most 8); below 1, requests wait and are preempted "
                             "as in vLLM's scheduler (memory pressure); above 1, headroom, as a large "
                             "GPU has under the engine's own sizing")
    parser.add_argument("--max-num-seqs", type=argtypes.positive_int, default=None,
                        help="with --pool-fraction / --fence-lag: requests running at once (vLLM's "
                             "max_num_seqs, the slots; default: --batch); fewer than --batch run in waves")
    parser.add_argument("--max-model-len", type=argtypes.positive_int, default=None,
                        help="with --prefix-caching: tokens each request's region can hold (vLLM's "
                             "max_model_len; default: the longest request of the run). Larger "
                             "regions leave room above each request to park moved blocks")
    parser.add_argument("--fence-lag", type=argtypes.non_negative_int, default=0,
                        help="with --prefix-caching: engine steps the device trails the host (1: "
                             "vLLM's async scheduling); counts the fences the host had to wait for")
    parser.add_argument("--max-batched-tokens", type=argtypes.positive_int, default=None,
                        help="with --prefix-caching: tokens computed per step at most (vLLM's "
                             "max_num_batched_tokens, 8192 by default on a GPU): a burst is admitted "
                             "over several steps (default: unlimited, every prompt in the first step)")
    parser.add_argument("--stage-prefixes", choices=("on", "off"), default=None,
                        help="with --prefix-caching: run the map-ahead worker (given each step to "
                             "finish, as a device step long enough hides it) with prefix staging on "
                             "or off, as vLLM's GPU runner does (VATTN_STAGE_PREFIXES); default: no "
                             "worker, every mapping on the step's path")
    parser.add_argument("--pack-mb", type=argtypes.non_negative_int, default=0,
                        help="with --prefix-caching and the scheduler: MiB for packs of shared runs "
                             "(VATTN_PACK_MB: a run of 8 page-sets hit twice is copied into one "
                             "allocation per range and later hits map it with one call per range); "
                             "default 0: off")
    parser.add_argument("--pack-sets", type=argtypes.int_list, default=(8,),
                        help="with --pack-mb: page-sets per pack, a power of 2, or several (8,16,32: a hit "
                             "tiled largest first; VATTN_PACK_SETS; default 8)")
    parser.add_argument("--defer-mapping", action="store_true",
                        help="with the scheduler: queue each step's VMM calls per range and make them "
                             "as the forward reaches each range, as vLLM's GPU runner does "
                             "(VATTN_DEFER_MAPPING); the table then shows the host ms of those calls "
                             "and of the first range's (still before the forward)")
    parser.add_argument("--free-reserve", type=argtypes.non_negative_int, default=0,
                        help="with --stage-prefixes (the map-ahead worker): page-sets pre-warm leaves "
                             "free and the worker refills between steps (VATTN_FREE_RESERVE, off by default "
                             "in vLLM's GPU runner); default 0: none")
    parser.add_argument("--warm-up", action="store_true",
                        help="with the scheduler: before the generations, one untimed request of the "
                             "first prompt for 2 tokens, as the engine stages warm up (a shared "
                             "prefix is then cached before the first burst)")
    parser.add_argument("--cold-slots", type=argtypes.non_negative_int, default=0,
                        help="with --prefix-caching: idle slots the pre-warm leaves empty, their share "
                             "free in the pool, for requests whose hit is mapped in (VATTN_COLD_SLOTS; "
                             "default 0: every slot pre-warmed)")
    parser.add_argument("--arrive-every", type=argtypes.non_negative_float, default=0.0,
                        help="with the scheduler: engine steps between two requests' arrivals, as a "
                             "server receives them (40 req/s at ~7 ms a step: 3.6); the table then "
                             "gives apply's µs per step (mean, p50, p99); default 0: all at once")
    parser.add_argument("--fence-policy", choices=("retire", "wait"), default="retire",
                        help="with --fence-lag: a released slot's pages whose fence is pending are "
                             "handed on at once and unmapped once it completes (retire: vLLM's GPU "
                             "runner, stream_ordered) or the host waits for the fence first (wait)")


def _runtime(device: str, batch: int, max_len: int, *, prefix_caching: bool = False,
             blocks: int | None = None, driver=None, stream_ordered: bool = True,
             stage: bool | None = None, pack_mb: int = 0, pack_sets: int | tuple[int, ...] = 8,
             defer: bool = False, free_reserve: int = 0, cold_slots: int = 0):
    """Llama-3-8B's page arithmetic (G=4: 128 tokens per 2 MiB page-set row) on CUDA; on the host
    backend the same 128 tokens per page with 1 KV head of 64 fp32 values and 256 KiB pages (16
    fp16 values and 32 KiB pages with prefix caching, whose workloads hold more tokens).
    ``blocks``: page-sets in the pool (default: every request's whole length, plus one);
    ``stage``: ``None`` no map-ahead worker, else the worker on (one block ahead, as vLLM's GPU
    runner has it) with prefix staging on or off; ``defer``: deferred mapping; ``free_reserve``:
    page-sets kept free (``KVCacheConfig.free_reserve``); ``cold_slots``: idle slots the pre-warm
    leaves empty (:meth:`VirtualKVCache.prewarm`)."""
    from vattn.adapters.vllm.gpu_runtime import GpuRuntime
    from vattn.core import KVCacheConfig
    cuda = torch.device(device).type == "cuda"
    heads, dim, dtype, page = ((8, 128, torch.bfloat16, 2 << 20) if cuda else (1, 16, torch.float16, 32 << 10)
                               if prefix_caching else (1, 64, torch.float32, 256 << 10))
    block = 128
    context = -(-max_len // block) * block
    pages_per_set = 32 // 4
    blocks = batch * context // block + 1 if blocks is None else blocks
    cfg = KVCacheConfig(num_layers=32, num_kv_heads=heads, head_dim=dim, dtype=dtype, max_slots=batch,
                        max_context=context, group_size=4, page_budget=blocks * pages_per_set * page,
                        page_bytes=page, device=device, map_ahead_tokens=0 if stage is None else block,
                        stream_ordered=stream_ordered, pack_pages=pack_mb * 2**20 // page,
                        pack_sets=pack_sets, free_reserve=free_reserve * pages_per_set)
    check_fits(f"{batch} requests of {max_len} tokens", cfg.page_budget, device,
               hint="lower --batch, --prompt or --new")
    names = [f"model.layers.{i}.self_attn.attn" for i in range(32)]
    return GpuRuntime(cfg, block_size=block, layer_names=names, max_num_tokens=max(batch, 8192),
                      prefix_caching=prefix_caching, driver=driver, stage_prefixes=bool(stage),
                      defer_mapping=defer, cold_slots=cold_slots)


def generation(rt, *, batch: int, prompt: int, new: int) -> dict:
    """One generation's bookkeeping; ``{name: host seconds}`` of each kind of call."""
    device, block = rt.cache.config.torch_device, rt.block_size
    spent = {"on_blocks": 0.0, "apply": 0.0, "tables": 0.0, "release": 0.0}
    idx = torch.arange(batch, dtype=torch.int32, device=device)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
    held = 0                                            # blocks each request holds (all alike)
    for step in range(new):
        length = prompt + step + 1                      # tokens each request holds after this step
        need = -(-length // block)
        t0 = time.perf_counter()
        if need != held:
            for i in range(batch):
                rt.on_blocks(i, need, new_request=held == 0)
            held = need
        t1 = time.perf_counter()
        rt.apply()
        t2 = time.perf_counter()
        pos = torch.full((batch,), length - 1, dtype=torch.int64, device=device)
        rt.tables.gather_block_table(idx, batch)
        rt.tables.compute_slot_mapping(idx, qsl, pos, batch)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()   # launches done; kernels are not host time
        t3 = time.perf_counter()
        spent["on_blocks"] += t1 - t0
        spent["apply"] += t2 - t1
        spent["tables"] += t3 - t2
    t0 = time.perf_counter()
    for i in range(batch):
        rt.release(i)
    spent["release"] = time.perf_counter() - t0
    return spent


def run(args) -> int:
    if args.prefix_caching:
        return run_prefix(args)
    rt = _runtime(args.device, args.batch, args.prompt + args.new)
    try:
        generation(rt, batch=args.batch, prompt=args.prompt, new=args.new)          # warm-up
        rt.step_us, rt.blocks_us = Histogram(), Histogram()                        # timed runs only
        runs = [generation(rt, batch=args.batch, prompt=args.prompt, new=args.new)
                for _ in tqdm(range(args.generations), desc="generations", leave=False)]
        m = rt.metrics()
    finally:
        rt.close()
    per_gen = {k: sorted(r[k] for r in runs)[len(runs) // 2] * 1e3 for k in runs[0]}
    result = {"device": args.device, "batch": args.batch, "prompt": args.prompt, "new": args.new,
              "ms_per_generation": {k: round(v, 2) for k, v in per_gen.items()},
              "total_ms_per_generation": round(sum(per_gen.values()), 2),
              "us_per_step": round(sum(per_gen.values()) * 1e3 / args.new, 2),
              "on_blocks_calls": m["on_blocks_us"]["count"] // args.generations,
              "on_blocks_mean_us": round(m["on_blocks_us"]["mean_us"], 2),
              "apply_mean_us": round(m["apply_step_us"]["mean_us"], 2)}
    md = (f"vattn's host work in one decode-heavy generation ({args.batch} requests, {args.prompt} in / "
          f"{args.new} out, median of {args.generations}, {args.device} backend):\n\n"
          "| on_blocks ms | apply ms | slot tables ms | release ms | total ms | µs per step | "
          "on_blocks calls | µs per on_blocks | µs per apply |\n|---|---|---|---|---|---|---|---|---|\n"
          f"| {per_gen['on_blocks']:.2f} | {per_gen['apply']:.2f} | {per_gen['tables']:.2f} | "
          f"{per_gen['release']:.2f} | {result['total_ms_per_generation']:.2f} | {result['us_per_step']:.1f} | "
          f"{result['on_blocks_calls']} | {result['on_blocks_mean_us']:.2f} | {result['apply_mean_us']:.2f} |\n")
    print(md)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if not args.no_report:
        write_section(f"host time per generation ({args.device})", md, command_line(), path=args.benchmarks)
    return 0


def run_prefix(args) -> int:
    """``--prefix-caching``: generations of the same prompts through a vLLM-like block pool; per
    generation the host time and the VMM calls vattn made (the first generation fills the cache,
    the later ones hit it)."""
    from .host_prefix import COUNTED, next_turn, prefix_generation, prompts_for
    from .host_sched import SCHED_COUNTED, scheduled_generation
    from .prefix_pool import PrefixBlockPool
    if args.workload == "shared-prefix" and args.shared >= args.prompt:
        raise ConfigError(f"--shared must be below --prompt ({args.prompt}), got {args.shared}")
    if args.pool_fraction > 8:
        raise ConfigError(f"--pool-fraction must be in (0, 8], got {args.pool_fraction}")
    stage = None if args.stage_prefixes is None else args.stage_prefixes == "on"
    scheduled = (args.pool_fraction != 1 or args.fence_lag > 0 or args.max_batched_tokens is not None
                 or stage is not None or args.pack_mb > 0 or args.warm_up or args.defer_mapping
                 or args.free_reserve > 0 or args.arrive_every > 0)
    if scheduled and args.workload == "multi-turn":
        raise ConfigError("--pool-fraction / --fence-lag / --max-batched-tokens / --stage-prefixes / --pack-mb / "
                          "--warm-up / --defer-mapping / --free-reserve / --arrive-every run decode-heavy or "
                          "shared-prefix, not multi-turn")
    turns = args.generations + 1
    longest = args.prompt + args.new + ((turns - 1) * (args.new + args.user) if args.workload == "multi-turn" else 0)
    fences = None
    if scheduled:
        from vattn.core.driver import get_driver
        from vattn.core.driver.lag import LaggingFences
        host_page = None if torch.device(args.device).type == "cuda" else 32 << 10   # _runtime's page
        fences = LaggingFences(get_driver(args.device, granularity=host_page), lag=args.fence_lag)
    whole = args.batch * -(-longest // 128) + 1
    blocks = max(-(-longest // 128) + 2, int(whole * args.pool_fraction))
    if args.max_model_len is not None and args.max_model_len < longest:
        raise ConfigError(f"--max-model-len must hold the longest request ({longest} tokens), "
                          f"got {args.max_model_len}")
    seqs = args.max_num_seqs or args.batch
    if args.max_num_seqs is not None and not scheduled:
        raise ConfigError("--max-num-seqs needs the scheduler: give --pool-fraction below 1, --fence-lag, "
                          "--max-batched-tokens or --stage-prefixes")
    rt = _runtime(args.device, seqs, args.max_model_len or longest, prefix_caching=True,
                  blocks=blocks, driver=fences, stream_ordered=args.fence_policy == "retire", stage=stage,
                  pack_mb=args.pack_mb, pack_sets=_sizes(args.pack_sets), defer=args.defer_mapping,
                  free_reserve=args.free_reserve, cold_slots=args.cold_slots)
    try:
        pool = PrefixBlockPool(blocks, rt.block_size, unit=args.hit_unit or None)
        prompts = prompts_for(args.workload, batch=args.batch, prompt=args.prompt, shared=args.shared)
        runs = []
        if args.warm_up:                        # as the engine stages: one prompt, 2 tokens, untimed
            scheduled_generation(rt, pool, prompts[:1], 2, max_running=seqs, fences=fences,
                                 max_batched_tokens=args.max_batched_tokens, settle=stage is not None)
        for turn in tqdm(range(turns), desc="generations", leave=False):
            if scheduled:
                runs.append(scheduled_generation(rt, pool, prompts, args.new, max_running=seqs,
                                                 fences=fences, max_batched_tokens=args.max_batched_tokens,
                                                 settle=stage is not None, arrive_every=args.arrive_every))
                continue
            runs.append(prefix_generation(rt, pool, prompts, args.new))
            tokens = runs[-1].pop("tokens")
            if args.workload == "multi-turn":
                prompts = next_turn(tokens, args.user, turn + 1)
        rt.cache.audit()
        ranges = rt.cache.layout.num_ranges
    finally:
        rt.close()
    counted = SCHED_COUNTED if scheduled else COUNTED
    if args.pack_mb:
        counted += ("packs_built", "pages_packed", "pack_unpacks")
    if stage is not None:                      # what staging leaves on the step's path
        counted += ("pages_aliased_on_path",)
        for r in runs:
            r["calls"]["pages_aliased_on_path"] = r["calls"]["pages_aliased"] - r["calls"]["page_sets_staged"] * ranges
    timed = ("on_blocks", "apply", "release") + (("issue", "first_range") if args.defer_mapping else ())
    per_step = ("apply µs/step mean", "p50", "p99") if args.arrive_every else ()
    rows = ["| generation | " + " | ".join(f"{k} ms" for k in timed) + "".join(f" | {k}" for k in per_step)
            + " | " + " | ".join(counted) + " |",
            "|---" * (1 + len(timed) + len(per_step) + len(counted)) + "|"]
    for n, r in enumerate(runs, start=1):
        steps_us = r.pop("apply_us", ()) or (0.0,)
        pcts = (sum(steps_us) / len(steps_us), upper_quantile(steps_us, 0.5),
                upper_quantile(steps_us, 0.99)) if per_step else ()
        rows.append(f"| {n} | " + " | ".join(f"{r[k] * 1e3:.1f}" for k in timed)
                    + "".join(f" | {v:.0f}" for v in pcts) + " | "
                    + " | ".join(str(r["calls"][k]) for k in counted) + " |")
    md = (f"vattn's host work per generation with vLLM's prefix caching on ({args.workload}, {args.batch} "
          f"requests, {args.prompt} in" + (f" of which {args.shared} shared" if args.workload == "shared-prefix"
                                          else "") + f" / {args.new} out, the same prompts each "
          f"generation, {args.device} backend"
          + (f"; a pool of {blocks} blocks ({args.pool_fraction:g} of the {whole} the whole run would "
             f"hold: vLLM-like scheduling with preemption), the device {args.fence_lag} step(s) behind "
             f"the host, fence policy {args.fence_policy}" if scheduled else "")
          + (f"; at most {args.max_batched_tokens} tokens computed a step" if args.max_batched_tokens else "")
          + (f"; the map-ahead worker on (finishing between steps), prefix staging {args.stage_prefixes}"
             if stage is not None else "")
          + (f"; {args.pack_mb} MiB for packs of {'/'.join(map(str, args.pack_sets))} page-sets of shared runs"
             if args.pack_mb else "")
          + ("; each step's VMM calls deferred to its forward, made range by range (issue: their "
             "host ms; first_range: the part before the first layer)" if args.defer_mapping else "")
          + (f"; {args.free_reserve} page-sets of the pool kept free (pre-warm leaves them, the worker "
             "refills them between steps)" if args.free_reserve else "")
          + (f"; a request arrives every {args.arrive_every:g} steps" if args.arrive_every else "")
          + (f"; {args.cold_slots} slots left empty by the pre-warm" if args.cold_slots else "")
          + ("; before the generations an untimed warm-up request of the first prompt (2 tokens), as "
             "the engine stages run one" if args.warm_up else "")
          + "; over the run the block pool handed out "
          f"{pool.new_blocks + pool.hit_blocks} blocks, {pool.hit_blocks} of them hits):\n\n" + "\n".join(rows) + "\n")
    print(md)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: getattr(args, k) for k in ("device", "batch", "prompt", "new", "workload",
                                                               "shared", "generations", "pool_fraction",
                                                               "fence_lag", "fence_policy", "max_model_len",
                                                               "max_num_seqs", "max_batched_tokens",
                                                               "stage_prefixes", "pack_mb", "pack_sets", "warm_up",
                                                               "defer_mapping", "free_reserve",
                                                               "arrive_every", "cold_slots")},
                       "generations": runs}, f, indent=1)
    if not args.no_report:
        pressure = (f", pool {args.pool_fraction:g}, device lag {args.fence_lag}, {args.fence_policy}"
                    + (f", max_num_seqs {args.max_num_seqs}" if args.max_num_seqs else "")
                    + (f", max_model_len {args.max_model_len}" if args.max_model_len else "")
                    + (f", {args.max_batched_tokens} tokens a step" if args.max_batched_tokens else "")
                    + (f", staging {args.stage_prefixes}" if stage is not None else "")
                    + (f", packs {args.pack_mb} MiB" if args.pack_mb else "")
                    + (f" of {'/'.join(map(str, args.pack_sets))} page-sets" if args.pack_mb and args.pack_sets != (8,) else "")
                    + (", warm-up" if args.warm_up else "")
                    + (", deferred mapping" if args.defer_mapping else "")
                    + (f", a request every {args.arrive_every:g} steps" if args.arrive_every else "")
                    + (f", {args.cold_slots} cold slots" if args.cold_slots else "")) if scheduled else ""
        write_section(f"host work with prefix caching, {args.workload}{pressure} ({args.device})", md, command_line(),
                      path=args.benchmarks)
    return 0


def _sizes(sizes: tuple[int, ...]) -> int | tuple[int, ...]:
    """``--pack-sets`` as :class:`KVCacheConfig` takes it: one size, or a tuple of several."""
    return sizes[0] if len(sizes) == 1 else sizes
