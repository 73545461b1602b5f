"""Pure slot/region arithmetic for TGI batches (no TGI import, no torch state).

A request that holds vattn slot ``s`` owns rows ``s * C .. s * C + C - 1`` of every layer's
flattened KV view (``C = rows_per_slot``). TGI addresses the KV cache by *slots* (flat row
indices, one per token the router reserved) and by *block tables*. The adapter keeps TGI's
per-request slot count (so ``cu_slots`` and ``slot_indices`` stay valid) and rewrites the
values to ``s * C + arange(n)``, so TGI's own ``KVCache.store`` writes token ``t`` of the
request to row ``s * C + t``. Column 0 of the request's block-table row carries ``s``: a
one-entry block table whose page is the whole region.
"""

from __future__ import annotations

import torch

from vattn.core.errors import ContextLengthError, SlotError, TensorError

__all__ = ["region_slots", "rewrite_request_slots", "set_region_column", "regions_of",
           "needed_lengths", "capacity_tokens"]


def region_slots(region: int, num_tokens: int, *, rows_per_slot: int, max_context: int,
                 num_regions: int, device=None) -> torch.Tensor:
    """``region * rows_per_slot + arange(num_tokens)`` as int64 ``[num_tokens]``.

    TGI reserves slots in whole blocks (256 tokens with ``ATTENTION=flashdecoding``), so a
    request may reserve more than ``max_context``; entries ``t >= max_context`` point at row 0
    of the always-mapped padding slot (``num_regions * rows_per_slot``). They are never written:
    growing a request past ``max_context`` fails earlier, in ``ensure``.

    Raises
    ------
    SlotError
        ``region`` outside ``[0, num_regions)``.
    ContextLengthError
        ``num_tokens`` negative or ``max_context`` beyond ``rows_per_slot``.
    """
    if not 0 <= region < num_regions:
        raise SlotError(f"region must be in [0, {num_regions}), got {region}")
    if num_tokens < 0 or max_context > rows_per_slot:
        raise ContextLengthError(f"need 0 <= num_tokens and max_context <= rows_per_slot, got "
                                 f"{num_tokens}, {max_context}, {rows_per_slot}")
    start, used = region * rows_per_slot, min(num_tokens, max_context)
    out = torch.full((num_tokens,), num_regions * rows_per_slot, dtype=torch.int64, device=device)
    out[:used] = torch.arange(start, start + used, dtype=torch.int64, device=device)
    return out


def rewrite_request_slots(slots: torch.Tensor, cu_slots: torch.Tensor, index: int, region: int, *,
                          rows_per_slot: int, max_context: int, num_regions: int) -> None:
    """Overwrite request ``index``'s segment ``slots[cu_slots[i]:cu_slots[i+1]]`` in place.

    ``slots`` is TGI's ``[sum n_i]`` int64 batch tensor, ``cu_slots`` its ``[B + 1]`` offsets.
    """
    if slots.dtype != torch.int64:
        raise TensorError(f"Invalid dtype of slots: expected torch.int64, got {slots.dtype}")
    if not 0 <= index < cu_slots.numel() - 1:
        raise SlotError(f"request index must be in [0, {cu_slots.numel() - 1}), got {index}")
    lo, hi = int(cu_slots[index]), int(cu_slots[index + 1])
    slots[lo:hi] = region_slots(region, hi - lo, rows_per_slot=rows_per_slot,
                                max_context=max_context, num_regions=num_regions,
                                device=slots.device)


def set_region_column(block_tables: torch.Tensor, index: int, region: int) -> None:
    """Write ``region`` into column 0 of row ``index`` of TGI's ``[B, max_blocks]`` int32 table."""
    if block_tables.dim() != 2 or block_tables.shape[1] < 1:
        raise TensorError(f"Invalid shape of block_tables: expected [B, >=1], got {tuple(block_tables.shape)}")
    block_tables[index, 0] = region


def regions_of(block_tables: torch.Tensor) -> torch.Tensor:
    """``[B]`` region of each row: column 0 of the block table (int64)."""
    return block_tables[:, 0].to(torch.int64)


def needed_lengths(cache_lengths, input_lengths, *, speculative: int = 0) -> list[int]:
    """Tokens each request must have mapped before a forward: cache + input (+ speculative)."""
    if len(cache_lengths) != len(input_lengths):
        raise TensorError(f"cache_lengths and input_lengths differ in length: "
                          f"{len(cache_lengths)} vs {len(input_lengths)}")
    return [int(c) + int(n) + int(speculative) for c, n in zip(cache_lengths, input_lengths)]


def capacity_tokens(*, total_page_sets: int, tokens_per_page: float, max_slots: int,
                    max_context: int) -> int:
    """Tokens the router may admit so no running request can ever run out of pages.

    Every request may waste up to one partly filled page-set, so ``max_slots`` page-sets are
    held back; the result is also capped at ``max_slots * max_context``.
    """
    usable = max(total_page_sets - max_slots, 0)
    return min(int(usable * tokens_per_page), max_slots * max_context)
