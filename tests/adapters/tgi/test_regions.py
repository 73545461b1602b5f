"""Pure slot/region arithmetic of the TGI adapter (no TGI needed)."""

import pytest
import torch

from vattn.adapters.tgi import regions
from vattn.core.errors import ContextLengthError, SlotError, TensorError


@pytest.mark.parametrize("region,n,rows", [(0, 5, 16), (3, 17, 97), (6, 0, 54)])
def test_region_slots_are_region_times_rows_plus_arange(region, n, rows):
    out = regions.region_slots(region, n, rows_per_slot=rows, max_context=rows, num_regions=7)
    assert out.dtype == torch.int64
    assert out.tolist() == [region * rows + t for t in range(n)]


def test_region_slots_errors():
    with pytest.raises(SlotError, match="region"):
        regions.region_slots(7, 1, rows_per_slot=8, max_context=8, num_regions=7)
    with pytest.raises(ContextLengthError):
        regions.region_slots(0, 9, rows_per_slot=16, max_context=17, num_regions=7)


def test_reservation_beyond_max_context_points_at_padding_slot():
    # TGI reserves whole 256-token blocks; rows past max_context go to the padding slot's row 0
    out = regions.region_slots(2, 12, rows_per_slot=10, max_context=8, num_regions=3)
    assert out.tolist() == [20 + t for t in range(8)] + [30] * 4


def test_rewrite_keeps_segment_lengths_and_other_requests():
    slots = torch.arange(100, 112, dtype=torch.int64)       # router slots, 3 requests
    cu = torch.tensor([0, 5, 7, 12])
    regions.rewrite_request_slots(slots, cu, 1, 2, rows_per_slot=10, max_context=10, num_regions=4)
    assert slots.tolist() == [100, 101, 102, 103, 104, 20, 21, 107, 108, 109, 110, 111]
    with pytest.raises(TensorError, match="int64"):
        regions.rewrite_request_slots(slots.int(), cu, 0, 0, rows_per_slot=10, max_context=10, num_regions=4)
    with pytest.raises(SlotError):
        regions.rewrite_request_slots(slots, cu, 3, 0, rows_per_slot=10, max_context=10, num_regions=4)


def test_block_table_column_zero_carries_region():
    bt = torch.full((3, 4), 9, dtype=torch.int32)
    regions.set_region_column(bt, 2, 5)
    assert regions.regions_of(bt).tolist() == [9, 9, 5]
    with pytest.raises(TensorError):
        regions.set_region_column(torch.zeros(3, dtype=torch.int32), 0, 1)


def test_needed_lengths_and_capacity():
    assert regions.needed_lengths([0, 4], [7, 1], speculative=2) == [9, 7]
    with pytest.raises(TensorError):
        regions.needed_lengths([0], [1, 2])
    # 10 page-sets, 4 slots held back for rounding waste, 8 tokens per page-set
    assert regions.capacity_tokens(total_page_sets=10, tokens_per_page=8.0, max_slots=4, max_context=100) == 48
    assert regions.capacity_tokens(total_page_sets=3, tokens_per_page=8.0, max_slots=4, max_context=100) == 0
    assert regions.capacity_tokens(total_page_sets=1000, tokens_per_page=8.0, max_slots=2, max_context=10) == 20
