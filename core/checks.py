"""Argument checks of :class:`~vattn.core.cache.VirtualKVCache`'s public methods: each raises the
typed error the contract names (docs/bad-input.md lists them)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from .config import KVCacheConfig
from .errors import ContextLengthError, SlotError, VattnError

__all__ = ["check_slot", "check_length", "check_bind", "check_batch", "batch_arrays"]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_slot(slot, max_slots: int) -> None:
    if not _is_int(slot) or not 0 <= slot < max_slots:
        raise SlotError(f"slot must be an int in [0, {max_slots}), got {slot!r}")


def check_length(n, max_context: int) -> None:
    if not _is_int(n) or n < 0:
        raise ContextLengthError(f"length must be an int >= 0, got {n!r}")
    if n > max_context:
        raise ContextLengthError(f"length {n} exceeds max_context={max_context}")


def check_bind(start, keys: list, hits, pages_per_slot: int) -> None:
    """The arguments of :meth:`~vattn.core.cache.VirtualKVCache.bind` (``keys`` as a list)."""
    if not _is_int(start) or start < 0:
        raise SlotError(f"start must be an int >= 0, got {start!r}")
    if not _is_int(hits) or not 0 <= hits <= len(keys):
        raise SlotError(f"hits must be an int in [0, {len(keys)}], got {hits!r}")
    if start + len(keys) > pages_per_slot:
        raise ContextLengthError(f"page-sets {start}..{start + len(keys) - 1} exceed the slot's "
                                 f"{pages_per_slot}")
    if len(set(keys)) != len(keys):
        raise SlotError(f"a block key is listed twice in one bind() call: {keys}")


def check_index(index, pages_per_slot: int) -> int:
    """A page-set index of one slot (:meth:`~vattn.core.cache.VirtualKVCache.claim`)."""
    if not _is_int(index) or index < 0:
        raise SlotError(f"index must be an int >= 0, got {index!r}")
    if index >= pages_per_slot:
        raise ContextLengthError(f"page-set {index} exceeds the slot's {pages_per_slot}")
    return int(index)


def check_batch(slots: np.ndarray, lens: np.ndarray, active: np.ndarray, cfg: KVCacheConfig) -> None:
    """One ``ensure`` call: acquired slots in range, each once, lengths within ``max_context``."""
    if slots.size and (slots.min() < 0 or slots.max() >= cfg.max_slots):
        bad = slots[(slots < 0) | (slots >= cfg.max_slots)][0]
        raise SlotError(f"slot must be an int in [0, {cfg.max_slots}), got {int(bad)}")
    if slots.size and not active[slots].all():
        bad = slots[~active[slots]][0]
        raise SlotError(f"slot {int(bad)} is not acquired (released or never acquired)")
    if lens.size and (lens.min() < 0 or lens.max() > cfg.max_context):
        bad = lens[(lens < 0) | (lens > cfg.max_context)][0]
        raise ContextLengthError(f"length {int(bad)} is outside [0, max_context={cfg.max_context}]")
    if slots.size > 1 and np.bincount(slots).max() > 1:
        raise SlotError("a slot is listed twice in one ensure() call")


def batch_arrays(lengths, lengths_seq) -> tuple[np.ndarray, np.ndarray]:
    """``(slots, lengths)`` as int64 arrays from ``{slot: length}`` or two sequences."""
    if lengths_seq is None:
        if not isinstance(lengths, Mapping):
            raise SlotError(f"ensure expects {{slot: length}} or (slots, lengths), got "
                            f"{type(lengths).__name__}")
        keys, values = list(lengths.keys()), list(lengths.values())
    else:
        keys, values = lengths, lengths_seq
    slots = _int_array(keys, "slots")
    lens = _int_array(values, "lengths", error=ContextLengthError)
    if slots.shape != lens.shape:
        raise SlotError(f"slots and lengths need equal sizes, got {slots.size} and {lens.size}")
    return slots, lens


def _int_array(xs, name: str, *, error: type[VattnError] = SlotError) -> np.ndarray:
    if isinstance(xs, torch.Tensor):
        if xs.device.type != "cpu" or xs.dtype.is_floating_point:
            raise error(f"{name} must be integers on the CPU, got {xs.dtype} on {xs.device}")
        xs = xs.numpy()
    arr = np.asarray(xs)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise error(f"{name} must be a 1-D sequence of ints, got {arr.dtype} with shape {arr.shape}")
    return arr.astype(np.int64, copy=False)
