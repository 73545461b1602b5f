"""The vLLM GPU stages' reports, computed without a GPU: waste and critical-path columns, the
identity verdicts, JIT lines, profiler tables, paired runs (no vLLM)."""

import json

import pytest
import torch

from vattn.core.errors import ConfigError


def _prompts(name, vocab_size, *, seed):
    """A workload's number of 4-token prompts (no multi-GB prompt lists in a unit test)."""
    from vattn.bench.gpu.workloads import WORKLOADS
    return [[1] * 4] * WORKLOADS[name][0]


def test_waste_per_request_columns():
    from vattn.bench.gpu.report import waste_per_request
    from vattn.bench.gpu.workloads import WORKLOADS
    assert set(WORKLOADS) == {"decode-heavy", "prefill-heavy", "long-context", "shared-prefix", "multi-turn",
                              "decode-light"}
    assert WORKLOADS["decode-light"] == (64, 1024, 256)
    assert WORKLOADS["shared-prefix"] == (128, 4096 + 256, 128)
    assert WORKLOADS["decode-heavy"] == (256, 512, 512)
    assert waste_per_request("stock", max_model_len=1024, shortest=513, metrics=None) == 15 * 128 * 1024
    assert waste_per_request("ceiling", max_model_len=1024, shortest=513, metrics=None) == 511 * 128 * 1024
    layout = {"layout": {"worst_waste_bytes": 16 << 20}}
    assert waste_per_request("vattn", max_model_len=1024, shortest=513, metrics=layout) == 16 << 20


def test_throughput_report_has_the_three_columns(monkeypatch, tmp_path):
    from types import SimpleNamespace as NS

    from vattn.bench.gpu import vllm_stages
    from vattn.conformance.protocol import RunResult
    metrics = {"layout": {"worst_waste_bytes": 16 << 20}, "apply_step_us": {"mean_us": 50.0, "count": 10},
               "ensure_us": {"mean_us": 20.0, "count": 10}, "pages_mapped_on_demand": 64}

    def fake_run_all(runner, model, prompts, new, *, logprobs):
        assert runner.modes == ("stock", "vattn", "ceiling") and len(prompts) == 8
        return {m: RunResult([[1] * new] * len(prompts), None, s, 8 * 65536, 8 * new,
                             {"init_s": 50.0, "vattn_metrics": metrics if m == "vattn" else None})
                for m, s in (("stock", 27.5), ("ceiling", 27.0), ("vattn", 27.2))}, {}
    monkeypatch.setattr(vllm_stages, "run_modes", fake_run_all)
    monkeypatch.setattr(vllm_stages, "llama_model", lambda path, fields: str(tmp_path))
    monkeypatch.setattr(vllm_stages, "workload_prompts", _prompts)
    report = vllm_stages.stage_throughput(NS(workload="long-context", models=str(tmp_path), out=str(tmp_path)))
    rows = report["rows"]
    assert report["ok"] and rows["vattn"]["ratio"] == round(27.5 / 27.2, 4)
    assert rows["vattn"]["worst_waste_MiB_per_request"] == 16.0
    assert rows["ceiling"]["worst_waste_MiB_per_request"] == 255 * 0.125     # (65792 - 65537) tokens
    assert rows["stock"]["worst_waste_MiB_per_request"] == 15 * 0.125
    assert rows["vattn"]["vmm_critical_path"]["host_ms"] == {"apply": 0.5, "on_blocks": 0.0, "issue": 0.0}
    assert rows["vattn"]["vmm_critical_path"]["inner_ms"]["ensure"] == 0.2


