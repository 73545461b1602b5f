"""``vattn compare --shape`` on the CPU: what each engine would be started with on the GPU (both
shapes), the table of GPU-like records (fixtures ``tests/fixtures/compare/gpu_h200``), the
worker's GPU setup (config-only model, the GPU stages' prompts), the deadline, an interruption,
the refusals, and ``tools/gpu/compare.sh``'s plumbing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vattn.bench.gpu.workloads import SHARED_PREFIX, workload_prompts
from vattn.cli import run_command
from vattn.conformance import compare_gpu, compare_worker
from vattn.conformance.compare_records import tokens_sha256
from vattn.conformance.protocol import RunResult

from tests.test_cli_errors import refused  # noqa: E402  (one line, exit status 2)

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "compare"
GPU, CPU_A = str(FIXTURES / "gpu_h200"), str(FIXTURES / "machine_a")
_ENV = ("VATTN_VLLM", "VATTN_VLLM_EXACT", "VATTN_SGLANG", "VLLM_USE_V2_MODEL_RUNNER",
        "VLLM_ALLOW_INSECURE_SERIALIZATION", "SGLANG_USE_SGL_FA3_KERNEL", "VATTN_STAGE_DEADLINE")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for key in _ENV:
        monkeypatch.delenv(key, raising=False)


def _dry(capsys, *argv) -> dict:
    assert run_command(["compare", "--dry-run", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def _rows(md: str) -> list[str]:
    return [line for line in md.splitlines() if line.startswith("| ") and not line.startswith("| engine |")]


# -- what each engine is started with ---------------------------------------------------------------
@pytest.mark.parametrize("shape", ["llama3-8b-shape", "llama-1b-shape"])
def test_every_engine_starts_with_its_defaults_plus_vattn(capsys, tmp_path, shape):
    got = _dry(capsys, "--shape", shape, "--models-dir", str(tmp_path))
    model = str(tmp_path / f"{shape}-config-seed0")
    assert (got["model"], got["model_label"], got["device"], got["dtype"]) == (model, shape, "cuda", "bfloat16")
    assert got["workload"] == {"name": "decode-heavy", "prompts": 256, "prompt_len": [512, 512],
                               "max_new_tokens": 512}
    assert got["rounds"] == 3 and not (tmp_path / f"{shape}-config-seed0").exists()   # nothing built
    # vLLM: its own sizing (no max_model_len / max_num_seqs / memory), prefix caching at its default
    # (not passed), CUDA graphs, dummy weights; only the backend and VATTN_VLLM differ
    vllm = got["engines"]["vllm"]
    both = {"model": model, "skip_tokenizer_init": True, "dtype": "bfloat16", "seed": 0, "enforce_eager": False,
            "load_format": "dummy"}
    assert vllm["modes"]["stock"]["LLM"] == dict(both, attention_backend="FLASH_ATTN", block_size=16)
    assert vllm["modes"]["vattn"]["LLM"] == dict(both, attention_backend="CUSTOM")
    runner_env = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1", "VLLM_USE_V2_MODEL_RUNNER": "1"}
    assert vllm["modes"]["stock"]["env"] == runner_env
    assert vllm["modes"]["vattn"]["env"] == dict(runner_env, VATTN_VLLM="1", VATTN_VLLM_EXACT="0")
    assert vllm["weights"] == "dummy" and vllm["runner"]["engine_args"] == compare_gpu.VLLM_ARGS
    # SGLang: its own sizing and radix cache, decode CUDA graphs, prefill eager in both modes
    sglang = got["engines"]["sglang"]
    both = {"model_path": model, "sampling_backend": "pytorch", "skip_tokenizer_init": True, "dtype": "bfloat16",
            "log_level": "error", "random_seed": 0, "disable_prefill_cuda_graph": True, "load_format": "dummy"}
    assert sglang["modes"]["stock"]["sglang.Engine"] == dict(both, attention_backend="fa3")
    assert sglang["modes"]["vattn"]["sglang.Engine"] == dict(both, attention_backend="vattn")
    assert sglang["modes"]["stock"]["env"] == {"SGLANG_USE_SGL_FA3_KERNEL": "1"}
    assert sglang["modes"]["vattn"]["env"] == {"SGLANG_USE_SGL_FA3_KERNEL": "1", "VATTN_SGLANG": "1"}
    # transformers: the seeded weights, continuous batching as on the H200 runs, paged|sdpa vs paged|vattn
    tf = got["engines"]["transformers"]
    assert tf["weights"] == "seeded" and tf["runner"] == {"block_size": 256, "max_batch_tokens": 2048}
    cb = tf["modes"]["stock"]["ContinuousBatchingConfig"]
    assert (cb["block_size"], cb["num_blocks"], cb["max_batch_tokens"], cb["max_requests_per_batch"]) == \
        (256, 256 * 5, 2048, 256)
    assert tf["modes"]["vattn"]["ContinuousBatchingConfig"] == cb
    assert tf["modes"]["vattn"]["vattn.adapters.transformers.enable"] == {"max_slots": 257, "max_context": 1024}
    assert tf["modes"]["stock"]["attn_implementation"] == "paged|sdpa"
    assert "CPU only" in got["engines"]["tgi"]["unsupported"]


def test_engine_options_reach_both_modes_of_their_engine_only(capsys, tmp_path):
    got = _dry(capsys, "--shape", "llama-1b-shape", "--workloads", "long-context,decode-heavy",
               "--engines", "vllm,sglang,transformers", "--python", f"vllm={sys.executable}",
               "--engine-option", "vllm:max_model_len=32768", "--engine-option", "vllm:max_num_seqs=256",
               "--engine-option", "sglang:mem_fraction_static=0.8",
               "--engine-option", "transformers:max_batch_tokens=8192", "--models-dir", str(tmp_path))
    assert got["workload"] == {"name": "long-context", "prompts": 8, "prompt_len": [65536, 65536],
                               "max_new_tokens": 64}
    assert list(got["engines"]) == ["vllm", "sglang", "transformers"]
    assert got["engines"]["vllm"]["python"] == sys.executable
    for mode in ("stock", "vattn"):
        llm = got["engines"]["vllm"]["modes"][mode]["LLM"]
        assert (llm["max_model_len"], llm["max_num_seqs"]) == (32768, 256) and "mem_fraction_static" not in llm
        engine = got["engines"]["sglang"]["modes"][mode]["sglang.Engine"]
        assert engine["mem_fraction_static"] == 0.8 and "max_model_len" not in engine
        assert got["engines"]["transformers"]["modes"][mode]["ContinuousBatchingConfig"]["max_batch_tokens"] == 8192


def test_the_shape_model_is_config_only_and_the_prompts_are_the_gpu_stages(tmp_path):
    spec = {"shape": "llama3-8b-shape", "layers": 2, "seed": 3, "models_dir": str(tmp_path)}
    path = compare_gpu.build_model_dir(spec)
    assert path == str(tmp_path / "llama3-8b-shape-2l-config-seed3")
    cfg = json.loads((Path(path) / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["max_position_embeddings"], cfg["head_dim"]) == (2, 131072, 128)
    assert cfg["architectures"] == ["LlamaForCausalLM"] and not (Path(path) / "model.safetensors").exists()
    assert json.loads((Path(path) / "vattn_model.json").read_text())["seed"] == 3
    assert compare_gpu.SHAPES["llama-1b-shape"]["head_dim"] == 64
    wl = compare_gpu.workload("shared-prefix", vocab_size=1000, seed=4, num=5)
    assert wl.prompts == workload_prompts("shared-prefix", 1000, seed=4)[:5] and wl.max_new_tokens == 128
    assert len({tuple(p[:SHARED_PREFIX]) for p in wl.prompts}) == 1 and wl.arrival_times is None


def test_help_documents_the_gpu_setup(capsys):
    from vattn.cli import main
    assert main(["compare", "--help"]) == 0
    out = capsys.readouterr().out
    for text in ("--shape", "llama3-8b-shape", "llama-1b-shape", "--workloads", "long-context", "shared-prefix",
                 "--dry-run", "ENGINE:KEY=VALUE", "vllm:max_model_len=32768", "--hbm-tbps", "dummy weights",
                 "VATTN_STAGE_DEADLINE", "tools/gpu/compare.sh"):
        assert text in out, text


# -- refusals --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, expected", [
    (["--shape", "llama-1b-shape", "--model", "tiny"],
     "ConfigError: --shape picks the model and the workload table: expected no --model with it"),
    (["--shape", "llama-1b-shape", "--workload", "decode-heavy"], "expected no --workload with it"),
    (["--shape", "llama-1b-shape", "--workloads", "identity"],
     "ConfigError: --workloads with --shape: expected names from decode-heavy, prefill-heavy, long-context, "
     "shared-prefix, decode-light, got ['identity']"),
    (["--workloads", "long-context"], "ConfigError: --workloads without --shape: expected names from identity"),
    (["--workloads", "multi-turn"], "argument --workloads: expected a comma-separated list of"),
    (["--workloads", "decode-heavy", "--workload", "decode-heavy"], "--workloads and --workload name the same"),
    (["--shape", "llama-1b-shape", "--engine-option", "transformers:no_such_option=1"],
     "ConfigError: --engine-option transformers: expected options of its runner"),
    (["--results", GPU, "--shape", "llama-1b-shape"], "expected no run option with it, got --shape"),
    (["--results", GPU, "--dry-run"], "expected no run option with it, got --dry-run"),
    (["--results", GPU, CPU_A], "cannot merge runs of different model shapes"),
])
def test_bad_shape_command_lines_are_one_line(capsys, argv, expected):
    assert expected in refused(capsys, "compare", *argv)


# -- the table of GPU records ------------------------------------------------------------------------
def test_gpu_records_table(tmp_path):
    assert run_command(["compare", "--results", GPU, "--out", str(tmp_path)]) == 0
    md = (tmp_path / "compare.md").read_text()
    tf, vllm, sglang, tgi = _rows(md)
    assert vllm.startswith("| vllm 0.26.0 | decode-heavy | 6.050 (6.020–6.100) | 6.000 (5.980–6.050) | "
                           "**1.012×** (0.995–1.017, 3 rounds) | near-ties only (1 of 4 prompts diverge at a "
                           "near-tie, worst gap 0.020 nats) | 7.90 MiB | 0.32 % (19.0 ms of apply_step, on_blocks) | "
                           "6 % (≥ 264 GB/s of 4.27 TB/s) |")
    # dummy weights: degenerate outputs are noted, not a failure
    assert "exact tokens (4/4 prompts); outputs degenerate (" in sglang and "dummy weights, a weak check" in sglang
    assert "0.42 % (24.2 ms of alloc_extend, alloc_decode, free)" in sglang
    # a run the deadline cut to 2 of 3 rounds says so in its ratio cell
    assert "**4.380×** (4.316–4.444, 2 rounds); stopped after 2 of 3 rounds: 40 s left" in tf
    assert tgi.startswith("| tgi | — | **not installed**: no module 'text_generation_server'")
    assert "131072 positions, bfloat16, config only: the engine's dummy weights (load_format=dummy); seeded" in md
    assert "Workload `decode-heavy` (the GPU stages' table, seed 0): 4 prompts of 512–512 tokens" in md
    assert "- vllm 0.26.0: cuda (NVIDIA H200)" in md and "copy bandwidth 4.27 TB/s (measured: 4 GiB" in md
    # --hbm-tbps wins over the records' own measurement
    assert run_command(["compare", "--results", GPU, "--out", str(tmp_path / "b"), "--hbm-tbps", "2.0"]) == 0
    assert "| 13 % (≥ 264 GB/s of 2.0 TB/s) |" in _rows((tmp_path / "b" / "compare.md").read_text())[1]


# -- the worker's GPU setup -----------------------------------------------------------------------------
class _Runner:
    name, modes = "fake", ("stock", "vattn")

    def __init__(self, fail_at: int | None = None, clock: dict | None = None):
        self.calls, self.timeouts, self.fail_at, self.clock = [], [], fail_at, clock
        self.timeout_s = 900.0

    def run(self, mode, model_dir, prompts, max_new_tokens, **kw):
        self.calls.append(mode)
        self.timeouts.append(self.timeout_s)
        if self.clock is not None:
            self.clock["left"] -= 200
        if len(self.calls) == self.fail_at:
            raise SystemExit(143)                   # what SIGTERM raises in the worker
        ids = [[(i + j) % 50 + 1 for j in range(max_new_tokens)] for i in range(len(prompts))]
        if mode == "vattn":
            ids[1][3] = 999
        lps = [[{t: -0.5, t + 1: -0.51} for t in req] for req in ids]
        return RunResult(token_ids=ids, logprobs=lps, seconds=0.5, num_prompt_tokens=1,
                         num_generated_tokens=sum(map(len, ids)), extra={"vattn_metrics": None})


def _spec(tmp_path, **more) -> dict:
    return {"engine": "fake", "out_dir": str(tmp_path / "out"), "shape": "llama-1b-shape", "model": "llama-1b-shape",
            "model_label": "llama-1b-shape (1 layers)", "layers": 1, "models_dir": str(tmp_path / "m"),
            "device": "cuda", "dtype": "bfloat16", "size": "gpu-stages", "seed": 0, "workloads": ["decode-heavy"],
            "num_requests": 3, "rounds": 3, "logprobs": 5, "gpu": "FAKE GPU", "hbm_copy_tbps": 4.0,
            "hbm_copy_source": "given: --hbm-tbps", **more}


def test_worker_runs_the_shape_with_the_gpu_stages_prompts(tmp_path, monkeypatch):
    runner = _Runner()
    monkeypatch.setattr(compare_worker, "_runner", lambda spec: runner)
    recs = {json.loads(Path(p).read_text())["mode"]: json.loads(Path(p).read_text())
            for p in compare_worker.run_engine(_spec(tmp_path))}
    assert runner.calls == ["stock", "vattn"] * 3 and runner.timeouts == [900.0] * 6   # no deadline
    stock, vattn = recs["stock"], recs["vattn"]
    assert stock["workload"]["prompts_sha256"] == tokens_sha256(workload_prompts("decode-heavy", 128256, seed=0)[:3])
    assert (stock["workload"]["num_prompts"], stock["workload"]["max_new_tokens"]) == (3, 512)
    assert stock["model"]["config"]["max_position_embeddings"] == 131072
    assert stock["model"]["config"]["num_hidden_layers"] == 1
    assert not list((tmp_path / "m").glob("*/model.safetensors"))                    # config only
    assert (vattn["gpu"], vattn["hbm_copy_tbps"], vattn["weights"]) == ("FAKE GPU", 4.0, "seeded")
    assert vattn["rounds_planned"] == 3 and vattn["stopped"] is None and vattn["shape"] == "llama-1b-shape"
    # only the verdict's log-probs are kept: prompt 1's first divergence, position 3
    kept = [(i, j) for i, req in enumerate(vattn["logprobs"]) for j, lp in enumerate(req) if lp]
    assert kept == [(1, 3)] and [(i, j) for i, req in enumerate(stock["logprobs"]) for j, lp in enumerate(req)
                                  if lp] == [(1, 3)]


def test_worker_keeps_each_run_inside_the_deadline(tmp_path, monkeypatch):
    clock = {"left": 1000.0}
    runner = _Runner(clock=clock)
    monkeypatch.setattr(compare_worker, "_runner", lambda spec: runner)
    monkeypatch.setattr(compare_worker, "_time_left", lambda: clock["left"])
    compare_worker.run_engine(_spec(tmp_path))
    # each run's limit ends 15 s before the deadline (30 s at least); restored afterwards
    assert runner.timeouts == [900.0, 785.0, 585.0, 385.0, 185.0, 30.0] and runner.timeout_s == 900.0


def test_deadline_stops_rounds_that_would_not_end_in_time(monkeypatch):
    monkeypatch.setenv("VATTN_STAGE_DEADLINE", str(compare_worker.time.time() + 60))
    reasons = []
    stop = compare_worker.deadline_stop(3, reasons)
    assert stop([30.0]) is None                       # 1.1 * 30 + 15 = 48 s fit in 60
    assert stop([30.0, 45.0]).startswith("stopped after 2 of 3 rounds: ") and len(reasons) == 1
    calls = []
    got = compare_worker.alternate_rounds(("stock", "vattn"), 3, lambda m: calls.append(m) or len(calls),
                                          stop=lambda took: "enough" if len(took) == 2 else None)
    assert calls == ["stock", "vattn"] * 2 and [r["round"] for r in got["vattn"]] == [1, 2]


def test_an_interrupted_worker_keeps_its_whole_rounds(tmp_path, monkeypatch):
    runner = _Runner(fail_at=4)                       # SIGTERM in round 2's vattn run
    monkeypatch.setattr(compare_worker, "_runner", lambda spec: runner)
    with pytest.raises(compare_worker._Stopped) as stopped:
        compare_worker.run_engine(_spec(tmp_path))
    recs = [json.loads(Path(p).read_text()) for p in stopped.value.paths]
    assert [(r["mode"], len(r["rounds"])) for r in recs] == [("stock", 1), ("vattn", 1)]
    assert recs[1]["stopped"].startswith("interrupted (SystemExit 143) in round 2")


# -- tools/gpu/compare.sh ---------------------------------------------------------------------------------
def test_wrapper_documents_its_knobs_and_runs_an_engine_that_is_missing(tmp_path):
    script = REPO / "tools" / "gpu" / "compare.sh"
    text = script.read_text()
    for knob in ("VATTN_ENGINES", "VATTN_SHAPE", "VATTN_WORKLOADS", "VATTN_ROUNDS", "VATTN_ENGINE_OPTIONS",
                 "VATTN_VLLM_SITE", "VATTN_SITE", "VATTN_BUDGET_S", "VATTN_HBM_TBPS", "--dry-run", "--results"):
        assert knob in text, knob
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    # plumbing only (no GPU here): python3 = this Python, TGI missing -> its row, merged, packed
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    out = tmp_path / "out"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(out), VATTN_ENGINES="tgi",
               VATTN_HBM_TBPS="4.27", VATTN_SHAPE="llama-1b-shape")
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    summary = (out / "compare_summary.txt").read_text()
    assert "== compare_tgi (limit" in summary and "== merge: rc=1" in summary    # 1: no engine compared
    assert _rows((out / "compare.md").read_text())[0].startswith("| tgi | — | **not installed**")
    assert (out / "compare_results.tgz").stat().st_size > 0
