"""Sweep the Triton decode kernel's knobs on the GPU; print the best config and % of HBM copy BW.

python tools/gpu/tune_decode.py --out DIR   (needs CUDA + triton; vattn importable)
"""

import argparse
import itertools
import json
import math
import os

import torch

from vattn.bench.paged_baselines import bench_us, hbm_copy_tbps
from vattn.core.ops.synthetic import group_views
from vattn.core.ops.triton_decode import TritonDecodeConfig, choose_num_splits, decode_triton

CASES = [(256, 1024), (64, 4096), (16, 16384), (8, 32768), (1, 131072), (4, 131072)]
HQ, HK, D = 32, 8, 128


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--group-size", type=int, default=2)
    args = p.parse_args()
    hbm = hbm_copy_tbps("cuda")
    grid = [TritonDecodeConfig(block_n=bn, num_warps=w, num_stages=s, target_ctas=t)
            for bn, w, s, t in itertools.product((32, 64, 128), (4, 8), (2, 3), (264, 528, 1056))]
    results = {}
    for batch, ctx in CASES:
        k, v, keep = group_views(slots=batch, rows_per_slot=ctx, group_size=args.group_size,
                                 kv_heads=HK, head_dim=D, dtype=torch.bfloat16, device="cuda")
        q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
        slots = torch.arange(batch, device="cuda")
        lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        out = torch.empty_like(q)
        kv_bytes = batch * ctx * HK * D * 2 * 2
        for i, cfg in enumerate(grid):
            fn = lambda: decode_triton(q, k, v, slots=slots, seqlens=lens, max_seqlen_k=ctx,
                                       scale=D ** -0.5, out=out, config=cfg)
            try:
                us = bench_us(fn, device="cuda")
            except Exception as exc:  # noqa: BLE001 - a config that does not compile is skipped
                print(f"B={batch} ctx={ctx} {cfg}: failed {str(exc)[:100]}")
                continue
            results.setdefault(i, {})[(batch, ctx)] = us
        best = min((r[(batch, ctx)], i) for i, r in results.items() if (batch, ctx) in r)
        tb = kv_bytes / (best[0] * 1e-6) / 1e12
        print(f"B={batch} ctx={ctx}: best {grid[best[1]]} splits="
              f"{choose_num_splits(batch, HK, ctx, grid[best[1]])} {best[0]:.1f} us {tb:.2f} TB/s "
              f"{100 * tb / hbm:.1f}% of {hbm:.2f} TB/s", flush=True)
        del k, v, keep
        torch.cuda.empty_cache()
    full = [i for i, r in results.items() if len(r) == len(CASES)]
    geo = {i: math.exp(sum(math.log(t) for t in results[i].values()) / len(CASES)) for i in full}
    best_i = min(geo, key=geo.get)
    print(f"BEST OVERALL (geomean over cases): {grid[best_i]}")
    with open(os.path.join(args.out, "triton_decode_tuning.json"), "w") as f:
        json.dump({"hbm_copy_TBps": hbm, "best": repr(grid[best_i]),
                   "configs": [repr(c) for c in grid],
                   "us": {str(i): {f"{b}x{c}": t for (b, c), t in r.items()} for i, r in results.items()}},
                  f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
