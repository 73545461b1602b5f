"""``vattn bench engine``: stage JSONs of an engine GPU run -> BENCHMARKS section and plot."""

import json

import pytest

from vattn.bench import engine
from vattn.conformance.models import PRESETS, kv_bytes_per_token, weight_bytes
from vattn.core.errors import ConfigError


def _write(tmp_path, name, report):
    (tmp_path / name).write_text(json.dumps(report))


def _throughput(workload, shape, secs, errors=None):
    rows = {m: {"seconds": s, "generated_tok_s": shape[0] * shape[2] / s} for m, s in secs.items()}
    if "vattn" in rows:
        rows["vattn"] |= {"worst_waste_MiB_per_request": 15.9,
                          "vmm_critical_path": {"apply_total_ms": 12.5, "on_blocks_total_ms": 3.25,
                                                "pages_mapped_on_demand": 0}}
    return {"workload": workload, "shape": shape, "rows": rows, "errors": errors or {}}


def test_markdown_rows_ratios_and_failures(tmp_path):
    _write(tmp_path, "throughput_decode-heavy.json",
           _throughput("decode-heavy", [256, 512, 512, 256], {"stock": 11.0, "ceiling": 10.9, "vattn": 10.95}))
    _write(tmp_path, "throughput_prefill-heavy.json",
           _throughput("prefill-heavy", [32, 16384, 64, 32], {"stock": 17.0, "ceiling": 16.7},
                       errors={"vattn": "VattnError: boom\nlast line of it"}))
    _write(tmp_path, "identity.json", {"ok": True, "not_degenerate": {"ok": True},
                                       "vattn_vs_stock": {"exact": True, "exact_match_rate": 1.0,
                                                          "token_match_rate": 1.0, "near_ties": 0,
                                                          "mismatches": 0, "schedule_difference": {}},
                                       "vattn-exact_vs_stock": {
                                           "exact": False, "near_ties": 1, "schedule_difference":
                                           {"step": 3, "a": [[0, 1]], "b": [[0, 1], [1, 9]]}},
                                       "same_path_exact": {"vattn-exact_vs_stock": False}})
    (tmp_path / "env.txt").write_text("NVIDIA H200, 143771 MiB\ntorch 2.11 vllm 0.26.0\n")
    res = engine.load_results(str(tmp_path))
    md = engine.markdown(res, hbm_tbps=4.27)
    lines = md.splitlines()
    decode = next(l for l in lines if l.startswith("| decode-heavy"))
    assert f"**{11.0 / 10.95:.4f}×**" in decode and f"{10.9 / 10.95:.4f}×" in decode
    assert "15.9" in decode and "0 pages mapped on demand" in decode and "TB/s (" in decode
    prefill = next(l for l in lines if l.startswith("| prefill-heavy"))
    assert "failed" in prefill
    assert "prefill-heavy / vattn failed: `VattnError: boom`" in md
    assert "vattn-exact vs stock **not exact**" in md
    assert "0.0000; the same schedule, step by step)" not in md   # worst gap not in the record
    assert "; the same schedule, step by step)" in md
    assert "schedules differ from step 3: [[0, 1]] vs [[0, 1], [1, 9]])" in md
    assert "**PASS**" in md and "- vattn vs stock: **exact**" in md and "H200" in res["env"]
    assert lines.index(decode) < lines.index(prefill)


def test_decode_bandwidth_counts_weights_and_kv():
    report = _throughput("decode-heavy", [2, 10, 3, 2], {"stock": 1.0, "vattn": 2.0})
    kv = 2 * (10 + 11 + 12) * kv_bytes_per_token(PRESETS["llama3-8b-shape"])
    weights = weight_bytes(PRESETS["llama3-8b-shape"])
    assert engine.decode_bandwidth(report, "vattn") == pytest.approx((3 * weights + kv) / 2)
    assert engine.decode_bandwidth(report, "ceiling") is None
    report["model_preset"] = "llama-1b-shape"                 # the 1B shape moves fewer bytes
    kv = 2 * (10 + 11 + 12) * kv_bytes_per_token(PRESETS["llama-1b-shape"])
    weights = weight_bytes(PRESETS["llama-1b-shape"])
    assert engine.decode_bandwidth(report, "vattn") == pytest.approx((3 * weights + kv) / 2)


