"""The ``vattn`` command: ``info``, ``bench {vmm,attention,layout,host,engine,serve,serve-rounds,faults,soak,radix,sched,loop,steps,aliasing}``, ``conformance``,
``compare``.

A bad input ends the command with one line on stderr (what was expected, what was given, what
to do) and exit status 2: a flag argparse refuses (:class:`UsageError`), a typed error of
:mod:`vattn.core.errors`, a missing optional module (an engine, ``matplotlib``) or a file that
cannot be read or written.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from vattn.core.errors import UnsupportedError, VattnError

__all__ = ["main", "run_command", "build_parser", "one_line", "UsageError", "USAGE_ERROR"]

#: exit status of a command refused for its input (argparse's own status for a usage error)
USAGE_ERROR = 2

# subcommand -> module exposing add_arguments(parser) and run(args) -> int
_COMMANDS = {
    "info": ("vattn.bench.info", "GPU, driver, VMM granularity and the backends found"),
    "conformance": ("vattn.conformance.cli", "token identity and throughput vs an engine's paged path"),
    "compare": ("vattn.conformance.compare", "every engine, stock vs vattn, alternated rounds: one table + plot"),
}
_BENCHES = {
    "vmm": ("vattn.bench.vmm", "VMM call latency, map throughput, ensure() critical-path time"),
    "attention": ("vattn.bench.attention", "decode/prefill on virtual KV vs paged kernels"),
    "layout": ("vattn.bench.layout", "layer-group sweep: waste vs speed, recommends G"),
    "host": ("vattn.bench.host", "host time vattn's vLLM runtime adds per decode-heavy generation"),
    "engine": ("vattn.bench.engine", "end-to-end engine runs (stock / ceiling / vattn) into BENCHMARKS.md"),
    "serve": ("vattn.bench.serve", "the engine's own server + benchmark client, stock vs vattn, alternated"),
    "serve-rounds": ("vattn.bench.serve_rounds", "the rounds of several `bench serve` runs pooled into one table"),
    "faults": ("vattn.bench.faults", "driver faults and a dry page pool inside a running vLLM engine"),
    "soak": ("vattn.bench.soak", "an engine server under mixed load with aborts: memory, fds, pages, audit"),
    "radix": ("vattn.bench.radix", "SGLang's radix cache driving vattn's pool: host time per forward (host backend)"),
    "sched": ("vattn.bench.sched", "the engine core's prefix-cache bookkeeping per generation (vLLM's KVCacheManager)"),
    "loop": ("vattn.bench.loop", "two engines' profiled loop windows (VATTN_ENGINE_PROFILE) side by side per function"),
    "steps": ("vattn.bench.steps", "a GPU run's step traces: vattn's host time, device idle and driver calls per step"),
    "aliasing": ("vattn.bench.aliasing", "decode over a shared prefix: private copies vs aliased pages vs one region"),
}


class UsageError(VattnError, ValueError):
    """A command line argparse refuses: unknown command or flag, a flag value of the wrong form.

    Attributes
    ----------
    prog : str
        The (sub)command whose parser refused it, e.g. ``"vattn bench attention"``.
    """

    def __init__(self, message: str, *, prog: str = "vattn"):
        super().__init__(message)
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that raises :class:`UsageError` instead of printing usage and exiting."""

    def error(self, message: str):
        raise UsageError(message, prog=self.prog)


def _add(sub, name: str, module: str, help_text: str) -> None:
    parser = sub.add_parser(name, help=help_text, description=help_text)
    parser.set_defaults(_module=module, _prog=parser.prog)
    try:
        importlib.import_module(module).add_arguments(parser)
    except ImportError as exc:  # an optional piece is missing: say so when it is used
        parser.set_defaults(_import_error=exc)


def build_parser() -> argparse.ArgumentParser:
    """The ``vattn`` parser; its ``parse_args`` raises :class:`UsageError` on a bad command line."""
    parser = _Parser(prog="vattn", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    for name, (module, help_text) in _COMMANDS.items():
        _add(sub, name, module, help_text)
    bench = sub.add_parser("bench", help="benchmarks (results go to BENCHMARKS.md)")
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="{" + ",".join(_BENCHES) + "}")
    for name, (module, help_text) in _BENCHES.items():
        _add(bench_sub, name, module, help_text)
    return parser


def _parse(argv: list[str]) -> argparse.Namespace:
    args, extra = build_parser().parse_known_args(argv or ["conformance"])  # no arguments: the main job
    if extra:       # named by the subcommand that got them, not by the top-level parser
        raise UsageError(f"unrecognized arguments: {' '.join(extra)}", prog=getattr(args, "_prog", "vattn"))
    return args


def _run(args: argparse.Namespace) -> int:
    if getattr(args, "_import_error", None) is not None:
        raise UnsupportedError(f"this command is unavailable here: {args._import_error}")
    return int(importlib.import_module(args._module).run(args) or 0)


def run_command(argv: list[str]) -> int:
    """Parse and run ``vattn ARGV``, letting a refusal propagate as its typed error.

    Raises
    ------
    UsageError
        argparse refused the command line.
    VattnError
        The command refused its input (e.g. ``ConfigError``) or cannot run here
        (``UnsupportedError``).
    """
    return _run(_parse(argv))


def main(argv: list[str] | None = None) -> int:
    """Run ``vattn ARGV``; return the exit status (2: the input was refused, on one stderr line)."""
    argv = sys.argv[1:] if argv is None else argv
    prog = "vattn"
    try:
        args = _parse(argv)
        prog = args._prog
        return _run(args)
    except SystemExit as exc:       # --help (and --version-like actions) print and exit
        return exc.code if isinstance(exc.code, int) else USAGE_ERROR
    except UsageError as exc:
        return _refuse(exc.prog, f"error: {exc} (see {exc.prog} --help)")
    except VattnError as exc:
        return _refuse(prog, f"{type(exc).__name__}: {exc}")
    except ModuleNotFoundError as exc:
        if not _optional(exc):
            raise
        return _refuse(prog, f"needs the optional module {exc.name!r}, which is not installed in this "
                             f"Python ({exc}); install it, or leave out the option that needs it")
    except OSError as exc:
        if exc.filename is None:
            raise
        return _refuse(prog, f"cannot use {exc.filename!r}: {exc.strerror or exc}; pass an existing, "
                             f"accessible path")


def _optional(exc: ModuleNotFoundError) -> bool:
    """Whether a missing module is an optional dependency (not a piece of vattn itself)."""
    return bool(exc.name) and exc.name.partition(".")[0] != "vattn"


def _refuse(prog: str, message: str) -> int:
    print(f"{prog}: {one_line(message)}", file=sys.stderr)
    return USAGE_ERROR


def one_line(text: str) -> str:
    """``text`` on one line: its first line, and its last when there are more (the root cause of
    a failed engine run comes last)."""
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    if len(lines) <= 1:
        return lines[0] if lines else ""
    return f"{lines[0]} ... {lines[-1]}"


if __name__ == "__main__":
    raise SystemExit(main())
