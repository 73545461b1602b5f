"""``vattn bench serve`` without an engine: parsing, alternation, the report, the tokenizer, the
server process handling (a stand-in server) and the command's refusals."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time

import pytest

from vattn.bench import serve, serve_clients, serve_engines, serve_report
from vattn.bench.serve_clients import ClientError, Workload, client_command, parse_result
from vattn.bench.serve_engines import Server, ServerError, ServerSpec, server_command
from vattn.conformance.tokenizer import write_tokenizer
from vattn.core.errors import ConfigError, UnsupportedError


def _vllm_result(scale=1.0, completed=10, failed=0):
    d = {"duration": 5.0, "completed": completed, "failed": failed, "request_throughput": 2.0 * scale,
         "output_throughput": 100.0 * scale, "total_token_throughput": 600.0 * scale}
    for i, lat in enumerate(("ttft", "tpot", "itl", "e2el")):
        d |= {f"mean_{lat}_ms": 10.0 * (i + 1) / scale, f"median_{lat}_ms": 9.0 * (i + 1) / scale,
              f"p50_{lat}_ms": 9.0 * (i + 1) / scale, f"p99_{lat}_ms": 30.0 * (i + 1) / scale,
              f"std_{lat}_ms": 1.0}
    return d


def _row(rnd, mode, scale=1.0, **kw):
    return {"round": rnd, "mode": mode, **parse_result("vllm", _vllm_result(scale)), **kw}


# -- parsing ----------------------------------------------------------------------------------------
def test_parse_vllm_result_takes_p50_p99_and_counts():
    row = parse_result("vllm", _vllm_result(completed=9, failed=1))
    assert row["completed"] == 9 and row["failed"] == 1
    assert row["ttft_p50_ms"] == 9.0 and row["ttft_p99_ms"] == 30.0 and row["tpot_mean_ms"] == 20.0
    assert row["request_throughput"] == 2.0 and row["output_throughput"] == 100.0
    assert set(row) == set(serve_clients.METRICS)


def test_parse_vllm_result_without_p99_is_refused():
    data = _vllm_result()
    del data["p99_tpot_ms"]
    with pytest.raises(ClientError, match="p99_tpot_ms"):
        parse_result("vllm", data)


def test_parse_sglang_result_uses_medians_and_expected_count():
    data = {"duration": 4.0, "completed": 7, "request_throughput": 1.75, "output_throughput": 50.0,
            "total_throughput": 300.0}
    for lat in ("ttft", "tpot", "itl", "e2e_latency"):
        data |= {f"mean_{lat}_ms": 5.0, f"median_{lat}_ms": 4.0, f"p99_{lat}_ms": 12.0}
    row = parse_result("sglang", data, expected=8)
    assert row["failed"] == 1 and row["completed"] == 7
    assert row["e2el_p50_ms"] == 4.0 and row["itl_p99_ms"] == 12.0
    assert row["total_token_throughput"] == 300.0


def test_read_result_takes_sglang_last_line(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text(json.dumps({"completed": 1}) + "\n" + json.dumps({"completed": 2}) + "\n")
    assert serve_clients.read_result("sglang", str(path)) == {"completed": 2}
    with pytest.raises(ClientError, match="no result"):
        serve_clients.read_result("vllm", str(tmp_path / "missing.json"))


# -- alternation and budget -------------------------------------------------------------------------
def test_order_alternates_modes_round_by_round():
    assert serve.order(3) == [(1, "stock"), (1, "vattn"), (2, "stock"), (2, "vattn"),
                              (3, "stock"), (3, "vattn")]
    with pytest.raises(ConfigError):
        serve.order(0)


def test_budget_skips_rounds_that_would_not_fit(monkeypatch):
    clock = {"t": 0.0}
    calls = []
    monkeypatch.setattr(serve.time, "monotonic", lambda: clock["t"])

    def fake_run(args, model, workload, device, rnd, mode):
        calls.append((rnd, mode))
        clock["t"] += 100.0
        return _row(rnd, mode)

    monkeypatch.setattr(serve, "_one_run", fake_run)
    args = type("A", (), {"rounds": 3, "budget_s": 450.0})()
    rows, notes = serve.run_rounds(args, "m", None, "cpu", log=lambda *_: None)
    # round 1 took 200 s; round 2 fits (250 left), round 3 does not (50 left)
    assert calls == [(1, "stock"), (1, "vattn"), (2, "stock"), (2, "vattn")]
    assert len(rows) == 4 and "rounds [3] skipped" in notes[0]


# -- report -----------------------------------------------------------------------------------------
def test_markdown_medians_spread_and_ratio_per_round():
    rows = [_row(1, "stock", 1.0), _row(1, "vattn", 1.1), _row(2, "stock", 2.0), _row(2, "vattn", 1.8),
            _row(3, "stock", 1.0), {"round": 3, "mode": "vattn", "error": "ServerError: boom"}]
    stats = serve_report.summarize(rows)
    assert stats["stock"]["request_throughput"] == {"median": 2.0, "min": 2.0, "max": 4.0, "n": 3}
    assert stats["vattn"]["request_throughput"]["n"] == 2
    ratios = serve_report.round_ratios(rows, "request_throughput")
    assert [r for r, _ in ratios] == [1, 2]
    assert ratios[0][1] == pytest.approx(1.1) and ratios[1][1] == pytest.approx(0.9)
    text = serve_report.markdown(rows, title="t", notes=["a note"])
    line = next(l for l in text.splitlines() if l.startswith("| requests/s"))
    assert "2 (2–4)" in line and "r1: 1.100, r2: 0.900" in line and "| 1.000 |" in line
    assert "FAILED: ServerError: boom" in text and "- a note" in text
    assert "↓" in next(l for l in text.splitlines() if l.startswith("| TTFT p99"))


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [_row(1, "stock"), _row(1, "vattn", 1.1)]
    path = serve_report.plot(rows, str(tmp_path / "p.png"))
    assert path and os.path.getsize(path) > 1000
    assert serve_report.plot([{"round": 1, "mode": "stock", "error": "x"}], str(tmp_path / "q.png")) is None


# -- tokenizer --------------------------------------------------------------------------------------
def _config(tmp_path, **fields):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 500, **fields}))
    return str(tmp_path)


@pytest.mark.parametrize("specials", [{}, {"bos_token_id": 1, "eos_token_id": 2}])
def test_tokenizer_round_trip(tmp_path, specials):
    from transformers import AutoTokenizer
    model = write_tokenizer(_config(tmp_path, **specials))
    tok = AutoTokenizer.from_pretrained(model)
    assert tok.vocab_size == 500 and len(tok) == 500
    ids = [(i * 37 + 11) % 500 for i in range(300)] + [0, 499]
    text = tok.decode(ids)
    assert tok.encode(text, add_special_tokens=False) == ids
    assert tok.decode([5, 6]) == "w5 w6"
    assert tok.encode("something unknown", add_special_tokens=False) == [0, 0]
    if specials:
        assert tok.bos_token_id == 1 and tok.eos_token_id == 2
        assert tok.encode("w7")[0] == 1 and tok.num_special_tokens_to_add() == 1
    else:
        assert tok.num_special_tokens_to_add() == 0 and tok.all_special_ids == []
    assert tok.apply_chat_template([{"role": "user", "content": "w3 w4"}], tokenize=False)


def test_tokenizer_refuses_bad_input(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        write_tokenizer(str(tmp_path / "nothing"))
    with pytest.raises(ConfigError, match="vocab_size"):
        write_tokenizer(_config(tmp_path / "a"), vocab_size=10)
    with pytest.raises(ConfigError, match="eos_token_id"):
        write_tokenizer(_config(tmp_path / "b", eos_token_id=900))


# -- engines and clients: command lines -------------------------------------------------------------
def test_vllm_vattn_mode_adds_backend_on_gpu_only(tmp_path):
    model = _config(tmp_path)
    stock = server_command("vllm", "stock", model, port=1, device="cuda")
    vattn = server_command("vllm", "vattn", model, port=1, device="cuda")
    cpu = server_command("vllm", "vattn", model, port=1, device="cpu")
    assert "--attention-backend" not in stock.argv and stock.env.get("VATTN_VLLM") is None
    assert vattn.argv[vattn.argv.index("--attention-backend") + 1] == "CUSTOM"
    assert vattn.env["VATTN_VLLM"] == "1" and cpu.env["VATTN_VLLM"] == "1"
    assert "--attention-backend" not in cpu.argv
    assert "--load-format" in stock.argv          # no weights in the folder: dummy weights
    assert vattn.env["VLLM_USE_V2_MODEL_RUNNER"] == "1" and cpu.env["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_vllm_vattn_mode_keeps_prefix_caching_and_extra_flags_pass_once(tmp_path):
    model = _config(tmp_path)
    assert "--no-enable-prefix-caching" not in server_command("vllm", "vattn", model, port=1).argv
    spec = server_command("vllm", "vattn", model, port=1, device="cuda",
                          extra_args=["--no-enable-prefix-caching", "--max-num-seqs", "8"])
    assert spec.argv.count("--no-enable-prefix-caching") == 1 and spec.argv[-2:] == ["--max-num-seqs", "8"]
    stock = server_command("vllm", "stock", model, port=1, device="cuda")
    assert "--no-enable-prefix-caching" not in stock.argv
    same = server_command("vllm", "stock", model, port=1, device="cuda", like_for_like=True)
    assert "--attention-backend" not in same.argv


def test_sglang_vattn_mode_mirrors_the_conformance_worker(tmp_path):
    model = _config(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")
    vattn = server_command("sglang", "vattn", model, port=7, device="cuda")
    stock = server_command("sglang", "stock", model, port=7, device="cuda")
    text = " ".join(vattn.argv)
    assert "--attention-backend vattn --disable-prefill-cuda-graph" in text
    assert "--disable-radix-cache" not in text and "--page-size" not in text   # SGLang's defaults
    assert vattn.env["VATTN_SGLANG"] == "1" and stock.env["VATTN_SGLANG"] is None
    assert "--load-format" not in vattn.argv and "--page-size" not in stock.argv
    assert vattn.argv[:4] == ["-m", "sglang.launch_server", "--model-path", model]
    like = server_command("sglang", "stock", model, port=7, like_for_like=True)
    assert "--disable-prefill-cuda-graph" in like.argv and "--attention-backend" not in like.argv


def test_client_commands():
    w = Workload(dataset="random", num_prompts=8, input_len=100, output_len=20, rate=4.0)
    v = client_command("vllm", w, model_dir="/m", host="h", port=5, result_path="/r/x.json")
    s = " ".join(v)
    assert "--metric-percentiles 50,99" in s and "--percentile-metrics ttft,tpot,itl,e2el" in s
    assert "--random-input-len 100" in s and "--ignore-eos" in s and "--result-filename x.json" in s
    sp = Workload(dataset="shared-prefix", num_prompts=8, input_len=100, output_len=20, rate=4.0,
                  prefix_len=60, num_prefixes=4)
    s = " ".join(client_command("vllm", sp, model_dir="/m", host="h", port=5, result_path="/r/x.json"))
    assert "prefix_repetition" in s and "--prefix-repetition-suffix-len 40" in s
    s = " ".join(client_command("sglang", sp, model_dir="/m", host="h", port=5, result_path="/r/x"))
    assert "--gsp-num-groups 4 --gsp-prompts-per-group 2 --gsp-system-prompt-len 60" in s
    s = " ".join(client_command("sglang", w, model_dir="/m", host="h", port=5, result_path="/r/x"))
    assert "--dataset-name random-ids" in s and "--random-range-ratio 1.0" in s


@pytest.mark.parametrize("kw, match", [
    (dict(rate=0.0), "rate"), (dict(rate=-1.0), "rate"),
    (dict(dataset="shared-prefix", prefix_len=100), "prefix_len < input_len"),
    (dict(dataset="shared-prefix", prefix_len=10, num_prefixes=3), "multiple of num_prefixes"),
    (dict(dataset="sharegpt"), "dataset")])
def test_workload_refusals(kw, match):
    base = dict(dataset="random", num_prompts=8, input_len=100, output_len=20, rate=1.0)
    with pytest.raises(ConfigError, match=match):
        Workload(**(base | kw))


def test_vllm_client_versions():
    serve_clients.check_vllm_version("0.26.0")
    serve_clients.check_vllm_version("0.32.0+cpu")
    with pytest.raises(UnsupportedError, match="0.25.1"):
        serve_clients.check_vllm_version("0.25.1")


# -- the server process: a stand-in engine ----------------------------------------------------------
_FAKE = textwrap.dedent("""
    import http.server, os, subprocess, sys, time
    mode = sys.argv[1]
    if mode == "die":
        print("engine failed: out of stand-in memory", flush=True); sys.exit(3)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(sys.argv[3], "w").write(str(child.pid))
    if mode == "mute":
        time.sleep(600)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404); self.end_headers()
        def log_message(self, *a): pass
    time.sleep(0.5)
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[2])), H).serve_forever()
""")


def _fake_server(tmp_path, mode, timeout_s=30.0):
    script = tmp_path / "fake.py"
    script.write_text(_FAKE)
    port = serve_engines.free_port()
    spec = ServerSpec(engine="fake", mode=mode, argv=[str(script), mode, str(port),
                                                     str(tmp_path / "child.pid")], port=port)
    return Server(spec, python=sys.executable, log_path=str(tmp_path / "server.log"), timeout_s=timeout_s)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:      # a zombie is dead
        return f.read().split(")")[1].split()[0] != "Z"


def test_server_waits_for_health_and_kills_its_whole_group(tmp_path):
    server = _fake_server(tmp_path, "ok")
    with server:
        assert server.start_s is not None and server.start_s >= 0.4
        child = int((tmp_path / "child.pid").read_text())
        assert _alive(child)
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child), "the server's child outlived it"


def test_server_that_exits_raises_with_log_tail(tmp_path):
    with pytest.raises(ServerError, match="out of stand-in memory"):
        with _fake_server(tmp_path, "die"):
            pass


def test_server_without_health_times_out_and_is_killed(tmp_path):
    server = _fake_server(tmp_path, "mute", timeout_s=3.0)
    with pytest.raises(ServerError, match="within 3 s"):
        server.__enter__()
    child = int((tmp_path / "child.pid").read_text())
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child) and server.proc is None


# -- the command's refusals: one line, exit status 2 ------------------------------------------------
from tests.test_cli_errors import refused  # noqa: E402  (one line, exit status 2)


BASE = ("bench", "serve", "--engine", "vllm", "--out")


@pytest.fixture
def engine_here(monkeypatch):
    monkeypatch.setattr(serve, "check_engine", lambda engine, python: "0.26.0")


def test_cli_unknown_engine(capsys, tmp_path):
    line = refused(capsys, "bench", "serve", "--engine", "tgi", "--model", str(tmp_path), "--out", str(tmp_path))
    assert "argument --engine: invalid choice: 'tgi'" in line


def test_cli_engine_not_installed(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.setattr(serve.importlib.util, "find_spec", lambda name: None)
    line = refused(capsys, *BASE, str(tmp_path), "--model", str(tmp_path))
    assert line.startswith("vattn bench serve: UnsupportedError: --engine vllm: expected vllm importable")


@pytest.mark.parametrize("value", ["0", "-2", "nan", "fast"])
def test_cli_bad_rate(capsys, tmp_path, value):
    line = refused(capsys, *BASE, str(tmp_path), "--model", str(tmp_path), "--rate", value)
    assert "argument --rate: expected a number > 0" in line and repr(value) in line


def test_cli_model_without_config(capsys, tmp_path, engine_here):
    line = refused(capsys, *BASE, str(tmp_path / "o"), "--model", str(tmp_path))
    assert "ConfigError: --model: expected a model directory with a config.json" in line


def test_cli_unknown_preset(capsys, tmp_path, engine_here):
    line = refused(capsys, *BASE, str(tmp_path / "o"), "--preset", "gpt-5")
    assert "ConfigError: --preset: expected one of" in line and "'gpt-5'" in line


def test_cli_shared_prefix_counts(capsys, tmp_path, engine_here):
    line = refused(capsys, *BASE, str(tmp_path / "o"), "--model", _config(tmp_path / "m"),
                   "--dataset", "shared-prefix", "--num-prompts", "10", "--num-prefixes", "3")
    assert "multiple of num_prefixes" in line
    line = refused(capsys, *BASE, str(tmp_path / "o"), "--model", _config(tmp_path / "m"),
                   "--prefix-len", "5")
    assert "--dataset shared-prefix only" in line


def test_cli_model_and_preset_exclusive(capsys, tmp_path):
    line = refused(capsys, *BASE, str(tmp_path), "--model", str(tmp_path), "--preset", "tiny")
    assert "not allowed with argument" in line


def test_root_cause_is_the_first_tracebacks_error(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("INFO start\n(EngineCore pid=1) ERROR Traceback (most recent call last):\n"
                   '(EngineCore pid=1) ERROR   File "x.py", line 3, in f\n'
                   '(EngineCore pid=1) ERROR     raise ConfigError("no prefix caching")\n'
                   "(EngineCore pid=1) ERROR vattn.core.errors.ConfigError: no prefix caching\n"
                   "Traceback (most recent call last):\nRuntimeError: Engine core initialization failed\n")
    assert serve_engines.root_cause(str(log)) == "vattn.core.errors.ConfigError: no prefix caching"
    assert serve_engines.root_cause(str(tmp_path / "none.log")) == ""


def test_check_engine_asks_a_linked_interpreter_itself(tmp_path):
    """A virtual environment's python is a link to the base interpreter: ``--python LINK`` must
    be asked what it can import (this process has vattn; the bare base interpreter behind the
    link does not), not be taken for this process because both resolve to one file."""
    base = os.path.realpath(sys.executable)
    link = tmp_path / "bin" / "python"
    link.parent.mkdir()
    link.symlink_to(base)
    assert serve.check_engine("json", str(link)) is not None
    if os.path.realpath(str(link)) == base and sys.prefix != sys.base_prefix:
        with pytest.raises(UnsupportedError, match="expected vattn importable in"):
            serve.check_engine("vattn", str(link))


def test_vattn_counters_come_from_the_newest_snapshot_and_show_in_the_report(tmp_path):
    """A vattn run's row carries its server's last ``VATTN_METRICS`` snapshot (one file per
    worker process: the newest wins); a run without one says so instead of showing zeros."""
    snap = {"apply_step_us": {"count": 10, "mean_us": 50.0, "p99_us": 90.0},
            "on_blocks_us": {"count": 4, "mean_us": 25.0}, "issue_us": {"count": 2, "mean_us": 100.0},
            "steps": 10, "fence_waits": 3, "pages_retired": 7, "map_calls": 16,
            "unmap_calls": 8, "page_sets_moved": 2, "prefix_hits": 5, "layout": {"worst_waste_bytes": 2 << 20}}
    (tmp_path / "vattn_metrics_11.json").write_text(json.dumps({"time": 1.0, "fence_waits": 99}))
    (tmp_path / "vattn_metrics_12.json").write_text(json.dumps({"time": 2.0, **snap}))
    got = serve.vattn_counters(str(tmp_path), "vllm")
    path = got["vmm_critical_path"]
    assert got["worst_waste_MiB_per_request"] == 2.0
    assert path["fence_waits"] == 3 and path["host_ms"] == {"apply": 0.5, "on_blocks": 0.1, "issue": 0.2}
    assert path["steps"] == 10 and path["host_us_per_step"] == 80.0     # (0.5 + 0.1 + 0.2) ms / 10
    assert path["step_mean_us"] == 50.0 and path["step_p99_us"] == 90.0
    empty = tmp_path / "none"
    empty.mkdir()
    assert "no vattn snapshot" in serve.vattn_counters(str(empty), "vllm")["vattn_metrics_error"]
    rows = [_row(1, "stock"), {**_row(1, "vattn", 1.1), "vattn": got},
            {**_row(2, "vattn", 1.1), "round": 2, "vattn": {"vattn_metrics_error": "none written"}}]
    text = serve_report.markdown(rows, title="t")
    line = next(l for l in text.splitlines() if l.startswith("| 1 | apply"))
    assert line == "| 1 | apply 0.5, on_blocks 0.1, issue 0.2 | 10 | 80 | 50 | 90 | 3 | 7 | 16 | 8 | 2 | 5 | – |", line
    assert "| 2 | none written |" in text


def test_modes_run_alone_or_reordered_and_are_checked(monkeypatch):
    calls = []
    monkeypatch.setattr(serve, "_one_run", lambda args, m, w, d, rnd, mode: calls.append((rnd, mode)) or _row(rnd, mode))
    args = type("A", (), {"rounds": 2, "budget_s": None, "modes": ["vattn"]})()
    rows, _ = serve.run_rounds(args, "m", None, "cpu", log=lambda *_: None)
    assert calls == [(1, "vattn"), (2, "vattn")] and len(rows) == 2
    assert "| requests/s ↑ | – |" in serve_report.markdown(rows)       # no stock: no ratio
    calls.clear()
    args.modes = ["vattn", "stock"]
    serve.run_rounds(args, "m", None, "cpu", log=lambda *_: None)
    assert calls == [(1, "vattn"), (1, "stock"), (2, "vattn"), (2, "stock")]
    args.modes = ["vattn", "vattn"]
    with pytest.raises(ConfigError, match="at most once"):
        serve.run_rounds(args, "m", None, "cpu", log=lambda *_: None)


def test_vllm_vattn_variants_start_vattns_server_with_their_switches(tmp_path):
    """``vattn:h1:b0`` is the vattn server with the runner's switches in its environment (the
    outer environment's own values of them do not leak into any mode)."""
    model = _config(tmp_path)
    spec = server_command("vllm", "vattn:h1:b0", model, port=1, device="cuda")
    assert spec.argv[spec.argv.index("--attention-backend") + 1] == "CUSTOM"
    assert spec.env["VATTN_VLLM"] == "1"
    assert spec.env["VATTN_DRIVER_GIL"] == "hold" and spec.env["VATTN_BATCH_COPIES"] == "0"
    plain = server_command("vllm", "vattn", model, port=1, device="cuda")
    assert "VATTN_DRIVER_GIL" not in plain.environ() and "VATTN_BATCH_COPIES" not in plain.environ()
    for bad in ("vattn:x9", "stock:h1", "vattn:h1@2", "vattn:h1:h2", "vattn-exact:h1"):
        with pytest.raises(ConfigError, match="mode must be one of stock, vattn or a vattn variant"):
            server_command("vllm", bad, model, port=1, device="cuda")
    with pytest.raises(ConfigError, match="mode must be one of stock, vattn for sglang, got 'vattn:h1'"):
        server_command("sglang", "vattn:h1", model, port=1, device="cuda")


