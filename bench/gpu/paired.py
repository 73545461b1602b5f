"""Two engines alive at once, their generations alternated: a ratio that machine drift cannot bias.

Run one after the other, two engines' times also differ by whatever changed on the machine in
between (clocks, heat, other tenants); one engine's own generations spread by ~1 % on the H200.
Here both engines start (one after the other: vLLM sizes its KV from the memory free at start)
and stay up; then each round runs the same batch once on each, in the order A B, then B A, so
each pair of generations is measured under the same conditions and a trend cancels out.

Engine side: ``python -m vattn.bench.gpu.paired SPEC DIR`` builds the vLLM engine of a
:mod:`vattn.conformance.workers.vllm` spec, warms it up and writes ``DIR/ready.json``; then for each line ``gen N`` on
its stdin it times one generation of the batch into ``DIR/result.N.json``; ``stop`` writes
``DIR/final.json`` (the last tokens, the vattn metrics) and exits. With ``turn_tokens`` in the
spec each generation is the next turn of a conversation: the next prompt is the last one, the
engine's own reply and ``turn_tokens`` new user tokens (:func:`user_turn`), so every turn after
the first hits the conversation so far in the prefix cache.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from vattn.core.errors import ConfigError, VattnError

from vattn.conformance.runners.process import first_traceback, kill_group

__all__ = ["run_paired", "paired_summary", "serve", "user_turn"]


def user_turn(request: int, turn: int, n: int, vocab_size: int) -> list[int]:
    """The ``n`` user tokens of ``request``'s turn ``turn`` (seeded: the same for every engine)."""
    import random
    rng = random.Random(request * 1_000_003 + turn)
    return [rng.randrange(1, vocab_size) for _ in range(n)]


def _write(path: str, value) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(value, f)
    os.replace(path + ".tmp", path)    # the driver never reads a half-written file


def serve(spec: dict, folder: str, commands=None) -> None:
    """The engine side (see the module docstring); ``commands``: lines to act on (stdin)."""
    from vllm import LLM, SamplingParams

    from vattn.conformance.workers.vllm import _metrics, engine_kwargs
    start = time.perf_counter()
    llm = LLM(**engine_kwargs(spec))
    new = spec["max_new_tokens"]
    params = SamplingParams(max_tokens=new, min_tokens=new, temperature=0.0, ignore_eos=True,
                            detokenize=False)
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, detokenize=False), use_tqdm=False)
    _write(os.path.join(folder, "ready.json"), {"init_s": round(time.perf_counter() - start, 2)})
    outs, turn = [], spec.get("turn_tokens")
    for line in commands if commands is not None else sys.stdin:
        word, _, n = line.strip().partition(" ")
        if word == "gen":
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            _write(os.path.join(folder, f"result.{int(n)}.json"),
                   {"seconds": time.perf_counter() - t0, "prompt_tokens": sum(
                       len(p["prompt_token_ids"]) for p in prompts),
                    "cached_tokens": sum(o.num_cached_tokens or 0 for o in outs)})
            if turn:                                 # the conversation goes on
                vocab = llm.llm_engine.model_config.get_vocab_size()
                prompts = [{"prompt_token_ids": p["prompt_token_ids"] + list(o.outputs[0].token_ids)
                            + user_turn(i, int(n), turn, vocab)}
                           for i, (p, o) in enumerate(zip(prompts, outs))]
        elif word == "stop":
            break
    _write(os.path.join(folder, "final.json"), {
        "token_ids": [list(o.outputs[0].token_ids) for o in outs],
        "vattn_metrics": _metrics(llm)})


