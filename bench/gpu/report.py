"""Columns of the GPU stages' reports that are plain arithmetic on the engines' results
(unit-tested without a GPU): waste per request, vattn's host time on the critical path, JIT
compiles during the timed run, profiler kernel families, pooled re-runs."""

from __future__ import annotations

import os
import re

from vattn.conformance.models import PRESETS, kv_bytes_per_token

__all__ = ["waste_per_request", "critical_path_summary", "vattn_columns", "jit_during_inference",
           "parse_profiler_table", "kernel_summary", "profiler_kernels", "PROFILER_TABLE", "pool_engines", "HOST_CALLS"]

_BYTES_PER_TOKEN_8B = kv_bytes_per_token(PRESETS["llama3-8b-shape"])   # all layers, K and V, bf16


def waste_per_request(mode: str, *, max_model_len: int, shortest: int, metrics: dict | None) -> int:
    """Worst-case bytes a request of this workload holds but does not use (Llama-3-8B shape).

    ``shortest``: the fewest tokens a request holds (prompt + 1); the ceiling wastes the rest of
    its ``max_model_len`` block, stock at most 15 tokens of a 16-token block, vattn at most one
    partly filled page per VA range (the layout's ``worst_waste_bytes``).
    """
    if mode == "stock":
        return 15 * _BYTES_PER_TOKEN_8B                        # a 16-token block, one token used
    if mode == "ceiling":
        return (max_model_len - shortest) * _BYTES_PER_TOKEN_8B   # one max_model_len block each
    return int(((metrics or {}).get("layout") or {}).get("worst_waste_bytes", -1))


def pool_engines(rows: dict) -> dict:
    """Every timed generation of a mode pooled over its engines (``MODE`` and its re-runs
    ``MODE@N``, e.g. ``stock vattn stock@2 vattn@2``: modes interleaved, so a drift of the machine
    during the call hits each alike): ``{mode: {engines, seconds_all, median_s, ratio}}`` for the
    modes run in more than one engine; ``ratio`` = stock's pooled median / this one's."""
    import statistics
    groups: dict[str, list] = {}
    for name, row in rows.items():
        times = row.get("seconds_each") or ([row["seconds"]] if row.get("seconds") else [])
        groups.setdefault(name.split("@")[0], []).append(times)
    pooled = {}
    for mode, runs in groups.items():
        if len(runs) > 1 and all(runs):
            flat = sorted(t for run in runs for t in run)
            pooled[mode] = {"engines": len(runs), "seconds_all": flat,
                            "median_s": round(statistics.median(flat), 4)}
    base = (pooled.get("stock") or {}).get("median_s")
    for row in pooled.values():
        row["ratio"] = round(base / row["median_s"], 4) if base else None
    return pooled


#: per engine, vattn's calls on a step's critical path: summary name -> metrics histogram
#: (vLLM's runtime: ``apply`` per step, ``on_blocks`` per block-table update, ``issue`` the VMM
#: calls deferred to the forward, made as it reaches each range — those a window left unmade
#: are made when the next one opens, inside ``apply``: rare, every forward reaches every range;
#: SGLang's allocator)
HOST_CALLS = {"vllm": {"apply": "apply_step_us", "on_blocks": "on_blocks_us", "issue": "issue_us"},
              "sglang": {"alloc_extend": "alloc_extend_us", "alloc_decode": "alloc_decode_us",
                         "free": "free_us"}}
#: time spent inside those calls, broken out (not added to them: ``apply`` runs ``ensure``)
_INNER_CALLS = {"vllm": {"ensure": "ensure_us", "map_incl_prewarm": "map_page_us"}, "sglang": {}}
#: the device's idle time behind those calls, per step (recorded by CUDA events; vLLM's runtime)
_WAIT_CALL = {"vllm": "apply_device_wait_us", "sglang": "-"}
#: the call made once per decode step, whose p99 the summary gives
_STEP_CALL = {"vllm": "apply_step_us", "sglang": "alloc_decode_us"}
#: the core's page events, copied as they are
_COUNTERS = ("pages_mapped_on_demand", "map_calls", "unmap_calls", "set_access_calls", "fence_waits",
             "pages_retired", "warm_hits", "prefix_hits", "pages_aliased", "keys_bound", "page_sets_moved", "keys_held",
             "page_sets_staged", "stage_prefixes", "blocks_copied", "slot_mapping", "layout",
             # SGLang: host waits for the device before a forward, hit copies waited for, retries
             "device_reads", "hit_copy_waits", "driver_retries",
             # SGLang: host ms per part of a forward's preparation (extend / decode)
             "prepare_phase_ms")


def critical_path_summary(m: dict, engine: str) -> dict:
    """Host time vattn spent on the step's critical path in ``engine`` (total ms per call kind,
    :data:`HOST_CALLS`) and the core's page events, from the metrics of a vattn run."""
    def total_ms(h):
        return round((h or {}).get("mean_us", 0) * (h or {}).get("count", 0) / 1e3, 2)
    host = {name: total_ms(m.get(key)) for name, key in HOST_CALLS[engine].items()}
    steps = m.get("steps")
    return {"host_ms": host, "steps": steps,
            # all of them over the engine's steps: their share of a step, next to its length
            "host_us_per_step": round(1e3 * sum(host.values()) / steps, 1) if steps else None,
            "inner_ms": {name: total_ms(m.get(key)) for name, key in _INNER_CALLS[engine].items()},
            "step_mean_us": (m.get(_STEP_CALL[engine]) or {}).get("mean_us"),
            "step_p99_us": (m.get(_STEP_CALL[engine]) or {}).get("p99_us"),
            "device_wait_ms": total_ms(m[_WAIT_CALL[engine]]) if _WAIT_CALL[engine] in m else None,
            "pages_prewarmed": m.get("prewarmed_pages"), "pool_init_s": m.get("init_s"),
            **{key: m.get(key) for key in _COUNTERS}}


