"""The ``paged|vattn`` attention function."""

from __future__ import annotations

from transformers.integrations.sdpa_paged import sdpa_attention_paged_forward

from vattn.core.errors import ConfigError

from .cache import VattnPagedCache

__all__ = ["vattn_paged_attention"]


def vattn_paged_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                          scaling: float | None = None, **kwargs):
    """SDPA over K/V read from the request's vattn slot (same math as ``paged|sdpa``).

    ``query``: ``[1, Hq, N, D]``; ``key``/``value``: ``[1, Hk, N, D]`` (packed requests);
    returns ``([1, N, Hq, D], None)``. Running the same SDPA on the same K/V values as the stock
    path keeps outputs bit-identical to ``paged|sdpa``.
    """
    cache = kwargs.get("cache")
    if not isinstance(cache, VattnPagedCache) or cache.vattn is None:
        raise ConfigError("paged|vattn needs the vattn cache: call vattn.adapters.transformers.enable(model) "
                          "before generate_batch / init_continuous_batching")
    return sdpa_attention_paged_forward(module, query, key, value, attention_mask, dropout=dropout,
                                        scaling=scaling, **kwargs)
