"""Every change vattn makes to TGI v3.3.7's server, each small, named and version-gated.

Applied by the import hook of :mod:`.activate` right after TGI's own module executes; each
``patch_*`` first checks the server fingerprint (:func:`.version.check_server`) and raises
``UnsupportedError`` on any other version. The patched functions close over one
:class:`Patcher` (no module-global state).
"""

from __future__ import annotations

import functools
import os

import torch

from vattn.core import KVCacheConfig, VirtualKVCache
from vattn.core.errors import ConfigError

from . import kv
from .runtime import TgiRuntime
from .version import check_server

__all__ = ["Patcher", "check_environment", "config_from_env"]


def check_environment(env=None) -> None:
    """TGI settings vattn needs in the server process (read from ``env``, default ``os.environ``).

    Raises
    ------
    ConfigError
        ``PREFIX_CACHING`` on, ``ATTENTION`` not ``flashdecoding``, or CUDA graphs on.
    """
    env = os.environ if env is None else env
    if env.get("PREFIX_CACHING", "0").lower() in {"1", "true"}:
        raise ConfigError("vattn's TGI adapter needs PREFIX_CACHING=0 (launch with "
                          "--prefix-caching 0 / PREFIX_CACHING=0); prefix sharing is not supported yet")
    if env.get("ATTENTION") != "flashdecoding":
        raise ConfigError("vattn's TGI adapter needs ATTENTION=flashdecoding (its [blocks, tokens, H, D] "
                          f"KV layout is what the virtual views have), got {env.get('ATTENTION')!r}")
    if env.get("CUDA_GRAPHS", "0") not in {"", "0"}:
        raise ConfigError("vattn's TGI adapter needs CUDA graphs off (launch with --cuda-graphs 0, "
                          "which leaves CUDA_GRAPHS unset; TGI pads graph batches by writing to slot 0, "
                          f"a live vattn region), got CUDA_GRAPHS={env['CUDA_GRAPHS']!r}")


def config_from_env(*, num_layers: int, num_heads: int, head_size: int, dtype: torch.dtype,
                    device, env=None) -> KVCacheConfig:
    """The cache config from the model shape and ``VATTN_TGI_*`` variables.

    ``VATTN_TGI_MAX_SLOTS`` (default 64), ``VATTN_TGI_MAX_CONTEXT`` (4096),
    ``VATTN_TGI_GROUP_SIZE`` (1), ``VATTN_TGI_PAGE_BUDGET`` (bytes if an int, a fraction if it
    has a dot; default 0.9), ``VATTN_TGI_PAGE_BYTES`` (driver granularity), ``VATTN_TGI_SCRUB``.
    """
    env = os.environ if env is None else env

    def _int(name, default):
        raw = env.get(name)
        try:
            return default if raw in (None, "") else int(raw)
        except ValueError as exc:
            raise ConfigError(f"{name} must be an int, got {raw!r}") from exc

    raw_budget = env.get("VATTN_TGI_PAGE_BUDGET", "0.9")
    try:
        budget = float(raw_budget) if "." in raw_budget else int(raw_budget)
    except ValueError as exc:
        raise ConfigError(f"VATTN_TGI_PAGE_BUDGET must be bytes or a fraction, got {raw_budget!r}") from exc
    return KVCacheConfig(num_layers=num_layers, num_kv_heads=num_heads, head_dim=head_size,
                         dtype=dtype, max_slots=_int("VATTN_TGI_MAX_SLOTS", 64),
                         max_context=_int("VATTN_TGI_MAX_CONTEXT", 4096),
                         group_size=_int("VATTN_TGI_GROUP_SIZE", 1), page_budget=budget,
                         page_bytes=_int("VATTN_TGI_PAGE_BYTES", None),
                         scrub=env.get("VATTN_TGI_SCRUB", "tenant"), device=str(device),
                         map_ahead_tokens=_int("VATTN_TGI_MAP_AHEAD", 0))


