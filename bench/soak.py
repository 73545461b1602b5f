"""``vattn bench soak``: an engine's own server under long mixed load, with aborts; does it leak?

One server of the engine (``vllm serve`` or SGLang's ``launch_server``, started as ``vattn bench
serve`` starts it: :mod:`.serve_engines`) with vattn (or ``--mode stock`` for a baseline) gets
``--requests`` streamed completions (:mod:`.soak_client`: lengths log-uniform in ``--input-len``
/ ``--output-len``, a share starting with shared prefixes so the engine's prefix cache works, a
share aborted mid-stream by the client) at Poisson arrivals of ``--rate`` requests/s, for at
most ``--duration`` seconds. Every ``--sample-s`` seconds it samples the server's process group
(RSS, open fds, threads), the GPU's used memory (``nvidia-smi``) and the engine's vattn metrics
(``VATTN_METRICS``, :mod:`vattn.core.snapshots`: pages mapped and free, slots held). After the
load: every request answered, one last 1-token request (the engines release a finished request at their
next step), then the idle snapshot the engine wrote with the core's page audit.

Checks (:func:`.soak_report.verdicts`): no request failed (HTTP error, broken stream, or fewer
tokens than asked with ``ignore_eos``), the server still healthy, fds / RSS / GPU memory flat
over the second half of the load, the audit clean and no slot held after the load. Written
under ``--out``: ``samples.jsonl`` (as it runs), ``requests.jsonl``, ``result.json``,
``soak.md`` and ``soak.png``; a status line every ``--progress-s`` seconds. Exit status 1 when
a check fails.

Example::

    vattn bench soak --engine vllm --preset llama-1b-shape --requests 100000 --rate 200 \\
        --duration 540 --out runs/soak
    vattn bench soak --engine vllm --model DIR --device cpu --requests 2000 --rate 8 \\
        --input-len 1:512 --output-len 1:64 --out runs/soak-cpu
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict

from vattn import argtypes
from vattn.core.snapshots import METRICS_ENV, read_snapshot

from . import soak_report
from .report import command_line
from .serve import add_server_arguments, check_engine, device_for, prepare_model, rate, sigterm_raises
from .serve_engines import MODES, Server, free_port, server_command
from .soak_client import LoadSpec, Request, Result, one_request, plan_requests, run_load

__all__ = ["add_arguments", "run", "process_group_usage", "engine_prefix_cache"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_server_arguments(parser)
    parser.add_argument("--mode", choices=MODES, default="vattn", help="the server's mode")
    parser.add_argument("--requests", type=argtypes.positive_int, default=100_000,
                        help="requests to send (fewer when --duration ends the load first)")
    parser.add_argument("--duration", type=argtypes.positive_float, default=540.0,
                        help="seconds of load at most (requests sent by then still finish)")
    parser.add_argument("--rate", type=rate, default=100.0, help="arrivals per second (Poisson), or inf")
    parser.add_argument("--input-len", type=argtypes.int_range, default=(1, 8192), help="LOW:HIGH tokens")
    parser.add_argument("--output-len", type=argtypes.int_range, default=(1, 1024), help="LOW:HIGH tokens")
    parser.add_argument("--abort", type=argtypes.share, default=0.05,
                        help="share of requests the client hangs up on mid-stream")
    parser.add_argument("--prefix-share", type=argtypes.share, default=0.3,
                        help="share of requests starting with one of --prefixes shared prefixes")
    parser.add_argument("--prefixes", type=argtypes.positive_int, default=4)
    parser.add_argument("--prefix-len", type=argtypes.positive_int, default=1024)
    parser.add_argument("--max-in-flight", type=argtypes.positive_int, default=512,
                        help="open requests at most (later arrivals wait in the client)")
    parser.add_argument("--sample-s", type=argtypes.positive_float, default=2.0)
    parser.add_argument("--progress-s", type=argtypes.positive_float, default=15.0)
    parser.add_argument("--request-timeout", type=argtypes.positive_float, default=600.0)
    parser.add_argument("--seed", type=argtypes.non_negative_int, default=0)
    parser.add_argument("--server-env", action="append", default=[], type=_env_pair, metavar="KEY=VALUE",
                        help="set in the server's environment (repeatable), e.g. "
                             "VATTN_FAULT_DRILL=map:0.05 to fail driver calls while it serves")


def _env_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key or not key.replace("_", "").isalnum():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


# -- what the server uses ---------------------------------------------------------------------------
def _children(pgid: int) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:                   # field 5 of stat: the process group
            pids.append(int(name))
    return pids


def process_group_usage(pgid: int) -> dict:
    """RSS (MB), open fds, threads and processes of every process in group ``pgid``, and each
    process's RSS (``rss_by_proc``: ``{"name:pid": MB}``, to tell the API server from the engine)."""
    rss_kb = fds = threads = procs = 0
    by_proc = {}
    for pid in _children(pgid):
        try:
            mine = 0
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("Name:"):
                        name = line.split(None, 1)[1].strip()
                    elif line.startswith("VmRSS:"):
                        mine = int(line.split()[1])
                    elif line.startswith("Threads:"):
                        threads += int(line.split()[1])
            fds += len(os.listdir(f"/proc/{pid}/fd"))
            rss_kb += mine
            by_proc[f"{name}:{pid}"] = round(mine / 1024, 1)
            procs += 1
        except OSError:                              # gone meanwhile, or not ours to read
            continue
    return {"rss_mb": rss_kb / 1024, "fds": fds, "threads": threads, "procs": procs,
            "rss_by_proc": by_proc}


