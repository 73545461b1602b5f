"""SGLang versions this adapter is tested against; anything else fails loudly.

SGLang's memory-pool, allocator and attention-backend internals change every release, so the
adapter refuses to run on a version it was not checked against.
"""

from __future__ import annotations

from vattn.core.errors import UnsupportedError

#: Exact releases the adapter was written and tested against.
SUPPORTED_VERSIONS: tuple[str, ...] = ("0.5.17",)


def installed_version() -> str:
    """Return the installed ``sglang`` version string.

    Raises
    ------
    UnsupportedError
        If SGLang is not installed.
    """
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError as exc:
        raise UnsupportedError("the vattn SGLang adapter needs sglang installed "
                               f"(supported: {', '.join(SUPPORTED_VERSIONS)})") from exc


def check_version(found: str | None = None) -> str:
    """Raise unless ``found`` (default: the installed version) is supported; return it."""
    found = installed_version() if found is None else found
    if found not in SUPPORTED_VERSIONS:
        raise UnsupportedError(f"sglang {found} is not supported by vattn: expected one of "
                               f"{', '.join(SUPPORTED_VERSIONS)}")
    return found
