"""Reference attention on virtually contiguous KV: fp32 math, any device (the CPU path).

Correctness only: it loops over requests on the host and reads ``seqlens`` / ``slots`` values,
so it synchronizes and is **not** CUDA-graph safe. Every other backend is tested against it.
"""

from __future__ import annotations

import torch

from ..errors import TensorError

__all__ = ["attend_one", "prefill_reference", "decode_reference"]


def attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
               causal: bool) -> torch.Tensor:
    """Attention of one request, fp32, GQA, causal mask aligned bottom-right.

    Parameters
    ----------
    q : torch.Tensor
        ``[Sq, Hq, D]``, the last ``Sq`` positions of the request.
    k, v : torch.Tensor
        ``[Sk, Hk, D]`` with ``Sk >= Sq`` when causal; ``Hq % Hk == 0``.
    scale : float
        Softmax scale.
    causal : bool
        Query ``i`` sees keys ``0 .. Sk - Sq + i``.

    Returns
    -------
    torch.Tensor
        ``[Sq, Hq, D]`` float32.
    """
    sq, hq, _ = q.shape
    sk, hk, _ = k.shape
    qf = q.float().transpose(0, 1)                                   # [Hq, Sq, D]
    kf = k.float().repeat_interleave(hq // hk, dim=1).transpose(0, 1)  # [Hq, Sk, D]
    vf = v.float().repeat_interleave(hq // hk, dim=1).transpose(0, 1)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * scale             # [Hq, Sq, Sk]
    if causal:
        qpos = torch.arange(sq, device=q.device).view(sq, 1) + (sk - sq)
        kpos = torch.arange(sk, device=q.device).view(1, sk)
        scores = scores.masked_fill(kpos > qpos, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, vf).transpose(0, 1)                    # [Sq, Hq, D]


def prefill_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
                      cu_seqlens_q: torch.Tensor, slots: torch.Tensor, seqlens_k: torch.Tensor,
                      scale: float, causal: bool, out: torch.Tensor) -> torch.Tensor:
    """Prefill / chunked prefill: request ``i`` owns q rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``.

    Its keys are rows ``0 .. seqlens_k[i] - 1`` of slot ``slots[i]`` (prefix plus new tokens,
    already stored). Shapes as in :func:`vattn.core.ops.prefill`.
    """
    cu, slot_ids, lens = cu_seqlens_q.tolist(), slots.tolist(), seqlens_k.tolist()
    _check_cu(cu, q.shape[0])
    _check_slots(slot_ids, k_cache.shape[0])
    chunks = [b - a for a, b in zip(cu, cu[1:])]
    _check_lengths("seqlens_k", lens, k_cache.shape[1], [n if causal else min(n, 1) for n in chunks])
    for i, (slot, sk) in enumerate(zip(slot_ids, lens)):
        q_i = q[cu[i]:cu[i + 1]]
        if q_i.shape[0] == 0:
            continue
        o = attend_one(q_i, k_cache[slot, :sk], v_cache[slot, :sk], scale=scale, causal=causal)
        out[cu[i]:cu[i + 1]] = o.to(out.dtype)
    return out


def decode_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
                     slots: torch.Tensor, seqlens: torch.Tensor, scale: float,
                     out: torch.Tensor) -> torch.Tensor:
    """One new token per request: ``q [B, Hq, D]`` attends to rows ``0 .. seqlens[b] - 1``."""
    slot_ids, lens = slots.tolist(), seqlens.tolist()
    _check_slots(slot_ids, k_cache.shape[0])
    _check_lengths("seqlens", lens, k_cache.shape[1], [1] * len(lens))
    for b, (slot, sk) in enumerate(zip(slot_ids, lens)):
        o = attend_one(q[b:b + 1], k_cache[slot, :sk], v_cache[slot, :sk], scale=scale, causal=False)
        out[b] = o[0].to(out.dtype)
    return out


# Value checks: this path reads slots and lengths on the host anyway, so a bad value is refused
# here instead of reading another slot's rows, past the view, or an empty softmax (NaN).
def _check_cu(cu: list[int], num_q: int) -> None:
    if cu[0] != 0 or cu[-1] > num_q or any(b < a for a, b in zip(cu, cu[1:])):
        raise TensorError(f"cu_seqlens_q must start at 0, not decrease and end at most at Nq={num_q}, "
                          f"got {cu}")


def _check_slots(slot_ids: list[int], num_slots: int) -> None:
    bad = [s for s in slot_ids if not 0 <= s < num_slots]
    if bad:
        raise TensorError(f"slots must be in [0, {num_slots}) (the cache view's slots), got {bad[0]}")


def _check_lengths(name: str, lens: list[int], rows: int, least: list[int]) -> None:
    for i, (n, low) in enumerate(zip(lens, least)):
        if not low <= n <= rows:
            raise TensorError(f"{name}[{i}] must be in [{low}, rows_per_slot={rows}] (at least its "
                              f"query rows), got {n}")
