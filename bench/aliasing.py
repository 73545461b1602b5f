"""Decode over a shared prefix: private copies, one copy mapped into every region, one region.

Prefix sharing on virtually contiguous KV maps the physical page-sets of a cached prefix into
each request's own region: the same physical page at many virtual addresses. Whether a decode
kernel reads it as cheaply as stock's paged sharing (every block table names the same blocks,
so every request reads the same virtual addresses) depends on the GPU's caches and TLBs, not on
vattn's bookkeeping. This benchmark isolates that, one layer of one decode step, the same
kernel and the same K/V values in three forms:

* ``private``: every request holds its own copy of the prefix (no sharing; B copies in HBM);
* ``aliased``: one physical copy mapped into each request's region (vattn's prefix sharing);
* ``one-region``: every request reads the same region (the virtual addresses of stock sharing).

``aliased`` near ``one-region`` means aliasing costs nothing; near ``private`` means the shared
copy is re-read from HBM once per request (what a virtually indexed cache or TLB would do).
"""

from __future__ import annotations

import argparse
import json

import torch

from .. import argtypes
from ..core import KVCacheConfig, KVLayout, VirtualKVCache
from ..core.ops import decode, resolve_backend
from .limits import check_fits
from .paged_baselines import bench_us, hbm_copy_tbps
from .report import command_line, environment, write_section
from .vmm import model_shape

__all__ = ["add_arguments", "run", "measure"]

_FORMS = ("private", "aliased", "one-region")
#: host pages of the CPU default (small, so a CPU run crosses many of them)
_HOST_PAGE = 64 << 10
#: CUDA's VMM granularity
_CUDA_PAGE = 2 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cuda = torch.cuda.is_available()
    parser.add_argument("--device", type=argtypes.device, default="cuda" if cuda else "cpu")
    parser.add_argument("--batch", type=argtypes.positive_int, default=128 if cuda else 4,
                        help="requests sharing the prefix")
    parser.add_argument("--prefix", type=argtypes.positive_int, default=4096 if cuda else 256,
                        help="tokens of the shared prefix (each request's whole context)")
    parser.add_argument("--model-shape", type=model_shape, default=None,
                        help="layers,kv_heads,head_dim,group (default: a 1B-class 16,8,64,4; "
                             "tiny on CPU)")
    parser.add_argument("--benchmarks", default="BENCHMARKS.md", help="file to write the section to")
    parser.add_argument("--json", default=None, help="also write the raw numbers here")


def _config(shape, *, device: str, slots: int, tokens: int, page_sets: int = 1) -> KVCacheConfig:
    """A cache of ``slots`` regions of ``tokens`` and ``page_sets`` page-sets (+ the padding slot's)."""
    layers, heads, dim, group = shape
    page = _HOST_PAGE if torch.device(device).type == "cpu" else _CUDA_PAGE
    ranges = layers // group                 # G layers' K and V share one range
    return KVCacheConfig(num_layers=layers, num_kv_heads=heads, head_dim=dim, dtype=torch.bfloat16,
                         max_slots=slots, max_context=tokens, group_size=group, device=device,
                         map_ahead_tokens=0, page_bytes=page, page_budget=(page_sets + 1) * ranges * page)


