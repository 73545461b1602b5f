"""``VattnBlockTables``: vLLM 0.26.0's V2 ``BlockTables`` in vattn's one-page-per-request form.

The V2 runner builds its ``BlockTables`` inside ``initialize_kv_cache``; :mod:`.gpu_hooks` has it
build this subclass instead. vLLM's own bookkeeping (``num_blocks``, the staged block ids) is
kept as is, so everything that reads it still works; what attention sees is replaced:

* ``append_block_ids`` -> also tells the runtime how many blocks the request holds now;
* ``apply_staged_writes`` (once per step, before ``prepare_inputs``) -> also maps the pages;
* ``gather_block_tables`` / ``compute_slot_mappings`` -> the slot forms of
  :class:`~.slot_tables.SlotTables` (persistent buffers, so captured CUDA graphs stay valid);
* ``get_dummy_block_tables`` -> padding slot, and the dummy ``seq_lens`` clamped to the padding
  slot's mapped rows (dummy runs use ``seq_len = num_tokens // num_reqs``, which can exceed it).
"""

from __future__ import annotations

import torch
from vllm.v1.worker.gpu.block_table import BlockTables

from vattn.core.errors import UnsupportedError

from .gpu_runtime import GpuRuntime

__all__ = ["VattnBlockTables"]


class VattnBlockTables(BlockTables):
    """``BlockTables`` whose tables address vattn's virtual views.

    Parameters
    ----------
    runtime : GpuRuntime
        The worker's runtime (slots, pages, slot tables).
    seq_lens : torch.Tensor
        The runner's persistent ``input_buffers.seq_lens`` (``[max_num_reqs]`` int32).
    num_computed : numpy.ndarray, optional
        The runner's ``req_states.num_computed_tokens_np``: for a new request, set before its
        blocks arrive, the tokens its prefix-cache hit covers (whole blocks).
    **kwargs
        vLLM's ``BlockTables`` arguments, unchanged.
    """

    def __init__(self, *, runtime: GpuRuntime, seq_lens: torch.Tensor, num_computed=None, **kwargs):
        super().__init__(**kwargs)
        if self.num_kv_cache_groups != 1 or self.cp_size != 1:
            raise UnsupportedError(f"vattn needs one KV cache group without context parallelism, got "
                                   f"{self.num_kv_cache_groups} groups, cp_size={self.cp_size}")
        if self.blocks_per_kv_block != [1]:   # num_blocks would count kernel blocks, not page-sets
            raise UnsupportedError(f"vattn needs the kernel block size to equal the block size, got "
                                   f"{self.kernel_block_sizes} for {self.block_sizes}")
        self.runtime = runtime
        self._seq_lens = seq_lens
        self._num_computed = num_computed

    def append_block_ids(self, req_index: int, new_block_ids: tuple[list[int], ...],
                         overwrite: bool) -> None:
        super().append_block_ids(req_index, new_block_ids, overwrite)
        hits = 0
        if overwrite and self._num_computed is not None:
            hits = int(self._num_computed[req_index]) // self.block_sizes[0]
        self.runtime.on_blocks(req_index, int(self.num_blocks.np[0, req_index]), new_request=overwrite,
                               block_ids=new_block_ids[0], hits=hits)

    def apply_staged_writes(self) -> None:
        super().apply_staged_writes()
        self.runtime.apply()

    def gather_block_tables(self, idx_mapping: torch.Tensor, num_reqs_padded: int,
                            out=None, out_ptrs=None) -> tuple[torch.Tensor, ...]:
        if out is not None:
            raise UnsupportedError("vattn: gather_block_tables(out=...) (speculative decoding / PCP)")
        return (self.runtime.tables.gather_block_table(idx_mapping, num_reqs_padded),)

    def compute_slot_mappings(self, idx_mapping: torch.Tensor, query_start_loc: torch.Tensor,
                              positions: torch.Tensor, num_tokens_padded: int,
                              out: torch.Tensor | None = None) -> torch.Tensor:
        if out is not None:
            raise UnsupportedError("vattn: compute_slot_mappings(out=...) (speculative decoding / PCP)")
        return self.runtime.tables.compute_slot_mapping(idx_mapping, query_start_loc, positions,
                                                        num_tokens_padded)

    def get_dummy_block_tables(self, num_reqs: int) -> tuple[torch.Tensor, ...]:
        self._seq_lens[:num_reqs].clamp_(max=self.runtime.padding_tokens)
        return (self.runtime.tables.dummy_block_table(num_reqs),)

    def get_dummy_slot_mappings(self, num_tokens: int) -> torch.Tensor:
        return self.runtime.tables.dummy_slot_mapping(num_tokens)
