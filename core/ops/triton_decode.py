"""Split-KV, GQA-aware decode attention for virtually contiguous KV (Triton; imported lazily).

Grid ``(B, Hk, num_splits)``: one program handles *all* ``Hq / Hk`` query heads that share one
KV head, so each K/V tile is read from HBM once per group, over one contiguous span of the
slot's rows. A second kernel merges the splits by their log-sum-exp. Row offsets are 64-bit
(``slot * slot_stride`` exceeds 2^31 elements on large caches). The cache is passed as an element
offset from ``q`` (see :func:`~vattn.core.ops.checks.anchor_delta`). Graph-safe: ``num_splits`` is a
function of host-known sizes only and the per-request span is computed on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .checks import anchor_delta

__all__ = ["TritonDecodeConfig", "decode_triton", "choose_num_splits", "DEFAULT_CONFIG"]


@dataclass(frozen=True, slots=True)
class TritonDecodeConfig:
    """Tuning knobs (``tools/gpu/ops.sh`` sweeps them on the H200 and prints the best).

    block_n : keys per tile. num_warps / num_stages : Triton launch options.
    target_ctas : aim for at least this many programs (a few waves of the GPU's SMs).
    min_split_tokens : never split a request into spans shorter than this.
    max_splits : upper bound on splits (size of the merge buffers).
    """

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    target_ctas: int = 4 * 132
    min_split_tokens: int = 256
    max_splits: int = 64


DEFAULT_CONFIG = TritonDecodeConfig()


def choose_num_splits(batch: int, kv_heads: int, max_seqlen_k: int, cfg: TritonDecodeConfig) -> int:
    """Splits per request so that ``batch * kv_heads * splits`` fills the GPU (host ints only)."""
    groups = max(1, batch * kv_heads)
    want = -(-cfg.target_ctas // groups)
    by_len = max(1, -(-max_seqlen_k // cfg.min_split_tokens))
    return int(max(1, min(want, by_len, cfg.max_splits)))


@triton.jit
def _split_kernel(Q, k_delta, v_delta, Slots, Seqlens, Out, Lse,
                  stride_qb, stride_qh, stride_ks, stride_kt, stride_vs, stride_vt,
                  stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                  scale_log2, num_splits,
                  QPK: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    slot = tl.load(Slots + b).to(tl.int64)
    seqlen = tl.load(Seqlens + b).to(tl.int32)
    span = tl.cdiv(tl.cdiv(seqlen, num_splits), BLOCK_N) * BLOCK_N
    start = split * span
    end = tl.minimum(start + span, seqlen)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < QPK
    mask_d = offs_d < HEAD_D
    heads = kvh * QPK + offs_h
    q_ptr = Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr, mask=mask_h[:, None] & mask_d[None, :], other=0.0)   # [BLOCK_H, BLOCK_D]

    k_base = Q + k_delta + slot * stride_ks + kvh * HEAD_D     # K, V addressed from q (mapped)
    v_base = Q + v_delta + slot * stride_vs + kvh * HEAD_D
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        rows = offs_n.to(tl.int64)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_base + rows[:, None] * stride_kt + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + rows[:, None] * stride_vt + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale_log2                            # [BLOCK_H, BLOCK_N]
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    mask_o = mask_h[:, None] & mask_d[None, :]
    if DIRECT:
        o_ptr = Out + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptr, o.to(Out.dtype.element_ty), mask=mask_o)
    else:
        o_ptr = (Out + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh
                 + split * stride_os + offs_d[None, :])
        tl.store(o_ptr, o, mask=mask_o)
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))    # log2 domain
        tl.store(Lse + b.to(tl.int64) * stride_lb + heads * stride_lh + split, lse, mask=mask_h)


@triton.jit
def _merge_kernel(Part, Lse, Out, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                  stride_ob, stride_oh, num_splits,
                  HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
    lse = tl.load(Lse + b * stride_lb + h * stride_lh + offs_s, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.where(mask_s & (lse > float("-inf")), tl.exp2(lse - m), 0.0)   # [BLOCK_S]
    part = tl.load(Part + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps
                   + offs_d[None, :], mask=mask_s[:, None] & (offs_d[None, :] < HEAD_D), other=0.0)
    o = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_d, o.to(Out.dtype.element_ty),
             mask=offs_d < HEAD_D)


def decode_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
                  slots: torch.Tensor, seqlens: torch.Tensor, max_seqlen_k: int, scale: float,
                  out: torch.Tensor, config: TritonDecodeConfig = DEFAULT_CONFIG,
                  num_splits: int | None = None) -> torch.Tensor:
    """Decode ``q [B, Hq, D]`` against ``k_cache/v_cache [slots, rows, Hk, D]`` into ``out``.

    ``seqlens[b] >= 1`` keys of slot ``slots[b]`` are read. ``num_splits`` overrides the heuristic
    (:func:`choose_num_splits`). Inputs are assumed validated by :func:`vattn.core.ops.decode`.
    """
    batch, hq, dim = q.shape
    hk = k_cache.shape[2]
    qpk = hq // hk
    splits = num_splits or choose_num_splits(batch, hk, int(max_seqlen_k), config)
    block_d = triton.next_power_of_2(dim)
    block_h = max(16, triton.next_power_of_2(qpk))
    common = dict(QPK=qpk, HEAD_D=dim, BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_N=config.block_n,
                  num_warps=config.num_warps, num_stages=config.num_stages)
    ks, kt = k_cache.stride(0), k_cache.stride(1)
    vs, vt = v_cache.stride(0), v_cache.stride(1)
    kd, vd = anchor_delta(k_cache, q), anchor_delta(v_cache, q)
    if splits == 1:
        _split_kernel[(batch, hk, 1)](
            q, kd, vd, slots, seqlens, out, out,
            q.stride(0), q.stride(1), ks, kt, vs, vt, out.stride(0), out.stride(1), 0, 0, 0,
            float(scale) * 1.4426950408889634, 1, DIRECT=True, **common)
        return out
    part = torch.empty((batch, hq, splits, dim), dtype=torch.float32, device=q.device)
    lse = torch.empty((batch, hq, splits), dtype=torch.float32, device=q.device)
    _split_kernel[(batch, hk, splits)](
        q, kd, vd, slots, seqlens, part, lse,
        q.stride(0), q.stride(1), ks, kt, vs, vt, part.stride(0), part.stride(1), part.stride(2),
        lse.stride(0), lse.stride(1), float(scale) * 1.4426950408889634, splits,
        DIRECT=False, **common)
    _merge_kernel[(batch, hq)](
        part, lse, out, part.stride(0), part.stride(1), part.stride(2), lse.stride(0),
        lse.stride(1), out.stride(0), out.stride(1), splits,
        HEAD_D=dim, BLOCK_D=block_d, BLOCK_S=max(2, triton.next_power_of_2(splits)), num_warps=4)
    return out
