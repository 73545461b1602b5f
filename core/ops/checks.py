"""Argument checks shared by the ops (host-side, shape/stride metadata only: graph-safe).

Every check raises :class:`vattn.core.errors.TensorError` naming the argument, what was expected
and what was given. None of them reads tensor *values* (that would synchronize the device).
"""

from __future__ import annotations

import torch

from ..errors import TensorError, UnsupportedError

__all__ = [
    "check_cache", "check_cache_pair", "check_index", "check_q", "check_out", "check_int32_rows",
    "flat_rows", "anchor_delta", "INT32_MAX", "FLOAT_DTYPES",
]

INT32_MAX = 2**31 - 1
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_cache(name: str, cache: torch.Tensor) -> None:
    """A layer view ``[slots, rows_per_slot, H, D]``: last dim contiguous, rows evenly strided.

    The slot stride must equal ``rows_per_slot * row_stride`` so the flattened rows view of the
    design notes exists (token ``t`` of slot ``s`` is row ``s * rows_per_slot + t``).
    """
    if not isinstance(cache, torch.Tensor):
        raise TensorError(f"{name} must be a torch.Tensor, got {type(cache).__name__}")
    if cache.dim() != 4:
        raise TensorError(f"Invalid shape of {name}: expected [slots, rows_per_slot, H, D], "
                          f"got {tuple(cache.shape)}")
    if cache.dtype not in FLOAT_DTYPES:
        raise TensorError(f"Invalid dtype of {name}: expected one of {FLOAT_DTYPES}, got {cache.dtype}")
    s_slot, s_row, s_head, s_dim = cache.stride()
    _, rows, heads, dim = cache.shape
    if s_dim != 1 or s_head != dim:
        raise TensorError(f"Invalid strides of {name}: the [H, D] block of a row must be contiguous "
                          f"(strides (..., {dim}, 1)), got {tuple(cache.stride())}")
    if s_row < heads * dim or s_slot != rows * s_row:
        raise TensorError(f"Invalid strides of {name}: expected slot stride = rows_per_slot * row "
                          f"stride = {rows} * {s_row}, got {tuple(cache.stride())}")


def check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    check_cache("k_cache", k_cache)
    check_cache("v_cache", v_cache)
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise TensorError(f"k_cache and v_cache must have equal shapes and strides, got "
                          f"{tuple(k_cache.shape)}/{tuple(k_cache.stride())} and "
                          f"{tuple(v_cache.shape)}/{tuple(v_cache.stride())}")
    if k_cache.dtype != v_cache.dtype or k_cache.device != v_cache.device:
        raise TensorError(f"k_cache and v_cache must share dtype and device, got {k_cache.dtype}@"
                          f"{k_cache.device} and {v_cache.dtype}@{v_cache.device}")


def check_q(q: torch.Tensor, cache: torch.Tensor, *, name: str = "q") -> None:
    """``q [N, Hq, D]`` against a cache ``[slots, rows, Hk, D]``: same dtype/device/D, Hq % Hk == 0."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        shape = tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
        raise TensorError(f"Invalid shape of {name}: expected [N, Hq, D], got {shape}")
    if q.device != cache.device:
        raise TensorError(f"{name} is on {q.device} but the KV cache is on {cache.device}")
    if q.dtype != cache.dtype:
        raise TensorError(f"Invalid dtype of {name}: expected {cache.dtype} (the cache's), got {q.dtype}")
    if q.shape[-1] != cache.shape[-1]:
        raise TensorError(f"Invalid head_dim of {name}: expected {cache.shape[-1]}, got {q.shape[-1]}")
    if q.shape[1] % cache.shape[2]:
        raise TensorError(f"q heads ({q.shape[1]}) must be a multiple of kv heads ({cache.shape[2]})")
    if q.stride(-1) != 1:
        raise TensorError(f"Invalid strides of {name}: last dim must be contiguous, got {q.stride()}")


def check_index(name: str, t: torch.Tensor, *, length: int, device: torch.device,
                dtypes: tuple = (torch.int32, torch.int64)) -> None:
    """A 1-D integer index tensor of a given length on the device of the data."""
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.shape[0] != length:
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise TensorError(f"Invalid shape of {name}: expected [{length}], got {shape}")
    if t.dtype not in dtypes:
        raise TensorError(f"Invalid dtype of {name}: expected one of {dtypes}, got {t.dtype}")
    if t.device != device:
        raise TensorError(f"{name} is on {t.device} but the data is on {device}")


def flat_rows(cache: torch.Tensor) -> torch.Tensor:
    """``[slots, rows, H, D]`` layer view -> ``[slots * rows, H, D]`` rows view (no copy)."""
    if not isinstance(cache, torch.Tensor):
        raise TensorError(f"the cache must be a torch.Tensor (a layer view or its rows view), got "
                          f"{type(cache).__name__}")
    if cache.dim() == 3:
        return cache
    check_cache("cache", cache)
    slots, rows, heads, dim = cache.shape
    return cache.as_strided((slots * rows, heads, dim), cache.stride()[1:])


def check_out(out, shape: tuple, like: torch.Tensor) -> torch.Tensor:
    """Return ``out`` (validated) or a new empty tensor shaped ``shape`` like ``like``."""
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    if tuple(out.shape) != tuple(shape) or out.dtype != like.dtype or out.device != like.device:
        raise TensorError(f"Invalid out: expected {tuple(shape)} {like.dtype} on {like.device}, got "
                          f"{tuple(out.shape)} {out.dtype} on {out.device}")
    if out.stride(-1) != 1:
        raise TensorError(f"Invalid strides of out: last dim must be contiguous, got {out.stride()}")
    return out


def check_int32_rows(cache: torch.Tensor, backend: str) -> None:
    """Kernels taking row offsets as int32 need ``slots * rows_per_slot`` to fit in int32."""
    total = cache.shape[0] * cache.shape[1]
    if total > INT32_MAX:
        raise UnsupportedError(f"backend {backend!r} addresses rows with int32 but the cache has "
                               f"{cache.shape[0]} slots x {cache.shape[1]} rows = {total} rows > 2^31-1; "
                               f"use fewer slots / a shorter max_context, or backend='triton'")


def anchor_delta(view: torch.Tensor, anchor: torch.Tensor) -> int:
    """Element offset of ``view``'s first element from ``anchor``'s (same dtype), for Triton.

    Triton refuses a tensor argument whose first byte is not mapped (it asks the driver about the
    pointer), and a virtual cache's view starts at slot 0, which may hold no page. Kernels take
    an ordinary tensor of the call (``q``, ``k_new``) and this offset instead; the address math
    is the same, only the base pointer handed to the launcher differs.
    """
    if view.dtype != anchor.dtype or view.device != anchor.device:
        raise TensorError(f"anchor must match the view ({view.dtype} on {view.device}), got "
                          f"{anchor.dtype} on {anchor.device}")
    delta, rem = divmod(view.data_ptr() - anchor.data_ptr(), view.element_size())
    if rem:
        raise TensorError(f"view and anchor addresses differ by a non-multiple of the element size "
                          f"({view.element_size()} bytes)")
    return delta
