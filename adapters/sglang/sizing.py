"""Size the vattn cache from what SGLang's KV-cache configurator decided (pure functions).

SGLang 0.5.17's ``KVCacheConfigurator`` builds, in this order, the ``ReqToTokenPool``
(``max_running_requests`` rows of ``context_len + extra`` tokens), the KV pool
(``PoolCls(max_total_num_tokens, page_size=..., dtype=..., head_num=..., ...)``) and the allocator.
The KV pool is not handed the request pool, so vattn derives its two bounds:

* ``max_context``: the request-pool row length, ``model context_len +
  get_req_to_token_extra_context_len(server_args)`` from SGLang's published ``ServerArgs``;
* ``max_requests``: the request-pool size SGLang resolves (``--max-running-requests``, else its
  own default from the token budget and the context length), capped by the page-sets the
  budget buys (a live request holds at least one). A slot SGLang can never fill would only
  thin the pre-warmed share of the slots it does fill.

One SGLang page is one vattn page-set (SGLang's page ids are the core's block keys), so SGLang's
``page_size`` is the tokens of one page-set: on CUDA fixed by the 2 MiB page and the layer group
(:func:`page_size_for`; the platform sets it), on the host backend any page size whose page-set is
a whole number of 4 KiB pages (the page bytes follow the page size).

The physical page budget is the page-sets holding ``max_total_num_tokens`` tokens plus
the two padding page-sets (the core's padding slot and the pool's slot 0), so an idle allocator
reports ``available_size() == max_total_num_tokens`` (SGLang's idle leak check). Both bounds are
checked against the real ``ReqToTokenPool`` when the attention backend is created
(:func:`check_fit`).
"""

from __future__ import annotations

import math
import numbers

import torch

from vattn.core import KVCacheConfig
from vattn.core.config import env_int, pack_mb, pack_sets
from vattn.core.errors import ConfigError
from vattn.core.layout import KVLayout, layout_report

#: Physical page size: the VMM granularity of the stock driver (design decision 1).
PAGE_BYTES = 2 << 20
#: Page-sets held for padding: the core's padding slot and the pool's slot 0.
PAD_PAGE_SETS = 2
#: Host backend: page-sets are whole multiples of this (the OS page).
HOST_PAGE = 4096
#: Slots beyond SGLang's own request count (its count may round differently; a slot costs
#: only address space until a request takes it).
SPARE_SLOTS = 8


