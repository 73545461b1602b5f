"""The vattn allocator is SGLang's own paged allocator: page ids from its free list, SGLang's
allocation functions and ChunkCache on top, physical capacity underneath."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.allocation", reason="sglang (CPU import set) not installed")

from tests.adapters.sglang._engine import PAGE, TOKEN_BYTES, Engine, new_req  # noqa: E402
from tests.core._util import count_calls  # noqa: E402
from vattn.adapters.sglang.allocator import VattnTokenAllocator  # noqa: E402
from vattn.adapters.sglang.pool import VattnMHATokenToKVPool, make_cache  # noqa: E402
from vattn.core.errors import ConfigError, UnsupportedError  # noqa: E402


def test_indices_are_sglang_page_ids_and_available_size_is_physical():
    e = Engine(radix=False, page_sets=12)
    assert e.alloc.available_size() == e.alloc.size == 12 * PAGE   # idle: SGLang's own check
    a = new_req(list(range(40)))
    e.admit([a])
    row = e.r2t.req_to_token[a.req_pool_idx, :40].tolist()
    pages = sorted({x // PAGE for x in row})
    assert len(pages) == 3 and 0 not in pages                      # page 0 is SGLang's padding
    assert all(x % PAGE == t % PAGE for t, x in enumerate(row))     # page-aligned per request
    assert e.alloc.available_size() == 9 * PAGE
    assert e.cache.metrics()["keys_held"] == 0                       # claimed, named one step later
    e.decode([a])
    assert e.cache.metrics()["keys_held"] == 3                       # each page id names a page-set
    e.finish(a)                                                      # ChunkCache frees everything
    assert e.alloc.available_size() == 12 * PAGE
    assert e.alloc.live_slots() == frozenset()
    e.pool.requests.prepare([], [])
    assert e.cache.metrics()["keys_held"] == 0
    e.cache.audit()


def test_out_of_pages_is_sglang_s_oom():
    e = Engine(radix=False, page_sets=3)
    e.admit([new_req(list(range(40)))])
    with pytest.raises(RuntimeError, match="out of memory"):
        e.admit([new_req(list(range(100, 120)))])                    # needs 2 pages, 0 left
    e.cache.audit()


def test_token_allocator_path_and_a_page_size_that_is_not_one_page_set_are_refused():
    e = Engine(radix=False)
    with pytest.raises(UnsupportedError, match="page_size > 1"):
        e.alloc.alloc(4)
    cache = make_cache(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float32,
                       max_requests=2, max_context=96, device="cpu", page_budget=1 << 20,
                       page_bytes=PAGE * TOKEN_BYTES)
    with pytest.raises(ConfigError, match=r"page_size 8 must equal the tokens of one vattn page-set \(16\)"):
        VattnMHATokenToKVPool.from_cache(cache, page_size=8)
    pool = VattnMHATokenToKVPool.from_cache(cache, page_size=PAGE)
    with pytest.raises(ConfigError, match="equal to the pool's 16"):
        VattnTokenAllocator(4 * 32, 32, torch.float32, "cpu", pool)
    with pytest.raises(ConfigError, match="page budget"):
        VattnTokenAllocator(10 ** 6, PAGE, torch.float32, "cpu", pool)
    with pytest.raises(ConfigError, match="VattnMHATokenToKVPool"):
        VattnTokenAllocator(64, PAGE, torch.float32, "cpu", SimpleNamespace())


@pytest.mark.parametrize("batch", [8])
def test_decode_step_host_work_does_not_grow_with_the_slot_count(batch):
    """SGLang's defaults give thousands of slots; a decode step's work must not scale with them
    (vattn's calls per step, counted: the regression guard for the slot-count bug)."""
    per_step = {}
    for reqs in (64, 1024):
        e = Engine(reqs=reqs, ctx=96, page_sets=5 * batch, radix=False, map_ahead=16)
        running = [new_req(list(range(7 * i, 7 * i + 20))) for i in range(batch)]
        e.admit(running)
        worst = 0
        for _ in range(20):
            worst = max(worst, count_calls(lambda: e.decode(running)))
            e.cache.wait()
        per_step[reqs] = worst
        e.cache.audit()
        e.cache.close()
    assert 0 < per_step[1024] <= per_step[64] * 1.1 + 5, per_step
