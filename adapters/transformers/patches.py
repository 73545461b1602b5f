"""The only place vattn touches transformers' internals (5.17.x, version-gated).

``continuous_api.PagedAttentionCache``: the manager builds its cache by this module-global name and
offers no option to pass a class, so the name is pointed at :class:`~.cache.VattnPagedCache`
(which behaves exactly as stock unless the model uses ``paged|vattn``). ``paged|vattn`` needs no
attention mask (the kernels mask causally), so the packed 4D mask stays off for it, as for flash.
"""

from __future__ import annotations

from .version import check_version

__all__ = ["install", "uninstall", "installed"]

_saved: dict = {}


def install() -> None:
    """Install the patch (idempotent). UnsupportedError on an untested transformers."""
    check_version()
    from transformers.generation.continuous_batching import continuous_api

    from .cache import VattnPagedCache

    if _saved:
        return
    _saved["cache"] = continuous_api.PagedAttentionCache
    continuous_api.PagedAttentionCache = VattnPagedCache


def uninstall() -> None:
    """Restore the stock name."""
    if not _saved:
        return
    from transformers.generation.continuous_batching import continuous_api

    continuous_api.PagedAttentionCache = _saved.pop("cache")


def installed() -> bool:
    return bool(_saved)