def test_identity_report_compares_each_mode_with_stock_and_vattn_with_the_ceiling(monkeypatch, tmp_path):
    from types import SimpleNamespace as NS

    from vattn.bench.gpu import vllm_stages
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
        schedule = {m: [[(0, 6), (1, 6)], [(0, 1), (1, 1)]] for m in rows}
        schedule["ceiling"] = [[(0, 6)], [(0, 1), (1, 6)]]    # prompt 1 admitted a step later
        return {m: RunResult(r, logprobs_of[m], 1.0, 10, 24, {"vattn_metrics": {"m": m},
                                                               "schedule": schedule[m]})
                for m, r in rows.items()}, {}
    logprobs_of = {m: logprobs(r) for m, r in {"stock": base, "vattn-exact": base, "vattn": tied,
                                                "ceiling": tied}.items()}
    monkeypatch.setattr(vllm_stages, "run_modes", fake_run_all)
    monkeypatch.setattr(vllm_stages, "free_cuda", lambda: None)
    monkeypatch.setattr("vattn.conformance.models.build_model", lambda *a, **kw: str(tmp_path))
    monkeypatch.setattr("vattn.conformance.models.check_not_degenerate", lambda ids: {"ok": True})
    monkeypatch.delenv("VATTN_IDENTITY_MODES", raising=False)
    monkeypatch.delenv("VATTN_IDENTITY_INPROC", raising=False)
    report = vllm_stages.stage_identity(NS(models=str(tmp_path), out=str(tmp_path)))
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
    assert report["vattn_vs_stock"]["schedule_difference"] == {}
    assert report["ceiling_vs_stock"]["schedule_difference"] == {
        "step": 0, "a": [(0, 6), (1, 6)], "b": [(0, 6)]}


def test_jit_during_inference_reads_vllms_monitor_lines(tmp_path):
    from vattn.bench.gpu.report import jit_during_inference
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
    from vattn.bench.gpu.report import kernel_summary, parse_profiler_table
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
    from vattn.bench.gpu.report import parse_profiler_table
    with pytest.raises(ValueError, match="no rule lines"):
        parse_profiler_table("Self CUDA time total: 1s")
    with pytest.raises(ValueError, match="lacks a column"):
        parse_profiler_table("\n".join([_RULE, "  ".join(["Name"] * 11), _RULE, _RULE]))
    bad = _table([("k", "12 parsecs", 1)])
    with pytest.raises(ValueError, match="expected a time"):
        parse_profiler_table(bad)


def test_profiler_table_reads_torchs_own_header():
    """A real (CPU-only) torch table: the rule and header are found; no Self CUDA column."""
    from vattn.bench.gpu.report import parse_profiler_table
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ones(8, 8) @ torch.ones(8, 8)
    table = prof.key_averages().table(sort_by="self_cpu_time_total")
    with pytest.raises(ValueError, match=r"Self CUDA.*header: \['Name', 'Self CPU %'"):
        parse_profiler_table(table)


def test_paired_stage_reports_per_round_ratios_and_renders(monkeypatch, tmp_path):
    from types import SimpleNamespace as NS

    from vattn.bench.gpu import paired, vllm_stages
    from vattn.bench import engine
    seen = {}

    def fake_run_paired(runner, modes, model, prompts, new, *, rounds, device, dtype):
        seen.update(modes=modes, rounds=rounds, mem=runner.engine_args["gpu_memory_utilization"])
        return {"stock": {"seconds_each": [11.0, 11.2, 10.9, 11.1], "init_s": 50.0, "vattn_metrics": None},
                "vattn": {"seconds_each": [10.9, 11.1, 11.0, 11.0], "init_s": 52.0,
                          "vattn_metrics": {"layout": {"worst_waste_bytes": 16 << 20}}}}
    monkeypatch.setattr(paired, "run_paired", fake_run_paired)
    monkeypatch.setattr(vllm_stages, "llama_model", lambda path, fields: str(tmp_path))
    monkeypatch.setattr(vllm_stages, "workload_prompts", _prompts)
    monkeypatch.delenv("VATTN_PAIR", raising=False)
    monkeypatch.setenv("VATTN_ROUNDS", "4")
    monkeypatch.setenv("VATTN_PAIR_MEM", "0.4")
    report = vllm_stages.stage_paired(NS(workload="decode-heavy", models=str(tmp_path), out=str(tmp_path)))
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
    from vattn.bench.gpu.paired import run_paired
    from vattn.conformance.runners.vllm import VllmRunner
    runner = VllmRunner(device="cuda", log_dir=None)
    for modes, rounds in ((["stock"], 2), (["stock", "stock"], 2), (["stock", "vattn"], 0)):
        with pytest.raises(ConfigError, match="two different modes|rounds must be"):
            run_paired(runner, modes, "m", [[1]], 1, rounds=rounds, device="cuda", dtype="bfloat16")


def test_paired_engine_gone_before_a_command_is_a_typed_error(tmp_path):
    import subprocess
    import sys

    from vattn.bench.gpu import paired
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


