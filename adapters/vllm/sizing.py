"""What vattn reads from vLLM's configuration: the cache config of a worker, the page budget,
layer names.

The cache is sized from what vLLM decided (``max_num_seqs``, ``max_model_len``, the model's
heads and layers; with prefix caching, its block size and block count); ``VATTN_PAGE_BUDGET``
and ``VATTN_GROUP_SIZE`` are vattn's own knobs.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re

from vattn.core import KVCacheConfig
from vattn.core.config import pack_mb, pack_sets
from vattn.core.errors import ConfigError
from vattn.core.layout import KVLayout

__all__ = ["CPU_KERNEL_BLOCK", "config_from_vllm", "layer_index"]

#: vLLM's ``CPU_ATTN`` backend supports kernel block sizes that are multiples of 32
#: (``CPUAttentionBackend.get_supported_kernel_block_sizes``): block sizes vattn suggests are too
CPU_KERNEL_BLOCK = 32


def config_from_vllm(vllm_config, *, device: str, num_blocks: int | None = None) -> KVCacheConfig:
    """A :class:`KVCacheConfig` for this rank: KV heads of the rank, slots = ``max_num_seqs``.

    Prefix caching off: pages of the driver's size (2 MiB), ``VATTN_PAGE_BUDGET`` bytes of them.
    Prefix caching on: one page-set holds exactly one vLLM block (``page_bytes = block_size *
    token_bytes`` of one range), and the budget is ``num_blocks + 1`` page-sets (vLLM's whole
    block pool, whose block 0 is its never-used null block, plus the padding slot's page-set):
    every block vLLM hands out is bound to a page-set and a cached one stays bound until vLLM
    hands its id out again, so vattn must be able to hold as many as vLLM has
    (``VATTN_PAGE_BUDGET`` is not used then). The host backend maps whole OS pages, so the
    block must be a multiple of the OS page (:class:`ConfigError` naming a block size that is).
    """
    model = vllm_config.model_config
    par = vllm_config.parallel_config
    num_layers = model.get_num_layers(par)
    budget = os.environ.get("VATTN_PAGE_BUDGET", "256MiB" if device == "cpu" else "0.5")
    cfg = KVCacheConfig(num_layers=num_layers, num_kv_heads=model.get_num_kv_heads(par),
                        head_dim=model.get_head_size(), dtype=model.dtype,
                        max_slots=vllm_config.scheduler_config.max_num_seqs,
                        max_context=model.max_model_len,
                        group_size=int(os.environ.get("VATTN_GROUP_SIZE", "1")),
                        page_budget=_parse_budget(budget), device=device,
                        map_ahead_tokens=0 if device == "cpu" else 256)
    if not getattr(vllm_config.cache_config, "enable_prefix_caching", False):
        return cfg
    block = vllm_config.cache_config.block_size
    lay = KVLayout.from_config(cfg, 1)
    page, os_page = block * lay.token_bytes, os.sysconf("SC_PAGE_SIZE")
    if page % os_page:
        step = math.lcm(os_page // math.gcd(lay.token_bytes, os_page), CPU_KERNEL_BLOCK)
        fits = -(-block // step) * step
        raise ConfigError(f"vattn with prefix caching maps one vLLM block as one page per VA range: "
                          f"block_size {block} x {lay.token_bytes} bytes per token and range = {page} "
                          f"bytes, not a multiple of the {os_page}-byte OS page; use --block-size "
                          f"{fits} (block_size={fits}), or turn prefix caching off "
                          f"(--no-enable-prefix-caching)")
    # packs of shared runs (VATTN_PACK_MB; off by default on the CPU runner, whose pages are a
    # block each; VATTN_PACK_SETS page-sets each, default 8)
    packs = dict(pack_pages=pack_mb() * 2**20 // page, pack_sets=pack_sets())
    if num_blocks is None:
        return dataclasses.replace(cfg, page_bytes=page, **packs)
    return dataclasses.replace(cfg, page_bytes=page, page_budget=(num_blocks + 1) * page * lay.num_ranges,
                               **packs)


def _parse_budget(text: str) -> int | float:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for suffix, mult in units.items():
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * mult)
    try:
        return float(text) if "." in text else int(text)
    except ValueError as exc:
        raise ConfigError(f"VATTN_PAGE_BUDGET must be bytes, '<n>MiB' or a fraction, got {text!r}") from exc


def layer_index(layer_name: str) -> int:
    """The layer number in a vLLM layer name (``model.layers.7.self_attn.attn`` -> 7)."""
    found = re.findall(r"\.(\d+)\.", f".{layer_name}.")
    if not found:
        raise ConfigError(f"cannot find a layer index in {layer_name!r}")
    return int(found[0])
