"""``vattn bench host``: vattn's vLLM runtime driven through a generation's calls (host backend)."""

import json

from vattn.cli import main


def test_host_bench_counts_the_calls_of_a_generation(tmp_path, capsys):
    out = tmp_path / "host.json"
    bench = tmp_path / "B.md"
    bench.write_text("# Benchmarks\n")
    rc = main(["bench", "host", "--device", "cpu", "--batch", "4", "--prompt", "100", "--new", "300",
               "--generations", "2", "--json", str(out), "--benchmarks", str(bench)])
    assert rc == 0
    result = json.loads(out.read_text())
    # lengths 101..400 need 1..4 blocks of 128 tokens: 4 block changes x 4 requests per generation
    assert result["on_blocks_calls"] == 16
    assert result["total_ms_per_generation"] > 0 and result["on_blocks_mean_us"] > 0
    assert set(result["ms_per_generation"]) == {"on_blocks", "apply", "tables", "release"}
    assert "## host time per generation (cpu)" in bench.read_text()
    assert "µs per on_blocks" in capsys.readouterr().out


def test_host_bench_refuses_an_empty_generation(capsys):
    assert main(["bench", "host", "--device", "cpu", "--batch", "0", "--no-report"]) == 2
    assert "argument --batch: expected an int >= 1, got '0'" in capsys.readouterr().err
