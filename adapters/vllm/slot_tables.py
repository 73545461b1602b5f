"""Block table and slot mapping in vattn's one-page-per-request form (engine-free, torch only).

vLLM's attention kernels address KV as ``cache[block_table[b, j], pos % block_size]``. vattn
hands them the layer view ``[max_slots + 1, rows_per_slot, H, D]`` as a paged cache whose page
is a whole slot region, so a request needs one block-table entry (its slot) and token ``p`` is
stored at flat row ``slot * rows_per_slot + p``. The tables live in persistent buffers (fixed
addresses), so CUDA graphs captured on them stay valid; padding rows point at the always-mapped
padding slot and padding tokens at ``-1`` (the store kernels skip negative rows).

Host side: :meth:`SlotTables.assign` / :meth:`clear` / :meth:`upload` (may copy host to device).
Device side, graph-safe to *replay* (they run eagerly before replay and write in place):
:meth:`gather_block_table`, :meth:`compute_slot_mapping`, the ``dummy_*`` fills.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from vattn.core.driver.cuda import CudaFence
from vattn.core.errors import SlotError
from vattn.core.uploads import FenceRing, upload_driver

__all__ = ["SlotTables", "PAD_ROW"]

PAD_ROW = -1   # vLLM's PAD_SLOT_ID: the store kernel skips these tokens
#: host staging buffers of :meth:`SlotTables.upload` (uploads in flight at once)
STAGING_RING = 4


class SlotTables:
    """Persistent per-step tables for one KV cache group.

    Parameters
    ----------
    max_num_reqs : int
        vLLM's request-state rows (``max_num_seqs``); row ``i`` is the runner's request index.
    max_num_tokens : int
        ``max_num_batched_tokens``: length of the slot-mapping buffer.
    rows_per_slot : int
        Rows of the flattened layer view owned by one slot.
    padding_slot : int
        The always-mapped slot (``max_slots``) that padding rows and unassigned indices read.
    device : torch.device | str
    driver : optional
        The cache's CUDA driver: the ring's fences are its ``record_fence`` (the GIL held where
        the driver holds it); where it keeps the GIL for the adapters' calls too
        (``gil_everywhere``: ``VATTN_DRIVER_GIL=hold-all``) the uploads are its
        ``copy_from_host`` instead of torch's ``copy_``, which releases the GIL and so may wait out
        another thread's switch interval. Without one: torch's ``copy_`` and events.
    """

    def __init__(self, *, max_num_reqs: int, max_num_tokens: int, rows_per_slot: int,
                 padding_slot: int, device, driver=None):
        self.rows_per_slot = rows_per_slot
        self.padding_slot = padding_slot
        self.device = torch.device(device)
        self.slot_of_index = np.full(max_num_reqs, padding_slot, dtype=np.int32)   # host truth
        self._slot_dev = torch.full((max_num_reqs,), padding_slot, dtype=torch.int32, device=device)
        # block_table: [max_num_reqs, 1] int32; slot_mapping: [1, max_num_tokens] int64
        self.block_table = torch.full((max_num_reqs, 1), padding_slot, dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((1, max_num_tokens), PAD_ROW, dtype=torch.int64, device=device)
        self._token_ids = torch.arange(max_num_tokens, dtype=torch.int32, device=device)
        self._dirty = False
        # host staging of the uploads: a ring of persistent (pinned, on CUDA) buffers, each
        # reused once the copy that last read it has run (its event), so no step allocates
        # pinned memory (``pin_memory()`` per upload showed as cudaHostAlloc calls in a serving
        # window) and an in-flight copy never sees a later step's table
        cuda = self.device.type == "cuda"
        self._staging = [torch.empty(max_num_reqs, dtype=torch.int32, pin_memory=cuda)
                         for _ in range(STAGING_RING)]
        self._ring = FenceRing(STAGING_RING)           # the fence of each buffer's last copy
        #: where fences come from (a driver's ``record_fence``: with the GIL held where it holds
        #: it; else torch's events) and whether the upload goes through the driver too
        through = cuda and driver is not None
        self._fences = driver.record_fence if through else (CudaFence if cuda else None)
        everywhere = upload_driver(driver, self.device)
        self._upload = everywhere.copy_from_host if everywhere is not None else None
        #: one Triton launch for the slot mapping (CUDA); the torch form elsewhere
        self.fused = self.device.type == "cuda"
        self.fused_error: str | None = None   # why the Triton kernel was given up, if it was
        if self.fused:
            self.warm_up()

    def warm_up(self) -> None:
        """Compile the Triton slot-mapping kernel now (host side, at engine start), so that no
        step pays a JIT compilation; on failure fall back to the torch form, loudly."""
        try:
            from .slot_kernels import warm_up
            warm_up(self.slot_mapping[0], self._slot_dev, rows_per_slot=self.rows_per_slot, pad=PAD_ROW)
        except Exception as exc:  # noqa: BLE001 - same policy as a failure at the first step
            self._give_up_fused(exc)

    def _give_up_fused(self, exc: Exception) -> None:
        self.fused, self.fused_error = False, f"{type(exc).__name__}: {exc}"[:300]
        warnings.warn(f"vattn: the Triton slot-mapping kernel failed ({self.fused_error}); "
                      "using the torch form (same result, more launches per step)")

    # -- host side -------------------------------------------------------------------------
    def assign(self, index: int, slot: int) -> None:
        """Request index ``index`` now owns vattn slot ``slot``."""
        if not 0 <= slot < self.padding_slot:
            raise SlotError(f"slot must be in [0, {self.padding_slot}), got {slot}")
        self.slot_of_index[index] = slot
        self._dirty = True

    def clear(self, index: int) -> None:
        """Index ``index`` holds no slot any more (its rows read the padding slot)."""
        self.slot_of_index[index] = self.padding_slot
        self._dirty = True

    def upload(self) -> None:
        """Copy the index -> slot table to the device if it changed (stream-ordered, async-safe:
        the copy reads a staging buffer of the ring that no copy in flight reads, never the
        live host array)."""
        if not self._dirty:
            return
        i = self._ring.claim()                          # waits if the device is a ring behind
        buf = self._staging[i]
        buf.numpy()[:] = self.slot_of_index
        if self._upload is not None:                    # the GIL held (hold-all)
            self._upload(self._slot_dev.data_ptr(), buf.data_ptr(), buf.nbytes)
        else:
            self._slot_dev.copy_(buf, non_blocking=True)
        if self._fences is not None:
            self._ring.read_by(i, self._fences)
        self._dirty = False

    @property
    def staging_waits(self) -> int:
        """Uploads that waited for a staging buffer."""
        return self._ring.waits

    # -- device side -------------------------------------------------------------------------
    def gather_block_table(self, idx_mapping: torch.Tensor, num_reqs_padded: int) -> torch.Tensor:
        """``[num_reqs_padded, 1]`` int32: the slot of each batch row; padding rows -> padding slot.

        ``idx_mapping``: ``[num_reqs]`` int32, batch row -> request index (vLLM's order).
        """
        n = idx_mapping.shape[0]
        col = self.block_table[:, 0]
        torch.index_select(self._slot_dev, 0, idx_mapping, out=col[:n])   # one kernel, in place
        if num_reqs_padded > n:
            col[n:num_reqs_padded].fill_(self.padding_slot)
        return self.block_table[:num_reqs_padded]

    def compute_slot_mapping(self, idx_mapping: torch.Tensor, query_start_loc: torch.Tensor,
                             positions: torch.Tensor, num_tokens_padded: int) -> torch.Tensor:
        """``[1, num_tokens_padded]`` int64 rows ``slot * rows_per_slot + position``; -1 elsewhere.

        Parameters
        ----------
        idx_mapping : ``[num_reqs]`` int32, batch row -> request index.
        query_start_loc : ``[>= num_reqs + 1]`` int32, non-decreasing token offsets of the rows.
        positions : ``[>= num_tokens_padded]`` int64, position of every scheduled token.

        No host synchronization: the token count is read on the device. On CUDA one Triton
        launch (:mod:`.slot_kernels`), elsewhere the torch form below (same result).
        """
        n = idx_mapping.shape[0]
        if self.fused:
            try:
                from .slot_kernels import slot_mapping_triton
                slot_mapping_triton(self.slot_mapping[0], idx_mapping, query_start_loc, positions,
                                    self._slot_dev, num_reqs=n, rows_per_slot=self.rows_per_slot,
                                    pad=PAD_ROW)
                return self.slot_mapping[:, :num_tokens_padded]
            except Exception as exc:  # noqa: BLE001 - e.g. Triton missing or failing to compile:
                self._give_up_fused(exc)   # the torch form computes the same table
        tokens = self._token_ids[:num_tokens_padded]
        ends = query_start_loc[1:n + 1]
        row = torch.searchsorted(ends, tokens, right=True)           # batch row of each token
        valid = row < n
        slots = self._slot_dev[idx_mapping.long()][row.clamp_(max=n - 1)]
        rows = slots.long() * self.rows_per_slot + positions[:num_tokens_padded]
        out = self.slot_mapping[0]
        out[:num_tokens_padded] = torch.where(valid, rows, PAD_ROW)
        out[num_tokens_padded:].fill_(PAD_ROW)
        return self.slot_mapping[:, :num_tokens_padded]

    def dummy_block_table(self, num_reqs: int) -> torch.Tensor:
        """``[num_reqs, 1]``: every row reads the padding slot (vLLM's dummy and capture runs)."""
        self.block_table[:num_reqs].fill_(self.padding_slot)
        return self.block_table[:num_reqs]

    def dummy_slot_mapping(self, num_tokens: int) -> torch.Tensor:
        """``[1, num_tokens]`` of -1 (whole buffer filled, like vLLM's dummy mapping)."""
        self.slot_mapping.fill_(PAD_ROW)
        return self.slot_mapping[:, :num_tokens]