def vattn_columns(metrics: dict | None, engine: str) -> dict:
    """A vattn row's waste and critical-path columns from its run's metrics (``{}`` without any;
    ``vattn_metrics_error`` when the engine could not report them)."""
    if not metrics:
        return {}
    if "error" in metrics:
        return {"vattn_metrics_error": metrics["error"]}
    waste = (metrics.get("layout") or {}).get("worst_waste_bytes")
    return {"worst_waste_MiB_per_request": None if waste is None else waste / 2**20,
            "vmm_critical_path": critical_path_summary(metrics, engine)}


_JIT = re.compile(r"JIT compilation during inference: (\S+?)\.? ")


def jit_during_inference(log: str | None) -> list[str] | None:
    """Kernels vLLM's JIT monitor saw compiled after start-up (a latency spike in the timed run),
    from an engine log; ``None`` when there is no log to read."""
    if not log or not os.path.exists(log):
        return None
    with open(log, errors="replace") as f:
        return [m.group(1) for m in _JIT.finditer(f.read())]


_UNITS = {"s": 1e6, "ms": 1e3, "us": 1.0, "ns": 1e-3}


def _us(text: str) -> float:
    m = re.fullmatch(r"([0-9.]+)(s|ms|us|ns)", text.strip())
    if not m:
        raise ValueError(f"expected a time like 12.3ms, got {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def parse_profiler_table(text: str) -> list[dict]:
    """Rows ``{name, self_cuda_us, calls}`` of a torch profiler ``key_averages().table()`` (what
    vLLM's profiler writes to ``profiler_out_<rank>.txt``), the columns found from its rule line."""
    lines = text.splitlines()
    rules = [i for i, line in enumerate(lines) if line.startswith("---") and set(line) <= {"-", " "}]
    if len(rules) < 2:
        raise ValueError("not a torch profiler table: no rule lines")
    spans = [(m.start(), m.end()) for m in re.finditer(r"-+", lines[rules[0]])]
    # header cells by their gaps, not the rule's spans: "CUDA time avg" overflows its column
    header = re.split(r"\s{2,}", lines[rules[0] + 1].strip())
    try:
        name_col, cuda_col, calls_col = (header.index(h) for h in ("Name", "Self CUDA", "# of Calls"))
    except ValueError as exc:
        raise ValueError(f"profiler table lacks a column ({exc}); header: {header}") from None
    rows = []
    for line in lines[rules[1] + 1:(rules[2] if len(rules) > 2 else len(lines))]:
        cells = [line[a:b].strip() for a, b in spans]
        if len(cells) <= max(name_col, cuda_col, calls_col) or not cells[name_col]:
            continue
        rows.append({"name": cells[name_col], "self_cuda_us": _us(cells[cuda_col]),
                     "calls": int(cells[calls_col])})
    return rows


#: kernel families of a decode step, by name (first match wins; the raw names are kept too)
_FAMILIES = (("kv store", ("reshape_and_cache",)),
             ("slot tables", ("_slot_mapping_kernel", "_slot_mappings_kernel", "gather_block_table",
                              "indexSelect")),
             ("attention", ("flash", "FlashAttn", "mha_", "fwd_combine")),
             ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_")))


#: rows that are not kernels: framework ops (``aten::mm``: its kernels are rows of their own too)
#: and vLLM's step annotations (``execute_context_...``: the span of a whole step)
_NOT_KERNELS = re.compile(r"^[A-Za-z_][\w.]*::|^execute_")


def kernel_summary(rows: list[dict], top: int = 12) -> dict:
    """GPU time per kernel family and the ``top`` kernels of a profiler table's rows (kernels
    only: op and annotation rows would count the same GPU time twice)."""
    kernels = [r for r in rows if r["self_cuda_us"] > 0 and not _NOT_KERNELS.match(r["name"])]
    families: dict[str, float] = {}
    for r in kernels:
        family = next((f for f, keys in _FAMILIES if any(k in r["name"] for k in keys)), "other")
        families[family] = families.get(family, 0.0) + r["self_cuda_us"]
    ordered = sorted(kernels, key=lambda r: -r["self_cuda_us"])
    return {"total_us": round(sum(r["self_cuda_us"] for r in kernels), 1),
            "families_us": {k: round(v, 1) for k, v in sorted(families.items())},
            "top": ordered[:top]}


#: the table vLLM's torch profiler writes for rank 0 into its profiler directory
PROFILER_TABLE = "profiler_out_0.txt"


def profiler_kernels(folder: str) -> dict:
    """:func:`kernel_summary` of the profiler table vLLM wrote into ``folder``.

    Raises
    ------
    OSError
        No table there.
    ValueError
        The file is not a table with CUDA columns (a CPU engine's).
    """
    with open(os.path.join(folder, PROFILER_TABLE)) as f:
        return kernel_summary(parse_profiler_table(f.read()))
