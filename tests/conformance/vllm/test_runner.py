"""The vLLM conformance runner's own logic: each mode's engine arguments and environment, mode
names (no vLLM)."""

import pytest

from vattn.conformance.runners import process
from vattn.core.errors import ConfigError, VattnError


# -- each mode's engine arguments on the GPU (pure functions) ---------------------------------------
def _spec(mode, **over):
    return dict(mode=mode, device="cuda", model_dir="/m", dtype="bfloat16", max_model_len=1024,
                max_num_seqs=256, **over)


def test_engine_kwargs_of_the_three_gpu_modes():
    from vattn.conformance.workers.vllm import engine_kwargs
    stock, ceiling, vattn = (engine_kwargs(_spec(m)) for m in ("stock", "ceiling", "vattn"))
    assert stock["attention_backend"] == "FLASH_ATTN" and stock["block_size"] == 16
    assert ceiling["attention_backend"] == "FLASH_ATTN" and ceiling["block_size"] == 1024
    assert ceiling["num_gpu_blocks_override"] == 257
    assert vattn["attention_backend"] == "CUSTOM" and "block_size" not in vattn
    assert all(kw["enable_prefix_caching"] is False and kw["enforce_eager"] is False
               for kw in (stock, ceiling, vattn))
    exact = engine_kwargs(_spec("vattn-exact"))
    assert exact["attention_backend"] == "CUSTOM" and "block_size" not in exact
    forced = engine_kwargs(_spec("vattn", vattn_block_size=256, compilation_config={"cudagraph_mode": "PIECEWISE"}))
    assert forced["block_size"] == 256 and forced["compilation_config"]["cudagraph_mode"] == "PIECEWISE"


def test_runner_modes_subset():
    from vattn.conformance.runners.vllm import VllmRunner
    assert VllmRunner(device="cuda", modes=("stock", "vattn")).modes == ("stock", "vattn")
    with pytest.raises(ConfigError):
        VllmRunner(device="cpu", modes=("ceiling",))
    with pytest.raises(ConfigError):
        VllmRunner(device="cpu", modes=("vattn-exact",))


@pytest.mark.parametrize("mode, vattn, exact", [("stock", None, None), ("ceiling", None, None),
                                                ("vattn", "1", "0"), ("vattn-exact", "1", "1")])
def test_runner_sets_each_modes_environment(monkeypatch, mode, vattn, exact):
    from vattn.conformance.runners.vllm import VllmRunner
    seen = {}

    def fake_run_group(cmd, env, timeout_s, log=None):
        seen.update(vattn=env.get("VATTN_VLLM"), exact=env.get("VATTN_VLLM_EXACT"))
        raise VattnError("stop here")
    monkeypatch.setattr(process, "run_group", fake_run_group)
    monkeypatch.setenv("VATTN_VLLM", "1")           # an outer setting must not leak into stock
    monkeypatch.setenv("VATTN_VLLM_EXACT", "1")
    with pytest.raises(VattnError, match="stop here"):
        VllmRunner(device="cuda").run(mode, "/m", [[1, 2]], 2, device="cuda")
    assert seen == {"vattn": vattn, "exact": exact}


def test_runner_mode_again_names_its_base_mode():
    from vattn.conformance.runners.vllm import VllmRunner, _base
    assert _base("stock@2") == "stock" and _base("vattn-exact@3") == "vattn-exact"
    assert _base("stock") == "stock" and _base("stock@x") == "stock@x"
    runner = VllmRunner(device="cuda", modes=("stock", "stock@2"), log_dir=None)
    assert runner.modes == ("stock", "stock@2")
    with pytest.raises(ConfigError, match="stock@2"):
        VllmRunner(device="cuda", modes=("stock", "bogus@2"))


def test_runner_group_variant_sets_the_group_size_of_its_engine(monkeypatch):
    from vattn.conformance.runners import vllm as conf
    assert conf._base("vattn:g2") == "vattn" and conf._base("vattn-exact:g1@2") == "vattn-exact"
    assert conf._group("vattn:g2") == 2 and conf._group("vattn:g8@3") == 8
    assert conf._group("vattn") is None and conf._group("stock@2") is None
    for bad in ("stock:g2", "vattn:g0", "vattn:gx", "vattn:2", "vattn:g2@x"):
        assert conf._base(bad) == bad and conf._group(bad) is None
        with pytest.raises(ConfigError, match="vattn:gG"):
            conf.VllmRunner(device="cuda", modes=("stock", bad))
    seen = {}

    def fake_run(cmd, env, timeout_s, log=None):   # the engine's environment, no engine
        seen[env.get("VATTN_GROUP_SIZE")] = (env.get("VATTN_VLLM"), env.get("VLLM_ENABLE_V1_MULTIPROCESSING"))
        raise RuntimeError("stop here")
    monkeypatch.setattr(process, "run_group", fake_run)
    monkeypatch.delenv("VATTN_GROUP_SIZE", raising=False)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    runner = conf.VllmRunner(device="cuda", modes=("vattn", "vattn:g2"), log_dir=None,
                             engine_env={"VLLM_ENABLE_V1_MULTIPROCESSING": 0})
    for mode in runner.modes:
        with pytest.raises(RuntimeError, match="stop here"):
            runner.run(mode, "m", [[1, 2]], 1)
    assert seen == {None: ("1", "0"), "2": ("1", "0")}   # engine_env wins over this process's