def gpu_used_mb() -> float | None:
    """The GPU's used memory (``nvidia-smi``, first GPU), ``None`` without one."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout.split()
        return float(out[0]) if out else None
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return None


_SNAPSHOT_KEYS = ("pages_mapped", "pages_free", "pages_total", "active_slots", "keys_held",
                  "requests_holding_slots", "idle", "steps", "mapped_bytes")


def _model_limits(model: str, engine_args: list[str]) -> tuple[int, int]:
    """``(max_model_len, vocab)`` of a model directory (``--max-model-len`` /
    ``--context-length`` among the engine arguments override the config)."""
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    limit = int(cfg.get("max_position_embeddings", 4096))
    for flag in ("--max-model-len", "--context-length"):
        if flag in engine_args and engine_args.index(flag) + 1 < len(engine_args):
            limit = int(engine_args[engine_args.index(flag) + 1])
    return limit, int(cfg.get("vocab_size", 1000))


def _served_name(base_url: str, fallback: str) -> str:
    try:
        with urllib.request.urlopen(base_url + "/v1/models", timeout=10) as resp:
            data = json.load(resp).get("data") or []
        return data[0]["id"] if data else fallback
    except (OSError, ValueError, KeyError):
        return fallback


def engine_prefix_cache(base_url: str) -> dict | None:
    """The engine's own prefix-cache counters from its Prometheus ``/metrics``: ``{"queries",
    "hits", "hit_rate"}`` (vLLM: tokens; SGLang: its ``cache_hit_rate`` gauge), ``None`` when the
    server exports none."""
    try:
        with urllib.request.urlopen(base_url + "/metrics", timeout=10) as resp:
            text = resp.read().decode(errors="replace")
    except OSError:
        return None
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.split("{", 1)[0].split(" ", 1)[0], line.rsplit(" ", 1)[1]
        for key, metric in (("queries", "vllm:prefix_cache_queries_total"),
                            ("hits", "vllm:prefix_cache_hits_total"), ("rate", "sglang:cache_hit_rate")):
            if name == metric:
                sums[key] = sums.get(key, 0.0) + float(value)
    if "queries" in sums:
        q, h = sums["queries"], sums.get("hits", 0.0)
        return {"queries": q, "hits": h, "hit_rate": h / q if q else 0.0}
    return {"hit_rate": sums["rate"]} if "rate" in sums else None


# -- the run ----------------------------------------------------------------------------------------
class _Soak:
    """The load, the sampler and the status line of one soak."""

    def __init__(self, args, server: Server, metrics_path: str, name: str, requests: list[Request]):
        self.args, self.server, self.metrics_path, self.name = args, server, metrics_path, name
        self.requests = requests
        self.counts = {"sent": 0, "ok": 0, "aborted": 0, "errors": 0}
        self.first_errors: list[str] = []
        self.tokens = {"input": 0, "output": 0}
        self.samples: list[dict] = []
        self.phase = "load"
        self.t0 = time.monotonic()
        self._req_log = open(os.path.join(args.out, "requests.jsonl"), "w")
        self._sample_log = open(os.path.join(args.out, "samples.jsonl"), "w")
        self._last_progress = 0.0
        #: when a process of the server's group that was up at the first sample was gone (an
        #: engine process died: the API server may still answer, with errors), else None
        self.died_at: float | None = None
        self.halt = asyncio.Event()

    def on_done(self, res: Result) -> None:
        key = {"ok": "ok", "aborted": "aborted"}.get(res.status, "errors")
        self.counts[key] += 1
        if key == "errors" and len(self.first_errors) < 5:
            self.first_errors.append(f"request {res.index}: {res.error}")
        self.tokens["input"] += res.input_len
        self.tokens["output"] += res.output_tokens
        self._req_log.write(json.dumps(asdict(res)) + "\n")

    def sample(self) -> dict:
        done = self.counts["ok"] + self.counts["aborted"] + self.counts["errors"]
        s = {"t": round(time.monotonic() - self.t0, 2), "phase": self.phase, **self.counts,
             "in_flight": self.counts["sent"] - done}
        s |= process_group_usage(self.server.proc.pid) if self.server.proc else {}
        s["gpu_mb"] = gpu_used_mb()
        snap = read_snapshot(self.metrics_path) if self.metrics_path else None
        if snap:
            s |= {k: snap.get(k) for k in _SNAPSHOT_KEYS}
            s["snapshot_age_s"] = round(time.time() - snap["time"], 1)
        if self.died_at is None and self.samples and s.get("procs") is not None \
                and s["procs"] < (self.samples[0].get("procs") or 0):
            self.died_at = s["t"]
            print(f"[soak {s['t']:7.0f} s] the server lost a process ({self.samples[0]['procs']} -> "
                  f"{s['procs']}): the engine died; no more requests are sent", file=sys.stderr, flush=True)
        self.samples.append(s)
        self._sample_log.write(json.dumps(s) + "\n")
        self._sample_log.flush()
        return s

    def progress(self, s: dict, force: bool = False) -> None:
        if not force and s["t"] - self._last_progress < self.args.progress_s:
            return
        self._last_progress = s["t"]
        pages = f", pages mapped {s['pages_mapped']:,}" if s.get("pages_mapped") is not None else ""
        gpu = f", GPU {s['gpu_mb']:,.0f} MB" if s.get("gpu_mb") is not None else ""
        print(f"[soak {s['t']:7.0f} s] sent {s['sent']:,}, ok {s['ok']:,}, aborted {s['aborted']:,}, "
              f"errors {s['errors']:,}, in flight {s['in_flight']}, RSS {s.get('rss_mb', 0):,.0f} MB, "
              f"fds {s.get('fds', 0)}{gpu}{pages}", file=sys.stderr, flush=True)

    async def sampler(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            s = await asyncio.to_thread(self.sample)
            self.progress(s)
            if self.died_at is not None:
                self.halt.set()
            try:
                await asyncio.wait_for(stop.wait(), self.args.sample_s)
            except TimeoutError:
                pass

    async def load(self) -> list[Result]:
        a = self.args

        def count_sent(req):
            self.counts["sent"] += 1

        stop = asyncio.Event()
        sampler = asyncio.create_task(self.sampler(stop))
        try:
            results = await run_load(self.server.base_url, self.name, self.requests,
                                     max_in_flight=a.max_in_flight, timeout_s=a.request_timeout,
                                     on_send=count_sent, on_done=self.on_done, stop_after_s=a.duration, halt=self.halt)
        finally:
            stop.set()
            await sampler
        return results

    def close(self) -> None:
        self._req_log.close()
        self._sample_log.close()


async def _final(soak: _Soak, host: str, port: int, idle_wait_s: float) -> dict | None:
    """One last 1-token request, then the idle snapshot written after it (``None``: none came,
    or no snapshot is asked for: stock)."""
    soak.phase = "final"
    last = Request(-1, 0.0, [1], 1, None, None)
    res = await one_request(host, port, soak.name, last, soak.t0, 120.0)
    if res.status != "ok":
        soak.first_errors.append(f"the last 1-token request: {res.error}")
        soak.counts["errors"] += 1
    if not soak.metrics_path:
        return None
    marker = time.time()
    deadline = time.monotonic() + idle_wait_s
    while time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        snap = read_snapshot(soak.metrics_path)
        if snap and snap.get("idle") and snap["time"] >= marker:
            return snap
    snap = read_snapshot(soak.metrics_path)
    return snap if snap and snap.get("idle") else None


def run(args: argparse.Namespace) -> int:
    """Run ``vattn bench soak``; 0 when every check passed."""
    version = check_engine(args.engine, args.python)
    os.makedirs(args.out, exist_ok=True)
    device = device_for(args.device)
    model = prepare_model(args)
    max_len, vocab = _model_limits(model, args.engine_args)
    spec = LoadSpec(num_requests=args.requests, rate=args.rate, input_len=args.input_len,
                    output_len=args.output_len, abort_share=args.abort, prefix_share=args.prefix_share,
                    num_prefixes=args.prefixes, prefix_len=args.prefix_len, vocab=vocab,
                    max_model_len=max_len, seed=args.seed)
    requests = plan_requests(spec)
    host, port = "127.0.0.1", free_port()
    server_spec = server_command(args.engine, args.mode, model, port=port, device=device,
                                 extra_args=args.engine_args, host=host)
    metrics_path = os.path.abspath(os.path.join(args.out, "vattn_metrics.json"))
    if os.path.exists(metrics_path):
        os.remove(metrics_path)
    server_spec.env[METRICS_ENV] = metrics_path if args.mode == "vattn" else None
    server_spec.env.update(dict(args.server_env))
    title = (f"{args.engine} {version} soak ({args.mode}), {os.path.basename(model)}, {device}: "
             f"in {spec.input_len[0]}–{spec.input_len[1]}, out {spec.output_len[0]}–{spec.output_len[1]} "
             f"tokens, {args.rate:g} req/s, {spec.abort_share:.0%} aborted, {spec.prefix_share:.0%} "
             f"on {spec.num_prefixes} shared prefixes of {spec.prefix_len}")
    previous = signal.signal(signal.SIGTERM, sigterm_raises)
    server = Server(server_spec, python=args.python, log_path=os.path.join(args.out, "server.log"),
                    timeout_s=args.server_timeout, host=host)
    try:
        with server:
            name = _served_name(server.base_url, model)
            soak = _Soak(args, server, metrics_path if args.mode == "vattn" else "", name, requests)
            try:
                start = time.monotonic()
                results = asyncio.run(soak.load())
                load_s = time.monotonic() - start
                final = asyncio.run(_final(soak, host, port, idle_wait_s=30.0))
                soak.progress(soak.sample(), force=True)
                alive = server.healthy()
                prefix_cache = engine_prefix_cache(server.base_url)
            finally:
                soak.close()
    finally:
        signal.signal(signal.SIGTERM, previous)
    result = {"engine": args.engine, "engine_version": version, "mode": args.mode, "device": device,
              "model": model, "load": asdict(spec), "counts": soak.counts, "tokens": soak.tokens,
              "first_errors": soak.first_errors, "load_s": load_s, "server_start_s": server.start_s,
              "server_alive": alive and soak.died_at is None, "died_at_s": soak.died_at,
              "final_snapshot": final if args.mode == "vattn" else None,
              "latency": soak_report.latency(results), "prefix_cache": prefix_cache,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "notes": [f"server: {' '.join(server_spec.argv[server_spec.argv.index('--port') + 2:])}"
                        + "".join(f"; {k}={v}" for k, v in args.server_env)]}
    checks = soak_report.verdicts(result, soak.samples)
    result["checks"] = [{"check": n, "passed": ok, "detail": d} for n, ok, d in checks]
    with open(os.path.join(args.out, "result.json"), "w") as f:
        json.dump(result, f, indent=1, default=repr)
    text = soak_report.markdown(result, soak.samples, title=title, command=command_line())
    with open(os.path.join(args.out, "soak.md"), "w") as f:
        f.write(text)
    png = soak_report.plot(soak.samples, os.path.join(args.out, "soak.png"), title=title)
    print(text + (f"\nplot: {png}" if png else "\nno plot (matplotlib missing)"))
    return 0 if all(ok for _, ok, _ in checks) else 1
