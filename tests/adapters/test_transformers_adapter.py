"""transformers continuous batching on vattn (CPU, host backend, tiny random Llama)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from vattn.core import ops  # noqa: E402
from vattn.core.errors import ConfigError, UnsupportedError  # noqa: E402

SMALL = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1,
         "head_dim": 32, "intermediate_size": 64, "vocab_size": 256, "max_position_embeddings": 512}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from vattn.conformance.models import build_model
    return build_model(SMALL, str(tmp_path_factory.mktemp("m")), seed=0)


def _prompts(n, seed=1):
    from vattn.conformance.models import random_prompts
    return random_prompts(n, [5 + 7 * i for i in range(n)], vocab_size=256, seed=seed)


def _runner(**kw):
    from vattn.conformance.runners.transformers import TransformersRunner
    return TransformersRunner(block_size=16, max_batch_tokens=128, **kw)


def test_identical_to_paged_sdpa(model_dir):
    prompts = _prompts(5)
    r = _runner()
    stock, vattn = r.run("stock", model_dir, prompts, 12), r.run("vattn", model_dir, prompts, 12)
    assert vattn.extra["attn_implementation"] == "paged|vattn"
    assert stock.token_ids == vattn.token_ids
    assert all(len(t) == 12 for t in vattn.token_ids)


def test_preemption_when_out_of_pages(model_dir, monkeypatch):
    """A budget of 2 request page-sets (+ scratch) for 4 requests: allocations fail, the manager
    requeues (never a crash) and every request still finishes with the stock tokens."""
    from vattn.adapters.transformers.cache import VattnPagedCache
    refused = []
    stock_allocate = VattnPagedCache.allocate_blocks

    def allocate_blocks(self, n_blocks, request_id, allocated_blocks):
        granted = stock_allocate(self, n_blocks, request_id, allocated_blocks)
        if self.vattn is not None and granted is None:
            refused.append(request_id)
        return granted

    monkeypatch.setattr(VattnPagedCache, "allocate_blocks", allocate_blocks)
    prompts = _prompts(4, seed=2)
    page_set = 2 * 2 * (2 << 20) * 2  # two layer ranges x 2 MiB pages
    stock = _runner().run("stock", model_dir, prompts, 8)
    tight = _runner(vattn_options={"page_budget": page_set, "max_slots": 4}).run("vattn", model_dir, prompts, 8)
    assert refused, "the budget should have refused some allocation"
    assert tight.token_ids == stock.token_ids


def test_slots_released_and_reused(model_dir, monkeypatch):
    from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

    import vattn.adapters.transformers as vt
    from vattn.adapters.transformers.cache import VattnPagedCache
    used = set()
    stock_allocate = VattnPagedCache.allocate_blocks

    def allocate_blocks(self, n_blocks, request_id, allocated_blocks):
        granted = stock_allocate(self, n_blocks, request_id, allocated_blocks)
        if self.slot_of(request_id) is not None:
            used.add(self.slot_of(request_id))
        return granted

    monkeypatch.setattr(VattnPagedCache, "allocate_blocks", allocate_blocks)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="paged|sdpa")
    vt.enable(model, max_slots=3)
    gen = GenerationConfig(max_new_tokens=4, min_new_tokens=4, do_sample=False, eos_token_id=None)
    cb = ContinuousBatchingConfig(block_size=16, num_blocks=32, max_batch_tokens=128,
                                  allow_block_sharing=False, use_cuda_graph=False)
    for seed in (3, 4, 5):  # 3 batches of 2 requests through 2 usable slots: reuse or fail
        out = model.generate_batch(_prompts(2, seed=seed), generation_config=gen, continuous_batching_config=cb,
                                   persistent_manager=True, warmup=False)
        assert all(not o.error for o in out.values())
    cache = model._cached_continuous_batching_manager.batch_processor.cache
    assert cache.vattn is not None and not cache._slots
    assert len(used) == 2 and cache._trash not in used  # 6 requests, the same 2 slots
    model.destroy_cached_continuous_batching_manager()


def test_bad_option_and_unenabled_attention(model_dir):
    from transformers import AutoModelForCausalLM

    import vattn.adapters.transformers as vt
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="paged|sdpa")
    with pytest.raises(ConfigError, match="bogus"):
        vt.enable(model, bogus=1)
    from vattn.adapters.transformers.attention import vattn_paged_attention
    with pytest.raises(ConfigError, match="enable"):
        vattn_paged_attention(None, None, None, None, None, cache=object())


def test_bad_backend_is_unsupported_at_enable(model_dir):
    from transformers import AutoModelForCausalLM

    import vattn.adapters.transformers as vt
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="paged|sdpa")
    with pytest.raises(UnsupportedError, match="decode"):
        vt.enable(model, decode_backend="triton")  # CUDA-only backend on a CPU model
    with pytest.raises(UnsupportedError, match="unknown backend"):
        vt.enable(model, prefill_backend="nope")
    assert model.config._attn_implementation == "paged|sdpa"


def test_budget_too_small_is_config_error(model_dir):
    with pytest.raises(ConfigError):  # raised by the cache, surfaced as failed requests
        _runner(vattn_options={"page_budget": 2 << 20}).run("vattn", model_dir, _prompts(1), 2)


def test_version_gate(monkeypatch):
    import sys

    from vattn.adapters.transformers.version import check_version
    current = sys.modules["transformers"]  # the lazy module may have been re-created since import
    monkeypatch.setattr(current, "__version__", "5.25.0")
    with pytest.raises(UnsupportedError, match="5.25.0"):
        check_version()
    monkeypatch.setattr(current, "__version__", "5.17.3")
    assert check_version() == "5.17.3"


# -- paged|vattn runs vattn.core.ops on the cache's virtual layer views --------------------------
class _Spy:
    """Stands in for ``vattn.core.ops`` in the attention module: records calls, then delegates."""

    def __init__(self, corrupt=False):
        self.calls, self.corrupt = [], corrupt

    def store(self, k, v, *args, **kw):
        self.calls.append(("store", k, v, kw))
        return ops.store(k, v, *args, **kw)

    def prefill(self, q, k, v, **kw):
        self.calls.append(("prefill", k, v, kw))
        return ops.prefill(q, k, v, **kw)

    def decode(self, q, k, v, **kw):
        self.calls.append(("decode", k, v, kw))
        if self.corrupt:  # zero every request's cached V (rows below its length: mapped)
            for slot, n in zip(kw["slots"].tolist(), kw["seqlens"].tolist()):
                v[slot, :n - 1].zero_()
        return ops.decode(q, k, v, **kw)


def test_ops_get_the_cache_views(model_dir, monkeypatch):
    import vattn.adapters.transformers.attention as attention
    spy = _Spy()
    monkeypatch.setattr(attention, "ops", spy)
    prompts = _prompts(3)
    stock = _runner().run("stock", model_dir, prompts, 6)
    runner = _runner()
    vattn = runner.run("vattn", model_dir, prompts, 6)
    assert vattn.token_ids == stock.token_ids
    names = {c[0] for c in spy.calls}
    assert names == {"store", "prefill", "decode"}
    for name, k, v, kw in spy.calls:
        assert k.dim() == 4 and k.shape[2:] == (1, 32)  # [slots + 1, rows_per_slot, Hk, D] views
        assert kw["backend"] in ("reference", "torch")
    cache_views = {(c[1].data_ptr(), c[1].stride()) for c in spy.calls}
    assert len(cache_views) == 2  # one K view per layer, reused by store, prefill and decode


def test_corrupting_the_views_changes_the_output(model_dir, monkeypatch):
    import vattn.adapters.transformers.attention as attention
    prompts = _prompts(3, seed=7)
    stock = _runner().run("stock", model_dir, prompts, 8)
    monkeypatch.setattr(attention, "ops", _Spy(corrupt=True))
    corrupted = _runner().run("vattn", model_dir, prompts, 8)
    assert corrupted.token_ids != stock.token_ids


def test_plan_step_slots_and_lengths():
    from vattn.adapters.transformers.attention import plan_step
    rows_per_slot = 97
    # request 0: slot 5, positions 10..12 (3 tokens); request 1: slot 2, position 40; one padding sequence
    write_index = torch.tensor([5 * 97 + 10, 5 * 97 + 11, 5 * 97 + 12, 2 * 97 + 40], dtype=torch.int64)
    cu_q = torch.tensor([0, 3, 4, 4], dtype=torch.int32)
    cu_k = torch.tensor([0, 13, 54, 54], dtype=torch.int32)
    plan = plan_step(write_index, cu_q, cu_k, rows_per_slot)
    assert plan.slots.tolist() == [5, 2, 2] and plan.slots.dtype == torch.int64
    assert plan.seqlens_k.tolist() == [13, 41, 0] and plan.seqlens_k.dtype == torch.int32
