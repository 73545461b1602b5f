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