def test_decode_bandwidth_from_sglang_workload_dict():
    """SGLang's runner writes ``workload`` as a dict of the shape and ``modes`` for the rows."""
    report = {"stage": "decode-heavy", "workload": {"num": 2, "prompt_len": 10, "new_tokens": 3},
              "modes": {"vattn": {"seconds": 2.0}}}
    kv = 2 * (10 + 11 + 12) * kv_bytes_per_token(PRESETS["llama3-8b-shape"])
    weights = weight_bytes(PRESETS["llama3-8b-shape"])
    assert engine.decode_bandwidth(report, "vattn") == pytest.approx((3 * weights + kv) / 2)
    report["workload"]["num"] = None
    assert engine.decode_bandwidth(report, "vattn") is None


def test_sglang_row_names_the_allocator_host_time():
    crit = {"host_ms": {"alloc_extend": 1.25, "alloc_decode": 20.0, "free": 0.5},
            "pages_mapped_on_demand": 0}
    report = {"stage": "decode-heavy", "workload": {"num": 2, "prompt_len": 10, "new_tokens": 3},
              "modes": {"stock": {"seconds": 2.2},
                        "vattn": {"seconds": 2.0, "worst_waste_MiB_per_request": 15.875,
                                  "vmm_critical_path": crit}}}
    row = engine._workload_row("decode-heavy", report, 4.27)
    assert "1.2 ms alloc_extend + 20.0 ms alloc_decode + 0.5 ms free; 0 pages mapped on demand" in row
    assert "15.9" in row and f"**{2.2 / 2.0:.4f}×**" in row and "device reads" not in row
    crit["device_reads"] = 517                    # the host waited for the device before a forward
    row = engine._workload_row("decode-heavy", report, 4.27)
    assert "0 pages mapped on demand; 517 device reads |" in row


def test_plot_and_section_written(tmp_path):
    pytest.importorskip("matplotlib")
    res_dir = tmp_path / "res"
    res_dir.mkdir()
    _write(res_dir, "throughput_long-context.json",
           _throughput("long-context", [8, 65536, 64, 8], {"stock": 27.5, "ceiling": 27.0, "vattn": 27.1}))
    bench = tmp_path / "B.md"
    bench.write_text("# Benchmarks\n")
    from vattn.cli import main
    rc = main(["bench", "engine", "--results", str(res_dir), "--png", str(tmp_path / "e.png"),
               "--benchmarks", str(bench), "--title", "vllm e2e"])
    assert rc == 0 and (tmp_path / "e.png").stat().st_size > 1000
    text = bench.read_text()
    assert "## vllm e2e" in text and "| long-context |" in text and "date: not recorded" in text


def test_bad_results_folder_is_a_typed_error(tmp_path):
    with pytest.raises(ConfigError, match="no such folder"):
        engine.load_results(str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="holds no"):
        engine.load_results(str(tmp_path))


def test_engines_of_a_mode_pooled_and_used_by_the_table(tmp_path):
    from vattn.bench.gpu.report import pool_engines
    rows = {"stock": {"seconds": 11.0, "seconds_each": [11.2, 11.0]},
            "vattn": {"seconds": 10.9, "seconds_each": [10.9, 11.1]},
            "ceiling": {"seconds": 10.8, "seconds_each": [10.8, 10.85]},
            "stock@2": {"seconds": 11.1, "seconds_each": [11.1, 11.3]},
            "vattn@2": {"seconds": 11.0, "seconds_each": [11.0, 11.05]}}
    pooled = pool_engines(rows)
    assert set(pooled) == {"stock", "vattn"}                 # the ceiling ran in one engine only
    assert pooled["stock"] == {"engines": 2, "seconds_all": [11.0, 11.1, 11.2, 11.3],
                               "median_s": 11.15, "ratio": 1.0}
    assert pooled["vattn"]["median_s"] == 11.025 and pooled["vattn"]["ratio"] == round(11.15 / 11.025, 4)
    assert pool_engines({"vattn@2": {"seconds": 1.0}}) == {}   # one engine: nothing to pool
    report = _throughput("decode-heavy", [256, 512, 512, 256], {"stock": 11.0, "ceiling": 10.8, "vattn": 10.9})
    report["pooled"] = pooled
    md = engine.markdown({"identity": None, "workloads": {"decode-heavy": report}, "env": ""})
    row = next(l for l in md.splitlines() if l.startswith("| decode-heavy"))
    assert f"**{11.15 / 11.025:.4f}×**" in row and f"{10.8 / 11.025:.4f}×" in row
    assert "decode-heavy / stock: median of 4 generations over 2 engines, 11.150 s" in md


