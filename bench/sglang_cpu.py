"""SGLang's CPU import set: what it takes to import SGLang's memory classes on a CPU machine.

SGLang imports ``torchvision`` at module level (``decode_jpeg`` and transform enums for
multimodal models) but never calls it on the text-only paths used here. PyPI only carries CUDA
builds of torchvision, which cannot load next to a CPU torch, so when sglang is installed but no
torchvision is, :func:`ensure_importable` registers an import-only stand-in: every attribute is a
placeholder that raises ``RuntimeError`` when called. With a real torchvision nothing is changed.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

__all__ = ["ensure_importable"]


class _Missing:
    """Placeholder for any torchvision attribute; calling it raises."""

    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: torchvision is not installed (CPU stand-in)")

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing(f"{self._name}.{name}")


class _TorchvisionStandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finder + loader answering ``torchvision`` and every ``torchvision.*`` submodule."""

    def find_spec(self, name, path, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0"  # reads as "older than anything" to version checks

        def missing(name, _prefix=spec.name):
            if name.startswith("__"):
                raise AttributeError(name)
            return _Missing(f"{_prefix}.{name}")

        module.__getattr__ = missing
        return module

    def exec_module(self, module):
        pass


def ensure_importable() -> bool:
    """Register the torchvision stand-in where sglang is installed and torchvision is not (once);
    returns whether sglang is installed."""
    if importlib.util.find_spec("sglang") is None:
        return False
    if importlib.util.find_spec("torchvision") is None and \
            not any(isinstance(f, _TorchvisionStandIn) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchvisionStandIn())
    return True
