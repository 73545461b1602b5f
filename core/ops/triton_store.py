"""Fused K/V store kernel (Triton; imported only when used)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import anchor_delta

__all__ = ["store_triton"]


@triton.jit
def _store_kernel(K_new, V_new, Rows, k_delta, v_delta,
                  stride_kr, stride_vr, stride_kn, stride_kh, stride_vn, stride_vh,
                  HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (token n, head h): copy ``k_new[n, h]`` and ``v_new[n, h]`` to row ``rows[n]``."""
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    row = tl.load(Rows + n)                      # int64: row * stride exceeds 2^31 elements
    K_rows = K_new + k_delta                     # the cache, addressed from a mapped pointer
    V_rows = V_new + v_delta
    offs = tl.arange(0, BLOCK_D)
    mask = offs < HEAD_D
    k = tl.load(K_new + n * stride_kn + h * stride_kh + offs, mask=mask)
    v = tl.load(V_new + n * stride_vn + h * stride_vh + offs, mask=mask)
    tl.store(K_rows + row * stride_kr + h * HEAD_D + offs, k, mask=mask)
    tl.store(V_rows + row * stride_vr + h * HEAD_D + offs, v, mask=mask)


def store_triton(k_rows: torch.Tensor, v_rows: torch.Tensor, k_new: torch.Tensor,
                 v_new: torch.Tensor, rows: torch.Tensor) -> None:
    """One launch for all tokens and both K and V. Shapes as in :func:`vattn.core.ops.store`."""
    n, heads, dim = k_new.shape
    if k_new.stride(-1) != 1:
        k_new = k_new.contiguous()
    if v_new.stride(-1) != 1:
        v_new = v_new.contiguous()
    _store_kernel[(n, heads)](
        k_new, v_new, rows, anchor_delta(k_rows, k_new), anchor_delta(v_rows, v_new),
        k_rows.stride(0), v_rows.stride(0), k_new.stride(0), k_new.stride(1),
        v_new.stride(0), v_new.stride(1),
        HEAD_D=dim, BLOCK_D=triton.next_power_of_2(dim), num_warps=1 if dim <= 128 else 2)
