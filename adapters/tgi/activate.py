"""Turn the adapter on inside TGI's server process.

How an operator enables it
--------------------------
TGI configures its server through environment variables set by the launcher, and so does
vattn: set ``VATTN_TGI=1`` (plus ``ATTENTION=flashdecoding``, ``PREFIX_CACHING=0``,
``CUDA_GRAPHS`` unset or ``0``, optional ``VATTN_TGI_*`` sizes, see :func:`.patches.config_from_env`).
Something must run vattn's check before TGI's modules are imported; there are two ways, neither
needs a ``sitecustomize``:

1. Start the server through vattn: ``python -m vattn.adapters.tgi serve <model> ...`` runs
   TGI's own ``text-generation-server`` CLI after installing the import hook.
2. For the Rust launcher (which spawns ``text-generation-server``): run
   ``python -m vattn.adapters.tgi install-hook`` once in the server's environment. It writes
   one ``vattn_tgi.pth`` line into site-packages that, at interpreter start, does nothing
   unless ``VATTN_TGI=1`` is set, and then installs the hook. ``uninstall-hook`` removes it.

The hook is a ``sys.meta_path`` finder: it replaces the body of
``text_generation_server.layers.attention`` (so model files import vattn's ``attention`` /
``paged_attention``) and patches ``models.flash_causal_lm`` and ``cache`` right after they load.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import sysconfig
from pathlib import Path

from vattn.core.errors import ConfigError

from .patches import Patcher

__all__ = ["install", "uninstall", "install_from_env", "enabled", "PTH_NAME", "PTH_LINE",
           "write_pth", "remove_pth"]

ENV_FLAG = "VATTN_TGI"
PTH_NAME = "vattn_tgi.pth"
PTH_LINE = ("import os; os.environ.get('VATTN_TGI', '0') not in ('', '0') and "
            "__import__('vattn.adapters.tgi.activate', fromlist=['x']).install_from_env()\n")
_ATTN = "text_generation_server.layers.attention"
_POST = {"text_generation_server.models.flash_causal_lm": "patch_flash_causal_lm",
         "text_generation_server.cache": "patch_cache"}


def enabled(env=None) -> bool:
    """``VATTN_TGI`` set to anything but ``""`` / ``"0"``; other values than ``"1"`` are an error."""
    value = (os.environ if env is None else env).get(ENV_FLAG, "0")
    if value in ("", "0"):
        return False
    if value != "1":
        raise ConfigError(f"{ENV_FLAG} must be '0' or '1', got {value!r}")
    return True


class _AttentionLoader(importlib.abc.Loader):
    def __init__(self, patcher: Patcher):
        self.patcher = patcher

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        self.patcher.fill_attention_package(module)


class _PostLoader(importlib.abc.Loader):
    def __init__(self, inner, hook):
        self.inner, self.hook = inner, hook

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        self.hook(module)


class TgiFinder(importlib.abc.MetaPathFinder):
    """Meta-path finder for the three TGI modules the adapter changes."""

    def __init__(self, patcher: Patcher):
        self.patcher = patcher

    def find_spec(self, fullname, path, target=None):
        if fullname != _ATTN and fullname not in _POST:
            return None
        real = importlib.machinery.PathFinder.find_spec(fullname, path)
        if real is None:
            return None
        if fullname == _ATTN:
            spec = importlib.machinery.ModuleSpec(fullname, _AttentionLoader(self.patcher),
                                                  origin=real.origin, is_package=True)
            spec.submodule_search_locations = list(real.submodule_search_locations)
            return spec
        real.loader = _PostLoader(real.loader, getattr(self.patcher, _POST[fullname]))
        return real


def install(*, env=None) -> Patcher:
    """Install the finder (idempotent) and return its :class:`Patcher`.

    Raises
    ------
    ConfigError
        A TGI module the hook must see first is already imported.
    """
    for finder in sys.meta_path:
        if isinstance(finder, TgiFinder):
            return finder.patcher
    early = [m for m in (_ATTN, *_POST) if m in sys.modules]
    if early:
        raise ConfigError(f"vattn's TGI hook must be installed before {early} are imported")
    patcher = Patcher(env=env)
    sys.meta_path.insert(0, TgiFinder(patcher))
    return patcher


def uninstall() -> None:
    """Remove the finder (already patched modules stay patched)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, TgiFinder)]


def install_from_env(env=None) -> Patcher | None:
    """Install the hook when ``VATTN_TGI=1``; the entry point of the ``.pth`` line."""
    return install(env=env) if enabled(env) else None


def write_pth(site_dir: str | None = None) -> Path:
    """Write the ``.pth`` line into ``site_dir`` (default: this interpreter's purelib)."""
    path = Path(site_dir or sysconfig.get_paths()["purelib"]) / PTH_NAME
    path.write_text(PTH_LINE)
    return path


def remove_pth(site_dir: str | None = None) -> bool:
    path = Path(site_dir or sysconfig.get_paths()["purelib"]) / PTH_NAME
    if path.exists():
        path.unlink()
        return True
    return False