def test_prefix_cache_hits_per_generation_are_listed_per_mode(tmp_path):
    report = _throughput("shared-prefix", [128, 4352, 128, 128], {"stock": 2.76, "vattn": 3.05})
    report["rows"]["stock"] |= {"cached_tokens_each": [520_192, 555_008], "prompt_tokens_each": [557_056] * 2}
    report["rows"]["vattn"] |= {"cached_tokens_each": [520_192, 540_672], "prompt_tokens_each": [557_056] * 2}
    _write(tmp_path, "throughput_shared-prefix.json", report)
    _write(tmp_path, "throughput_decode-heavy.json",      # no hits anywhere: no line
           _throughput("decode-heavy", [256, 512, 512, 256], {"stock": 11.0, "vattn": 10.95}))
    md = engine.markdown(engine.load_results(str(tmp_path)))
    (line,) = [l for l in md.splitlines() if "served from the prefix cache" in l]
    assert line.startswith("- shared-prefix:")
    assert "stock 520,192 (93.4 %), 555,008 (99.6 %)" in line and "vattn 520,192 (93.4 %), 540,672 (97.1 %)" in line
    mismatched = {"rows": {"vattn": {"cached_tokens_each": [5], "prompt_tokens_each": []}}}
    assert engine.hits_line("x", mismatched) is None


def test_each_generation_of_one_engine_is_listed_with_its_ratio(tmp_path):
    report = _throughput("decode-heavy", [256, 512, 512, 256], {"stock": 9.16, "vattn": 9.86})
    report["rows"]["stock"]["seconds_each"] = [11.97, 9.16]
    report["rows"]["vattn"]["seconds_each"] = [12.02, 9.86]
    _write(tmp_path, "throughput_decode-heavy.json", report)
    md = engine.markdown(engine.load_results(str(tmp_path)))
    (line,) = [l for l in md.splitlines() if "seconds per generation" in l]
    assert "stock 11.97, 9.16; vattn 12.02, 9.86" in line and "0.996×, 0.929×" in line
    one = _throughput("x", [1, 1, 1, 1], {"stock": 1.0, "vattn": 1.0})
    one["rows"]["stock"]["seconds_each"], one["rows"]["vattn"]["seconds_each"] = [1.0], [1.0]
    assert engine.generations_line("x", one) is None


def _round(report, tag, stock_each, vattn_each):
    for mode, each in (("stock", stock_each), ("vattn", vattn_each)):
        report["rows"][f"{mode}{tag}"] = {"seconds": min(each), "seconds_each": each}


