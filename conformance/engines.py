"""Lazy registry of conformance engine runners: name -> ``"module:Class"``.

Runners are imported only when asked for, so ``vattn conformance --engine
vllm`` works without transformers installed and vice versa.
"""

from __future__ import annotations

import importlib

from vattn.core.errors import ConfigError, UnsupportedError

from .protocol import EngineRunner

__all__ = ["ENGINES", "load_runner", "available_engines"]

ENGINES: dict[str, str] = {
    "transformers": "vattn.adapters.transformers.conformance:TransformersRunner",
    "vllm": "vattn.adapters.vllm.conformance:VllmRunner",
    "sglang": "vattn.adapters.sglang.conformance:SglangRunner",
    "tgi": "vattn.adapters.tgi.conformance:TgiRunner",
}


def load_runner(name: str, **kwargs) -> EngineRunner:
    """Import and construct the runner registered under ``name``.

    Parameters
    ----------
    name
        One of :data:`ENGINES`.
    **kwargs
        Passed to the runner's constructor.

    Raises
    ------
    ConfigError
        ``name`` is not registered.
    UnsupportedError
        The engine (or its adapter) cannot be imported here.
    """
    if name not in ENGINES:
        raise ConfigError(f"unknown engine {name!r}: expected one of {sorted(ENGINES)}")
    module_name, _, class_name = ENGINES[name].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UnsupportedError(
            f"engine {name!r} is not available here ({module_name}: {exc}); "
            f"install it (e.g. pip install 'vattn[{name}]') or pick another --engine") from exc
    try:
        cls = getattr(module, class_name)
    except AttributeError as exc:
        raise UnsupportedError(f"{module_name} has no runner class {class_name!r}") from exc
    return cls(**kwargs)


def available_engines() -> dict[str, str | None]:
    """Map each engine name to ``None`` if importable, else the import error text."""
    found: dict[str, str | None] = {}
    for name, target in ENGINES.items():
        try:
            importlib.import_module(target.partition(":")[0])
            found[name] = None
        except ImportError as exc:
            found[name] = str(exc)
    return found
