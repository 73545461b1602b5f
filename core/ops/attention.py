"""``prefill`` and ``decode``: validate, resolve the backend, run it."""

from __future__ import annotations

import numbers

import torch

from ..errors import TensorError, UnsupportedError
from .checks import check_cache_pair, check_index, check_out, check_q
from .dispatch import resolve_backend

__all__ = ["prefill", "decode"]


def prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
            cu_seqlens_q: torch.Tensor, slots: torch.Tensor, seqlens_k: torch.Tensor,
            max_seqlen_q: int, max_seqlen_k: int, scale: float | None = None, causal: bool = True,
            backend: str = "auto", out: torch.Tensor | None = None) -> torch.Tensor:
    """Prefill / chunked prefill on a cached prefix (new K/V already stored).

    Parameters
    ----------
    q : torch.Tensor
        ``[Nq, Hq, D]`` float16/bfloat16 (float32 on the reference path), requests concatenated.
    k_cache, v_cache : torch.Tensor
        ``[slots, rows_per_slot, Hk, D]`` layer views, ``Hq % Hk == 0`` (GQA).
    cu_seqlens_q : torch.Tensor
        ``[B + 1]`` int32: request ``i`` owns q rows ``cu_seqlens_q[i] : cu_seqlens_q[i + 1]``.
    slots : torch.Tensor
        ``[B]`` int32/int64 slot of each request (any order, any gaps).
    seqlens_k : torch.Tensor
        ``[B]`` int32 keys of each request *including* its new tokens (prefix + chunk).
    max_seqlen_q, max_seqlen_k : int
        Host-side upper bounds of the q chunk and key lengths (``1 <= max_seqlen_q <= Nq``,
        ``1 <= max_seqlen_k <= rows_per_slot``).
    scale : float, optional
        Softmax scale (finite, > 0), default ``D ** -0.5``.
    causal : bool
        Causal mask aligned bottom-right: q row ``i`` of a chunk of ``n`` sees keys
        ``0 .. seqlens_k - n + i``.
    backend : str
        ``"auto"`` or a name from ``vattn.core.ops.BACKENDS`` (see ``resolve_backend``).
    out : torch.Tensor, optional
        ``[Nq, Hq, D]`` buffer to write into.

    Returns
    -------
    torch.Tensor
        ``[Nq, Hq, D]``, dtype of ``q``.

    Raises
    ------
    TensorError
        A tensor of the wrong type, shape, dtype, device or strides, or a host bound or scale out
        of range. The ``"reference"`` backend (which reads values on the host anyway) also refuses
        slots, key lengths and ``cu_seqlens_q`` values out of range; the graph-safe backends do not
        read values.
    UnsupportedError
        ``backend`` cannot run here.
    """
    check_cache_pair(k_cache, v_cache)
    check_q(q, k_cache)
    if not isinstance(cu_seqlens_q, torch.Tensor) or cu_seqlens_q.dim() != 1 or cu_seqlens_q.numel() < 2:
        raise TensorError(f"Invalid cu_seqlens_q: expected a [B + 1] int32 tensor, got {cu_seqlens_q!r}")
    batch = cu_seqlens_q.shape[0] - 1
    check_index("cu_seqlens_q", cu_seqlens_q, length=batch + 1, device=q.device)
    check_index("slots", slots, length=batch, device=q.device)
    check_index("seqlens_k", seqlens_k, length=batch, device=q.device)
    _check_bound("max_seqlen_q", max_seqlen_q, q.shape[0], "Nq")
    _check_bound("max_seqlen_k", max_seqlen_k, k_cache.shape[1])
    scale = _scale(scale, q.shape[-1])
    name = resolve_backend("prefill", device=q.device, dtype=q.dtype, head_dim=q.shape[-1],
                           backend=backend)
    args = dict(cu_seqlens_q=cu_seqlens_q, slots=slots, seqlens_k=seqlens_k,
                max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, scale=scale, causal=causal)
    if name == "reference":
        from .reference import prefill_reference
        out = check_out(out, q.shape, q)
        return prefill_reference(q, k_cache, v_cache, out=out, scale=scale, causal=causal,
                                 cu_seqlens_q=cu_seqlens_q, slots=slots, seqlens_k=seqlens_k)
    out = None if out is None else check_out(out, q.shape, q)
    return _run_fa_family(name, q, k_cache, v_cache, out=out, **args)


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, slots: torch.Tensor,
           seqlens: torch.Tensor, max_seqlen_k: int | None = None, scale: float | None = None,
           backend: str = "auto", out: torch.Tensor | None = None,
           cu_seqlens_q: torch.Tensor | None = None) -> torch.Tensor:
    """One new token per request attends to its slot's first ``seqlens[b]`` rows.

    Parameters
    ----------
    q : torch.Tensor
        ``[B, Hq, D]``.
    k_cache, v_cache : torch.Tensor
        ``[slots, rows_per_slot, Hk, D]`` layer views.
    slots : torch.Tensor
        ``[B]`` int32/int64.
    seqlens : torch.Tensor
        ``[B]`` int32, ``>= 1``, keys including the current token (already stored).
    max_seqlen_k : int, optional
        Host-side bound of ``seqlens``; default ``rows_per_slot`` (always valid, graph-safe).
        A tight bound lets the split heuristics pick fewer splits.
    scale, backend, out
        As in :func:`prefill`; ``out`` is ``[B, Hq, D]``.
    cu_seqlens_q : torch.Tensor, optional
        ``arange(B + 1)`` int32, built once per step by callers that run many layers (the
        FlashAttention-family backends need it; otherwise one small kernel per call builds it).
        Passing ``slots`` and ``seqlens`` as int32 likewise avoids a conversion per call.

    Returns
    -------
    torch.Tensor
        ``[B, Hq, D]``, dtype of ``q``.

    Raises
    ------
    TensorError, UnsupportedError
        As in :func:`prefill`.
    """
    check_cache_pair(k_cache, v_cache)
    check_q(q, k_cache)
    batch = q.shape[0]
    check_index("slots", slots, length=batch, device=q.device)
    check_index("seqlens", seqlens, length=batch, device=q.device)
    if cu_seqlens_q is not None:
        check_index("cu_seqlens_q", cu_seqlens_q, length=batch + 1, device=q.device, dtypes=(torch.int32,))
    max_seqlen_k = k_cache.shape[1] if max_seqlen_k is None else max_seqlen_k
    _check_bound("max_seqlen_k", max_seqlen_k, k_cache.shape[1])
    scale = _scale(scale, q.shape[-1])
    name = resolve_backend("decode", device=q.device, dtype=q.dtype, head_dim=q.shape[-1],
                           backend=backend)
    if name in ("reference", "triton"):
        out = check_out(out, q.shape, q)
    elif out is not None:
        out = check_out(out, q.shape, q)
    if name == "reference":
        from .reference import decode_reference
        return decode_reference(q, k_cache, v_cache, slots=slots, seqlens=seqlens, scale=scale, out=out)
    if name == "triton":
        from .triton_decode import decode_triton
        return decode_triton(q, k_cache, v_cache, slots=slots, seqlens=seqlens,
                             max_seqlen_k=max_seqlen_k, scale=scale, out=out)
    if name == "flash_attn":
        from .external import decode_flash_attn
        return decode_flash_attn(q, k_cache, v_cache, slots=slots, seqlens=seqlens, scale=scale, out=out)
    if name == "flashinfer":
        from .external import decode_flashinfer
        return decode_flashinfer(q, k_cache, v_cache, slots=slots, seqlens=seqlens, scale=scale, out=out)
    cu_q = (torch.arange(batch + 1, dtype=torch.int32, device=q.device) if cu_seqlens_q is None
            else cu_seqlens_q)
    return _run_fa_family(name, q, k_cache, v_cache, cu_seqlens_q=cu_q, slots=slots,
                          seqlens_k=seqlens, max_seqlen_q=1, max_seqlen_k=max_seqlen_k,
                          scale=scale, causal=False, out=out)