def sglang_bounds(num_tokens: int) -> tuple[int, int]:
    """``(max_context, max_requests)`` for a pool of ``num_tokens`` tokens, from SGLang's
    published ``ServerArgs``.

    ``max_requests`` is the request-pool size SGLang itself resolves from the same inputs
    (:func:`sglang_max_requests`), so the cache has no more slots than SGLang can run at once;
    :func:`check_fit` compares both bounds with the real ``ReqToTokenPool`` later.

    Raises
    ------
    ConfigError
        If SGLang has not published its server args in this process (no engine running).
    """
    from sglang.srt.mem_cache.allocation_sizing import get_req_to_token_extra_context_len
    from sglang.srt.runtime_context import get_parallel, get_server_args

    try:
        args = get_server_args()
    except ValueError as exc:
        raise ConfigError("the vattn SGLang pool sizes itself from SGLang's published server "
                          f"args, which are not set in this process: {exc}") from exc
    model_context = args.get_model_config().context_len
    context = model_context + get_req_to_token_extra_context_len(args)
    reqs = args.max_running_requests
    if reqs is not None:
        reqs = max(1, reqs // max(1, get_parallel().attn_dp_size))
    # a few spare slots: SGLang resolves from its token capacity before page alignment
    return int(context), sglang_max_requests(num_tokens, model_context, reqs) + SPARE_SLOTS


def sglang_max_requests(num_tokens: int, context_len: int, requested: int | None) -> int:
    """Concurrent requests SGLang 0.5.17 allows per worker (its
    ``KVCacheConfigurator.resolve_max_num_reqs`` for a model without Mamba state):
    ``--max-running-requests`` if given, else ``num_tokens / context_len * 512`` clamped to
    ``[2048, 4096]``; never more than ``num_tokens // 2``."""
    if requested is None:
        requested = max(min(int(num_tokens / context_len * 512), 4096), 2048)
    return max(1, min(int(requested), num_tokens // 2))


def group_size_for(layer_num: int, group_size: int | None = None) -> int:
    """Layers per VA range: ``group_size``, else ``VATTN_SGLANG_GROUP_SIZE``, else the engines'
    default (:func:`vattn.core.config.engine_group_size`: 4 where it divides ``layer_num``)."""
    from vattn.core.config import engine_group_size
    return group_size or env_int("VATTN_SGLANG_GROUP_SIZE") or engine_group_size(layer_num)


def page_size_for(*, dtype: torch.dtype, head_num: int, head_dim: int, layer_num: int,
                  group_size: int | None = None) -> int:
    """SGLang ``page_size`` on CUDA: the tokens one 2 MiB page-set holds (one SGLang page = one
    page-set, so a radix-tree page is shared by mapping it, never copied).

    Raises
    ------
    ConfigError
        The page does not hold a whole number of tokens.
    """
    group = group_size_for(layer_num, group_size)
    rep = layout_report(num_layers=group, num_kv_heads=head_num, head_dim=head_dim, dtype=dtype,
                        group_size=group, page_bytes=PAGE_BYTES)
    if PAGE_BYTES % rep.token_bytes:
        raise ConfigError(f"a {PAGE_BYTES}-byte page holds {rep.tokens_per_page:.2f} tokens of "
                          f"{group} layers; set VATTN_SGLANG_GROUP_SIZE to a divisor of "
                          f"{layer_num} that gives a whole number")
    return PAGE_BYTES // rep.token_bytes


def _page_bytes(device: str, page_size: int | None, token_bytes: int) -> int:
    """The page size (bytes) making one page-set hold ``page_size`` tokens; CUDA: 2 MiB."""
    if torch.device(device).type == "cuda" or page_size is None:
        if page_size is not None and page_size * token_bytes != PAGE_BYTES:
            raise ConfigError(f"SGLang page_size must be {PAGE_BYTES // token_bytes} with vattn on "
                              f"CUDA (the tokens of one 2 MiB page-set), got {page_size}: drop "
                              "--page-size or pass that value")
        return PAGE_BYTES
    if page_size * token_bytes % HOST_PAGE:
        step = HOST_PAGE // math.gcd(HOST_PAGE, token_bytes)
        raise ConfigError(f"SGLang page_size {page_size} makes a page-set of "
                          f"{page_size * token_bytes} bytes, not a multiple of {HOST_PAGE}: use "
                          f"a multiple of {step}")
    return page_size * token_bytes


def cache_config(*, num_tokens: int, dtype: torch.dtype, head_num: int, head_dim: int,
                 layer_num: int, device: str, max_context: int, max_requests: int | None = None,
                 group_size: int | None = None, map_ahead_tokens: int | None = None,
                 page_size: int | None = None) -> KVCacheConfig:
    """The :class:`KVCacheConfig` behind a pool SGLang asked to hold ``num_tokens`` tokens.

    Parameters
    ----------
    num_tokens : int
        SGLang's ``max_total_num_tokens`` (its memory profiler's token budget).
    dtype, head_num, head_dim, layer_num, device
        As SGLang passes them to its KV pool (``head_num``: KV heads of this rank).
    max_context : int
        Tokens one request can hold (SGLang's ``req_to_token`` row length).
    max_requests : int, optional
        Concurrent requests (``--max-running-requests`` per worker); default: one per page-set.
    group_size, map_ahead_tokens : int, optional
        Core options; default from ``VATTN_SGLANG_GROUP_SIZE`` / ``VATTN_SGLANG_MAP_AHEAD``,
        else the core's defaults (map-ahead off on the CPU).
    page_size : int, optional
        SGLang's page size; one page-set holds exactly that many tokens (CUDA: it must be
        :func:`page_size_for`; host: the page bytes follow it).
    """
    for name, value in (("num_tokens", num_tokens), ("max_context", max_context),
                        ("max_requests", max_requests), ("group_size", group_size)):
        if value is not None and (not isinstance(value, numbers.Integral) or isinstance(value, bool)
                                  or value < 1):
            raise ConfigError(f"{name} must be a positive int, got {value!r}")
    if str(device).split(":")[0] not in ("cpu", "cuda"):
        raise ConfigError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}")
    num_tokens, max_context = int(num_tokens), int(max_context)
    group_size = group_size_for(layer_num, group_size)
    if map_ahead_tokens is None:
        map_ahead_tokens = env_int("VATTN_SGLANG_MAP_AHEAD")
    if map_ahead_tokens is None:
        map_ahead_tokens = 0 if torch.device(device).type == "cpu" else 256
    token_bytes = layout_report(num_layers=layer_num, num_kv_heads=head_num, head_dim=head_dim,
                                dtype=dtype, group_size=group_size).token_bytes
    page_bytes = _page_bytes(device, page_size, token_bytes)
    base = dict(num_layers=layer_num, num_kv_heads=head_num, head_dim=head_dim, dtype=dtype,
                max_context=max_context, group_size=group_size, page_bytes=page_bytes,
                device=device, map_ahead_tokens=map_ahead_tokens,
                # packs of shared runs beside the pool (VATTN_PACK_MB, default 0: off)
                pack_pages=pack_mb() * 2**20 // page_bytes, pack_sets=pack_sets())
    probe = KVCacheConfig(**base, max_slots=1)
    layout = KVLayout.from_config(probe, page_bytes)
    # page-sets holding num_tokens tokens; one page-set serves one request, so also enough of
    # them for num_tokens / max_context requests (small models: a page-set > max_context)
    sets = max(layout.pages_for(num_tokens), -(-num_tokens // max_context))
    slots = sets if max_requests is None else max(1, min(int(max_requests), sets))
    budget = (sets + PAD_PAGE_SETS) * layout.page_set_bytes
    return KVCacheConfig(**dict(base, group_size=probe.group_size), max_slots=slots + 1,
                         page_budget=budget)


def check_fit(pool, req_to_token_pool) -> None:
    """Raise :class:`ConfigError` unless the vattn pool can serve SGLang's request pool.

    A request's positions are ``< req_to_token_pool.max_context_len`` and at most
    ``min(req_to_token_pool.size, page-sets)`` requests are live at once.
    """
    cfg = pool.vattn_cache.config
    if req_to_token_pool.max_context_len > cfg.max_context:
        raise ConfigError(f"SGLang's req_to_token rows hold {req_to_token_pool.max_context_len} "
                          f"tokens, the vattn cache only {cfg.max_context} per request")
    need = min(int(req_to_token_pool.size), pool.max_requests_physical)
    if need > pool.max_requests:
        raise ConfigError(f"SGLang may run {need} requests at once, the vattn cache has "
                          f"{pool.max_requests} slots; raise --max-running-requests")
