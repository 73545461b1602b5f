"""Engine-free parts of the vLLM GPU path, on CPU tensors and the host VMM backend (no vLLM)."""

import json
from types import SimpleNamespace

import pytest
import torch

from vattn.adapters.vllm import gpu_layout as gl
from vattn.core.errors import ConfigError, UnsupportedError


# -- block size = tokens per page-set ------------------------------------------------------------
@pytest.mark.parametrize("heads, dim, group, expected", [(8, 128, 1, 512), (8, 128, 2, 256),
                                                         (8, 128, 4, 128), (2, 64, 2, 2048),
                                                         (4, 128, 4, 256)])
def test_tokens_per_page(heads, dim, group, expected):
    assert gl.tokens_per_page(num_kv_heads=heads, head_dim=dim, dtype=torch.bfloat16,
                              group_size=group) == expected


@pytest.mark.parametrize("heads, dim, group", [(8, 128, 8), (3, 96, 1), (5, 128, 1)])
def test_tokens_per_page_refuses_partial_tiles_and_fractions(heads, dim, group):
    with pytest.raises(ConfigError):
        gl.tokens_per_page(num_kv_heads=heads, head_dim=dim, dtype=torch.bfloat16, group_size=group)


def test_group_size_env(monkeypatch):
    monkeypatch.delenv("VATTN_GROUP_SIZE", raising=False)
    assert [gl.group_size_for(n) for n in (32, 2, 6, 7)] == [4, 2, 2, 1]
    monkeypatch.setenv("VATTN_GROUP_SIZE", "2")
    assert gl.group_size_for(32) == 2
    for bad in ("3", "x", "0"):
        monkeypatch.setenv("VATTN_GROUP_SIZE", bad)
        with pytest.raises(ConfigError):
            gl.group_size_for(32)


def test_cache_config_budget_is_num_blocks_page_sets():
    cfg = gl.cache_config(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                          num_blocks=37, max_num_reqs=5, max_model_len=1000, device="cpu", group_size=4)
    assert cfg.page_budget == 37 * 8 * gl.PAGE_BYTES       # 8 ranges of 2 MiB per block
    assert cfg.max_context == 1024 and cfg.max_slots == 5
    assert cfg.map_ahead_tokens == 128                     # one block (page-set) ahead


def test_exact_mode_reserves_spare_rows_and_env_is_checked(monkeypatch):
    kw = dict(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, num_blocks=37,
              max_num_reqs=5, device="cpu", group_size=4)
    assert gl.cache_config(max_model_len=1024, **kw).max_context == 1024
    assert gl.cache_config(max_model_len=1024, exact=True, **kw).max_context == 1152   # 1024 + 16 -> 9 pages
    assert gl.cache_config(max_model_len=1000, exact=True, **kw).max_context == 1024   # 1016 still fits 8
    monkeypatch.delenv(gl.EXACT_ENV, raising=False)
    assert gl.exact_kernel_path() is False
    monkeypatch.setenv(gl.EXACT_ENV, "1")
    assert gl.exact_kernel_path() is True
    monkeypatch.setenv(gl.EXACT_ENV, "yes")
    with pytest.raises(ConfigError, match="VATTN_VLLM_EXACT must be 0 or 1"):
        gl.exact_kernel_path()


def _vllm_config(**over):
    cfg = SimpleNamespace(
        cache_config=SimpleNamespace(enable_prefix_caching=False, cache_dtype="auto"),
        model_config=SimpleNamespace(enable_sleep_mode=False, enable_cumem_allocator=False,
                                     use_mla=False, dtype=torch.bfloat16),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1, prefill_context_parallel_size=1),
        attention_config=SimpleNamespace(backend=SimpleNamespace(name="CUSTOM")),
        speculative_config=None, kv_transfer_config=None)
    for path, value in over.items():
        obj, name = cfg, path.split(".")
        for part in name[:-1]:
            obj = getattr(obj, part)
        setattr(obj, name[-1], value)
    return cfg