def test_modes_of_takes_vllm_variants_and_refuses_them_for_sglang():
    args = type("A", (), {"engine": "vllm", "modes": ["stock", "vattn", "vattn:h1"]})()
    assert serve.modes_of(args) == ("stock", "vattn", "vattn:h1")
    args.engine = "sglang"
    with pytest.raises(ConfigError, match="--modes: mode must be one of stock, vattn for sglang"):
        serve.modes_of(args)


def test_report_has_a_column_and_a_ratio_per_variant(tmp_path):
    rows = [_row(1, "stock", 1.0), _row(1, "vattn", 1.1), _row(1, "vattn:h1", 0.5),
            _row(2, "stock", 2.0), _row(2, "vattn", 1.8), _row(2, "vattn:h1", 2.0)]
    assert serve_report.modes_in(rows) == ["stock", "vattn", "vattn:h1"]
    text = serve_report.markdown(rows, title="t")
    assert "order stock, vattn, vattn:h1 per round" in text
    head = next(l for l in text.splitlines() if l.startswith("| metric"))
    assert head.count("median (min–max)") == 3 and "vattn:h1/stock per round" in head
    line = next(l for l in text.splitlines() if l.startswith("| requests/s"))
    assert "r1: 1.100, r2: 0.900 | 1.000 |" in line and "r1: 0.500, r2: 1.000 | 0.750 |" in line
    rows[2]["vattn"] = {"vmm_critical_path": {"host_ms": {"apply": 1.0}}}
    assert "| 1 vattn:h1 | apply 1 |" in serve_report.markdown(rows)
    pytest.importorskip("matplotlib")
    assert serve_report.plot(rows, str(tmp_path / "p.png"))