def measure(shape, *, device: str, batch: int, prefix: int) -> dict:
    """µs of one decode call (layer 0, ``batch`` requests of ``prefix`` tokens) in each form."""
    layers, heads, dim, _ = shape
    dev = torch.device(device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    k = torch.randn(prefix, heads, dim, generator=gen).to(dev, torch.bfloat16)
    v = torch.randn(prefix, heads, dim, generator=gen).to(dev, torch.bfloat16)
    q = torch.randn(batch, heads * 4, dim, generator=gen).to(dev, torch.bfloat16)
    lens = torch.full((batch,), prefix, dtype=torch.int32, device=dev)
    backend = resolve_backend("decode", device=dev, dtype=torch.bfloat16, head_dim=dim)
    out, times = {}, {}
    probe = _config(shape, device=device, slots=batch, tokens=prefix)
    sets = KVLayout.from_config(probe, probe.page_bytes).pages_for(prefix)
    with VirtualKVCache(_config(shape, device=device, slots=batch, tokens=prefix,
                                page_sets=batch * sets)) as own, \
            VirtualKVCache(_config(shape, device=device, slots=batch, tokens=prefix, page_sets=sets)) as shared:
        own_slots = [own.acquire() for _ in range(batch)]
        if own.ensure({s: prefix for s in own_slots}):
            raise RuntimeError("the private cache could not map its prefixes")   # sized above
        for s in own_slots:
            own.k(0)[s, :prefix], own.v(0)[s, :prefix] = k, v
        keys = [("prefix", i) for i in range(sets)]
        share_slots = [shared.acquire() for _ in range(batch)]
        shared.bind(share_slots[0], 0, keys)
        shared.ensure({share_slots[0]: prefix})
        shared.k(0)[share_slots[0], :prefix], shared.v(0)[share_slots[0], :prefix] = k, v
        for s in share_slots[1:]:
            shared.bind(s, 0, keys, hits=sets)              # the same physical page-sets
        shared.ensure({s: prefix for s in share_slots})
        views = {"private": (own, own_slots), "aliased": (shared, share_slots),
                 "one-region": (shared, [share_slots[0]] * batch)}
        for form in _FORMS:
            cache, slots = views[form]
            idx = torch.tensor(slots, dtype=torch.int32, device=dev)
            kc, vc = cache.k(0), cache.v(0)
            out[form] = decode(q, kc, vc, slots=idx, seqlens=lens, max_seqlen_k=prefix, backend=backend)
            times[form] = bench_us(lambda: decode(q, kc, vc, slots=idx, seqlens=lens, max_seqlen_k=prefix,
                                                  backend=backend), device=dev)
        aliased_pages = shared.metrics()["pages_aliased"]
    same = all(torch.equal(out[f], out["private"]) for f in _FORMS)
    logical = batch * prefix * heads * dim * 2 * 2          # K and V, bf16, read once per request
    return {"backend": backend, "batch": batch, "prefix": prefix, "shape": list(shape),
            "page_sets_per_request": sets, "pages_aliased": aliased_pages, "outputs_equal": same,
            "us": times, "logical_GBps": {f: logical / (t * 1e-6) / 1e9 for f, t in times.items()},
            "unique_bytes": {"private": logical, "aliased": logical // batch,
                             "one-region": logical // batch}}


def _markdown(r: dict, copy_tbps: float) -> str:
    base = r["us"]["one-region"]
    rows = ["| form | µs per decode call | vs one-region | logical GB/s (share of HBM copy) | "
            "bytes in HBM |", "|---|---|---|---|---|"]
    for f in _FORMS:
        gbps = r["logical_GBps"][f]
        rows.append(f"| {f} | {r['us'][f]:.1f} | {base / r['us'][f]:.3f}× | {gbps:.4g} "
                    f"({gbps / (copy_tbps * 1e3):.0%}) | {r['unique_bytes'][f] / 2**20:.4g} MiB |")
    return (f"Layer 0 of a {','.join(map(str, r['shape']))} (layers,kv_heads,head_dim,group) shape, "
            f"{r['batch']} requests × {r['prefix']} tokens, bf16, decode backend `{r['backend']}`, "
            f"{r['page_sets_per_request']} page-sets per request ({r['pages_aliased']} pages "
            f"mapped as aliases); outputs of the three forms "
            f"{'bit-equal' if r['outputs_equal'] else '**differ**'}. HBM copy bandwidth "
            f"{copy_tbps:.2f} TB/s. Logical GB/s counts every request's K/V once (what a "
            f"kernel without cache reuse moves).\n\n" + "\n".join(rows))


def run(args) -> int:
    cuda = args.device.startswith("cuda")
    shape = args.model_shape or ((16, 8, 64, 4) if cuda else (4, 2, 32, 2))
    layers, heads, dim, _ = shape
    need = (args.batch + 2) * args.prefix * layers * heads * dim * 2 * 2
    check_fits(f"{args.batch} requests × {args.prefix} tokens", need, args.device,
               hint="pass a smaller --batch or --prefix")
    r = measure(shape, device=args.device, batch=args.batch, prefix=args.prefix)
    copy = hbm_copy_tbps(torch.device(args.device))
    print(json.dumps(r))
    body = _markdown(r, copy)
    print(body)
    env = environment()
    write_section(f"shared-prefix aliasing, decode ({env.get('gpu', 'cpu')})", body, command_line(),
                  path=args.benchmarks)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r | {"hbm_copy_TBps": copy}, f, indent=2)
    return 0 if r["outputs_equal"] else 1