@pytest.mark.parametrize("path, value, error", [
    ("model_config.enable_sleep_mode", True, ConfigError),
    ("model_config.enable_cumem_allocator", True, ConfigError),
    ("attention_config.backend", SimpleNamespace(name="FLASH_ATTN"), ConfigError),
    ("attention_config.backend", None, ConfigError),
    ("speculative_config", object(), UnsupportedError),
    ("kv_transfer_config", object(), UnsupportedError),
    ("parallel_config.decode_context_parallel_size", 2, UnsupportedError),
    ("cache_config.cache_dtype", "fp8", UnsupportedError),
])
def test_check_engine_config_refuses(path, value, error):
    gl.check_engine_config(_vllm_config())
    with pytest.raises(error):
        gl.check_engine_config(_vllm_config(**{path: value}))


def test_prefix_caching_is_accepted_on_gpu():
    gl.check_engine_config(_vllm_config(**{"cache_config.enable_prefix_caching": True}))


class FullAttentionSpec(SimpleNamespace):   # the name is what the check looks at
    pass


def _kv_config(block_size=128, groups=1, layers=32, page=None):
    spec = FullAttentionSpec(block_size=block_size, sliding_window=None, attention_chunk_size=None,
                             page_size_bytes=page or 2 * block_size * 8 * 128 * 2)
    group = SimpleNamespace(kv_cache_spec=spec, layer_names=[f"model.layers.{i}.attn" for i in range(layers)])
    return SimpleNamespace(kv_cache_groups=[group] * groups, num_blocks=10)


def test_check_kv_cache_config():
    page_set = 8 * gl.PAGE_BYTES
    gl.check_kv_cache_config(_kv_config(), block_size=128, page_set_bytes=page_set)
    with pytest.raises(ConfigError, match="block_size=128"):
        gl.check_kv_cache_config(_kv_config(block_size=16), block_size=128, page_set_bytes=page_set)
    with pytest.raises(UnsupportedError):
        gl.check_kv_cache_config(_kv_config(groups=2), block_size=128, page_set_bytes=page_set)
    with pytest.raises(ConfigError):
        gl.check_kv_cache_config(_kv_config(page=12345), block_size=128, page_set_bytes=page_set)
    other = _kv_config()
    other.kv_cache_groups[0].kv_cache_spec = SimpleNamespace(block_size=128)
    with pytest.raises(UnsupportedError):
        gl.check_kv_cache_config(other, block_size=128, page_set_bytes=page_set)


# -- the GPU conformance runner's engine arguments (pure functions) ---------------------------------
def _spec(mode, **over):
    return dict(mode=mode, device="cuda", model_dir="/m", dtype="bfloat16", max_model_len=1024,
                max_num_seqs=256, **over)


def test_engine_kwargs_of_the_three_gpu_modes():
    from vattn.adapters.vllm.worker import engine_kwargs
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
    from vattn.adapters.vllm.conformance import VllmRunner
    assert VllmRunner(device="cuda", modes=("stock", "vattn")).modes == ("stock", "vattn")
    with pytest.raises(ConfigError):
        VllmRunner(device="cpu", modes=("ceiling",))
    with pytest.raises(ConfigError):
        VllmRunner(device="cpu", modes=("vattn-exact",))


@pytest.mark.parametrize("mode, vattn, exact", [("stock", None, None), ("ceiling", None, None),
                                                ("vattn", "1", "0"), ("vattn-exact", "1", "1")])
def test_runner_sets_each_modes_environment(monkeypatch, mode, vattn, exact):
    from vattn.adapters.vllm import conformance as vc
    seen = {}

    def fake_run_group(cmd, env, timeout_s, log=None):
        seen.update(vattn=env.get("VATTN_VLLM"), exact=env.get("VATTN_VLLM_EXACT"))
        raise vc.VattnError("stop here")
    monkeypatch.setattr(vc, "_run_group", fake_run_group)
    monkeypatch.setenv("VATTN_VLLM", "1")           # an outer setting must not leak into stock
    monkeypatch.setenv("VATTN_VLLM_EXACT", "1")
    with pytest.raises(vc.VattnError, match="stop here"):
        vc.VllmRunner(device="cuda").run(mode, "/m", [[1, 2]], 2, device="cuda")
    assert seen == {"vattn": vattn, "exact": exact}


