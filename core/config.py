"""The one validated configuration of a :class:`~vattn.core.cache.VirtualKVCache`."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .errors import ConfigError

__all__ = ["KVCacheConfig", "SCRUB_POLICIES", "MAX_AUTO_RANGES", "auto_group_size", "engine_group_size",
           "env_int", "DRIVER_RETRIES_ENV", "driver_retries", "STAGE_PREFIXES_ENV", "stage_prefixes", "env_flag",
           "PACK_MB_ENV", "pack_mb", "DEFER_MAPPING_ENV", "defer_mapping"]

#: ``group_size=None`` picks the smallest group giving at most this many VA ranges, so a request
#: wastes at most this many partly filled pages (16 MiB with 2 MiB pages). Measured on the H200
#: (BENCHMARKS.md, layout sweep, Llama-3-8B): G=4 and G=8 decode within 1-2 % of paged and of the
#: per-layer layout, prefill 1.05-1.08x paged; G=32 (one range) is up to 11 % slower.
MAX_AUTO_RANGES = 8
SCRUB_POLICIES = ("tenant", "always", "never")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2,
           torch.uint8, torch.int8)


@dataclass(frozen=True, slots=True, kw_only=True)
class KVCacheConfig:
    """Shape, layout, memory budget and policies of a virtual KV cache.

    Parameters
    ----------
    num_layers, num_kv_heads, head_dim : int
        Model shape (KV heads of this rank under tensor parallelism).
    dtype : torch.dtype
        Element type of K and V.
    max_slots : int
        Concurrent requests; slot ids are ``0 .. max_slots - 1``.
    max_context : int
        Tokens one slot can hold.
    group_size : int | None
        Layers sharing one VA range (decision 2 of the design notes); must divide ``num_layers``.
        ``None`` (default): :func:`auto_group_size` (``4`` for 32 layers, ``1`` up to 8 layers).
    split_kv : bool
        K and V in separate ranges (the paper's per-layer layout); only with ``group_size=1``.
    page_budget : int | float
        Physical memory for KV pages: bytes (int) or a fraction of free device memory (float in (0, 1]).
    page_bytes : int | None
        Physical page size; ``None`` means the driver's granularity (2 MiB).
    scrub : str
        ``"tenant"`` zeroes pages that move to another tenant, ``"always"`` on every reuse, ``"never"``.
    device : str | torch.device
        ``"cpu"`` uses the host backend, ``"cuda[:N]"`` the CUDA VMM backend.
    map_ahead_tokens : int
        Tokens beyond each running slot's length that a background worker maps ahead when
        :meth:`~vattn.core.VirtualKVCache.step` is called (default 0: off, no thread; engines
        whose requests grow step by step turn it on).
    pack_pages : int
        Physical pages (beyond ``page_budget``) for packs: a prefix run of ``pack_sets``
        page-sets hit a second time is copied once into one allocation per range, and every later
        hit maps it with one call per range instead of one per page (the driver charges per
        allocation). Default 0: off. See docs/shared-prefix-packs.md.
    pack_sets : int | tuple[int, ...]
        Page-sets per pack (a power of two >= 2, default 8); runs start at multiples of it. A
        tuple of such sizes (e.g. ``(8, 16, 32)``) packs each hit run with the largest that fits
        an aligned start, then the smaller ones: a long prefix takes few calls and a short one
        is still packed (:attr:`pack_sizes`).
    free_reserve : int
        Pool pages :meth:`~vattn.core.VirtualKVCache.prewarm` leaves unmapped and the map-ahead
        worker keeps free between steps, by unmapping idle slots' page-sets that hold nothing
        (no block key, no other mapping): a burst of requests then grows from the free pool,
        with no reclaim on the step's path. Needs ``map_ahead_tokens`` (the worker). Default 0.
    stream_ordered : bool
        ``True`` when all device work the caller's thread enqueues after
        :meth:`~vattn.core.VirtualKVCache.release` is ordered after that release's fence (one
        stream for the KV, as vLLM's GPU runner uses). Reclaim then hands a released slot's pages
        to another request without waiting for the fence (its old mapping is unmapped once the
        fence completes): no host wait under memory pressure. Default ``False``: reclaim waits.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16
    max_slots: int
    max_context: int
    group_size: int | None = None
    split_kv: bool = False
    page_budget: int | float = 0.9
    page_bytes: int | None = None
    scrub: str = "tenant"
    device: str | torch.device = "cpu"
    map_ahead_tokens: int = 0
    stream_ordered: bool = False
    pack_pages: int = 0
    pack_sets: int = 8
    free_reserve: int = 0

    def __post_init__(self):
        if self.group_size is None and isinstance(self.num_layers, int) and self.num_layers > 0:
            object.__setattr__(self, "group_size", auto_group_size(self.num_layers, self.split_kv))
        for name in ("num_layers", "num_kv_heads", "head_dim", "max_slots", "max_context", "group_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        if self.dtype not in _DTYPES:
            raise ConfigError(f"dtype must be one of {[str(d) for d in _DTYPES]}, got {self.dtype!r}")
        if self.num_layers % self.group_size:
            raise ConfigError(f"group_size must divide num_layers={self.num_layers}, got {self.group_size}")
        if not isinstance(self.split_kv, bool):
            raise ConfigError(f"split_kv must be a bool, got {self.split_kv!r}")
        if self.split_kv and self.group_size != 1:
            raise ConfigError(f"split_kv=True needs group_size=1, got group_size={self.group_size}")
        _check_budget(self.page_budget)
        if self.page_bytes is not None and (not isinstance(self.page_bytes, int) or self.page_bytes <= 0):
            raise ConfigError(f"page_bytes must be a positive int or None, got {self.page_bytes!r}")
        if self.scrub not in SCRUB_POLICIES:
            raise ConfigError(f"scrub must be one of {SCRUB_POLICIES}, got {self.scrub!r}")
        if not isinstance(self.map_ahead_tokens, int) or self.map_ahead_tokens < 0:
            raise ConfigError(f"map_ahead_tokens must be an int >= 0, got {self.map_ahead_tokens!r}")
        if not isinstance(self.pack_pages, int) or isinstance(self.pack_pages, bool) or self.pack_pages < 0:
            raise ConfigError(f"pack_pages must be an int >= 0, got {self.pack_pages!r}")
        sizes = self.pack_sets if isinstance(self.pack_sets, tuple) else (self.pack_sets,)
        if (not sizes or len(set(sizes)) != len(sizes)
                or any(not isinstance(n, int) or isinstance(n, bool) or n < 2 or n & (n - 1) for n in sizes)):
            raise ConfigError(f"pack_sets must be a power of two >= 2, or a tuple of distinct ones, "
                              f"got {self.pack_sets!r}")
        if not isinstance(self.free_reserve, int) or isinstance(self.free_reserve, bool) or self.free_reserve < 0:
            raise ConfigError(f"free_reserve must be an int >= 0, got {self.free_reserve!r}")
        if self.free_reserve and not self.map_ahead_tokens:
            raise ConfigError("free_reserve needs the map-ahead worker that refills it: expected "
                              f"map_ahead_tokens > 0 with free_reserve={self.free_reserve}, got 0")
        if not isinstance(self.stream_ordered, bool):
            raise ConfigError(f"stream_ordered must be a bool, got {self.stream_ordered!r}")
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError) as exc:
            raise ConfigError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}") from exc
        if device.type not in ("cpu", "cuda"):
            raise ConfigError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")

    @property
    def pack_sizes(self) -> tuple[int, ...]:
        """The pack sizes of :attr:`pack_sets`, largest first."""
        sizes = self.pack_sets if isinstance(self.pack_sets, tuple) else (self.pack_sets,)
        return tuple(sorted(sizes, reverse=True))

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)


