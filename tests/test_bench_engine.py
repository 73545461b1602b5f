"""``vattn bench engine``: stage JSONs of an engine GPU run -> BENCHMARKS section and plot."""

import json

import pytest

from vattn.bench import engine
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
                                                          "mismatches": 0},
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
    assert "**PASS**" in md and "- vattn vs stock: **exact**" in md and "H200" in res["env"]
    assert lines.index(decode) < lines.index(prefill)


def test_decode_bandwidth_counts_weights_and_kv():
    report = _throughput("decode-heavy", [2, 10, 3, 2], {"stock": 1.0, "vattn": 2.0})
    kv = 2 * (10 + 11 + 12) * engine._KV_BYTES_PER_TOKEN_8B
    assert engine.decode_bandwidth(report, "vattn") == pytest.approx((3 * engine._WEIGHT_BYTES_8B + kv) / 2)
    assert engine.decode_bandwidth(report, "ceiling") is None


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
