"""The engines' own OpenAI-compatible servers, stock or with vattn, for ``vattn bench serve``.

:func:`server_command` says how a mode starts (command line and environment), :class:`Server`
runs it: a subprocess in its own session (process group), ``/health`` polled until it answers
200, the whole group killed on exit, also on Ctrl-C or an exception.

Modes
-----
vLLM (``python -m vllm.entrypoints.openai.api_server``): ``stock`` is the server with its
defaults; ``vattn`` adds ``VATTN_VLLM=1`` and what the conformance runner's vattn mode sets
(:func:`vattn.conformance.workers.vllm.engine_kwargs`: ``--attention-backend CUSTOM`` on GPU, nothing
on the CPU platform); prefix caching stays vLLM's default (on) in both modes, as vattn serves it
on both paths. Both modes get the runner's environment
(:meth:`vattn.conformance.runners.vllm.VllmRunner.env_for`: the V2 model runner on GPU, a 1 GiB
KV space on CPU). A vLLM mode may also be one of the runner's vattn variants (``vattn:h1``,
``vattn:d0:b0``, ...): the vattn server with the variant's switches in its environment
(:func:`mode_base`); the switches of the outer environment reach no server.

SGLang (``python -m sglang.launch_server``): ``stock`` is the server with its defaults
(``SGLANG_USE_SGL_FA3_KERNEL=1`` in both modes, as the conformance runner has it); ``vattn`` adds
``VATTN_SGLANG=1`` and the vattn settings of :func:`vattn.conformance.workers.sglang.engine_kwargs`
(``--attention-backend vattn --disable-prefill-cuda-graph``; the radix cache stays SGLang's default,
on, in both modes, and the vattn platform sets the page size).

``like_for_like=True`` gives stock the settings vattn forces too (all but the attention backend):
the same prefix caching, page size and prefill graphs in both modes. A model directory without
weights gets ``--load-format dummy`` in both modes. Extra engine arguments go to both modes, last.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from vattn.core.errors import ConfigError, VattnError

__all__ = ["ENGINES", "MODES", "ServerError", "ServerSpec", "Server", "server_command", "mode_base",
           "has_weights", "free_port", "log_tail", "root_cause"]

ENGINES = ("vllm", "sglang")
MODES = ("stock", "vattn")
_SERVER_MODULE = {"vllm": "vllm.entrypoints.openai.api_server", "sglang": "sglang.launch_server"}
_MODEL_FLAG = {"vllm": "--model", "sglang": "--model-path"}
#: the SGLang vattn settings (keys of workers.sglang.engine_kwargs) a server needs as well
_SGLANG_VATTN_KEYS = ("attention_backend", "page_size", "disable_radix_cache", "disable_prefill_cuda_graph")
_PREFIX_OFF = {"vllm": "--no-enable-prefix-caching", "sglang": "--disable-radix-cache"}


class ServerError(VattnError):
    """An engine server did not come up (exited, or no ``/health`` 200 in time); the message ends
    with the tail of its log."""


@dataclass
class ServerSpec:
    """How one server run starts: ``argv`` (after the Python interpreter) and the environment
    added to this process's (``None`` values: removed)."""

    engine: str
    mode: str
    argv: list[str]
    env: dict[str, str | None] = field(default_factory=dict)
    port: int = 0

    def environ(self) -> dict[str, str]:
        env = dict(os.environ)
        for key, value in self.env.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        return env


def has_weights(model_dir: str) -> bool:
    """Whether ``model_dir`` holds weight files (else the engines load it with dummy weights)."""
    return any(name.endswith((".safetensors", ".bin", ".pt")) for name in os.listdir(model_dir))


