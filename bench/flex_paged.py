"""torch FlexAttention's paged attention (stock torch) as a baseline on the same KV data.

FlexAttention pages must match its KV block size, so this baseline runs at ``page=128`` (its
smallest well-supported block), not 16. The page table comes from :func:`paged_copy`'s shuffled
blocks, so the kernel reads exactly the values the vattn path reads. Compiled once per shape
(``torch.compile(flex_attention)``); ``compiled=False`` runs eager (CPU tests).
"""

from __future__ import annotations

import functools

import torch

__all__ = ["FLEX_PAGE", "flex_paged_runner"]

FLEX_PAGE = 128


@functools.cache
def _compiled():
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention, dynamic=False)


def flex_paged_runner(paged, q: torch.Tensor, seqlens: torch.Tensor, *, q_len: int, scale: float,
                      causal: bool, compiled: bool = True):
    """Zero-argument callable running paged FlexAttention; output ``[B * q_len, Hq, D]``.

    Parameters
    ----------
    paged : PagedKV
        ``page`` must be :data:`FLEX_PAGE`; ``block_table [B, per]`` of physical block ids.
    q : torch.Tensor
        ``[B * q_len, Hq, D]`` (every request has ``q_len`` queries, the last ones of its keys).
    seqlens : torch.Tensor
        ``[B]`` keys per request.
    """
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    batch, per = paged.block_table.shape
    n_blocks, page, hk, dim = paged.k.shape
    if page != FLEX_PAGE:
        raise ValueError(f"FlexAttention paged baseline needs page {FLEX_PAGE}, got {page}")
    dev = q.device
    pa = PagedAttention(n_blocks, page, batch, device=dev)
    table = paged.block_table.to(torch.int64)
    pa.page_table[:, :per] = table
    rows = torch.arange(batch, device=dev)[:, None].expand(batch, per)
    pa.physical_to_logical[rows, table] = torch.arange(per, device=dev)[None, :].expand(batch, per)
    kv_len = seqlens.to(torch.int64)
    offset = kv_len - q_len                                   # bottom-right causal alignment

    def mask(b, h, q_idx, kv_idx):
        return (q_idx + offset[b] >= kv_idx) if causal else (kv_idx >= 0)

    logical = create_block_mask(mask, batch, None, q_len, per * page, device=dev,
                                BLOCK_SIZE=(FLEX_PAGE, page))
    block_mask = pa.convert_logical_block_mask(logical, kv_len=kv_len)
    k = paged.k.view(1, n_blocks * page, hk, dim).transpose(1, 2)
    v = paged.v.view(1, n_blocks * page, hk, dim).transpose(1, 2)
    hq = q.shape[1]
    qq = q.view(batch, q_len, hq, dim).transpose(1, 2)       # [B, Hq, q_len, D]
    # the paged K/V have batch 1; flex broadcasts it over the query batch via the block mask
    k, v = k.expand(batch, hk, -1, dim), v.expand(batch, hk, -1, dim)
    fn = _compiled() if compiled else flex_attention

    def run():
        out = fn(qq, k, v, block_mask=block_mask, scale=scale, enable_gqa=hq != hk)
        return out.transpose(1, 2).reshape(batch * q_len, hq, dim)
    return run