def test_rounds_from_two_calls_are_merged_into_medians_per_generation(tmp_path):
    first, second = tmp_path / "r12", tmp_path / "r3"
    first.mkdir(), second.mkdir()
    a = _throughput("shared-prefix", [128, 4352, 128, 128], {"stock": 2.76, "vattn": 2.77})
    a["rows"]["stock"]["seconds_each"], a["rows"]["vattn"]["seconds_each"] = [3.49, 2.76], [5.17, 2.77]
    _round(a, "@2", [3.57, 2.79], [5.05, 2.79])
    b = {"workload": "shared-prefix", "shape": [128, 4352, 128, 128], "rows": {}, "errors": {}}
    _round(b, "@3", [3.57, 2.77], [5.67, 2.79])
    _write(first, "throughput_shared-prefix.json", a)
    _write(second, "throughput_shared-prefix.json", b)
    res = engine.load_results([str(first), str(second)])
    report = res["workloads"]["shared-prefix"]
    assert set(report["rows"]) == {"stock", "vattn", "stock@2", "vattn@2", "stock@3", "vattn@3"}
    assert report["pooled"]["stock"]["engines"] == 3 and len(report["pooled"]["vattn"]["seconds_all"]) == 6
    line = engine.rounds_line("shared-prefix", report)
    gen1 = sorted([3.49 / 5.17, 3.57 / 5.05, 3.57 / 5.67])
    gen2 = sorted([2.76 / 2.77, 2.79 / 2.79, 2.77 / 2.79])
    assert "median of 3 alternated rounds" in line
    assert f"generation 1 **{gen1[1]:.3f}×** ({gen1[0]:.3f}–{gen1[2]:.3f})" in line
    assert f"generation 2 **{gen2[1]:.3f}×** ({gen2[0]:.3f}–{gen2[2]:.3f})" in line
    md = engine.markdown(res)
    assert line in md and "seconds per generation of one engine" not in md   # rounds replace it
    row = next(l for l in md.splitlines() if l.startswith("| shared-prefix"))
    assert f"**{gen1[1]:.3f}×** / **{gen2[1]:.3f}×** (per generation, median of 3 rounds)" in row
    _write(second, "throughput_shared-prefix.json", a)                       # the same modes twice
    with pytest.raises(ConfigError, match="more than one folder"):
        engine.load_results([str(first), str(second)])
    with pytest.raises(ConfigError, match="at least one folder"):
        engine.load_results([])
    b["model_preset"] = "llama-1b-shape"                                    # another shape: refused
    _write(second, "throughput_shared-prefix.json", b)
    with pytest.raises(ConfigError, match="'llama-1b-shape' in .*render each shape on its own"):
        engine.load_results([str(first), str(second)])


def test_prefix_staging_shows_in_the_critical_path_cell():
    report = _throughput("shared-prefix", [128, 4352, 128, 128], {"stock": 2.76, "vattn": 2.77})
    report["rows"]["vattn"]["vmm_critical_path"]["page_sets_staged"] = 3680
    md = engine.markdown({"identity": None, "workloads": {"shared-prefix": report}, "env": ""})
    row = next(l for l in md.splitlines() if l.startswith("| shared-prefix"))
    assert "0 pages mapped on demand; 3680 page-sets staged ahead" in row
    assert "GPU idle" not in row                              # not recorded: not claimed
    report["rows"]["vattn"]["vmm_critical_path"]["device_wait_ms"] = 41.25
    md = engine.markdown({"identity": None, "workloads": {"shared-prefix": report}, "env": ""})
    assert "on_blocks (GPU idle behind it: 41.2 ms); 0 pages mapped" in md


def test_other_modes_are_listed_against_stock_of_their_round():
    report = _throughput("shared-prefix", [128, 4352, 128, 128], {"stock": 2.76, "vattn": 2.77})
    _round(report, "", [3.5, 2.8], [4.2, 2.8])
    report["rows"]["vattn:s0"] = {"seconds": 2.8, "seconds_each": [5.0, 2.8]}
    report["rows"]["stock@2"] = {"seconds": 2.8, "seconds_each": [3.6, 2.8]}
    report["rows"]["vattn:s0@2"] = {"seconds": 2.8, "seconds_each": [4.5, 2.9]}
    line = engine.variants_line("shared-prefix", report)
    assert line == ("- shared-prefix: other modes per generation: vattn:s0 5.00, 2.80 s (0.700×, 1.000× stock); "
                    "vattn:s0@2 4.50, 2.90 s (0.800×, 0.966× stock)")
    assert line in engine.markdown({"identity": None, "workloads": {"shared-prefix": report}, "env": ""})
    assert engine.variants_line("x", _throughput("x", [1, 1, 1, 1], {"stock": 1.0, "vattn": 1.0})) is None


