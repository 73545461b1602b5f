"""Make SGLang's CPU modules importable in the CI environment (tools/engine_env.sh sglang).

SGLang imports ``torchvision`` at module level (``decode_jpeg`` and transform enums for
multimodal models) but never calls it on the text-only paths tested here. PyPI only carries CUDA
builds of torchvision, which cannot load next to the CPU torch, so when sglang is installed but
no torchvision is, an import-only stand-in is registered: every attribute is a placeholder that raises
``RuntimeError`` when called. With a real torchvision installed nothing is changed.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types


class _Missing:
    """Placeholder for any torchvision attribute; calling it raises."""

    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: torchvision is not installed (CPU test stand-in)")

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


if importlib.util.find_spec("sglang") is not None and importlib.util.find_spec("torchvision") is None:
    sys.meta_path.insert(0, _TorchvisionStandIn())
