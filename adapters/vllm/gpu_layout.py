"""Engine-free geometry and config checks of the vLLM GPU path (no vLLM import: unit-testable).

One vLLM *block* is one vattn *page-set* (one 2 MiB page in each of the ``L / G`` VA ranges),
so ``block_size`` = tokens per page of the layer-group layout and vLLM's ``num_gpu_blocks``
= page-sets the KV budget holds. vLLM's scheduler, admission and preemption then count exactly
what vattn maps. The functions here take duck-typed vLLM config objects (only the attributes
they read), so tests pass ``types.SimpleNamespace`` objects.
"""

from __future__ import annotations

import os

import torch

from vattn.core import KVCacheConfig, layout_report
from vattn.core.config import engine_group_size, env_flag, env_int
from vattn.core.errors import ConfigError, UnsupportedError

__all__ = ["PAGE_BYTES", "KV_TILE", "EXACT_ENV", "EXACT_MARGIN", "PACK_MB_DEFAULT", "FREE_RESERVE_ENV", "free_reserve_sets", "COLD_SLOTS_ENV", "cold_slots", "exact_kernel_path",
           "default_group_size", "group_size_for", "tokens_per_page", "block_size_for_vllm", "cache_config",
           "check_engine_config", "check_kv_cache_config"]

PAGE_BYTES = 2 << 20   # the CUDA VMM granularity on Hopper: one physical page
#: FA3's key tile for head_dim <= 128 with causal masking. A page must hold a whole number of
#: tiles: the TMA path of FA3 loads full tiles, and a tile crossing into an unmapped page faults.
KV_TILE = 128
_GROUP_ENV = "VATTN_GROUP_SIZE"
#: ``VATTN_VLLM_EXACT=1``: run FA3 on the kernel path stock vLLM runs (a diagnostic mode).
#: FA3 (Hopper) loads a paged KV with TMA only when the page size is a multiple of its key tile
#: (and the query block is large, i.e. prefill); stock vLLM's 16-token pages never qualify. A
#: vattn slot region is a multiple of 128 rows, so by default prefill takes the TMA path — faster
#: (the ceiling's path too) but a different kernel instantiation. In exact mode FA3 sees pages of
#: ``rows_per_slot - EXACT_MARGIN`` rows (not a multiple of 128): the non-TMA path, as stock. Each
#: slot region gets ``EXACT_MARGIN`` spare rows of address space so every request still fits one
#: page. Measured on the H200 (2026-12-04): this does *not* make outputs bit-identical to stock
#: (4 of 16 prompts exact, as in the default mode), so the kernel path is not what differs.
EXACT_ENV = "VATTN_VLLM_EXACT"
EXACT_MARGIN = 16
#: MiB of device memory for packs of shared runs beside vLLM's pool when prefix caching is on
#: (``VATTN_PACK_MB`` overrides it; 0 turns packs off). A shared run of 8 page-sets hit twice is
#: copied into one allocation per range, and later hits map it with one call per range instead of
#: one per page (docs/shared-prefix-packs.md). Measured on the H100 (2026-12-06, 3 alternated
#: rounds): the shared-prefix first generation 0.729x -> 0.886x stock at the 8B shape, the second
#: and decode-heavy unchanged (BENCHMARKS.md). Prefix staging, which maps page by page, is off by
#: default beside it (``VATTN_STAGE_PREFIXES=1`` turns it on; it did not move the GPU runs).
PACK_MB_DEFAULT = 1024
#: page-sets of the pool left free at start and refilled by the map-ahead worker between steps
#: (``KVCacheConfig.free_reserve``; :func:`free_reserve_sets`, default 0: none)
FREE_RESERVE_ENV = "VATTN_FREE_RESERVE"
#: idle slots the pre-warm leaves empty, with prefix caching (:func:`cold_slots`, default 0: none)
COLD_SLOTS_ENV = "VATTN_COLD_SLOTS"


def exact_kernel_path() -> bool:
    """Whether ``VATTN_VLLM_EXACT=1`` asks for stock's FA3 kernel path (see :data:`EXACT_ENV`)."""
    return env_flag(EXACT_ENV, False)