def mode_base(engine: str, mode: str) -> str:
    """``stock`` or ``vattn`` for ``mode``: one of :data:`MODES` or, for vLLM, a vattn variant of
    the conformance runner (``vattn:h2:b1``: its switches set in the server's environment,
    :func:`vattn.conformance.runners.vllm.base_mode`).

    Raises
    ------
    ConfigError
        Anything else (SGLang's servers take no variants).
    """
    if mode in MODES:
        return mode
    if engine == "vllm" and ":" in mode and "@" not in mode:
        from vattn.conformance.runners.vllm import base_mode
        if base_mode(mode) == "vattn":
            return "vattn"
    variants = " or a vattn variant such as vattn:h2:b1" if engine == "vllm" else ""
    raise ConfigError(f"mode must be one of {', '.join(MODES)}{variants} for {engine}, got {mode!r}")


def server_command(engine: str, mode: str, model_dir: str, *, port: int, device: str = "cuda",
                   extra_args: list[str] | tuple[str, ...] = (), like_for_like: bool = False,
                   host: str = "127.0.0.1") -> ServerSpec:
    """The server of ``engine`` in ``mode`` on ``model_dir`` (see the module docstring).

    Raises
    ------
    ConfigError
        An unknown engine or mode.
    """
    if engine not in ENGINES:
        raise ConfigError(f"engine must be one of {ENGINES}, got {engine!r}")
    base = mode_base(engine, mode)
    argv = ["-m", _SERVER_MODULE[engine], _MODEL_FLAG[engine], model_dir, "--host", host,
            "--port", str(port)]
    if not has_weights(model_dir):
        argv += ["--load-format", "dummy"]
    forced, env = (_vllm_mode if engine == "vllm" else _sglang_mode)(mode, device, model_dir)
    backend = {"--attention-backend"}
    if base == "vattn":
        argv += forced
    elif like_for_like:
        vattn_flags, _ = (_vllm_mode if engine == "vllm" else _sglang_mode)("vattn", device, model_dir)
        argv += _without(vattn_flags, backend)
    argv += _dedupe_prefix_flag(argv, extra_args, engine)
    return ServerSpec(engine=engine, mode=mode, argv=argv, env=env, port=port)


def _vllm_mode(mode: str, device: str, model_dir: str) -> tuple[list[str], dict]:
    from vattn.conformance.runners.vllm import VllmRunner
    from vattn.conformance.workers.vllm import engine_kwargs
    base = mode_base("vllm", mode)
    spec = dict(mode=base, run_name=mode, device=device, model_dir=model_dir, dtype="auto",
                sizing="defaults", max_model_len=None, max_num_seqs=None)
    runner_env = VllmRunner(device=device).env_for(spec)
    env: dict[str, str | None] = {k: v for k, v in runner_env.items() if os.environ.get(k) != v}
    env |= {k: None for k in os.environ if k not in runner_env}   # e.g. VATTN_VLLM for stock
    env.setdefault("VATTN_VLLM", None if base == "stock" else "1")
    flags = []
    if base == "vattn":
        backend = engine_kwargs(spec).get("attention_backend")
        if backend:
            flags += ["--attention-backend", backend]
    return flags, env


def _sglang_mode(mode: str, device: str, model_dir: str) -> tuple[list[str], dict]:
    from vattn.conformance.workers.sglang import engine_kwargs
    env = {"SGLANG_USE_SGL_FA3_KERNEL": "1", "VATTN_SGLANG": "1" if mode == "vattn" else None}
    flags = []
    if mode == "vattn":
        kw = engine_kwargs("vattn", model_dir, {})
        for key in _SGLANG_VATTN_KEYS:
            value = kw.get(key)
            if value is True:
                flags.append("--" + key.replace("_", "-"))
            elif value not in (None, False):
                flags += ["--" + key.replace("_", "-"), str(value)]
    return flags, env


def _without(flags: list[str], names: set[str]) -> list[str]:
    """``flags`` less each flag in ``names`` and its value."""
    out, skip = [], False
    for i, arg in enumerate(flags):
        if skip:
            skip = False
            continue
        if arg in names:
            skip = i + 1 < len(flags) and not flags[i + 1].startswith("--")
            continue
        out.append(arg)
    return out


