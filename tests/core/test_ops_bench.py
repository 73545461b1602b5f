"""The kernel benchmarks' CLIs run end to end at a tiny size on the CPU (reference path)."""

import argparse
import json

import pytest
import torch

from vattn.bench import attention, layout
from vattn.bench.paged_baselines import paged_copy


def _args(module, argv):
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(argv)


def test_bench_attention_tiny(tmp_path):
    args = _args(attention, ["--models", "yi-6b", "--contexts", "33", "--batches", "1,3",
                             "--prefill-contexts", "17", "--dtype", "fp32", "--device", "cpu",
                             "--no-report", "--out", str(tmp_path)])
    assert attention.run(args) == 0
    data = json.loads((tmp_path / "attention.json").read_text())
    assert {(r["op"], r["batch"]) for r in data["results"]} == {("decode", 1), ("decode", 3), ("prefill", 1)}
    assert all(r["us"] > 0 and r["TB/s"] > 0 for r in data["results"])
    assert "| decode | yi-6b | 3 | 33 |" in (tmp_path / "attention.md").read_text()


def test_bench_attention_has_the_head_dim_64_shape_outside_the_default_grid(tmp_path):
    assert attention.MODEL_SHAPES["llama-1b"] == (32, 8, 64)
    assert "llama-1b" not in _args(attention, []).models
    args = _args(attention, ["--models", "llama-1b", "--contexts", "33", "--batches", "2", "--ops", "decode",
                             "--dtype", "fp32", "--device", "cpu", "--no-report", "--out", str(tmp_path)])
    assert attention.run(args) == 0
    rows = json.loads((tmp_path / "attention.json").read_text())["results"]
    assert [(r["op"], r["model"], r["batch"]) for r in rows] == [("decode", "llama-1b", 2)]


def test_bench_layout_tiny(tmp_path):
    pytest.importorskip("vattn.core.cache")
    args = _args(layout, ["--model-shape", "2,4,2,16", "--groups", "1,2,all", "--decode-cases",
                          "2x40", "--prefill-cases", "1x8", "--dtype", "fp32", "--device", "cpu",
                          "--no-report", "--out", str(tmp_path)])
    assert layout.run(args) == 0
    data = json.loads((tmp_path / "layout.json").read_text())
    assert data["recommended"] in ("1", "2", "all")
    assert len(data["rows"]) == 6


def test_recommend_prefers_least_waste_within_tolerance():
    rows = [{"layout": "1", "us": {"x": 100.0}, "worst_waste_MiB": 128.0},
            {"layout": "4", "us": {"x": 100.5}, "worst_waste_MiB": 16.0},
            {"layout": "all", "us": {"x": 120.0}, "worst_waste_MiB": 2.0}]
    assert layout.recommend(rows, 0.01) == "4"
    assert layout.recommend(rows, 0.25) == "all"
    assert layout.recommend(rows, 0.0) == "1"


def test_paged_copy_holds_the_same_rows():
    k = torch.randn(5, 64, 2, 8)
    v = torch.randn(5, 64, 2, 8)
    slots = torch.tensor([4, 0, 2])
    pk = paged_copy(k, v, slots, 40)
    assert pk.block_table.shape == (3, 3)
    for i, s in enumerate(slots.tolist()):
        got = pk.k[pk.block_table[i].long()].reshape(-1, 2, 8)[:40]
        assert torch.equal(got, k[s, :40])
        assert torch.equal(pk.v[pk.block_table[i].long()].reshape(-1, 2, 8)[:40], v[s, :40])


def test_bench_attention_budget_leaves_shapes_out_and_says_so(tmp_path):
    args = _args(attention, ["--models", "yi-6b", "--contexts", "33,65", "--batches", "1,3",
                             "--prefill-contexts", "17", "--dtype", "fp32", "--device", "cpu",
                             "--no-report", "--out", str(tmp_path), "--budget-s", "0"])
    assert attention.run(args) == 0
    data = json.loads((tmp_path / "attention.json").read_text())
    assert len(data["results"]) == 1                       # the first shape starts, no other
    assert data["results"][0]["op"] == "prefill"             # prefill shapes come first
    assert data["left_out"][0] == "decode yi-6b B=1 ctx=33" and len(data["left_out"]) == 4
    assert (tmp_path / "attention.rows.jsonl").read_text().count("\n") == 1
    assert "Not measured" in (tmp_path / "attention.md").read_text()


def _row(op, backend, ctx, batch, ratio, hbm=None):
    return {"op": op, "backend": backend, "context": ctx, "batch": batch, "model": "m",
            "ratio_same_kernel": ratio, "%HBM": hbm}


def test_targets_report_misses_by_how_much():
    rows = [_row("decode", "vllm_fa3", 8192, 16, 0.98), _row("decode", "vllm_fa3", 1024, 1, 1.02),
            _row("prefill", "vllm_fa3", 16384, 1, 1.12), _row("prefill", "vllm_fa3", 32768, 1, 1.05),
            _row("prefill", "vllm_fa3", 4096, 1, 0.5),
            _row("decode", "triton", 8192, 64, None, hbm=90.0), _row("decode", "triton", 1024, 1, None, hbm=5.0)]
    text = attention.targets(rows)
    assert "1 below 1.00×" in text and "missed by 2.0 %" in text and "B=16 ctx=8192" in text
    assert "1.050–1.120×" in text and "missed by 5.0 points" in text     # 4K prefill not counted
    assert "90–90 % of copy bandwidth over 1 shapes (target ≥ 85 % met)" in text
    assert "met" in attention.targets([_row("decode", "vllm_fa3", 8, 1, 1.0)])


def test_vmm_copy_holds_the_same_rows_on_a_real_virtual_cache():
    from vattn.core.ops import decode
    from vattn.core.ops.synthetic import group_views
    k, v, keep = group_views(slots=4, rows_per_slot=256, group_size=2, kv_heads=2, head_dim=16,
                             dtype=torch.float32, layer=1, generator=torch.Generator().manual_seed(0))
    slots = torch.tensor([3, 0, 2])
    from vattn.bench.vmm_backed import vmm_copy
    mk, mv, ms, cache = vmm_copy(k, v, slots, 200, group=2)
    try:
        assert cache.metrics()["pages_mapped"] > 0            # real pages, not the source memory
        for dst, src in zip(ms.tolist(), slots.tolist()):
            assert torch.equal(mk[dst, :200], k[src, :200]) and torch.equal(mv[dst, :200], v[src, :200])
        q = torch.randn(3, 4, 16, generator=torch.Generator().manual_seed(1))
        lens = torch.tensor([200, 1, 97], dtype=torch.int32)
        want = decode(q, k, v, slots=slots.to(torch.int32), seqlens=lens, backend="reference")
        got = decode(q, mk, mv, slots=ms, seqlens=lens, backend="reference")
        assert torch.equal(got, want)
    finally:
        cache.close()


def test_bench_attention_vmm_rows_compare_with_the_same_kernel(tmp_path):
    args = _args(attention, ["--models", "yi-6b", "--contexts", "33", "--batches", "3", "--ops",
                             "decode", "--dtype", "fp32", "--device", "cpu", "--no-report", "--vmm",
                             "--out", str(tmp_path)])
    assert attention.run(args) == 0
    rows = json.loads((tmp_path / "attention.json").read_text())["results"]
    assert [r["backend"] for r in rows] == ["reference", "reference@vmm"]
    assert all(r["us"] > 0 for r in rows)
    assert "--vmm" in attention._command_args(args)