def _engine_env(monkeypatch, name: str, modes) -> list:
    """``$name`` in the engine environment of each of ``modes`` (one vattn run each, stopped
    before any engine starts), with this process's own ``$name`` set to a value none should see."""
    from vattn.conformance.runners import vllm as conf
    seen = []

    def fake_run(cmd, env, timeout_s, log=None):
        seen.append(env.get(name))
        raise RuntimeError("stop here")
    monkeypatch.setattr(process, "run_group", fake_run)
    monkeypatch.setenv(name, "7")                            # this process's setting is not inherited
    runner = conf.VllmRunner(device="cuda", modes=tuple(modes), log_dir=None)
    for mode in runner.modes:
        with pytest.raises(RuntimeError, match="stop here"):
            runner.run(mode, "m", [[1, 2]], 1)
    return seen


def test_runner_staging_variant_turns_prefix_staging_on_or_off_in_its_engine(monkeypatch):
    from vattn.conformance.runners import vllm as conf
    assert conf._base("vattn:s0") == "vattn" and conf._base("vattn:g2:s1@2") == "vattn"
    assert conf._staging("vattn:g2:s0") == "0" and conf._group("vattn:g2:s0") == 2
    assert conf._staging("vattn:s1:p0") == "1" and conf._pack_mb("vattn:s1:p0") == 0
    assert conf._staging("vattn") is None and conf._staging("stock@2") is None
    for bad in ("stock:s0", "vattn:s2", "vattn:s0:s1", "vattn:g2:g4"):
        assert conf._base(bad) == bad
        with pytest.raises(ConfigError, match="vattn:s0"):
            conf.VllmRunner(device="cuda", modes=("stock", bad))
    assert _engine_env(monkeypatch, "VATTN_STAGE_PREFIXES", ("vattn", "vattn:s0", "vattn:s1")) == [None, "0", "1"]
    assert _engine_env(monkeypatch, "VATTN_DEFER_MAPPING", ("vattn", "vattn:d0", "vattn:s1:d1")) == [None, "0", "1"]
    assert _engine_env(monkeypatch, "VATTN_DEVICE_WAIT", ("vattn", "vattn:w0", "vattn:d1:w1")) == [None, "0", "1"]
    assert _engine_env(monkeypatch, "VATTN_FREE_RESERVE", ("vattn", "vattn:r0", "vattn:r256")) == [None, "0", "256"]
    assert _engine_env(monkeypatch, "VATTN_DRIVER_GIL", ("vattn", "vattn:h0", "vattn:h1", "vattn:h2")) == [None, "release", "hold", "hold-all"]
    assert _engine_env(monkeypatch, "VATTN_BATCH_COPIES", ("vattn", "vattn:b0", "vattn:h1:b1")) == [None, "0", "1"]
    assert _engine_env(monkeypatch, "VATTN_COLD_SLOTS", ("vattn", "vattn:c0", "vattn:c128:b1")) == [None, "0", "128"]
    # stock's FA3 kernel path as a variant (the servers take variants, not ``vattn-exact``)
    assert _engine_env(monkeypatch, "VATTN_VLLM_EXACT", ("stock", "vattn", "vattn:e1", "vattn:e0:b1",
                                                        "vattn-exact")) == [None, "0", "1", "0", "1"]


def test_runner_pack_variant_gives_its_engine_a_pack_budget(monkeypatch):
    from vattn.conformance.runners import vllm as conf
    assert conf._base("vattn:p1024") == "vattn" and conf._base("vattn:s0:p64@2") == "vattn"
    assert conf._pack_mb("vattn:p1024") == 1024 and conf._pack_mb("vattn") is None
    for bad in ("stock:p8", "vattn:p", "vattn:p8:p16", "vattn:px"):
        assert conf._base(bad) == bad
    assert _engine_env(monkeypatch, "VATTN_PACK_MB", ("vattn", "vattn:p1024")) == [None, "1024"]


def test_a_loop_profile_or_step_trace_labels_each_engine_with_its_mode(monkeypatch):
    from vattn.conformance.runners import vllm as conf
    runner = conf.VllmRunner(device="cuda", modes=("stock", "vattn:e1"), log_dir=None)
    spec = {"mode": "vattn", "run_name": "vattn:e1", "device": "cuda"}
    for name in ("VATTN_STEP_TRACE", "VATTN_ENGINE_PROFILE"):
        monkeypatch.delenv("VATTN_STEP_TRACE", raising=False)
        monkeypatch.delenv("VATTN_ENGINE_PROFILE", raising=False)
        assert "VATTN_RUN_NAME" not in runner.env_for(spec)
        monkeypatch.setenv(name, "/tmp/x-{pid}")
        assert runner.env_for(spec)["VATTN_RUN_NAME"] == "vattn:e1"
        assert runner.env_for({"mode": "stock", "run_name": "stock", "device": "cuda"})["VATTN_RUN_NAME"] == "stock"