def _dedupe_prefix_flag(argv: list[str], extra: list[str] | tuple[str, ...], engine: str) -> list[str]:
    """``extra`` without a prefix-caching-off flag ``argv`` has already."""
    flag = _PREFIX_OFF[engine]
    return [a for a in extra if not (a == flag and flag in argv)]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def log_tail(path: str, n: int = 3000) -> str:
    """The last ``n`` characters of a log file ('' if it does not exist)."""
    if not os.path.exists(path):
        return ""
    with open(path, "rb") as f:
        f.seek(max(0, os.path.getsize(path) - n))
        return f.read().decode(errors="replace")


_ERROR_LINE = re.compile(r"((?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception)): (.*)")


def root_cause(path: str) -> str:
    """The first ``SomeError: message`` line after the log's first traceback ('' if none): an
    engine core's own error, which its later "see root cause above" lines only point at."""
    if not os.path.exists(path):
        return ""
    with open(path, "rb") as f:
        text = f.read().decode(errors="replace")
    at = text.find("Traceback (most recent call last)")
    if at < 0:
        return ""
    for line in text[at:].splitlines()[1:]:
        found = _ERROR_LINE.search(line)
        if found and not line.lstrip().startswith(("File ", "raise ")):
            return found.group(0).strip()
    return ""


def _failure(path: str) -> str:
    cause = root_cause(path)
    return f"{log_tail(path)}" + (f"\nroot cause: {cause}" if cause else "")


class Server:
    """One engine server, started on ``__enter__``, its process group killed on ``__exit__``.

    Parameters
    ----------
    spec : ServerSpec
        What to start (:func:`server_command`).
    python : str
        The interpreter that has the engine installed.
    log_path : str
        stdout and stderr of the server.
    timeout_s : float
        How long to wait for ``/health`` to answer 200.
    host : str
        Where the server listens.

    Raises
    ------
    ServerError
        On ``__enter__``: the server exited or was not healthy within ``timeout_s`` (the message
        ends with its log's tail).
    """

    def __init__(self, spec: ServerSpec, *, python: str, log_path: str, timeout_s: float = 600.0,
                 host: str = "127.0.0.1"):
        self.spec, self.python, self.log_path = spec, python, log_path
        self.timeout_s, self.host = float(timeout_s), host
        self.proc: subprocess.Popen | None = None
        self.start_s: float | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.spec.port}"

    def command(self) -> list[str]:
        return [self.python, *self.spec.argv]

    def healthy(self) -> bool:
        """Whether ``/health`` answers 200 now."""
        return _healthy(self.base_url + "/health")

    def __enter__(self) -> "Server":
        os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
        t0 = time.monotonic()
        with open(self.log_path, "w") as log:
            log.write("$ " + " ".join(self.command()) + "\n")
            log.flush()
            self.proc = subprocess.Popen(self.command(), env=self.spec.environ(), stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_healthy(t0)
        except BaseException:
            self.stop()
            raise
        self.start_s = time.monotonic() - t0
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_healthy(self, t0: float) -> None:
        what = f"{self.spec.engine} {self.spec.mode} server"
        while True:
            code = self.proc.poll()
            if code is not None:
                raise ServerError(f"{what} exited with status {code} before /health answered "
                                  f"(log {self.log_path}):\n{_failure(self.log_path)}")
            if _healthy(self.base_url + "/health"):
                return
            if time.monotonic() - t0 > self.timeout_s:
                raise ServerError(f"{what}: expected /health to answer 200 within "
                                  f"{self.timeout_s:.0f} s, it did not (log {self.log_path}):\n"
                                  f"{_failure(self.log_path)}")
            time.sleep(1.0)

    def stop(self) -> None:
        """Kill the server's whole process group (engine cores are its children) and reap it."""
        if self.proc is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=15 if sig == signal.SIGTERM else 30)
            except subprocess.TimeoutExpired:
                continue
            if sig == signal.SIGTERM:      # the leader is gone; its children may not be
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            break
        self.proc = None


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False
