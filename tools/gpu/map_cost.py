"""What one aliased page costs on this driver, split by call, and whether fewer calls cost less.

Run on a CUDA machine: ``python3 tools/gpu/map_cost.py [--regions 64] [--pages 32] --json F``.
Prints one JSON object with, for each case, microseconds per 2 MiB page of cuMemMap and of
cuMemSetAccess (and of cuMemUnmap), mapping the same physical pages into ``--regions`` regions:

* ``page``: one 2 MiB allocation per page, one map call per page, one access call per region;
* ``page-access-each``: the same with one access call per page;
* ``chunkK``: one K-page allocation mapped whole (one map call per K pages), with what creating
  and releasing such an allocation costs;
* ``offsetK``: one big allocation mapped K pages at a time at a non-zero offset (whether the
  driver accepts an offset at all is reported as ``offset_supported``);
* ``partial_supported``: whether the first page alone of a 4-page allocation can be mapped (offset
  0, a size below the allocation's);
* ``range_unmap``: whether one cuMemUnmap over a range of several adjacent mappings (one
  allocation each) unmaps them all, and what it costs per page beside one call per page.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def _case(drv, cu, *, name, base, span, regions, pieces, access_each):
    """``pieces``: (va offset, size, handle, handle offset) per map call within one region."""
    t_map = t_acc = t_unmap = 0.0
    for r in range(regions):
        va = base + r * span
        for off, size, handle, hoff in pieces:
            t = time.perf_counter()
            err, = cu.cuMemMap(va + off, size, hoff, handle, 0)
            t_map += time.perf_counter() - t
            if err != cu.CUresult.CUDA_SUCCESS:
                return {"case": name, "error": f"cuMemMap: {cu.cuGetErrorName(err)[1]}"}
            if access_each:
                t = time.perf_counter()
                drv.set_access(va + off, size)
                t_acc += time.perf_counter() - t
        if not access_each:
            t = time.perf_counter()
            drv.set_access(va, span)
            t_acc += time.perf_counter() - t
    torch.cuda.synchronize()
    for r in range(regions):
        va = base + r * span
        t = time.perf_counter()
        for off, size, _, _ in pieces:
            drv.unmap(va + off, size)
        t_unmap += time.perf_counter() - t
    pages = span // drv.granularity * regions
    return {"case": name, "map_calls": len(pieces) * regions, "pages": pages,
            "map_us_per_page": t_map * 1e6 / pages, "access_us_per_page": t_acc * 1e6 / pages,
            "unmap_us_per_page": t_unmap * 1e6 / pages,
            "map_us_per_call": t_map * 1e6 / (len(pieces) * regions)}


def _offset_agrees(drv, cu, base, big, g) -> bool:
    """Page 1 of ``big`` seen through a map at offset ``g`` equals it seen through a map of
    pages 0..1 (the same bytes at two addresses)."""
    from vattn.core.driver.cuda import _ArrayInterface
    a, b = base, base + 4 * g
    drv._call("cuMemMap", cu.cuMemMap, a, g, g, big, 0)
    drv._call("cuMemMap", cu.cuMemMap, b, 2 * g, 0, big, 0)
    drv.set_access(a, g)
    drv.set_access(b, 2 * g)
    ta = torch.as_tensor(_ArrayInterface(a, g), device="cuda")
    tb = torch.as_tensor(_ArrayInterface(b + g, g), device="cuda")
    ta.copy_(torch.randint(0, 255, (g,), dtype=torch.uint8, device="cuda"))
    torch.cuda.synchronize()
    same = bool(torch.equal(ta, tb))
    del ta, tb
    drv.unmap(a, g)
    drv.unmap(b, 2 * g)
    return same


def _range_unmap(drv, cu, base, pages, regions) -> dict:
    """Map ``pages`` (one allocation each) side by side in each region, then unmap each region
    with one call; the region is mapped again afterwards to show the call left nothing behind."""
    g, span = drv.granularity, len(pages) * drv.granularity
    spent = 0.0
    for r in range(regions):
        va = base + r * span
        for i, h in enumerate(pages):
            drv.map(va + i * g, g, h)
        drv.set_access(va, span)
    torch.cuda.synchronize()
    for r in range(regions):
        t = time.perf_counter()
        err, = cu.cuMemUnmap(base + r * span, span)
        spent += time.perf_counter() - t
        if err != cu.CUresult.CUDA_SUCCESS:
            for i in range(len(pages)):                 # leave the region clean for what follows
                cu.cuMemUnmap(base + r * span + i * g, g)
            return {"supported": False, "error": str(cu.cuGetErrorName(err)[1])}
    for i, h in enumerate(pages):                       # all gone: the same addresses map again
        drv.map(base + i * g, g, h)
    drv.unmap(base, span)
    return {"supported": True, "unmap_us_per_page": spent * 1e6 / (len(pages) * regions),
            "unmap_us_per_call": spent * 1e6 / regions, "pages_per_call": len(pages)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--regions", type=int, default=64)
    parser.add_argument("--pages", type=int, default=32)
    parser.add_argument("--chunks", default="1,4,8,32")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    from vattn.core.driver.cuda import CudaDriver
    drv = CudaDriver("cuda")
    cu, g = drv.cu, drv.granularity
    span = args.pages * g
    base = drv.reserve(span * args.regions)
    out = {"device": torch.cuda.get_device_name(), "granularity": g, "regions": args.regions,
           "pages_per_region": args.pages, "cases": []}
    small = [drv.create(g) for _ in range(args.pages)]
    pieces = [(i * g, g, h, 0) for i, h in enumerate(small)]
    for rep in range(2):                                  # the first pass warms the driver up
        for each in (False, True):
            row = _case(drv, cu, name="page-access-each" if each else "page", base=base, span=span,
                        regions=args.regions, pieces=pieces, access_each=each)
            if rep:
                out["cases"].append(row)
    out["range_unmap"] = _range_unmap(drv, cu, base, small, args.regions)
    for h in small:
        drv.release(h)
    for k in (int(x) for x in args.chunks.split(",")):
        if args.pages % k:
            continue
        t = time.perf_counter()
        handles = [drv.create(k * g) for _ in range(args.pages // k)]
        create_us = (time.perf_counter() - t) * 1e6 / len(handles)
        pieces = [(i * k * g, k * g, h, 0) for i, h in enumerate(handles)]
        row = _case(drv, cu, name=f"chunk{k}", base=base, span=span, regions=args.regions,
                    pieces=pieces, access_each=False)
        t = time.perf_counter()
        for h in handles:
            drv.release(h)
        # what a physical allocation of k pages costs to make and to give back (cuMemCreate /
        # cuMemRelease), once per allocation rather than per region
        out["cases"].append(row | {"create_us_per_allocation": create_us,
                                   "release_us_per_allocation": (time.perf_counter() - t) * 1e6 / len(handles)})
    big = drv.create(span + g)                            # one page more: every piece at offset >= g
    for k in (int(x) for x in args.chunks.split(",")):
        if args.pages % k:
            continue
        pieces = [(i * k * g, k * g, big, g + i * k * g) for i in range(args.pages // k)]
        row = _case(drv, cu, name=f"offset{k}", base=base, span=span, regions=args.regions,
                    pieces=pieces, access_each=False)
        out["cases"].append(row)
    out["offset_supported"] = not any("error" in r for r in out["cases"] if r["case"].startswith("offset"))
    if out["offset_supported"]:
        out["offset_content_agrees"] = _offset_agrees(drv, cu, base, big, g)
    drv.release(big)
    four = drv.create(4 * g)
    err, = cu.cuMemMap(base, g, 0, four, 0)
    out["partial_supported"] = err == cu.CUresult.CUDA_SUCCESS
    if out["partial_supported"]:
        drv.unmap(base, g)
    else:
        out["partial_error"] = str(cu.cuGetErrorName(err)[1])
    drv.release(four)
    drv.free_va(base, span * args.regions)
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