def _identity_with_fakes(monkeypatch, tmp_path, extra=lambda mode: {}) -> list:
    """The identity stage with its engines, model build and degeneracy check stood in for; each
    run's ``(engine_args, prompt lengths)`` is appended to the list returned."""
    from vattn.bench.gpu import vllm_stages
    from vattn.conformance.protocol import RunResult
    seen = []

    def fake_run_all(runner, model, prompts, new, *, logprobs):
        seen.append((runner.engine_args, [len(p) for p in prompts]))
        rows = [[1, 2, 3]] * len(prompts)
        return {m: RunResult(rows, [[{t: -0.1} for t in r] for r in rows], 1.0, 10, 3, extra(m))
                for m in runner.modes}, {}
    monkeypatch.setattr(vllm_stages, "run_modes", fake_run_all)
    monkeypatch.setattr(vllm_stages, "free_cuda", lambda: None)
    monkeypatch.setattr("vattn.conformance.models.build_model", lambda *a, **kw: str(tmp_path))
    monkeypatch.setattr("vattn.conformance.models.check_not_degenerate", lambda ids: {"ok": True})
    return seen


def test_identity_under_memory_pressure_gives_every_mode_the_same_kv_bytes(monkeypatch, tmp_path):
    from types import SimpleNamespace as NS

    from vattn.bench.gpu import vllm_stages
    seen = _identity_with_fakes(monkeypatch, tmp_path, lambda m: {"num_gpu_blocks": 19 if m == "vattn" else 304})
    monkeypatch.setenv("VATTN_IDENTITY_MODES", "stock vattn")
    monkeypatch.setenv("VATTN_IDENTITY_KV_BYTES", str(160 << 20))
    report = vllm_stages.stage_identity(NS(models=str(tmp_path), out=str(tmp_path)))
    assert seen[0][0]["llm_kwargs"] == {"kv_cache_memory_bytes": 160 << 20}
    assert report["ok"] and report["kv_cache_memory_bytes"] == 160 << 20
    assert report["num_gpu_blocks"] == {"stock": 304, "vattn": 19}


def test_vattn_tp_sets_tensor_parallelism_for_every_mode(monkeypatch, tmp_path):
    from vattn.bench.gpu import vllm_stages
    monkeypatch.setenv("VATTN_TP", "2")
    runner = vllm_stages.make_runner(str(tmp_path), "t", 8, ("stock", "vattn"),
                                     llm_kwargs={"kv_cache_memory_bytes": 1 << 30})
    assert runner.engine_args["llm_kwargs"] == {"kv_cache_memory_bytes": 1 << 30, "tensor_parallel_size": 2}
    monkeypatch.delenv("VATTN_TP")
    assert "llm_kwargs" not in vllm_stages.make_runner(str(tmp_path), "t", 8, ("stock",)).engine_args


@pytest.mark.parametrize("prefix, shared, cached", [("1", True, True), ("nocache", True, False), ("0", False, False)])
def test_identity_on_shared_prefixes_with_and_without_the_cache(monkeypatch, tmp_path, prefix, shared, cached):
    """``VATTN_IDENTITY_PREFIX=nocache``: the shared-prefix prompts with prefix caching off in
    every engine (the control for near-ties seen with the cache on)."""
    from types import SimpleNamespace as NS

    from vattn.bench.gpu import vllm_stages
    seen = _identity_with_fakes(monkeypatch, tmp_path)
    monkeypatch.setenv("VATTN_IDENTITY_MODES", "stock stock@2")
    monkeypatch.setenv("VATTN_IDENTITY_PREFIX", prefix)
    report = vllm_stages.stage_identity(NS(models=str(tmp_path), out=str(tmp_path)))
    (args, lengths), = seen
    assert report["shared_prefixes"] is shared and report["prefix_caching"] is cached
    assert bool(args["prefix_caching"]) is cached and (min(lengths) >= 300) is shared
    monkeypatch.setenv("VATTN_IDENTITY_PREFIX", "yes")
    with pytest.raises(SystemExit, match="VATTN_IDENTITY_PREFIX must be one of"):
        vllm_stages.stage_identity(NS(models=str(tmp_path), out=str(tmp_path)))
