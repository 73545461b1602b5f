import torch

from vattn.core import KVCacheConfig, VirtualKVCache

SMALL_PAGE = 64 << 10


def small_config(device="cpu", **over) -> KVCacheConfig:
    """A cache whose pages hold few tokens, so tests cross many page boundaries."""
    page = SMALL_PAGE if device == "cpu" else None
    base = dict(num_layers=4, num_kv_heads=2, head_dim=32, dtype=torch.float16, max_slots=6,
                max_context=700, group_size=2, page_budget=(80 if device == "cpu" else 40) * (page or 2 << 20),
                page_bytes=page, device=device, map_ahead_tokens=0)
    base.update(over)
    return KVCacheConfig(**base)


def make_cache(device="cpu", driver=None, **over) -> VirtualKVCache:
    return VirtualKVCache(small_config(device, **over), driver=driver)


def count_calls(fn, *, prefix: str = "vattn.") -> int:
    """Python function calls into modules named ``prefix...`` while ``fn()`` runs on this thread
    (deterministic, unlike wall time: what a step costs the engine's thread in vattn's code)."""
    import sys
    calls = 0

    def prof(frame, event, arg):
        nonlocal calls
        if event == "call" and frame.f_globals.get("__name__", "").startswith(prefix):
            calls += 1

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls
