"""The ``vattn`` command: ``info``, ``bench {vmm,attention,layout,host,engine}``, ``conformance``."""

from __future__ import annotations

import argparse
import importlib
import sys

__all__ = ["main"]

# subcommand -> module exposing add_arguments(parser) and run(args) -> int
_COMMANDS = {
    "info": ("vattn.bench.info", "GPU, driver, VMM granularity and the backends found"),
    "conformance": ("vattn.conformance.cli", "token identity and throughput vs an engine's paged path"),
}
_BENCHES = {
    "vmm": ("vattn.bench.vmm", "VMM call latency, map throughput, ensure() critical-path time"),
    "attention": ("vattn.bench.attention", "decode/prefill on virtual KV vs paged kernels"),
    "layout": ("vattn.bench.layout", "layer-group sweep: waste vs speed, recommends G"),
    "host": ("vattn.bench.host", "host time vattn's vLLM runtime adds per decode-heavy generation"),
    "engine": ("vattn.bench.engine", "end-to-end engine runs (stock / ceiling / vattn) into BENCHMARKS.md"),
}


def _add(sub, name: str, module: str, help_text: str) -> None:
    parser = sub.add_parser(name, help=help_text, description=help_text)
    parser.set_defaults(_module=module)
    try:
        importlib.import_module(module).add_arguments(parser)
    except ImportError as exc:  # an optional piece is missing: say so when it is used
        parser.set_defaults(_import_error=exc)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vattn", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    for name, (module, help_text) in _COMMANDS.items():
        _add(sub, name, module, help_text)
    bench = sub.add_parser("bench", help="benchmarks (results go to BENCHMARKS.md)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for name, (module, help_text) in _BENCHES.items():
        _add(bench_sub, name, module, help_text)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv or ["conformance"])  # no arguments: the main job
    if getattr(args, "_import_error", None) is not None:
        print(f"vattn: this command is unavailable here: {args._import_error}", file=sys.stderr)
        return 2
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