def test_waste_per_request_columns():
    from vattn.adapters.vllm.gpu_run import WORKLOADS, waste_per_request
    assert set(WORKLOADS) == {"decode-heavy", "prefill-heavy", "long-context", "shared-prefix", "multi-turn"}
    assert WORKLOADS["shared-prefix"] == (128, 4096 + 256, 128, 128)
    assert WORKLOADS["decode-heavy"] == (256, 512, 512, 256)
    assert waste_per_request("stock", max_model_len=1024, shortest=513, metrics=None) == 15 * 128 * 1024
    assert waste_per_request("ceiling", max_model_len=1024, shortest=513, metrics=None) == 511 * 128 * 1024
    layout = {"layout": {"worst_waste_bytes": 16 << 20}}
    assert waste_per_request("vattn", max_model_len=1024, shortest=513, metrics=layout) == 16 << 20


def test_throughput_report_has_the_three_columns(monkeypatch, tmp_path):
    from types import SimpleNamespace as NS

    from vattn.adapters.vllm import gpu_run
    from vattn.conformance.protocol import RunResult
    metrics = {"layout": {"worst_waste_bytes": 16 << 20}, "apply_step_us": {"mean_us": 50.0, "count": 10},
               "ensure_us": {"mean_us": 20.0, "count": 10}, "pages_mapped_on_demand": 64}

    def fake_run_all(runner, model, prompts, new, *, logprobs):
        assert runner.modes == ("stock", "vattn", "ceiling") and len(prompts) == 8
        return {m: RunResult([[1] * new] * len(prompts), None, s, 8 * 65536, 8 * new,
                             {"init_s": 50.0, "vattn_metrics": metrics if m == "vattn" else None})
                for m, s in (("stock", 27.5), ("ceiling", 27.0), ("vattn", 27.2))}, {}
    monkeypatch.setattr(gpu_run, "_run_all", fake_run_all)
    monkeypatch.setattr(gpu_run, "_config_only_model", lambda path, fields: str(tmp_path))
    monkeypatch.setattr("vattn.conformance.models.random_prompts", lambda n, l, **kw: [[1] * 4] * n)
    report = gpu_run.stage_throughput(NS(workload="long-context", models=str(tmp_path), out=str(tmp_path)))
    rows = report["rows"]
    assert report["ok"] and rows["vattn"]["ratio"] == round(27.5 / 27.2, 4)
    assert rows["vattn"]["worst_waste_MiB_per_request"] == 16.0
    assert rows["ceiling"]["worst_waste_MiB_per_request"] == 255 * 0.125     # (65792 - 65537) tokens
    assert rows["stock"]["worst_waste_MiB_per_request"] == 15 * 0.125
    assert rows["vattn"]["vmm_critical_path"]["apply_total_ms"] == 0.5


