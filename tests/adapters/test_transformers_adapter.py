"""transformers continuous batching on vattn (CPU, host backend, tiny random Llama)."""

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

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
    from vattn.adapters.transformers.conformance import TransformersRunner
    return TransformersRunner(block_size=16, max_batch_tokens=128, **kw)


def test_identical_to_paged_sdpa(model_dir):
    prompts = _prompts(5)
    r = _runner()
    stock, vattn = r.run("stock", model_dir, prompts, 12), r.run("vattn", model_dir, prompts, 12)
    assert vattn.extra["attn_implementation"] == "paged|vattn"
    assert stock.token_ids == vattn.token_ids
    assert all(len(t) == 12 for t in vattn.token_ids)


def test_preemption_when_out_of_pages(model_dir):
    """A budget of 2 request page-sets (+ scratch) for 4 requests forces waits; all finish."""
    prompts = _prompts(4, seed=2)
    page_set = 2 * 2 * (2 << 20) * 2  # two layer ranges x 2 MiB pages
    stock = _runner().run("stock", model_dir, prompts, 8)
    tight = _runner(vattn_options={"page_budget": page_set, "max_slots": 4}).run("vattn", model_dir, prompts, 8)
    assert tight.token_ids == stock.token_ids


def test_slots_released_and_reused(model_dir):
    from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

    import vattn.adapters.transformers as vt
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