def test_await_idle_snapshot_waits_for_one_newer_than_the_client_end(tmp_path):
    """A vattn server is killed only once its idle snapshot (audit, step trace) is written, or
    after the timeout."""
    now = {"t": 0.0}
    sleeps = []

    def sleep(s):
        sleeps.append(s)
        now["t"] += s
        if len(sleeps) == 3:             # the engine goes idle while we wait
            (tmp_path / "vattn_metrics_7.json").write_text(json.dumps({"time": 50.0, "idle": True}))

    (tmp_path / "vattn_metrics_7.json").write_text(json.dumps({"time": 40.0, "idle": True}))   # an old one
    assert serve.await_idle_snapshot(str(tmp_path), since=45.0, clock=lambda: now["t"], sleep=sleep)
    assert len(sleeps) == 3
    sleeps.clear()
    now["t"] = 0.0
    assert not serve.await_idle_snapshot(str(tmp_path), since=60.0, timeout_s=1.0, poll_s=0.25,
                                         clock=lambda: now["t"], sleep=sleep)
    assert len(sleeps) == 4


# -- rounds of several runs ----------------------------------------------------------------------
def _run_dir(path, rows, *, rate=30.0, version="0.26.0", model="/a/tmp1/llama-1b-shape"):
    path.mkdir(parents=True)
    meta = {"engine": "vllm", "engine_version": version, "device": "cuda", "model": model,
            "workload": {"dataset": "shared-prefix", "num_prompts": 800, "input_len": 1024,
                         "output_len": 256, "rate": rate, "prefix_len": 512, "num_prefixes": 8,
                         "seed": 0, "warmups": 1},
            "modes": ["stock", "vattn"], "rounds": 1, "like_for_like": False, "engine_args": [],
            "date": "2026-12-08 00:47 UTC"}
    (path / "rows.json").write_text(json.dumps({"meta": meta, "rows": rows, "notes": []}))