def default_group_size(num_layers: int) -> int:
    """Layers per VA range when ``VATTN_GROUP_SIZE`` is unset (:func:`vattn.core.config.engine_group_size`)."""
    return engine_group_size(num_layers)


def group_size_for(num_layers: int) -> int:
    """``VATTN_GROUP_SIZE`` if set (must divide ``num_layers``), else :func:`default_group_size`."""
    text = os.environ.get(_GROUP_ENV)
    if text is None:
        return default_group_size(num_layers)
    try:
        group = int(text)
    except ValueError as exc:
        raise ConfigError(f"{_GROUP_ENV} must be an int, got {text!r}") from exc
    if group <= 0 or num_layers % group:
        raise ConfigError(f"{_GROUP_ENV} must divide num_layers={num_layers}, got {group}")
    return group


def tokens_per_page(*, num_kv_heads: int, head_dim: int, dtype: torch.dtype, group_size: int,
                    page_bytes: int = PAGE_BYTES) -> int:
    """Tokens of ``group_size`` layers one page holds = the vLLM ``block_size`` vattn needs.

    Raises
    ------
    ConfigError
        The page does not hold a whole number of tokens, or not a multiple of :data:`KV_TILE`.
    """
    rep = layout_report(num_layers=group_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                        dtype=dtype, group_size=group_size, page_bytes=page_bytes)
    if page_bytes % rep.token_bytes:
        raise ConfigError(f"a {page_bytes}-byte page holds {rep.tokens_per_page:.2f} tokens of "
                          f"{group_size} layers (token = {rep.token_bytes} bytes); vattn's vLLM path "
                          f"needs a whole number: pick another {_GROUP_ENV}")
    tokens = page_bytes // rep.token_bytes
    if tokens % KV_TILE:
        raise ConfigError(f"tokens per page must be a multiple of {KV_TILE} (FA3's key tile), got "
                          f"{tokens} with {_GROUP_ENV}={group_size}; use a smaller group size")
    return tokens


def _kv_dtype(model_config, cache_config) -> torch.dtype:
    cache_dtype = getattr(cache_config, "cache_dtype", "auto")
    if cache_dtype not in ("auto", None):
        raise UnsupportedError(f"vattn's vLLM GPU path stores KV in the model dtype; "
                               f"kv_cache_dtype={cache_dtype!r} is not supported yet")
    return model_config.dtype


def block_size_for_vllm(vllm_config) -> int:
    """The ``block_size`` vattn needs for this engine config (the backend's preferred size)."""
    cache, model, par = vllm_config.cache_config, vllm_config.model_config, vllm_config.parallel_config
    return tokens_per_page(num_kv_heads=model.get_num_kv_heads(par), head_dim=model.get_head_size(),
                           dtype=_kv_dtype(model, cache),
                           group_size=group_size_for(model.get_num_layers(par)))


def free_reserve_sets(num_blocks: int) -> int:
    """Page-sets to keep free for the steps that admit a burst: ``$VATTN_FREE_RESERVE`` (default
    0, off until a GPU run measures it: on the host replay it takes the first burst's reclaim
    off the step's path — 18 % of the shared-prefix burst's bookkeeping at 128 page-sets — but
    its refill unmaps the loose page-sets a repeated generation's moves would use, which then
    map new pages; two steps of ``max_num_batched_tokens`` is the size to try).

    Raises
    ------
    ConfigError
        More than half of vLLM's blocks.
    """
    sets = env_int(FREE_RESERVE_ENV, 0, minimum=0)
    if sets > num_blocks // 2:
        raise ConfigError(f"{FREE_RESERVE_ENV} must be at most half of vLLM's {num_blocks} blocks, got {sets}")
    return sets


