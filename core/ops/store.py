"""Store a step's new K/V rows into the layer views (graph-safe, 64-bit row math).

Token ``t`` of slot ``s`` lives in row ``s * rows_per_slot + t`` of a layer's flattened rows view
``[slots * rows_per_slot, H, D]`` (see ``KVLayout``). A step may mix requests and positions freely
(prefill chunks, decode tokens, speculative tokens): the caller passes one row index per token.
"""

from __future__ import annotations

import importlib.util
import numbers

import torch

from ..errors import TensorError, UnsupportedError
from .checks import check_index, flat_rows

__all__ = ["store", "rows_for"]


def rows_for(slots: torch.Tensor, positions: torch.Tensor, rows_per_slot: int) -> torch.Tensor:
    """Row index of each token: ``slots * rows_per_slot + positions`` as int64 (graph-safe).

    Parameters
    ----------
    slots, positions : torch.Tensor
        ``[N]`` integer tensors on one device (a slot per token and its position in the request).
    rows_per_slot : int
        ``cache.layout.rows_per_slot`` (``k_cache.shape[1]``).

    Returns
    -------
    torch.Tensor
        ``[N]`` int64.

    Raises
    ------
    TensorError
        ``slots`` or ``positions`` is not an integer tensor, or ``rows_per_slot`` not an int >= 1.
    """
    for name, t in (("slots", slots), ("positions", positions)):
        if not isinstance(t, torch.Tensor) or t.dtype.is_floating_point or t.dtype.is_complex:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TensorError(f"{name} must be an integer torch.Tensor, got {got}")
    if isinstance(rows_per_slot, bool) or not isinstance(rows_per_slot, numbers.Integral) or rows_per_slot < 1:
        raise TensorError(f"rows_per_slot must be an int >= 1, got {rows_per_slot!r}")
    return slots.to(torch.int64) * int(rows_per_slot) + positions.to(torch.int64)


def store(k_cache_rows: torch.Tensor, v_cache_rows: torch.Tensor, k_new: torch.Tensor,
          v_new: torch.Tensor, rows: torch.Tensor, *, backend: str = "auto") -> None:
    """Write ``k_new[i]`` / ``v_new[i]`` into row ``rows[i]`` of the K / V views.

    One kernel writes both K and V of all tokens (``backend="triton"``, chosen by ``"auto"`` on
    CUDA when Triton is installed); ``backend="torch"`` uses two ``index_copy_`` kernels (any
    device). Both are CUDA-graph safe: no host synchronization, no value-dependent shapes.

    Parameters
    ----------
    k_cache_rows, v_cache_rows : torch.Tensor
        ``[slots * rows_per_slot, H, D]`` rows views (``cache.k_rows(layer)``) or the 4-D layer
        views ``[slots, rows_per_slot, H, D]`` (flattened here without a copy). Strided rows are
        fine; each row's ``[H, D]`` block must be contiguous.
    k_new, v_new : torch.Tensor
        ``[N, H, D]``, same dtype and device as the cache; any strides.
    rows : torch.Tensor
        ``[N]`` int64 row indices (:func:`rows_for`). Precondition (not checked, it would
        synchronize): every row is mapped, i.e. below the slot's ensured length. On the CPU the
        rows are checked to lie inside the view (no synchronization there).
    backend : {"auto", "triton", "torch"}

    Raises
    ------
    TensorError
        A tensor of the wrong type, shape, dtype or device, or (CPU) a row outside the view.
    UnsupportedError
        An unknown backend, or ``"triton"`` without CUDA (or ``TRITON_INTERPRET=1``).
    """
    k_rows, v_rows = flat_rows(k_cache_rows), flat_rows(v_cache_rows)
    _check_store(k_rows, v_rows, k_new, v_new, rows)
    if k_new.shape[0] == 0:
        return
    if backend == "auto":
        backend = "triton" if k_rows.is_cuda and importlib.util.find_spec("triton") else "torch"
    if backend == "torch":
        k_rows.index_copy_(0, rows, k_new)
        v_rows.index_copy_(0, rows, v_new)
    elif backend == "triton":
        if not k_rows.is_cuda and not _interpreting():
            raise UnsupportedError("store backend 'triton' needs a CUDA tensor (or TRITON_INTERPRET=1)")
        from .triton_store import store_triton
        store_triton(k_rows, v_rows, k_new, v_new, rows)
    else:
        raise UnsupportedError(f"store backend must be 'auto', 'triton' or 'torch', got {backend!r}")


def _check_store(k_rows, v_rows, k_new, v_new, rows) -> None:
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or tuple(t.shape[1:]) != tuple(k_rows.shape[1:]):
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise TensorError(f"Invalid shape of {name}: expected [N, {k_rows.shape[1]}, "
                              f"{k_rows.shape[2]}], got {shape}")
        if t.dtype != k_rows.dtype or t.device != k_rows.device:
            raise TensorError(f"{name} must match the cache ({k_rows.dtype} on {k_rows.device}), "
                              f"got {t.dtype} on {t.device}")
    if k_new.shape[0] != v_new.shape[0]:
        raise TensorError(f"k_new and v_new must have the same N, got {k_new.shape[0]} and {v_new.shape[0]}")
    if k_rows.shape != v_rows.shape or k_rows.dtype != v_rows.dtype or k_rows.device != v_rows.device:
        raise TensorError("k_cache_rows and v_cache_rows must have equal shape, dtype and device")
    check_index("rows", rows, length=k_new.shape[0], device=k_rows.device, dtypes=(torch.int64,))
    if rows.device.type == "cpu" and rows.numel():
        low, high = int(rows.min()), int(rows.max())
        if low < 0 or high >= k_rows.shape[0]:
            raise TensorError(f"rows must be in [0, {k_rows.shape[0]}) (slots x rows_per_slot of the "
                              f"view), got {low if low < 0 else high}")


def _interpreting() -> bool:
    import os
    return os.environ.get("TRITON_INTERPRET") == "1"