def test_serve_rounds_pools_separate_runs_in_order_with_each_rounds_order(tmp_path, capsys):
    """Three calls of one round each (the order alternated) become rounds 1-3 of one table: the
    per-round ratios in call order, their median, and each round's order in the header; a
    model folder that differs only in its temporary parent still pools."""
    from vattn.cli import main
    _run_dir(tmp_path / "a" / "llama-1b-shape", [_row(1, "stock"), _row(1, "vattn", 1.25)])
    _run_dir(tmp_path / "b" / "llama-1b-shape", [_row(1, "vattn", 0.8), _row(1, "stock")],
             model="/other/tmp2/llama-1b-shape")
    _run_dir(tmp_path / "c", [_row(1, "stock"), _row(1, "vattn", 1.0)])
    args = ["bench", "serve-rounds", "--out", str(tmp_path / "out")]
    for name in "abc":
        args += ["--results", str(tmp_path / name)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "(order r1: stock, vattn; r2: vattn, stock; r3: stock, vattn," in out
    line = next(l for l in out.splitlines() if l.startswith("| TTFT p50"))
    ratios = [c.strip() for c in line.split("|")[4:6]]
    assert ratios[0].startswith("r1: ") and ", r2: " in ratios[0] and ", r3: 1.000" in ratios[0]
    assert float(ratios[1]) == 1.0                       # the median of three per-round ratios
    assert "- rounds" not in out and "- round 2: " in out
    pooled = json.loads((tmp_path / "out" / "rows.json").read_text())["rows"]
    assert [(r["round"], r["mode"]) for r in pooled] == [(1, "stock"), (1, "vattn"), (2, "vattn"),
                                                          (2, "stock"), (3, "stock"), (3, "vattn")]


def test_serve_rounds_refuses_runs_of_other_workloads_and_missing_results(tmp_path):
    from vattn.bench import serve_rounds
    from vattn.cli import run_command
    _run_dir(tmp_path / "a", [_row(1, "stock"), _row(1, "vattn")])
    _run_dir(tmp_path / "b", [_row(1, "stock"), _row(1, "vattn")], rate=40.0)
    with pytest.raises(ConfigError, match=r"different configurations \(workload: .*'rate': 30.0.* vs .*'rate': 40.0"):
        run_command(["bench", "serve-rounds", "--results", str(tmp_path / "a"), "--results", str(tmp_path / "b")])
    _run_dir(tmp_path / "c", [_row(1, "stock")], version="0.32.0")
    with pytest.raises(ConfigError, match="engine_version: '0.26.0' vs '0.32.0'"):
        serve_rounds.merge(serve_rounds.load([str(tmp_path / "a"), str(tmp_path / "c")]))
    with pytest.raises(ConfigError, match="no such folder"):
        run_command(["bench", "serve-rounds", "--results", str(tmp_path / "nope")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no rows.json"):
        run_command(["bench", "serve-rounds", "--results", str(tmp_path / "empty")])
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "rows.json").write_text("[]")
    with pytest.raises(ConfigError, match="is not a `bench serve` rows.json"):
        run_command(["bench", "serve-rounds", "--results", str(tmp_path / "bad")])


def test_serve_rounds_exits_non_zero_when_a_pooled_run_failed(tmp_path, capsys):
    from vattn.cli import main
    _run_dir(tmp_path / "a", [_row(1, "stock"), _row(1, "vattn")])
    _run_dir(tmp_path / "b", [_row(1, "stock"), {**_row(1, "vattn"), "error": "ServerError: died"}])
    assert main(["bench", "serve-rounds", "--results", str(tmp_path / "a")]) == 0
    assert main(["bench", "serve-rounds", "--results", str(tmp_path / "a"), "--results", str(tmp_path / "b")]) == 1
    assert "FAILED: ServerError: died" in capsys.readouterr().out