def test_other_modes_of_decode_heavy_carry_their_share_of_the_hbm_copy_bandwidth():
    """Decode-heavy: each other mode (and stock) with the bytes per second it moved at least and
    that as a share of the measured copy bandwidth, the same lower bound as the table's column."""
    report = _throughput("decode-heavy", [256, 512, 512, 256], {"stock": 9.0})
    report["rows"]["stock"]["seconds_each"] = [12.0, 9.0]
    report["rows"]["vattn:d1"] = {"seconds": 9.5, "seconds_each": [12.2, 9.5]}
    line = engine.variants_line("decode-heavy", report, 3.0)
    got = engine.decode_bandwidth(report, "vattn:d1") / 1e12
    assert f"(0.984×, 0.947× stock; {got:.2f} TB/s = {100 * got / 3.0:.0f} % of HBM copy)" in line
    assert got == pytest.approx(engine.decode_bandwidth(report, "stock") / 1e12 * 9.0 / 9.5)
    assert line.endswith(" % of HBM copy") and "; stock " in line
    assert "TB/s" not in engine.variants_line("shared-prefix", report, 3.0)   # decode-heavy only


def test_one_round_or_uneven_generations_give_no_rounds_line():
    one = _throughput("x", [1, 1, 1, 1], {"stock": 1.0, "vattn": 1.0})
    _round(one, "", [1.0, 1.0], [1.0, 1.0])
    assert engine.rounds_line("x", one) is None
    _round(one, "@2", [1.0], [1.0])                         # a round with one generation only
    assert engine.rounds_line("x", one) is None


def test_vattns_work_is_listed_per_generation():
    report = _throughput("shared-prefix", [128, 4352, 128, 128], {"stock": 2.76, "vattn": 2.77})
    report["rows"]["vattn"]["vattn_each"] = [
        {"apply_ms": 900.0, "device_wait_ms": 610.4, "pages_aliased": 32512, "map_calls": 40000},
        {"apply_ms": 960.0, "device_wait_ms": 615.0, "pages_aliased": 32512, "map_calls": 40010}]
    report["rows"]["vattn"]["vattn_before"] = {"apply_ms": 100.0, "device_wait_ms": 10.0, "pages_aliased": 0,
                                               "map_calls": 28544}      # start-up and warm-up
    report["rows"]["vattn:s0"] = {"seconds": 2.8, "vattn_each": [
        {"apply_ms": 5.0, "device_wait_ms": None, "pages_aliased": 0}]}
    md = engine.markdown({"identity": None, "workloads": {"shared-prefix": report}, "env": ""})
    assert ("vattn 800 / 600 ms, 32,512 aliased, 11,456 map calls; 60 / 5 ms, 0 aliased, 10 map calls"
            " | vattn:s0 5 / — ms, 0 aliased") in md
    assert "- shared-prefix: vattn's work per generation (host ms of `apply` / the GPU's idle ms behind it" in md
    del report["rows"]["vattn"]["vattn_each"], report["rows"]["vattn:s0"]
    assert "work per generation" not in engine.markdown(
        {"identity": None, "workloads": {"shared-prefix": report}, "env": ""})


def test_the_same_modes_in_later_folders_are_their_rounds(tmp_path):
    """Three calls each running ``stock vattn`` (the order alternated by the caller): the n-th
    folder's modes become MODE@n, pooled with the first's."""
    for n, (s, v) in enumerate([(3.49, 5.17), (3.57, 5.05), (3.52, 4.90)], start=1):
        (tmp_path / f"r{n}").mkdir()
        a = _throughput("shared-prefix", [128, 4352, 128, 128], {"stock": s, "vattn": v})
        _write(tmp_path / f"r{n}", "throughput_shared-prefix.json", a)
    res = engine.load_results([str(tmp_path / f"r{n}") for n in (1, 2, 3)])
    report = res["workloads"]["shared-prefix"]
    assert set(report["rows"]) == {"stock", "vattn", "stock@2", "vattn@2", "stock@3", "vattn@3"}
    assert report["rows"]["vattn@3"]["seconds"] == 4.90 and report["pooled"]["vattn"]["engines"] == 3
