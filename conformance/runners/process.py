"""One engine run in a child process: spec JSON in, result JSON out.

The child is ``python -m <worker> IN.json OUT.json`` (a module of
:mod:`vattn.conformance.workers`) in a process group of its own, so a timeout, an interruption
or a crash kills every process the engine started (vLLM's engine core, SGLang's scheduler)
instead of leaving one behind holding the GPU.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile

from vattn.conformance.protocol import RunResult
from vattn.core.errors import VattnError

__all__ = ["run_worker", "run_group", "kill_group", "first_traceback", "log_tail"]


def run_worker(module: str, spec: dict, *, env: dict, timeout_s: float, what: str,
               log: str | None = None) -> RunResult:
    """Run worker ``module`` on ``spec`` in a fresh process; its result as a :class:`RunResult`.

    Parameters
    ----------
    module
        The worker's module path (``vattn.conformance.workers.vllm``).
    env
        The child's whole environment.
    what
        Names the run in errors, e.g. ``"vLLM vattn"``.
    log
        A file the child's stdout and stderr stream into (``None``: kept in memory).

    Raises
    ------
    VattnError
        The run timed out or exited non-zero; the message ends with the log's tail and its
        first traceback (the root cause, last: callers keep a message's tail).
    """
    with tempfile.TemporaryDirectory(prefix="vattn-run-") as tmp:
        src, dst = os.path.join(tmp, "in.json"), os.path.join(tmp, "out.json")
        with open(src, "w") as f:
            json.dump(spec, f)
        cmd = [sys.executable, "-m", module, src, dst]
        try:
            proc = run_group(cmd, env, timeout_s, log)
        except subprocess.TimeoutExpired as exc:
            raise VattnError(f"{what} run timed out after {timeout_s:.0f} s"
                             f"{f' (log: {log})' if log else ''}:\n{log_tail(log) if log else ''}") from exc
        if proc.returncode != 0:
            raise VattnError(f"{what} run failed (exit {proc.returncode}"
                             f"{f'; log: {log}' if log else ''}):\n{proc.stderr[-2500:]}"
                             f"{first_traceback(log)}")
        with open(dst) as f:
            out = json.load(f)
    if out.get("logprobs") is not None:       # JSON keys are strings: token ids again
        out["logprobs"] = [[{int(t): lp for t, lp in pos.items()} for pos in req] for req in out["logprobs"]]
    return RunResult(**out)


def run_group(cmd: list[str], env: dict, timeout_s: float,
              log: str | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own process group; on timeout (``TimeoutExpired``) or interruption kill
    the whole group: an engine's own child processes would otherwise keep the GPU.

    With ``log``, stdout and stderr stream into that file as the run goes (so a run that hangs
    or is killed still leaves its log) and ``stderr`` of the result is the log's tail."""
    sink = open(log, "w") if log else None
    try:
        proc = subprocess.Popen(cmd, env=env, stdout=sink or subprocess.PIPE,
                                stderr=subprocess.STDOUT if sink else subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except BaseException:   # timeout, or this process being stopped (SIGTERM -> SystemExit)
            kill_group(proc.pid)
            proc.communicate()
            raise
        finally:
            if sink:
                sink.write(f"\n--- exit {proc.returncode}\n")
        kill_group(proc.pid)   # a crashed run may leave its engine's child processes behind
    finally:
        if sink:
            sink.close()
    if log:
        out, err = "", log_tail(log)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def log_tail(path: str, n: int = 6000) -> str:
    """The last ``n`` bytes of a log, decoded."""
    with open(path, "rb") as f:
        f.seek(max(0, os.path.getsize(path) - n))
        return f.read().decode(errors="replace")


def first_traceback(log: str | None, n: int = 2500) -> str:
    """The log's first traceback: the engine's root cause, before its own "see above"."""
    if not log:
        return ""
    with open(log, "rb") as f:
        text = f.read().decode(errors="replace")
    at = text.find("Traceback (most recent call last)")
    return "" if at < 0 else f"\n--- first traceback in {os.path.basename(log)}:\n{text[at:at + n]}"


def kill_group(pgid: int) -> None:
    """SIGKILL every process of group ``pgid`` (gone already: nothing to do)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
