"""SGLang's ``torch_native`` attention math on vattn's virtually contiguous KV (the CPU path).

Conformance compares against SGLang's own ``torch_native`` backend, so this path runs the *same*
``torch.nn.functional.scaled_dot_product_attention`` call with the same argument shapes: per
request, ``[1, Hq, S, D]`` queries (extend: the new rows placed after ``prefix`` padding rows,
``is_causal=True`` on the square ``S x S`` problem), ``[1, Hk, S, D]`` keys/values and
``enable_gqa`` when ``Hq != Hk``. SDPA picks its kernel and its blocking from these shapes, so
the same values give the same bits. Keys are a strided view of the slot's rows ``0 .. S-1`` (no
``req_to_token`` gather, no copy): SGLang gathers into a dense ``[S, Hk, D]`` tensor, vattn's
rows have a larger token stride, and torch's CPU SDPA gives the same bits for both (checked by
``tests/adapters/sglang/test_backend.py`` with ``torch.equal``).

Host-side loops over requests, reads ``slots`` / lengths on the host: correctness only, not
CUDA-graph safe (like ``torch_native`` itself).
"""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention

__all__ = ["extend_sdpa", "decode_sdpa"]


def _kv(rows: torch.Tensor, base: int, n: int) -> torch.Tensor:
    """``[Hk, n, D]`` strided view of rows ``base .. base+n-1``."""
    return rows[base:base + n].movedim(0, 1)


def extend_sdpa(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, *,
                bases: list[int], prefix_lens: list[int], seq_lens: list[int], scale: float,
                out: torch.Tensor) -> torch.Tensor:
    """Prefill / chunked prefill of a batch, as SGLang's ``torch_native`` computes it.

    Parameters
    ----------
    q : torch.Tensor
        ``[N, Hq, D]``: each request's new tokens, requests concatenated in batch order.
    k_rows, v_rows : torch.Tensor
        ``[rows, Hk, D]`` flattened layer views; request ``i``'s token ``t`` is row
        ``bases[i] + t`` (all ``seq_lens[i]`` tokens already stored).
    bases, prefix_lens, seq_lens : list of int
        Host values per request; request ``i`` owns ``seq_lens[i] - prefix_lens[i]`` q rows.
    scale : float
        Softmax scale.
    out : torch.Tensor
        ``[N, Hq, D]``, written and returned.
    """
    enable_gqa = q.shape[1] != k_rows.shape[1]
    qh = q.movedim(0, 1)                                              # [Hq, N, D]
    start = 0
    for base, prefix, seq in zip(bases, prefix_lens, seq_lens):
        end = start + seq - prefix
        padded = torch.zeros((qh.shape[0], seq, qh.shape[2]), dtype=q.dtype, device=q.device)
        padded[:, prefix:, :] = qh[:, start:end, :]
        o = scaled_dot_product_attention(
            padded.unsqueeze(0), _kv(k_rows, base, seq).unsqueeze(0),
            _kv(v_rows, base, seq).unsqueeze(0), enable_gqa=enable_gqa, scale=scale,
            is_causal=True)
        out[start:end] = o.squeeze(0).movedim(1, 0)[prefix:]
        start = end
    return out


def decode_sdpa(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, *,
                bases: list[int], seq_lens: list[int], scale: float,
                out: torch.Tensor) -> torch.Tensor:
    """One new token per request: ``q [B, Hq, D]`` attends to rows ``bases[b] .. +seq_lens[b]``.

    Shapes and arguments as in :func:`extend_sdpa`; returns ``out`` (``[B, Hq, D]``).
    """
    enable_gqa = q.shape[1] != k_rows.shape[1]
    qh = q.movedim(0, 1)                                              # [Hq, B, D]
    for b, (base, seq) in enumerate(zip(bases, seq_lens)):
        o = scaled_dot_product_attention(
            qh[:, b:b + 1, :].unsqueeze(0), _kv(k_rows, base, seq).unsqueeze(0),
            _kv(v_rows, base, seq).unsqueeze(0), enable_gqa=enable_gqa, scale=scale,
            is_causal=False)
        out[b:b + 1] = o.squeeze(0).movedim(1, 0)
    return out