class _Engine:
    """One serving engine process of the driver."""

    def __init__(self, runner, spec: dict, folder: str):
        self.mode, self.folder = spec["run_name"], folder
        path = os.path.join(folder, "spec.json")
        _write(path, spec)
        self.log = runner.log_path(f"{self.mode}-paired") or os.path.join(folder, "engine.log")
        self._sink = open(self.log, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vattn.bench.gpu.paired", path, folder], env=runner.env_for(spec),
            stdin=subprocess.PIPE, stdout=self._sink, stderr=subprocess.STDOUT, text=True,
            start_new_session=True)

    def wait_for(self, name: str, timeout_s: float) -> dict:
        """The JSON the engine writes as ``name``, once it exists; a typed error if the engine
        exits or ``timeout_s`` passes first."""
        path, deadline = os.path.join(self.folder, name), time.monotonic() + timeout_s
        while not os.path.exists(path):
            if self.proc.poll() is not None:
                raise VattnError(f"vLLM {self.mode} engine exited ({self.proc.returncode}) before "
                                 f"{name}{first_traceback(self.log)}")
            if time.monotonic() > deadline:
                raise VattnError(f"vLLM {self.mode} engine wrote no {name} within {timeout_s:.0f} s")
            time.sleep(0.05)
        with open(path) as f:
            return json.load(f)

    def send(self, line: str) -> None:
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError) as exc:   # the engine is gone
            raise VattnError(f"vLLM {self.mode} engine exited ({self.proc.poll()}) before "
                             f"{line!r}{first_traceback(self.log)}") from exc

    def close(self) -> None:
        kill_group(self.proc.pid)   # the engine core may be a grandchild: the whole group
        self.proc.wait()
        for stream in (self.proc.stdin, self._sink):
            try:
                stream.close()
            except OSError:          # a pipe whose reader is gone
                pass


def run_paired(runner, modes, model_dir: str, prompts, max_new_tokens: int, *, rounds: int,
               device: str, dtype: str, start_timeout_s: float = 420.0,
               run_timeout_s: float = 300.0) -> dict:
    """Start the engines of ``modes`` (two) one after the other, then ``rounds`` rounds of one
    generation each, alternating the order; ``{mode: {seconds_each, init_s, token_ids,
    vattn_metrics}}``. ``runner`` is a :class:`~vattn.conformance.runners.vllm.VllmRunner`
    (specs, environments, logs)."""
    modes = list(modes)
    if len(modes) != 2 or modes[0] == modes[1]:
        raise ConfigError(f"paired runs take two different modes, got {modes}")
    if rounds < 1:
        raise ConfigError(f"rounds must be >= 1, got {rounds}")
    engines: dict[str, _Engine] = {}
    with tempfile.TemporaryDirectory(prefix="vattn-paired-") as tmp:
        try:
            out = {}
            for mode in modes:                  # one at a time: each sizes its KV from free memory
                spec = runner.spec_for(mode, model_dir, prompts, max_new_tokens, logprobs=0,
                                       device=device, dtype=dtype)
                folder = os.path.join(tmp, mode.replace("/", "_"))
                os.makedirs(folder)
                engines[mode] = _Engine(runner, spec, folder)
                out[mode] = dict(engines[mode].wait_for("ready.json", start_timeout_s), seconds_each=[],
                                 cached_tokens_each=[], prompt_tokens_each=[])
            for r in range(rounds):
                for mode in (modes if r % 2 == 0 else modes[::-1]):
                    engines[mode].send(f"gen {r}")
                    got = engines[mode].wait_for(f"result.{r}.json", run_timeout_s)
                    out[mode]["seconds_each"].append(round(got["seconds"], 4))
                    out[mode]["cached_tokens_each"].append(got.get("cached_tokens"))   # prefix-cache hits
                    out[mode]["prompt_tokens_each"].append(got.get("prompt_tokens"))
            for mode, engine in engines.items():
                engine.send("stop")
                out[mode] |= engine.wait_for("final.json", run_timeout_s)
            return out
        finally:
            for engine in engines.values():
                engine.close()


def paired_summary(results: dict, baseline: str) -> dict:
    """Per-round ratios ``baseline time / other time`` (> 1: the other is faster) and their
    median, beside each mode's median time."""
    other = next(m for m in results if m != baseline)
    base, them = results[baseline]["seconds_each"], results[other]["seconds_each"]
    ratios = [round(b / t, 4) for b, t in zip(base, them)]
    return {"baseline": baseline, "other": other, "ratios": ratios,
            "median_ratio": round(statistics.median(ratios), 4),
            "median_s": {m: round(statistics.median(r["seconds_each"]), 4) for m, r in results.items()}}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as f:
        spec = json.load(f)
    serve(spec, argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
