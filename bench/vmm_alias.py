"""Aliasing throughput: one set of physical pages mapped into many regions, by 1..N threads.

What a shared prefix costs when requests arrive: vLLM's prefix cache hands every new request the
cached blocks, and vattn maps their page-sets into the request's own region (map each page, then
one access call per region and range). This measures that pattern on the driver alone, and
whether host threads mapping disjoint regions at once finish sooner (a driver that serialises
its page-table updates gains nothing from them).
"""

from __future__ import annotations

import threading
import time

from vattn.core.driver import get_driver

__all__ = ["alias_throughput", "markdown"]


def alias_throughput(device: str, *, pages: int, regions: int, threads: list[int],
                     chunk: int = 1) -> list[dict]:
    """Map ``pages`` shared physical pages into each of ``regions`` regions (one map call per
    physical allocation of ``chunk`` pages, one access call per region), then unmap them, with
    ``t`` threads for each ``t`` of ``threads`` (regions dealt round-robin); one row per thread
    count. ``chunk`` > 1 asks whether a map's cost is per call or per page."""
    if pages % chunk:
        raise ValueError(f"--alias-chunk {chunk} must divide --alias-pages {pages}")
    drv = get_driver(device)
    page = drv.granularity * chunk
    span = pages * drv.granularity
    base = drv.reserve(span * regions)
    handles = [drv.create(page) for _ in range(pages // chunk)]
    rows = []
    try:
        for count in threads:
            rows.append(_one(drv, base, span, page, handles, regions, count) | {"chunk": chunk})
    finally:
        for h in handles:
            drv.release(h)
        drv.free_va(base, span * regions)
    single = rows[0]["map_ms"] if rows else None
    for row in rows:
        row["speedup"] = single / row["map_ms"] if single else None
    return rows


def _one(drv, base: int, span: int, page: int, handles: list, regions: int, count: int) -> dict:
    def mapper(mine: list[int]) -> None:
        for r in mine:
            va = base + r * span
            for i, h in enumerate(handles):
                drv.map(va + i * page, page, h)
            drv.set_access(va, span)

    def unmapper(mine: list[int]) -> None:
        for r in mine:
            va = base + r * span
            for i in range(len(handles)):
                drv.unmap(va + i * page, page)

    parts = [list(range(k, regions, count)) for k in range(count)]
    times = []
    for work in (mapper, unmapper):
        pool = [threading.Thread(target=work, args=(part,)) for part in parts]
        start = time.perf_counter()
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        times.append((time.perf_counter() - start) * 1e3)
    mapped = span // drv.granularity * regions
    return {"threads": count, "regions": regions, "pages": mapped, "map_ms": times[0],
            "unmap_ms": times[1], "map_access_us_per_page": times[0] * 1e3 / mapped,
            "unmap_us_per_page": times[1] * 1e3 / mapped}


def markdown(rows: list[dict], page_bytes: int) -> str:
    chunk = rows[0].get("chunk", 1)
    per = "map per page" if chunk == 1 else f"one map per {chunk}-page physical allocation"
    head = (f"Aliasing: {rows[0]['pages'] // rows[0]['regions']} shared {page_bytes >> 20} MiB pages "
            f"mapped into each of {rows[0]['regions']} regions ({per}, one access call per "
            f"region), then unmapped, by 1..N host threads on disjoint regions:")
    out = [head, "", "| threads | map + access ms | µs per page | unmap ms | µs per page | map speed-up over 1 thread |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['threads']} | {r['map_ms']:.1f} | {r['map_access_us_per_page']:.1f} | "
                   f"{r['unmap_ms']:.1f} | {r['unmap_us_per_page']:.1f} | {r['speedup']:.2f}× |")
    return "\n".join(out)
