import json

import pytest

from vattn.conformance.engines import ENGINES, load_runner
from vattn.conformance.workloads import make_workload
from vattn.core.errors import ConfigError, UnsupportedError


def test_workloads_are_seeded_and_bounded():
    a = make_workload("decode-heavy", size="cpu", vocab_size=100, seed=3)
    b = make_workload("decode-heavy", size="cpu", vocab_size=100, seed=3)
    assert a.prompts == b.prompts
    assert all(1 <= t < 100 for p in a.prompts for t in p)
    c = make_workload("prefill-heavy", size="gpu", vocab_size=100, max_context=4096)
    assert all(len(p) + c.max_new_tokens <= 4096 for p in c.prompts)


def test_poisson_arrivals_increase():
    w = make_workload("poisson", size="cpu", vocab_size=50, seed=1)
    assert w.arrival_times[0] == 0.0
    assert all(x <= y for x, y in zip(w.arrival_times, w.arrival_times[1:]))


def test_bad_names_raise_typed_errors():
    with pytest.raises(ConfigError):
        make_workload("nope", size="cpu", vocab_size=10)
    with pytest.raises(ConfigError):
        load_runner("nope")


def test_engine_registry_names():
    assert set(ENGINES) == {"transformers", "vllm", "sglang", "tgi"}


def test_missing_engine_is_unsupported(monkeypatch):
    monkeypatch.setitem(ENGINES, "ghost", "vattn.adapters.ghost_engine_xyz:Runner")
    with pytest.raises(UnsupportedError, match="ghost"):
        load_runner("ghost")


def test_build_tiny_model(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    from vattn.conformance.models import build_model, model_shape
    out = build_model({"num_hidden_layers": 1, "hidden_size": 64, "num_attention_heads": 2,
                       "num_key_value_heads": 1, "head_dim": 32, "intermediate_size": 64,
                       "vocab_size": 128, "max_position_embeddings": 256}, str(tmp_path), seed=0)
    cfg = json.load(open(tmp_path / "config.json"))
    assert cfg["num_hidden_layers"] == 1 and (tmp_path / "model.safetensors").exists()
    assert model_shape(out).num_kv_heads == 1
    from safetensors.torch import load_file
    w = load_file(str(tmp_path / "model.safetensors"))["model.layers.0.mlp.up_proj.weight"]
    assert 0.015 < float(w.float().std()) < 0.025


def test_instantiate_matches_saved_weights(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    import torch
    from safetensors.torch import load_file

    from vattn.conformance.models import build_model, instantiate, saved_weights
    fields = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1,
              "head_dim": 32, "intermediate_size": 64, "vocab_size": 128, "max_position_embeddings": 256}
    on_disk = build_model(fields, str(tmp_path / "file"), seed=3)
    lazy = build_model(fields, str(tmp_path / "lazy"), seed=3, save_weights=False, num_layers=1)
    assert saved_weights(on_disk) and not saved_weights(lazy)
    assert json.load(open(tmp_path / "lazy" / "config.json"))["num_hidden_layers"] == 1
    saved = load_file(str(tmp_path / "file" / "model.safetensors"))
    built = instantiate(on_disk, device="cpu", dtype="float32").state_dict()
    assert saved.keys() == built.keys()
    assert all(torch.equal(saved[k], built[k]) for k in saved)


def test_num_requests_override():
    w = make_workload("decode-heavy", size="gpu", vocab_size=1000, num=3)
    assert len(w.prompts) == 3 and w.max_new_tokens == 256
    with pytest.raises(ConfigError):
        make_workload("identity", size="cpu", vocab_size=10, num=0)


def test_weight_and_kv_bytes_of_the_llama3_8b_shape():
    from vattn.conformance.models import PRESETS, kv_bytes_per_token, weight_bytes
    shape = PRESETS["llama3-8b-shape"]
    assert weight_bytes(shape) == 2 * 8_030_261_248      # Llama-3-8B's published parameter count
    assert weight_bytes(shape, elem_bytes=4) == 4 * 8_030_261_248
    assert kv_bytes_per_token(shape) == 32 * 2 * 8 * 128 * 2