def test_identity_report_compares_each_mode_with_stock_and_vattn_with_the_ceiling(monkeypatch, tmp_path):
    from types import SimpleNamespace as NS

    from vattn.adapters.vllm import gpu_run
    from vattn.conformance.protocol import RunResult
    base = [[(7 * i + j) % 50 + 3 for j in range(6)] for i in range(4)]
    tied = [row[:] for row in base]
    tied[2][4] = 1                                        # one late divergence, at a near-tie

    def logprobs(rows):
        return [[{t: -0.5, (1 if t != 1 else base[i][k]): -0.52} for k, t in enumerate(row)]
                for i, row in enumerate(rows)]

    seen_env = []

    def fake_run_all(runner, model, prompts, new, *, logprobs):
        assert runner.modes == ("stock", "vattn-exact", "vattn", "ceiling")
        seen_env.append(runner.engine_env)
        rows = {"stock": base, "vattn-exact": base, "vattn": tied, "ceiling": tied}
        return {m: RunResult(r, logprobs_of[m], 1.0, 10, 24, {"vattn_metrics": {"m": m}})
                for m, r in rows.items()}, {}
    logprobs_of = {m: logprobs(r) for m, r in {"stock": base, "vattn-exact": base, "vattn": tied,
                                                "ceiling": tied}.items()}
    monkeypatch.setattr(gpu_run, "_run_all", fake_run_all)
    monkeypatch.setattr(gpu_run, "_free_cuda", lambda: None)
    monkeypatch.setattr("vattn.conformance.models.build_model", lambda *a, **kw: str(tmp_path))
    monkeypatch.setattr("vattn.conformance.models.check_not_degenerate", lambda ids: {"ok": True})
    monkeypatch.delenv("VATTN_IDENTITY_MODES", raising=False)
    monkeypatch.delenv("VATTN_IDENTITY_INPROC", raising=False)
    report = gpu_run.stage_identity(NS(models=str(tmp_path), out=str(tmp_path)))
    assert report["ok"]
    assert report["vattn-exact_vs_stock"]["exact"] and report["vattn_vs_ceiling"]["exact"]
    assert not report["vattn_vs_stock"]["exact"] and report["vattn_vs_stock"]["near_ties"] == 1
    assert report["vattn_vs_stock"]["first_divergence"] == [None, None, 4, None]
    assert report["same_path_exact"] == {"vattn-exact_vs_stock": True, "vattn_vs_ceiling": True}
    assert report["vattn_metrics"] == {"m": "vattn"} and report["vattn-exact_metrics"] == {"m": "vattn-exact"}
    assert report["exact_pairs"] == {"vattn-exact_vs_stock": True, "vattn_vs_stock": False,
                                     "ceiling_vs_stock": False, "vattn_vs_vattn-exact": False,
                                     "ceiling_vs_vattn-exact": False, "ceiling_vs_vattn": True}
    assert report["inproc"] and seen_env == [{"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}]


def test_jit_during_inference_reads_vllms_monitor_lines(tmp_path):
    from vattn.adapters.vllm.gpu_report import jit_during_inference
    log = tmp_path / "engine.log"
    log.write_text(
        "(EngineCore pid=1) INFO [jit_monitor.py:79] Kernel JIT monitor activated; monitored JIT"
        " compilations during inference will use mode=warn.\n"
        "(EngineCore pid=1) WARNING [jit_monitor.py:135] Triton kernel JIT compilation during"
        " inference: _slot_mapping_kernel. This causes a latency spike; consider extending warmup\n")
    assert jit_during_inference(str(log)) == ["_slot_mapping_kernel"]
    log.write_text("(EngineCore pid=1) INFO [jit_monitor.py:79] Kernel JIT monitor activated\n")
    assert jit_during_inference(str(log)) == []
    assert jit_during_inference(str(tmp_path / "missing.log")) is None
    assert jit_during_inference(None) is None


def test_runner_mode_again_names_its_base_mode():
    from vattn.adapters.vllm.conformance import VllmRunner, _base
    assert _base("stock@2") == "stock" and _base("vattn-exact@3") == "vattn-exact"
    assert _base("stock") == "stock" and _base("stock@x") == "stock@x"
    runner = VllmRunner(device="cuda", modes=("stock", "stock@2"), log_dir=None)
    assert runner.modes == ("stock", "stock@2")
    with pytest.raises(ConfigError, match="stock@2"):
        VllmRunner(device="cuda", modes=("stock", "bogus@2"))


def test_runner_group_variant_sets_the_group_size_of_its_engine(monkeypatch):
    from vattn.adapters.vllm import conformance as conf
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
    monkeypatch.setattr(conf, "_run_group", fake_run)
    monkeypatch.delenv("VATTN_GROUP_SIZE", raising=False)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    runner = conf.VllmRunner(device="cuda", modes=("vattn", "vattn:g2"), log_dir=None,
                             engine_env={"VLLM_ENABLE_V1_MULTIPROCESSING": 0})
    for mode in runner.modes:
        with pytest.raises(RuntimeError, match="stop here"):
            runner.run(mode, "m", [[1, 2]], 1)
    assert seen == {None: ("1", "0"), "2": ("1", "0")}   # engine_env wins over this process's


_RULE = "  ".join(["-" * 55] + ["-" * 12] * 10) + "  "
_HEAD = ["Name", "Self CPU %", "Self CPU", "CPU total %", "CPU total", "CPU time avg", "Self CUDA",
         "Self CUDA %", "CUDA total", "CUDA time avg", "# of Calls"]


def _table(rows):
    """A torch profiler key_averages table as vLLM writes it (right-aligned, fixed columns)."""
    def line(cells):
        return "  ".join([f"{cells[0]:>55}"] + [f"{c:>12}" for c in cells[1:]]) + "  "
    body = [line([n if len(n) <= 55 else n[:52] + "...", "0.00%", "0.000us", "0.00%", "1.000us", "0.000us", cuda, "1.00%", cuda, "1.000us",
                  str(calls)]) for n, cuda, calls in rows]
    return "\n".join([_RULE, line(_HEAD), _RULE, *body, _RULE, "Self CPU time total: 1.234s",
                      "Self CUDA time total: 301.250ms", ""])


def test_profiler_table_parsed_into_kernel_families():
    from vattn.adapters.vllm.gpu_report import kernel_summary, parse_profiler_table
    text = _table([("void flash::FlashAttnFwdSm90<cutlass::bfloat16_t, 128...", "120.500ms", 2048),
                   ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "1.5s", 4096),
                   ("void vllm::reshape_and_cache_flash_kernel<__nv_bfl...", "850.000us", 2048),
                   ("_slot_mapping_kernel", "12.000us", 64),
                   ("_compute_slot_mappings_kernel", "3.000us", 64),      # stock vLLM's own
                   ("void at::native::indexSelectSmallIndex<int, long, ...", "1.000us", 64),
                   ("cudaGraphLaunch", "0.000us", 64),
                   ("triton_red_fused_add_rms_norm_0", "900ns", 10),
                   ("aten::mm", "6.000ms", 16),                          # an op: its kernel is a row too
                   ("execute_context_0(0)_generation_256(256)", "200.000ms", 16)])   # a step's span
    rows = parse_profiler_table(text)
    assert [r["calls"] for r in rows] == [2048, 4096, 2048, 64, 64, 64, 64, 10, 16, 16]
    assert rows[0]["name"].startswith("void flash::FlashAttnFwdSm90")
    assert rows[1]["self_cuda_us"] == 1.5e6 and rows[7]["self_cuda_us"] == 0.9
    summary = kernel_summary(rows, top=2)
    assert summary["families_us"] == {"attention": 120500.0, "gemm": 1.5e6, "kv store": 850.0,
                                      "other": 0.9, "slot tables": 16.0}
    assert [r["name"][:5] for r in summary["top"]] == ["nvjet", "void "]
    assert summary["total_us"] == round(120500 + 1.5e6 + 850 + 16 + 0.9, 1)


def test_profiler_table_errors_name_what_is_wrong():
    from vattn.adapters.vllm.gpu_report import parse_profiler_table
    with pytest.raises(ValueError, match="no rule lines"):
        parse_profiler_table("Self CUDA time total: 1s")
    with pytest.raises(ValueError, match="lacks a column"):
        parse_profiler_table("\n".join([_RULE, "  ".join(["Name"] * 11), _RULE, _RULE]))
    bad = _table([("k", "12 parsecs", 1)])
    with pytest.raises(ValueError, match="expected a time"):
        parse_profiler_table(bad)


def test_profiler_table_reads_torchs_own_header():
    """A real (CPU-only) torch table: the rule and header are found; no Self CUDA column."""
    from vattn.adapters.vllm.gpu_report import parse_profiler_table
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ones(8, 8) @ torch.ones(8, 8)
    table = prof.key_averages().table(sort_by="self_cpu_time_total")
    with pytest.raises(ValueError, match=r"Self CUDA.*header: \['Name', 'Self CPU %'"):
        parse_profiler_table(table)


def test_paired_stage_reports_per_round_ratios_and_renders(monkeypatch, tmp_path):
    from types import SimpleNamespace as NS

    from vattn.adapters.vllm import gpu_run, paired
    from vattn.bench import engine
    seen = {}

    def fake_run_paired(runner, modes, model, prompts, new, *, rounds, device, dtype):
        seen.update(modes=modes, rounds=rounds, mem=runner.engine_args["gpu_memory_utilization"])
        return {"stock": {"seconds_each": [11.0, 11.2, 10.9, 11.1], "init_s": 50.0, "vattn_metrics": None},
                "vattn": {"seconds_each": [10.9, 11.1, 11.0, 11.0], "init_s": 52.0,
                          "vattn_metrics": {"layout": {"worst_waste_bytes": 16 << 20}}}}
    monkeypatch.setattr(paired, "run_paired", fake_run_paired)
    monkeypatch.setattr(gpu_run, "_config_only_model", lambda path, fields: str(tmp_path))
    monkeypatch.setattr("vattn.conformance.models.random_prompts", lambda n, l, **kw: [[1] * 4] * n)
    monkeypatch.delenv("VATTN_PAIR", raising=False)
    monkeypatch.setenv("VATTN_ROUNDS", "4")
    monkeypatch.setenv("VATTN_PAIR_MEM", "0.4")
    report = gpu_run.stage_paired(NS(workload="decode-heavy", models=str(tmp_path), out=str(tmp_path)))
    assert seen == {"modes": ["stock", "vattn"], "rounds": 4, "mem": 0.4}
    assert report["paired"]["ratios"] == [round(11.0 / 10.9, 4), round(11.2 / 11.1, 4),
                                          round(10.9 / 11.0, 4), round(11.1 / 11.0, 4)]
    assert report["rows"]["stock"]["seconds"] == 11.05 and report["rows"]["vattn"]["seconds"] == 11.0
    assert report["rows"]["vattn"]["worst_waste_MiB_per_request"] == 16.0
    (tmp_path / "paired_decode-heavy.json").write_text(json.dumps(report))
    md = engine.markdown(engine.load_results(str(tmp_path)))
    row = next(l for l in md.splitlines() if l.startswith("| decode-heavy (paired)"))
    assert f"**{11.05 / 11.0:.4f}×**" in row and "not run" in row          # no ceiling engine
    assert f"median **{report['paired']['median_ratio']:.4f}**" in md
    rows = [l for l in md.splitlines() if l.startswith("| decode-heavy")]
    assert len(rows) == 1, rows        # the paired JSON is not read a second time as a throughput run


def test_paired_refuses_bad_mode_lists():
    from vattn.adapters.vllm.conformance import VllmRunner
    from vattn.adapters.vllm.paired import run_paired
    runner = VllmRunner(device="cuda", log_dir=None)
    for modes, rounds in ((["stock"], 2), (["stock", "stock"], 2), (["stock", "vattn"], 0)):
        with pytest.raises(ConfigError, match="two different modes|rounds must be"):
            run_paired(runner, modes, "m", [[1]], 1, rounds=rounds, device="cuda", dtype="bfloat16")


def test_paired_engine_gone_before_a_command_is_a_typed_error(tmp_path):
    import subprocess
    import sys

    from vattn.adapters.vllm import paired
    from vattn.core.errors import VattnError
    engine = paired._Engine.__new__(paired._Engine)      # a stand-in process that exits at once
    engine.mode, engine.folder, engine.log = "stock", str(tmp_path), str(tmp_path / "e.log")
    (tmp_path / "e.log").write_text("Traceback (most recent call last):\n  boom\n")
    engine._sink = open(tmp_path / "sink.log", "w")
    engine.proc = subprocess.Popen([sys.executable, "-c", "pass"], stdin=subprocess.PIPE, text=True,
                                   start_new_session=True)
    engine.proc.wait()
    with pytest.raises(VattnError, match="stock engine exited .0. before ready.json"):
        engine.wait_for("ready.json", 5)
    with pytest.raises(VattnError, match="boom"):
        for _ in range(64):      # the first writes may still land in the pipe's buffer
            engine.send("gen 0" + " " * 4096)
    engine.close()
