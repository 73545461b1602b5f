"""``vattn bench radix``: the host time vattn adds to SGLang's forwards with its radix cache on,
replayed on the host backend (no GPU, no model) with SGLang's own memory classes.

SGLang's ``ReqToTokenPool``, ``RadixCache`` and paged allocation functions drive vattn's pool,
allocator and attention backend as SGLang's scheduler does: every prompt arrives at once; a
prefill batch admits waiting requests (their radix match locked, pages allocated, rows written)
while their uncached tokens fit ``--chunk`` (SGLang's ``chunked_prefill_size``; the first always
fits) and inserts them into the tree after its forward; otherwise every running request decodes
one token; a finished request goes into the tree and frees its row. A forward is the backend's
preparation (``init_forward_metadata``: :meth:`RowSlots.prepare`) and then, layer by layer, the
VMM calls it deferred (:meth:`RowSlots.ready`, with ``--defer-mapping``). The map-ahead worker
finishes between forwards (a device step long enough hides it). Needs SGLang importable (its
CPU import set: ``.venvs/sglang``).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import deque
from types import SimpleNamespace

from tqdm import tqdm

from .. import argtypes
from ..core.errors import ConfigError, UnsupportedError
from .host_prefix import prompts_for
from .report import command_line, write_section

__all__ = ["add_arguments", "run", "Replay", "extend_slots", "decode_slots", "forward_batch"]

#: the 1B-class shape's layer count and layer group (16 layers, G=4: 4 VA ranges); the host
#: backend's page holds 256 tokens of one KV head of 8 fp16 values per layer of the group
LAYERS, GROUP, HEAD_DIM = 16, 4, 8
#: cache counters reported per generation
COUNTED = ("map_calls", "unmap_calls", "set_access_calls", "pages_aliased", "prefix_hits", "keys_bound",
           "page_sets_moved", "pages_mapped_on_demand", "page_sets_staged", "packs_built", "pages_packed",
           "calls_deferred")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", choices=("shared-prefix", "decode-heavy"), default="shared-prefix",
                        help="one shared system prompt + own tokens per request, or distinct prompts")
    parser.add_argument("--batch", type=argtypes.positive_int, default=128, help="requests of a generation")
    parser.add_argument("--prompt", type=argtypes.positive_int, default=4352, help="prompt tokens")
    parser.add_argument("--shared", type=argtypes.positive_int, default=4096,
                        help="shared-prefix: tokens of the shared system prompt (within --prompt)")
    parser.add_argument("--new", type=argtypes.positive_int, default=128, help="tokens generated per request")
    parser.add_argument("--generations", type=argtypes.positive_int, default=2,
                        help="generations of the same prompts (the later ones hit what the first cached)")
    parser.add_argument("--page", type=argtypes.positive_int, default=256,
                        help="tokens of a page-set = SGLang's page size (256 at the 1B shape)")
    parser.add_argument("--chunk", type=argtypes.positive_int, default=8192,
                        help="uncached tokens a prefill batch computes at most (chunked_prefill_size)")
    parser.add_argument("--max-running", type=argtypes.positive_int, default=1024,
                        help="SGLang's max_running_requests: request rows and vattn slots")
    parser.add_argument("--pool-fraction", type=argtypes.positive_float, default=2.0,
                        help="the page pool as a share of what every request's whole length needs")
    parser.add_argument("--pack-mb", type=argtypes.non_negative_int, default=0,
                        help="MiB of host memory for packs of shared runs (VATTN_PACK_MB); 0: off")
    parser.add_argument("--pack-sets", type=argtypes.int_list, default=(8,),
                        help="page-sets per pack, or several sizes (VATTN_PACK_SETS)")
    parser.add_argument("--defer-mapping", action="store_true",
                        help="queue each forward's VMM calls per range, made layer by layer (VATTN_DEFER_MAPPING)")
    parser.add_argument("--stage-prefixes", choices=("on", "off"), default=None,
                        help="map prefixes a burst keeps hitting into idle slots ahead (VATTN_STAGE_PREFIXES; "
                             "default: the adapter's, on without packs and off with them)")
    parser.add_argument("--seed", type=int, default=0, help="prompt tokens")
    parser.add_argument("--benchmarks", default="BENCHMARKS.md", help="file to write the section to")
    parser.add_argument("--no-report", action="store_true", help="print only, leave BENCHMARKS.md")
    parser.add_argument("--json", default=None, help="also write the raw numbers here")


def _check(args) -> None:
    if args.workload == "shared-prefix" and args.shared >= args.prompt:
        raise ConfigError(f"--shared must be below --prompt ({args.prompt}), got {args.shared}")
    if args.page < 2:
        raise ConfigError(f"--page must be at least 2 tokens (SGLang page size > 1), got {args.page}")
    if args.pool_fraction > 8:
        raise ConfigError(f"--pool-fraction must be in (0, 8], got {args.pool_fraction}")
    if args.max_running < args.batch:
        raise ConfigError(f"--max-running ({args.max_running}) must hold every request of a generation "
                          f"(--batch {args.batch})")


class Replay:
    """SGLang's memory classes over a vattn pool on the host backend, stepped as its scheduler."""

    def __init__(self, args):
        import torch
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
        from sglang.srt.mem_cache.radix_cache import RadixCache

        from ..adapters.sglang.allocator import VattnTokenAllocator
        from ..adapters.sglang.backend import VattnAttnBackend
        from ..adapters.sglang.pool import VattnMHATokenToKVPool, make_cache
        longest = args.prompt + args.new
        context = -(-longest // args.page) * args.page
        sets = max(int(args.batch * -(-longest // args.page) * args.pool_fraction), -(-longest // args.page) + 1)
        token_bytes = GROUP * 2 * HEAD_DIM * 2              # one range: K and V of the group's layers, fp16
        page_bytes = args.page * token_bytes
        self.cache = make_cache(num_layers=LAYERS, num_kv_heads=1, head_dim=HEAD_DIM, dtype=torch.float16,
                                max_requests=args.max_running, max_context=context, device="cpu",
                                group_size=GROUP, page_bytes=page_bytes, map_ahead_tokens=args.page,
                                page_budget=(sets + 2) * (LAYERS // GROUP) * page_bytes,
                                pack_pages=args.pack_mb * 2**20 // page_bytes, pack_sets=tuple(args.pack_sets))
        self.pool = VattnMHATokenToKVPool.from_cache(self.cache, page_size=args.page)
        self.rows = self.pool.requests
        self.rows.defer_mapping = args.defer_mapping
        if args.stage_prefixes is not None:
            self.rows.staging = args.stage_prefixes == "on"
        self.alloc = VattnTokenAllocator(sets * args.page, args.page, torch.float16, "cpu", self.pool)
        self.alloc.defer_frees = True                  # as on a GPU: settled at the next allocation
        self.r2t = ReqToTokenPool(size=args.max_running, max_context_len=context, device="cpu",
                                  enable_memory_saver=False)
        self.tree = RadixCache(CacheInitParams(disable=False, req_to_token_pool=self.r2t,
                                               token_to_kv_pool_allocator=self.alloc, page_size=args.page))
        runner = SimpleNamespace(device="cpu", req_to_token_pool=self.r2t, token_to_kv_pool=self.pool)
        self.backend = VattnAttnBackend(runner, op_backend="sdpa")
        self.args, self.rid = args, 0
        self.spent = dict.fromkeys(("extend", "decode", "issue", "first_range", "free"), 0.0)

    def close(self) -> None:
        self.cache.close()

    # -- the scheduler ---------------------------------------------------------------------------
    def generation(self, prompts: list[list[int]]) -> dict:
        """Every prompt through to ``--new`` tokens; host seconds per part, counters, forwards."""
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey
        before, phases0 = self.cache.metrics(), _phases(self.rows)
        self.spent = dict.fromkeys(self.spent, 0.0)
        waiting, running = deque(self._req(p) for p in prompts), []
        forwards = cached = 0
        while waiting or running:
            batch, budget = [], self.args.chunk
            while waiting and len(running) + len(batch) < self.args.max_running:
                req = waiting[0]
                # as SGLang's Req.adjust_max_prefix_ids: at least the last token is computed
                m = self.tree.match_prefix(MatchPrefixParams(key=RadixKey(req.get_fill_ids()[:-1])))
                cost = len(req.origin_input_ids) - len(m.device_indices)
                if batch and cost > budget:
                    break
                waiting.popleft()
                req.prefix_indices, req.last_node = m.device_indices, m.last_device_node
                self.tree.inc_lock_ref(req.last_node)
                req.cache_protected_len = len(req.prefix_indices)
                cached += len(req.prefix_indices)
                budget -= cost
                batch.append(req)
            if batch:
                self._extend(batch)
                for req in batch:
                    self.tree.cache_unfinished_req(req)
                running += batch
            else:
                self._decode(running)
                for req in [r for r in running if len(r.output_ids) >= self.args.new]:
                    running.remove(req)
                    t0 = time.perf_counter()
                    self.tree.cache_finished_req(req, kv_len_to_handle=req.kv_committed_len)
                    self.r2t.free(req)
                    self.spent["free"] += time.perf_counter() - t0
            forwards += 1
        self.rows.prepare([], [])                      # the last rows release their slots
        self.cache.wait()
        after, phases = self.cache.metrics(), _phases(self.rows)
        return {"ms": {k: round(v * 1e3, 1) for k, v in self.spent.items()},
                "phase_ms": {mode: {k: round(phases[mode][k] - phases0[mode][k], 1) for k in phases[mode]}
                             for mode in phases},
                "calls": {k: after.get(k, 0) - before.get(k, 0) for k in COUNTED},
                "forwards": forwards, "cached_tokens": cached}

    def _req(self, tokens):
        self.rid += 1
        req = SimpleNamespace(rid=f"r{self.rid}", origin_input_ids=list(tokens), output_ids=[],
                              req_pool_idx=None, prefix_indices=None, last_node=None, cache_protected_len=0,
                              extra_key=None, inflight_middle_chunks=0, kv_committed_len=0, priority=0)
        req.get_fill_ids = lambda: req.origin_input_ids + req.output_ids
        return req

    def _extend(self, reqs) -> None:
        from sglang.srt.model_executor.forward_batch_info import ForwardMode
        self.r2t.alloc(reqs)
        prefixes = [len(r.prefix_indices) for r in reqs]
        seqs = [len(r.origin_input_ids) for r in reqs]
        last = [int(r.prefix_indices[-1]) if p else -1 for r, p in zip(reqs, prefixes)]
        loc = extend_slots(self.tree, self.r2t, reqs, prefixes, seqs, last)
        self._forward(ForwardMode.EXTEND, reqs, prefixes, seqs, loc, "extend")

    def _decode(self, reqs) -> None:
        from sglang.srt.model_executor.forward_batch_info import ForwardMode
        for req in reqs:
            req.output_ids.append(1 + len(req.output_ids) % 31000)
        seqs, loc = decode_slots(self.tree, self.r2t, reqs)
        self._forward(ForwardMode.DECODE, reqs, [s - 1 for s in seqs], seqs, loc, "decode")

    def _forward(self, mode, reqs, prefixes, seqs, loc, kind: str) -> None:
        fb = forward_batch(mode, reqs, prefixes, seqs, loc)
        t0 = time.perf_counter()
        self.backend.init_forward_metadata(fb)
        t1 = time.perf_counter()
        self.rows.ready(0)                              # the forward: each layer's range first
        t2 = time.perf_counter()
        for layer in range(1, LAYERS):
            self.rows.ready(layer)
        t3 = time.perf_counter()
        self.spent[kind] += t1 - t0
        self.spent["first_range"] += t2 - t1
        self.spent["issue"] += t3 - t1
        self.cache.wait()                               # the worker finishes while the device computes


def extend_slots(tree, r2t, reqs, prefixes: list[int], seqs: list[int], last: list[int]):
    """SGLang's extend allocation: positions ``prefixes[i] .. seqs[i] - 1`` of each request from
    SGLang's own allocation function (``last``: each one's last cached slot, -1 for none), its
    prefix indices and the new slots written into ``req_to_token``; returns ``out_cache_loc``."""
    import torch
    from sglang.srt.mem_cache.allocation import alloc_paged_token_slots_extend
    n = sum(s - p for p, s in zip(prefixes, seqs))
    loc = alloc_paged_token_slots_extend(tree, _ints(prefixes), _ints(prefixes), _ints(seqs), _ints(seqs),
                                         _ints(last), n)
    for req, p, s, part in zip(reqs, prefixes, seqs, loc.split([s - p for p, s in zip(prefixes, seqs)])):
        if p:
            r2t.write((req.req_pool_idx, slice(0, p)), req.prefix_indices[:p].to(torch.int32))
        r2t.write((req.req_pool_idx, slice(p, s)), part.to(torch.int32))
        req.kv_committed_len = s
    return loc


def forward_batch(mode, reqs, prefixes: list[int], seqs: list[int], loc, *, rids: bool = True):
    """SGLang's ``ForwardBatch`` of ``reqs`` (their host-side fields, as its scheduler fills
    them; ``rids=False``: without request ids)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    ext = [s - p for p, s in zip(prefixes, seqs)]
    return ForwardBatch(forward_mode=mode, batch_size=len(reqs), input_ids=_ints([0] * sum(ext)),
                        req_pool_indices=_ints([r.req_pool_idx for r in reqs]), seq_lens=_ints(seqs),
                        out_cache_loc=loc, seq_lens_sum=sum(seqs), seq_lens_cpu=_ints(seqs),
                        extend_num_tokens=sum(ext), extend_prefix_lens=_ints(prefixes),
                        extend_seq_lens=_ints(ext), extend_prefix_lens_cpu=prefixes,
                        extend_seq_lens_cpu=ext, rids=[r.rid for r in reqs] if rids else None)


def decode_slots(tree, r2t, reqs) -> tuple:
    """SGLang's decode allocation for ``reqs`` (each with its new token appended): one slot each
    from SGLang's own allocation function, written into ``req_to_token``; returns the sequence
    lengths and ``out_cache_loc``."""
    from sglang.srt.mem_cache.allocation import alloc_paged_token_slots_decode
    seqs = [len(r.get_fill_ids()) for r in reqs]
    rows = _ints([r.req_pool_idx for r in reqs])
    last = r2t.req_to_token[rows, _ints(seqs) - 2].long()
    loc = alloc_paged_token_slots_decode(tree, _ints(seqs), _ints(seqs), last)
    for req, s, x in zip(reqs, seqs, loc.tolist()):
        r2t.write((req.req_pool_idx, s - 1), x)
        req.kv_committed_len = s
    return seqs, loc


def _phases(rows) -> dict:
    return {mode: dict(parts) for mode, parts in rows.phase_ms.items()}


def _ints(xs):
    import torch
    return torch.tensor(xs, dtype=torch.int64)


def run(args) -> int:
    _check(args)
    from .sglang_cpu import ensure_importable
    try:
        ensure_importable()
        import sglang.srt.mem_cache.radix_cache  # noqa: F401
    except ImportError as exc:
        raise UnsupportedError(f"vattn bench radix needs SGLang 0.5.17 importable (its CPU import set: "
                               f"bash tools/engine_env.sh sglang): {exc}") from None
    prompts = prompts_for(args.workload, batch=args.batch, prompt=args.prompt, shared=args.shared,
                          seed=args.seed)
    replay = Replay(args)
    staging = "on" if replay.rows.staging else "off"           # as it ran: the adapter's default or the flag
    try:
        runs = [replay.generation(prompts) for _ in tqdm(range(args.generations), desc="generations", leave=False)]
        replay.cache.audit()
    finally:
        replay.close()
    md = _markdown(args, runs, staging)
    print(md)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if not k.startswith("_")}, "staging": staging,
                       "generations": runs}, f, indent=1, default=str)
    if not args.no_report:
        title = (f"SGLang radix replay, {args.workload}, {args.batch} x {args.prompt}/{args.new}"
                 + (f", packs {args.pack_mb} MiB" if args.pack_mb else "")
                 + (", deferred mapping" if args.defer_mapping else "") + " (cpu)")
        write_section(title, md, command_line(), path=args.benchmarks)
    return 0


def _markdown(args, runs: list[dict], staging: str) -> str:
    timed = ("extend", "decode", "free", "issue", "first_range")
    head = ("| generation | forwards | cached tokens | " + " | ".join(f"{k} ms" for k in timed) + " | "
            + " | ".join(COUNTED) + " |")
    rows = [head, "|---" * (3 + len(timed) + len(COUNTED)) + "|"]
    for n, r in enumerate(runs, start=1):
        rows.append(f"| {n} | {r['forwards']} | {r['cached_tokens']} | "
                    + " | ".join(f"{r['ms'][k]:.1f}" for k in timed) + " | "
                    + " | ".join(str(r["calls"][k]) for k in COUNTED) + " |")
    phases = ["", "Host ms per part of the preparation (`RowSlots.phase_ms`), extends / decodes:", "",
              "| generation | " + " | ".join(runs[0]["phase_ms"]["extend"]) + " |",
              "|---" * (1 + len(runs[0]["phase_ms"]["extend"])) + "|"]
    for n, r in enumerate(runs, start=1):
        phases.append(f"| {n} | " + " | ".join(f"{r['phase_ms']['extend'][k]:.1f} / {r['phase_ms']['decode'][k]:.1f}"
                                              for k in r["phase_ms"]["extend"]) + " |")
    return (f"vattn's host work per generation under SGLang's radix cache ({args.workload}, {args.batch} "
            f"requests, {args.prompt} in" + (f" of which {args.shared} shared" if args.workload == "shared-prefix"
                                            else "") + f" / {args.new} out, the same prompts each generation; "
            f"{LAYERS} layers in groups of {GROUP}, page-sets of {args.page} tokens = SGLang's page; "
            f"prefill batches of at most {args.chunk} uncached tokens; {args.max_running} request rows; "
            f"a pool of {args.pool_fraction:g}x what the generation needs; map-ahead on, prefix staging "
            f"{staging}" + (f"; {args.pack_mb} MiB for packs of {'/'.join(map(str, args.pack_sets))} "
                                         f"page-sets" if args.pack_mb else "")
            + ("; VMM calls deferred to the forward, made layer by layer (issue: their host ms; "
               "first_range: before layer 0, still on the path)" if args.defer_mapping else "")
            + "; host backend):\n\n" + "\n".join(rows) + "\n" + "\n".join(phases) + "\n")
