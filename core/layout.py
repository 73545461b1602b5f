"""Byte math of the virtual KV tensors (decisions 2 and 3 of the design notes).

A group of ``G`` layers shares one VA range shaped ``[slots + 1, rows_per_slot, G, 2, H, D]``
(``[slots + 1, rows_per_slot, H, D]`` per K or per V range with ``split_kv``). The extra last
slot is the always-mapped padding slot. Slot ``s`` owns bytes ``[s*R, (s+1)*R)`` of every range;
``R`` is a multiple of the page size and of ``token_bytes``, so token ``t`` of slot ``s`` is row
``s * rows_per_slot + t`` of a flattened per-layer view.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch

from .errors import ConfigError

__all__ = ["KVLayout", "LayoutReport", "layout_report", "cache_layout_row", "LayerPlace"]


@dataclass(frozen=True, slots=True)
class LayerPlace:
    """Where one layer's K and V live: range index and element offset inside a token row."""

    k_range: int
    v_range: int
    k_offset: int
    v_offset: int


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shapes, strides and page arithmetic for one cache configuration."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    element_bytes: int
    max_slots: int
    max_context: int
    group_size: int
    split_kv: bool
    page_bytes: int

    #: derived once (the page arithmetic runs in every bind and growth): bytes of one token in
    #: one range; VA ranges; ``R``, the bytes one slot owns in every range; token rows and pages
    #: per slot
    token_bytes: int = field(init=False, repr=False, compare=False)
    num_ranges: int = field(init=False, repr=False, compare=False)
    region_bytes: int = field(init=False, repr=False, compare=False)
    rows_per_slot: int = field(init=False, repr=False, compare=False)
    pages_per_slot: int = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        per_layer = 1 if self.split_kv else 2
        token = self.group_size * per_layer * self.num_kv_heads * self.head_dim * self.element_bytes
        step = math.lcm(self.page_bytes, token)
        region = -(-self.max_context * token // step) * step
        for name, value in (("token_bytes", token),
                            ("num_ranges", self.num_layers // self.group_size * (2 if self.split_kv else 1)),
                            ("region_bytes", region), ("rows_per_slot", region // token),
                            ("pages_per_slot", region // self.page_bytes)):
            object.__setattr__(self, name, value)

    @classmethod
    def from_config(cls, cfg, page_bytes: int) -> "KVLayout":
        return cls(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, _itemsize(cfg.dtype),
                   cfg.max_slots, cfg.max_context, cfg.group_size, cfg.split_kv, page_bytes)

    @property
    def row_elems(self) -> int:
        return self.token_bytes // self.element_bytes

    @property
    def num_va_slots(self) -> int:
        """Slots with VA: ``max_slots`` plus the padding slot."""
        return self.max_slots + 1

    @property
    def range_bytes(self) -> int:
        return self.num_va_slots * self.region_bytes

    @property
    def tokens_per_page(self) -> float:
        """Tokens one page-set (one page in every range) holds."""
        return self.page_bytes / self.token_bytes

    @property
    def page_set_bytes(self) -> int:
        return self.page_bytes * self.num_ranges

    def pages_for(self, num_tokens: int) -> int:
        """Page-sets needed so tokens ``0 .. num_tokens - 1`` are mapped."""
        return -(-num_tokens * self.token_bytes // self.page_bytes)

    def tokens_for(self, num_page_sets: int) -> int:
        """Tokens fully backed by ``num_page_sets`` page-sets."""
        return min(num_page_sets * self.page_bytes // self.token_bytes, self.rows_per_slot)

    def page_offset(self, slot: int, page: int) -> int:
        """Byte offset of a slot's ``page``-th page inside every range."""
        return slot * self.region_bytes + page * self.page_bytes

    def place(self, layer: int) -> LayerPlace:
        """Where ``layer``'s K and V live; ``ConfigError`` unless ``layer`` is an int in range."""
        index = _as_index(layer)
        if index is None or not 0 <= index < self.num_layers:
            raise ConfigError(f"layer must be in [0, {self.num_layers}) as an int, got {layer!r}")
        layer = index
        hd = self.num_kv_heads * self.head_dim
        if self.split_kv:
            return LayerPlace(2 * layer, 2 * layer + 1, 0, 0)
        j, rng = layer % self.group_size, layer // self.group_size
        return LayerPlace(rng, rng, 2 * j * hd, (2 * j + 1) * hd)

    def slot_view(self, range_elems: torch.Tensor, elem_offset: int) -> torch.Tensor:
        """``[slots + 1, rows_per_slot, H, D]`` strided view of one layer's K or V."""
        rows, row = self.rows_per_slot, self.row_elems
        return range_elems.as_strided(
            (self.num_va_slots, rows, self.num_kv_heads, self.head_dim),
            (rows * row, row, self.head_dim, 1), range_elems.storage_offset() + elem_offset)

    def waste_bytes(self, num_tokens: int) -> int:
        """Mapped but unused bytes of a request holding ``num_tokens`` tokens."""
        return self.pages_for(num_tokens) * self.page_set_bytes - num_tokens * self.token_bytes * self.num_ranges


@dataclass(frozen=True, slots=True)
class LayoutReport:
    """What a layout costs for one model shape."""

    group_size: int
    split_kv: bool
    num_ranges: int
    token_bytes: int
    tokens_per_page: float
    worst_waste_bytes: int  # at most one partly filled page per range

    def as_row(self) -> dict:
        return {"layout": "per-layer K/V split" if self.split_kv else f"G={self.group_size}",
                "ranges": self.num_ranges, "tokens_per_page": self.tokens_per_page,
                "worst_waste_MiB": self.worst_waste_bytes / 2**20}


def layout_report(*, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                  group_size: int, split_kv: bool = False, page_bytes: int = 2 << 20) -> LayoutReport:
    """Tokens per page and worst-case waste per request for a model shape and layer group ``G``.

    Raises
    ------
    ConfigError
        A size that is not a positive int, a dtype that is not a ``torch.dtype``, or a
        ``group_size`` that does not divide ``num_layers``.
    """
    sizes = dict(group_size=group_size, num_layers=num_layers, num_kv_heads=num_kv_heads,
                 head_dim=head_dim, page_bytes=page_bytes)
    for name, value in sizes.items():
        if not _is_int(value) or value <= 0:
            raise ConfigError(f"{name} must be a positive int, got {value!r}")
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"dtype must be a torch.dtype, got {dtype!r}")
    if num_layers % group_size:
        raise ConfigError(f"group_size must divide num_layers={num_layers}, got {group_size}")
    lay = KVLayout(num_layers, num_kv_heads, head_dim, _itemsize(dtype), 1, 1, group_size,
                   split_kv, page_bytes)
    waste = lay.num_ranges * (page_bytes - min(lay.token_bytes, page_bytes))
    return LayoutReport(group_size, split_kv, lay.num_ranges, lay.token_bytes, lay.tokens_per_page,
                        waste)


def cache_layout_row(config, page_bytes: int) -> dict:
    """:meth:`LayoutReport.as_row` of a :class:`~vattn.core.KVCacheConfig`'s layout, plus its
    ``worst_waste_bytes`` (what the adapters put in their metrics)."""
    rep = layout_report(num_layers=config.num_layers, num_kv_heads=config.num_kv_heads,
                        head_dim=config.head_dim, dtype=config.dtype, group_size=config.group_size,
                        split_kv=config.split_kv, page_bytes=page_bytes)
    return rep.as_row() | {"worst_waste_bytes": rep.worst_waste_bytes}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _as_index(value) -> int | None:
    """``value`` as a Python int if it is an integer (``int``, numpy or 0-d integer tensor) other
    than a bool, else ``None``."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