def _run_fa_family(name, q, k_cache, v_cache, **args) -> torch.Tensor:
    """Varlen FlashAttention backends shared by prefill and decode."""
    if name == "torch_fa2":
        from .torch_fa import prefill_torch_fa2
        return prefill_torch_fa2(q, k_cache, v_cache, **args)
    from . import external
    if name in ("vllm_fa3", "vllm_fa2"):
        return external.run_vllm(q, k_cache, v_cache, fa_version=int(name[-1]), **args)
    if name == "sgl_fa3":
        return external.run_sgl(q, k_cache, v_cache, **args)
    if name == "flash_attn":
        return external.prefill_flash_attn(q, k_cache, v_cache, **args)
    raise UnsupportedError(f"backend {name!r} has no varlen prefill path")


def _check_bound(name: str, value, upper: int, what: str = "rows_per_slot") -> None:
    """``value`` must be a host int in ``[1, upper]`` (``[0, 0]`` when ``upper`` is 0: no rows)."""
    lower = min(1, upper)
    if not isinstance(value, int) or isinstance(value, bool) or not lower <= value <= upper:
        raise TensorError(f"{name} must be a host int in [{lower}, {what}={upper}], got {value!r}")


def _scale(scale, head_dim: int) -> float:
    """The softmax scale: ``head_dim ** -0.5`` by default, else a finite float > 0."""
    if scale is None:
        return head_dim ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not 0 < scale < float("inf"):
        raise TensorError(f"scale must be a finite float > 0 or None, got {scale!r}")
    return float(scale)
