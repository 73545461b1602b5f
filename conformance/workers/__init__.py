"""The engine side of a conformance run, one engine per process:
``python -m vattn.conformance.workers.<engine> SPEC.json OUT.json`` reads a spec, runs the
engine, and writes :class:`~vattn.conformance.protocol.RunResult` fields (started by
:func:`vattn.conformance.runners.process.run_worker`).
"""

from __future__ import annotations

import json
import sys

__all__ = ["main"]


def main(run, argv: list[str] | None = None) -> int:
    """Read the spec JSON (``argv[0]``), write ``run(spec)`` as JSON (``argv[1]``)."""
    src, dst = (sys.argv[1:] if argv is None else argv)[:2]
    with open(src) as f:
        spec = json.load(f)
    result = run(spec)
    with open(dst, "w") as f:
        json.dump(result, f, default=str)
    return 0