def auto_group_size(num_layers: int, split_kv: bool = False) -> int:
    """Smallest divisor ``G`` of ``num_layers`` with ``num_layers / G <= MAX_AUTO_RANGES`` (1 if split)."""
    if split_kv:
        return 1
    return next(g for g in range(1, num_layers + 1)
                if num_layers % g == 0 and num_layers // g <= MAX_AUTO_RANGES)


def engine_group_size(num_layers: int) -> int:
    """The layer group the engine adapters use by default: 4 (measured best for Llama-3-8B on the
    H200, design note 2; fewer VA ranges also mean fewer partly filled pages per request and fewer
    tokens per page-set, the granularity of prefix sharing), else the largest of 2, 1 dividing
    ``num_layers``."""
    return next(g for g in (4, 2, 1) if num_layers % g == 0)


def _check_budget(budget) -> None:
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise ConfigError(f"page_budget must be bytes (int) or a fraction (float), got {budget!r}")
    if isinstance(budget, float) and not 0.0 < budget <= 1.0:
        raise ConfigError(f"a fractional page_budget must be in (0, 1], got {budget}")
    if isinstance(budget, int) and budget <= 0:
        raise ConfigError(f"page_budget in bytes must be positive, got {budget}")


#: Times a cache call whose driver call failed is retried within an engine step (every adapter)
DRIVER_RETRIES_ENV = "VATTN_DRIVER_RETRIES"


def driver_retries(retries: int | None = None) -> int:
    """``retries`` if given, else ``$VATTN_DRIVER_RETRIES`` (default 2)."""
    return env_int(DRIVER_RETRIES_ENV, 2, minimum=0) if retries is None else int(retries)


#: ``1`` / ``0`` turns staging shared prefixes into idle slots on / off in the engine adapters
#: (each adapter has its own default: :func:`stage_prefixes`)
STAGE_PREFIXES_ENV = "VATTN_STAGE_PREFIXES"


PACK_MB_ENV = "VATTN_PACK_MB"
PACK_SETS_ENV = "VATTN_PACK_SETS"


def pack_mb(default: int = 0) -> int:
    """``$VATTN_PACK_MB``: MiB of device memory an engine adapter gives packs (``pack_pages``),
    on top of the KV pool; unset: the adapter's ``default`` (0: off)."""
    return env_int(PACK_MB_ENV, default, minimum=0)


def pack_sets() -> int | tuple[int, ...]:
    """``$VATTN_PACK_SETS``: page-sets per pack (``pack_sets``), default 8; several sizes as a
    comma list, ``8,16,32`` (powers of 2, checked by :class:`KVCacheConfig`).

    Raises
    ------
    ConfigError
        A value that is not an integer >= 2 or a comma list of them.
    """
    raw = os.environ.get(PACK_SETS_ENV, "")
    if "," not in raw:
        return env_int(PACK_SETS_ENV, 8, minimum=2)
    try:
        sizes = tuple(int(part) for part in raw.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 2:
        raise ConfigError(f"{PACK_SETS_ENV} must be an integer >= 2 or a comma list of them "
                          f"(e.g. 8,16,32), got {raw!r}")
    return sizes


#: ``1`` / ``0`` turns deferred mapping (:meth:`VirtualKVCache.deferred`) on / off in the engine
#: adapters that can make the deferred calls layer by layer (vLLM's GPU runner; default off there)
DEFER_MAPPING_ENV = "VATTN_DEFER_MAPPING"


def defer_mapping(default: bool = True) -> bool:
    """Whether an adapter defers a step's VMM calls to its forward: ``$VATTN_DEFER_MAPPING``
    (``1`` / ``0``), unset: the adapter's ``default``."""
    return env_flag(DEFER_MAPPING_ENV, default)


def stage_prefixes(default: bool = True) -> bool:
    """Whether prefix staging is on: ``$VATTN_STAGE_PREFIXES`` (``1`` / ``0``), unset: the
    adapter's ``default``."""
    return env_flag(STAGE_PREFIXES_ENV, default)


def env_flag(name: str, default: bool) -> bool:
    """Environment variable ``name`` as a switch: ``1`` on, ``0`` off, unset: ``default``.

    Raises
    ------
    ConfigError
        A value other than ``0`` or ``1``.
    """
    text = os.environ.get(name, "1" if default else "0")
    if text not in ("0", "1"):
        raise ConfigError(f"{name} must be 0 or 1, got {text!r}")
    return text == "1"


def env_int(name: str, default: int | None = None, *, minimum: int | None = None) -> int | None:
    """The integer in environment variable ``name`` (``default`` when unset or empty).

    Raises
    ------
    ConfigError
        The value is not an integer, or is below ``minimum``.
    """
    raw = os.environ.get(name, "")
    if raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or (minimum is not None and value < minimum):
        floor = "" if minimum is None else f" >= {minimum}"
        raise ConfigError(f"{name} must be an integer{floor}, got {raw!r}")
    return value