class Patcher:
    """Owns the runtime of one server process and the patches that reach it."""

    def __init__(self, *, env=None):
        self.env = os.environ if env is None else env
        self.runtime: TgiRuntime | None = None
        self.applied: list[str] = []

    # -- layers/attention/__init__.py ----------------------------------------------------------
    def fill_attention_package(self, module) -> None:
        """Body used instead of TGI's ``layers/attention/__init__.py`` (which picks a
        CUDA/ROCm/IPEX backend and refuses plain CPU): the same names, vattn's attention."""
        check_server()
        check_environment(self.env)
        from text_generation_server.layers.attention.common import Seqlen
        module.Seqlen = Seqlen
        module.attention, module.paged_attention = kv.attention, kv.paged_attention
        module.SUPPORTS_WINDOWING = False
        from text_generation_server.layers.attention.kv_cache import KVCache, get_kv_scales
        module.KVCache, module.get_kv_scales = KVCache, get_kv_scales
        module.__all__ = ["attention", "get_kv_scales", "paged_attention", "SUPPORTS_WINDOWING",
                          "KVCache", "Seqlen"]
        self.applied.append("attention_package")

    # -- models/flash_causal_lm.py ------------------------------------------------------------
    def patch_flash_causal_lm(self, module) -> None:
        check_server()
        model_cls, batch_cls = module.FlashCausalLM, module.FlashCausalLMBatch
        model_cls.init_kv_cache = self._init_kv_cache(module.KVCache)
        model_cls.forward = self._forward(model_cls.forward)
        model_cls.generate_token = self._generate_token(model_cls.generate_token)
        model_cls.warmup = self._warmup(model_cls.warmup)
        batch_cls.filter = self._filter(batch_cls.filter)
        self.applied.append("flash_causal_lm")

    # -- cache.py -----------------------------------------------------------------------------
    def patch_cache(self, module) -> None:
        check_server()
        module.Cache.delete = self._delete(module.Cache.delete)
        self.applied.append("cache")

    def _init_kv_cache(self, kv_cache_cls):
        patcher = self

        def init_kv_cache(self, num_blocks, num_layers, num_heads, head_size, dtype, device):
            # num_blocks is ignored: physical memory is the vattn page budget.
            rt = patcher.runtime
            if rt is not None:
                rt.release_all()
            cfg = config_from_env(num_layers=num_layers, num_heads=num_heads, head_size=head_size,
                                  dtype=dtype, device=device, env=patcher.env)
            if rt is None or rt.cache.config != cfg:
                if rt is not None:
                    rt.cache.close()
                patcher.runtime = rt = TgiRuntime(VirtualKVCache(cfg))
            self.kv_cache = kv.layer_caches(kv_cache_cls, rt.cache)
        return init_kv_cache

    def _forward(self, orig):
        patcher = self

        @functools.wraps(orig)
        def forward(self, batch, adapter_data):
            spec = 0 if batch.speculative_ids is None else int(batch.speculative_ids.shape[1])
            patcher.runtime.bind(batch, speculative=spec)
            return orig(self, batch, adapter_data)
        return forward

    def _generate_token(self, orig):
        patcher = self

        @functools.wraps(orig)
        def generate_token(self, batch):
            ids = [r.id for r in batch.requests]
            generations, next_batch, timings = orig(self, batch)
            if next_batch is None and patcher.runtime is not None:
                patcher.runtime.release(ids)
            return generations, next_batch, timings
        return generate_token

    def _warmup(self, orig):
        patcher = self

        @functools.wraps(orig)
        def warmup(self, batch, max_input_tokens, max_total_tokens):
            supported, max_input, max_total = orig(self, batch, max_input_tokens, max_total_tokens)
            patcher.runtime.release_all()
            return min(supported, patcher.runtime.capacity_tokens()), max_input, max_total
        return warmup

    def _filter(self, orig):
        patcher = self

        @functools.wraps(orig)
        def filter(self, request_ids):
            gone = {r.id for r in self.requests} - set(request_ids)
            out = orig(self, request_ids)
            if patcher.runtime is not None:
                patcher.runtime.release(gone)
            return out
        return filter

    def _delete(self, orig):
        patcher = self

        @functools.wraps(orig)
        def delete(self, batch_id):
            batch = self.cache.get(batch_id)
            if batch is not None and patcher.runtime is not None:
                patcher.runtime.release([r.id for r in batch.requests])
            return orig(self, batch_id)
        return delete