def cold_slots(max_num_reqs: int) -> int:
    """Slots the pre-warm leaves empty for requests whose prefix-cache hit is mapped in
    (:meth:`VirtualKVCache.prewarm`'s ``cold_slots``): ``$VATTN_COLD_SLOTS``, default 0 (off
    until a GPU run measures it; on the host replay of the shared-prefix burst it takes most of
    the unmaps of the pre-warmed pages where the hit goes). The burst's size is the size to try.

    Raises
    ------
    ConfigError
        Not fewer than vLLM's ``max_num_seqs`` (some slot must stay warm).
    """
    n = env_int(COLD_SLOTS_ENV, 0, minimum=0)
    if n >= max_num_reqs:
        raise ConfigError(f"{COLD_SLOTS_ENV} must be below max_num_seqs ({max_num_reqs}), got {n}")
    return n


def cache_config(*, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 num_blocks: int, max_num_reqs: int, max_model_len: int, device: str,
                 group_size: int | None = None, exact: bool = False, pack_mb: int = 0,
                 pack_sets: int | tuple[int, ...] = 8) -> KVCacheConfig:
    """The :class:`KVCacheConfig` matching vLLM's block accounting.

    ``page_budget`` = ``num_blocks`` page-sets: one for the padding slot (vLLM keeps block 0 as
    its null block, never handed to a request) and exactly the ``num_blocks - 1`` the scheduler
    may hand out. The runtime pre-warms every slot with an even share of the pool at start (see
    :meth:`~vattn.core.cache.VirtualKVCache.prewarm`), and map-ahead keeps one block beyond each
    running request's blocks mapped (``map_ahead_tokens`` = one block): a request outgrowing its
    share gets its next block in the background, taken from the free pool or from idle slots,
    not on the step's path when vLLM hands the block out. A block mapped ahead stays
    reclaimable, so vLLM's free-block count and vattn's pool never disagree. Scrubbing stays the core's ``"tenant"``
    policy with one tenant: a page is zeroed once, when first mapped (stock vLLM allocates its
    pool with ``torch.zeros``; FA3 reads whole tiles, so a page must never hold NaN garbage), and
    not again when a slot is reused; with the pre-warm that zeroing happens at start.
    ``exact``: reserve :data:`EXACT_MARGIN` spare rows per slot (address space only) for the
    exact kernel path. On CUDA the cache is ``stream_ordered``: vLLM writes and reads KV on the
    runner's one stream, where vattn records each release's fence, so under memory pressure a
    released slot's pages go to a growing request without the host waiting for the step in
    flight (their old mapping is unmapped once it completes). ``pack_mb`` (``$VATTN_PACK_MB``):
    device memory beyond vLLM's blocks for packs of shared runs of ``pack_sets`` page-sets
    (``$VATTN_PACK_SETS``; one map call per range for a hit on them instead of one per page;
    docs/shared-prefix-packs.md), 0: off. The free reserve (:func:`free_reserve_sets`, off by
    default): page-sets a burst grows into from the free pool, no reclaim on the step's path.
    """
    group = group_size_for(num_layers) if group_size is None else group_size
    block = tokens_per_page(num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, group_size=group)
    page_set = num_layers // group * PAGE_BYTES
    spare = EXACT_MARGIN if exact else 0
    max_context = -(-(max_model_len + spare) // block) * block   # a last block may pass max_model_len
    return KVCacheConfig(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                         dtype=dtype, max_slots=max_num_reqs, max_context=max_context,
                         group_size=group, page_budget=num_blocks * page_set, page_bytes=PAGE_BYTES,
                         device=device, map_ahead_tokens=block,
                         stream_ordered=torch.device(device).type == "cuda",
                         pack_pages=pack_mb * 2**20 // PAGE_BYTES, pack_sets=pack_sets,
                         free_reserve=free_reserve_sets(num_blocks) * (num_layers // group))


def check_engine_config(vllm_config) -> None:
    """Refuse engine features the GPU path does not implement (before anything is allocated).

    Raises
    ------
    ConfigError
        vLLM's own CuMem (sleep-mode) allocator on, or a backend other than
        ``CUSTOM`` selected while ``VATTN_VLLM=1``.
    UnsupportedError
        Speculative decoding, KV transfer, context parallelism, MLA or a quantized KV cache.
    """
    cache, model, par = vllm_config.cache_config, vllm_config.model_config, vllm_config.parallel_config
    if getattr(model, "enable_sleep_mode", False) or getattr(model, "enable_cumem_allocator", False):
        raise ConfigError("vattn manages KV memory with its own CUDA VMM pool: turn off vLLM's "
                          "sleep mode / enable_cumem_allocator")
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    if getattr(backend, "name", backend) != "CUSTOM":
        raise ConfigError(f"VATTN_VLLM=1 replaces the KV cache, so the attention backend must be "
                          f"vattn's: pass attention_backend='CUSTOM' (got {backend!r})")
    refused = {"speculative decoding": getattr(vllm_config, "speculative_config", None) is not None,
               "KV transfer / disaggregated serving": getattr(vllm_config, "kv_transfer_config", None)
               is not None,
               "decode context parallelism": getattr(par, "decode_context_parallel_size", 1) > 1,
               "prefill context parallelism": getattr(par, "prefill_context_parallel_size", 1) > 1,
               "MLA attention": bool(getattr(model, "use_mla", False))}
    found = [name for name, on in refused.items() if on]
    if found:
        raise UnsupportedError(f"vattn's vLLM GPU path does not support {', '.join(found)} yet")
    _kv_dtype(model, cache)


#: the custom ops that write and read a layer's KV; deferred mapping needs them run eagerly
#: (outside any CUDA graph), where the backend makes each layer's deferred calls first
KV_OPS = ("vllm::unified_kv_cache_update", "vllm::unified_attention_with_output")


def defer_mapping_for(vllm_config) -> tuple[bool, str]:
    """Whether the engine runs every layer's KV store and attention outside CUDA graphs except in
    full-graph replays (which the hooks precede with every deferred call): ``(ok, why not)``."""
    comp = getattr(vllm_config, "compilation_config", None)
    if comp is None:
        return False, "the engine's config has no compilation_config"
    mode = getattr(getattr(comp, "cudagraph_mode", None), "name", "NONE")
    if mode in ("NONE", "FULL", "FULL_DECODE_ONLY") or getattr(vllm_config.model_config, "enforce_eager", False):
        return True, ""                 # no piecewise graph: eager or a full replay
    split = set(getattr(comp, "splitting_ops", None) or ())
    missing = [op for op in KV_OPS if op not in split]
    if missing:
        return False, f"piecewise CUDA graphs capture {', '.join(missing)} (not in splitting_ops)"
    return True, ""


def check_kv_cache_config(kv_cache_config, *, block_size: int, page_set_bytes: int) -> None:
    """One full-attention KV group whose block is exactly one vattn page-set.

    Raises
    ------
    UnsupportedError
        Several KV groups (hybrid, sliding-window or Mamba layers) or a non-full-attention spec.
    ConfigError
        The engine's block size differs from the page's tokens.
    """
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise UnsupportedError(f"vattn's vLLM GPU path needs one KV cache group (full attention in "
                               f"every layer), got {len(groups)}")
    spec = groups[0].kv_cache_spec
    if type(spec).__name__ != "FullAttentionSpec" or getattr(spec, "sliding_window", None) \
            or getattr(spec, "attention_chunk_size", None):
        raise UnsupportedError(f"vattn's vLLM GPU path needs full causal attention, got {spec!r}")
    if spec.block_size != block_size:
        raise ConfigError(f"vattn needs block_size={block_size} (tokens per {PAGE_BYTES >> 20} MiB page "
                          f"of the layer-group layout), got {spec.block_size}: leave block_size unset "
                          f"(the CUSTOM backend picks it) or pass block_size={block_size}")
    per_block = getattr(spec, "page_size_bytes", None)
    layers = len(groups[0].layer_names)
    if per_block is not None and per_block * layers != page_set_bytes:
        raise ConfigError(f"one vLLM block of {layers} layers is {per_block * layers} bytes but one "
                          f"vattn page-set is {page_set_bytes}: the budgets would disagree")
