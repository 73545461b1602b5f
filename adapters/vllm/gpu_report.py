"""Columns of the GPU throughput report that are plain arithmetic (unit-tested without a GPU)."""

from __future__ import annotations

from vattn.conformance.models import PRESETS, kv_bytes_per_token

__all__ = ["waste_per_request", "vmm_summary"]

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


def vmm_summary(m: dict) -> dict:
    """Host time vattn spent on the step's critical path, from the core's metrics."""
    def total_ms(h):
        return round((h or {}).get("mean_us", 0) * (h or {}).get("count", 0) / 1e3, 2)
    return {"apply_total_ms": total_ms(m.get("apply_step_us")),
            "apply_p99_us": (m.get("apply_step_us") or {}).get("p99_us"),
            "ensure_total_ms": total_ms(m.get("ensure_us")), "map_incl_prewarm_ms": total_ms(m.get("map_page_us")),
            "on_blocks_total_ms": total_ms(m.get("on_blocks_us")),
            "pages_mapped_on_demand": m.get("pages_mapped_on_demand"),
            "pages_prewarmed": m.get("prewarmed_pages"), "slot_mapping": m.get("slot_mapping"),
            "unmap_calls": m.get("unmap_calls"),
            "fence_waits": m.get("fence_waits"), "warm_hits": m.get("warm_hits"),
            "pool_init_s": m.get("init_s"), "layout": m.get("layout")}
