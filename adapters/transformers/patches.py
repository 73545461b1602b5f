"""The only two places vattn touches transformers' internals (5.17.x, version-gated).

1. ``continuous_api.PagedAttentionCache``: the manager builds its cache by this module-global
   name and offers no option to pass a class, so the name is pointed at
   :class:`~.cache.VattnPagedCache` (which behaves exactly as stock unless the model uses
   ``paged|vattn``).
2. ``input_outputs.attn_mask_is_needed``: only ``paged|eager``/``paged|sdpa`` get the packed 4D
   mask; ``paged|vattn`` runs SDPA on the same inputs, so it needs it too.
"""

from __future__ import annotations

from .version import check_version

__all__ = ["install", "uninstall", "installed"]

_saved: dict = {}


def install() -> None:
    """Install both patches (idempotent). UnsupportedError on an untested transformers."""
    check_version()
    from transformers.generation.continuous_batching import continuous_api, input_outputs

    from .cache import ATTN_NAME, VattnPagedCache

    if _saved:
        return
    _saved["cache"] = continuous_api.PagedAttentionCache
    _saved["mask"] = input_outputs.attn_mask_is_needed
    stock_mask = _saved["mask"]

    def attn_mask_is_needed(config) -> bool:
        return config._attn_implementation == ATTN_NAME or stock_mask(config)

    continuous_api.PagedAttentionCache = VattnPagedCache
    input_outputs.attn_mask_is_needed = attn_mask_is_needed


def uninstall() -> None:
    """Restore the stock names."""
    if not _saved:
        return
    from transformers.generation.continuous_batching import continuous_api, input_outputs

    continuous_api.PagedAttentionCache = _saved.pop("cache")
    input_outputs.attn_mask_is_needed = _saved.pop("mask")


def installed() -> bool:
    return bool(_saved)
