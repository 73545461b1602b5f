"""The transformers versions this adapter is tested with, and the gate."""

from __future__ import annotations

from vattn.core.errors import UnsupportedError

__all__ = ["SUPPORTED", "check_version"]

# continuous batching was reworked in 5.25 (the model calls cache.update, fixed attention names)
SUPPORTED = ((5, 17), (5, 18))  # [min, max): 5.17.x


def check_version() -> str:
    """Return the installed transformers version; UnsupportedError outside :data:`SUPPORTED`."""
    try:
        import transformers
    except ImportError as exc:
        raise UnsupportedError(f"vattn.adapters.transformers needs transformers 5.17.x: {exc}") from exc
    version = transformers.__version__
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if not SUPPORTED[0] <= parts < SUPPORTED[1]:
        raise UnsupportedError(
            f"transformers {version} is not supported by vattn.adapters.transformers "
            f"(tested: >={'.'.join(map(str, SUPPORTED[0]))},<{'.'.join(map(str, SUPPORTED[1]))}); "
            "its continuous-batching internals differ")
    return version
