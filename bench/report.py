"""Write benchmark results into BENCHMARKS.md: one section per benchmark, with provenance."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import re
import sys
from pathlib import Path

__all__ = ["write_section", "environment", "environment_md", "upper_quantile", "results_files"]


def results_files(folders, pattern: str, what: str) -> list[str]:
    """The files matching ``pattern`` under each of ``folders`` (at any depth), in the folders'
    order and sorted within each: what a ``--results`` option reads.

    Raises
    ------
    ConfigError
        A folder does not exist or holds no such file (``what`` names them in the message).
    """
    import glob  # noqa: PLC0415

    from vattn.core.errors import ConfigError  # noqa: PLC0415
    found = []
    for folder in folders:
        if not os.path.isdir(folder):
            raise ConfigError(f"--results: no such folder {folder!r}")
        paths = sorted(glob.glob(os.path.join(folder, "**", pattern), recursive=True))
        if not paths:
            raise ConfigError(f"--results: no {what} under {folder!r}")
        found += paths
    return found


def upper_quantile(values, q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` by upper rank, ``sorted[min(n - 1, int(q * n))]``
    (the per-step p50 / p99 of the host and VMM benches); 0.0 when empty."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def environment() -> dict:
    """Date, hardware and versions of this run."""
    import torch  # noqa: PLC0415

    env = {"date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "python": platform.python_version(), "torch": torch.__version__,
           "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["cuda"] = torch.version.cuda
        env["driver"] = _driver_version()
    for mod in ("triton", "transformers", "vllm", "sglang", "cuda.bindings"):
        version = _version(mod)
        if version:
            env[mod] = version
    return env


def environment_md(env: dict | None = None) -> str:
    env = env or environment()
    return " · ".join(f"{k}: {v}" for k, v in env.items())


def write_section(title: str, body_md: str, command: str, *, path: str | os.PathLike = "BENCHMARKS.md",
                  env: dict | None = None) -> Path:
    """Add or replace the section ``## title`` of the benchmarks file.

    The section carries the environment line and the exact command, then ``body_md``.
    """
    path = Path(path)
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    section = (f"## {title}\n\n{environment_md(env)}\n\n```\n{command}\n```\n\n{body_md.strip()}\n")
    pattern = re.compile(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)
    return path


def command_line() -> str:
    """The command that started this process, as a user would type it."""
    argv = list(sys.argv)
    if argv and argv[0].endswith(("cli.py", "__main__.py")) or (argv and argv[0].endswith("vattn")):
        argv[0] = "vattn"
    return " ".join(argv)


def _version(mod: str) -> str | None:
    try:
        module = __import__(mod, fromlist=["__version__"])
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None
    return getattr(module, "__version__", None)


def _driver_version() -> str | None:
    try:
        import subprocess  # noqa: PLC0415
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None
