import pytest
import torch

from vattn.core import ConfigError, KVCacheConfig, KVLayout, layout_report


def _layout(**over):
    cfg = dict(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, max_slots=4,
               max_context=1000, group_size=4)
    cfg.update(over)
    return KVLayout.from_config(KVCacheConfig(**cfg), 2 << 20)


@pytest.mark.parametrize("group,tokens,waste_mib", [(1, 512, 64), (2, 256, 32), (4, 128, 16), (8, 64, 8), (32, 16, 2)])
def test_report_matches_design_table(group, tokens, waste_mib):
    rep = layout_report(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, group_size=group)
    assert rep.tokens_per_page == tokens
    assert rep.num_ranges * 2 == 64 // group
    assert waste_mib - 1 < rep.worst_waste_bytes / 2**20 <= waste_mib


def test_split_kv_is_the_papers_per_layer_layout():
    rep = layout_report(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, group_size=1,
                        split_kv=True)
    assert (rep.num_ranges, rep.tokens_per_page) == (64, 1024)
    assert rep.worst_waste_bytes / 2**20 > 127


def test_region_is_page_and_token_aligned_for_odd_token_sizes():
    lay = _layout(num_kv_heads=5, head_dim=24, group_size=1, dtype=torch.float16, max_context=997)
    assert lay.token_bytes == 2 * 5 * 24 * 2
    assert lay.region_bytes % lay.page_bytes == 0 and lay.region_bytes % lay.token_bytes == 0
    assert lay.rows_per_slot >= 997
    assert lay.pages_for(0) == 0 and lay.pages_for(1) == 1
    per_page = lay.page_bytes / lay.token_bytes
    assert lay.pages_for(int(per_page) + 1) == 2   # a token straddling the page boundary needs both


def test_layer_places_cover_every_offset_once():
    lay = _layout(group_size=4)
    seen = set()
    for layer in range(32):
        p = lay.place(layer)
        seen.add((p.k_range, p.k_offset)); seen.add((p.v_range, p.v_offset))
    assert len(seen) == 64
    with pytest.raises(ConfigError, match="layer must be in"):
        lay.place(32)


@pytest.mark.parametrize("bad,match", [
    (dict(group_size=3), "group_size must divide"),
    (dict(split_kv=True, group_size=2), "split_kv=True needs group_size=1"),
    (dict(max_slots=0), "max_slots must be a positive int"),
    (dict(page_budget=1.5), "fractional page_budget"),
    (dict(scrub="sometimes"), "scrub must be one of"),
    (dict(dtype=torch.int64), "dtype must be one of"),
    (dict(device="tpu"), "device must be"),
    (dict(map_ahead_tokens=-1), "map_ahead_tokens"),
])
def test_bad_config_is_a_typed_error(bad, match):
    with pytest.raises(ConfigError, match=match):
        _layout(**bad)


@pytest.mark.parametrize("layers,split,want", [(2, False, 1), (8, False, 1), (32, False, 4),
                                               (28, False, 4), (60, False, 10), (32, True, 1)])
def test_auto_group_size_bounds_the_ranges(layers, split, want):
    from vattn.core.config import MAX_AUTO_RANGES, auto_group_size
    assert auto_group_size(layers, split) == want
    cfg = KVCacheConfig(num_layers=layers, num_kv_heads=8, head_dim=128, max_slots=2,
                        max_context=1024, split_kv=split)
    assert cfg.group_size == want
    if not split:
        rep = layout_report(num_layers=layers, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                            group_size=cfg.group_size)
        assert rep.num_ranges <= MAX_AUTO_RANGES
        assert rep.worst_waste_bytes <= MAX_AUTO_RANGES * (2 << 20)
