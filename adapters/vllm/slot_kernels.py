"""One Triton launch for the step's slot mapping (imported only when used, i.e. on CUDA).

:meth:`.slot_tables.SlotTables.compute_slot_mapping` in torch takes about ten small kernels per
step; stock vLLM's V2 runner takes one (its own Triton kernel). This is the one-launch form:
program ``r < num_reqs`` writes the rows of batch row ``r``'s tokens, the last program fills the
rest of the buffer with ``-1``. Reads the token offsets on the device: no host synchronization.

The integer arguments are not specialized (``do_not_specialize``): Triton would otherwise compile
one variant per class of value (``== 1``, divisible by 16, other) of ``num_reqs``, i.e. a JIT
compilation the first time a step's batch size falls into a new class — seen on the H200 inside
the timed part of an end-to-end run. :func:`warm_up` compiles the one variant at engine start.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["slot_mapping_triton", "warm_up"]


@triton.jit(do_not_specialize=["num_reqs", "buffer_len", "rows_per_slot"])
def _slot_mapping_kernel(IdxMapping, QueryStartLoc, Positions, SlotOfIndex, Out, num_reqs,
                         buffer_len, rows_per_slot, PAD: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    if r == num_reqs:                                 # the tail: every row after the last token
        tail = tl.load(QueryStartLoc + num_reqs)
        for i in range(tail, buffer_len, BLOCK):
            offs = i + tl.arange(0, BLOCK)
            tl.store(Out + offs, tl.full((BLOCK,), PAD, tl.int64), mask=offs < buffer_len)
    else:
        index = tl.load(IdxMapping + r)
        slot = tl.load(SlotOfIndex + index).to(tl.int64)
        start = tl.load(QueryStartLoc + r)
        end = tl.load(QueryStartLoc + r + 1)
        for i in range(start, end, BLOCK):
            offs = i + tl.arange(0, BLOCK)
            mask = offs < end
            pos = tl.load(Positions + offs, mask=mask).to(tl.int64)
            tl.store(Out + offs, slot * rows_per_slot + pos, mask=mask)


def slot_mapping_triton(out: torch.Tensor, idx_mapping: torch.Tensor, query_start_loc: torch.Tensor,
                        positions: torch.Tensor, slot_of_index: torch.Tensor, *, num_reqs: int,
                        rows_per_slot: int, pad: int, block: int = 1024) -> None:
    """Fill ``out`` (``[buffer_len]`` int64) in place; arguments as in ``compute_slot_mapping``."""
    _slot_mapping_kernel[(num_reqs + 1,)](
        idx_mapping, query_start_loc, positions, slot_of_index, out, num_reqs, out.shape[0],
        rows_per_slot, PAD=pad, BLOCK=block)


def warm_up(out: torch.Tensor, slot_of_index: torch.Tensor, *, rows_per_slot: int, pad: int) -> None:
    """Compile the kernel now (engine start) on tensors like the runner's, then refill ``out``
    with ``pad``: the first real step must not pay a JIT compilation."""
    device = out.device
    idx = torch.zeros(1, dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 1], dtype=torch.int32, device=device)
    pos = torch.zeros(out.shape[0], dtype=torch.int64, device=device)
    slot_mapping_triton(out, idx, qsl, pos, slot_of_index, num_reqs=1, rows_per_slot=rows_per_slot,
                        pad=pad)
    out.fill_(pad)
