"""The FlexAttention paged baseline reads the same values as the vattn views (CPU, eager)."""

import pytest
import torch

from vattn.bench.flex_paged import FLEX_PAGE, flex_paged_runner
from vattn.bench.paged_baselines import paged_copy
from vattn.core.ops import decode, prefill
from vattn.core.ops.synthetic import group_views

pytest.importorskip("torch.nn.attention.flex_attention")


@pytest.mark.parametrize("q_len,causal", [(1, False), (5, True)])
def test_flex_paged_matches_vattn_reference(q_len, causal):
    g = torch.Generator().manual_seed(q_len)
    k, v, _ = group_views(slots=4, rows_per_slot=512, group_size=2, kv_heads=2, head_dim=16,
                          dtype=torch.float32, layer=1, generator=g)
    slots = torch.tensor([3, 0, 2])
    lens = torch.tensor([300, 7, 129], dtype=torch.int32)
    q = torch.randn(3 * q_len, 4, 16, generator=g)
    paged = paged_copy(k, v, slots, 300, page=FLEX_PAGE)
    got = flex_paged_runner(paged, q, lens, q_len=q_len, scale=0.25, causal=causal, compiled=False)()
    if q_len == 1:
        want = decode(q, k, v, slots=slots, seqlens=lens, max_seqlen_k=300, scale=0.25)
    else:
        cu = torch.arange(4, dtype=torch.int32) * q_len
        want = prefill(q, k, v, cu_seqlens_q=cu, slots=slots, seqlens_k=lens, max_seqlen_q=q_len,
                       max_seqlen_k=300, scale=0.25, causal=causal)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_flex_paged_rejects_other_page_sizes():
    k, v, _ = group_views(slots=2, rows_per_slot=64, group_size=1, kv_heads=1, head_dim=16,
                          dtype=torch.float32)
    paged = paged_copy(k, v, torch.tensor([0]), 32, page=16)
    with pytest.raises(ValueError, match="page 128"):
        flex_paged_runner(paged, torch.randn(1, 1, 16), torch.tensor([32]), q_len=1, scale=1.0,
                          causal=False, compiled=False)
