"""The one TGI server version this adapter targets, identified by source fingerprints.

TGI's Python server (``text_generation_server``) is not published as a package and its
``pyproject.toml`` carries a stale version (``2.0.5-dev0`` at v3.3.7), so the installed
distribution version cannot identify a release. Instead the adapter hashes the server files
its patches touch and compares them with the files of the targeted tag.
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

from vattn.core.errors import UnsupportedError

__all__ = ["TGI_VERSION", "SOURCE_SHA256", "server_root", "check_server", "fingerprint"]

TGI_VERSION = "3.3.7"

# First 16 hex digits of sha256 of each file at tag v3.3.7, relative to text_generation_server/.
SOURCE_SHA256 = {
    "models/flash_causal_lm.py": "36b3a793f9d18d85",
    "layers/attention/__init__.py": "00e86be32bb90061",
    "layers/attention/kv_cache.py": "57591ad5535d2faf",
    "layers/attention/common.py": "e7b756810157cb9b",
    "models/globals.py": "02eacc5141c09a7f",
    "cache.py": "f30f7334f8e94760",
}


def server_root() -> Path | None:
    """Directory of the importable ``text_generation_server`` package, or ``None``.

    Finds the package without importing it (its import has side effects on the environment).
    """
    spec = importlib.util.find_spec("text_generation_server")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def fingerprint(root: Path) -> dict[str, str | None]:
    """Short sha256 of each fingerprinted file under ``root`` (``None`` where missing)."""
    out = {}
    for rel in SOURCE_SHA256:
        path = Path(root) / rel
        out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path.is_file() else None
    return out


def check_server(root: Path | None = None) -> str:
    """Fail loudly unless the server source is exactly TGI v3.3.7 in the patched files.

    Returns
    -------
    str
        ``TGI_VERSION`` when every fingerprint matches.

    Raises
    ------
    UnsupportedError
        The server is missing or any patched file differs from v3.3.7.
    """
    root = server_root() if root is None else Path(root)
    if root is None:
        raise UnsupportedError("text_generation_server is not importable; install TGI's server "
                               f"v{TGI_VERSION} from its repository (server/) first")
    got = fingerprint(root)
    bad = {rel: h for rel, h in got.items() if h != SOURCE_SHA256[rel]}
    if bad:
        detail = ", ".join(f"{rel}: expected {SOURCE_SHA256[rel]}, got {h}" for rel, h in bad.items())
        raise UnsupportedError(f"vattn's TGI adapter supports text_generation_server v{TGI_VERSION} "
                               f"only; files at {root} differ ({detail})")
    return TGI_VERSION
