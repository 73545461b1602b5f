"""Bad input at every public entry: one typed error each, with a message that says what went wrong.

``CASES`` is the table of ``docs/bad-input.md``: every row is a test here (the exact error class
and a fragment of its message), and :func:`test_doc_lists_every_case` checks that the document
holds exactly the table :func:`render_table` makes from ``CASES``. After changing a row, write
the table again with ``python tests/test_bad_input.py``.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace as NS
from unittest import mock

import pytest
import torch

from vattn.cli import UsageError, run_command
from vattn.core import (ConfigError, ContextLengthError, DriverError, KVCacheConfig, SlotError,
                        TensorError, UnsupportedError, VirtualKVCache)

DOC = Path(__file__).resolve().parents[1] / "docs" / "bad-input.md"
BEGIN, END = "<!-- table: begin -->", "<!-- table: end -->"


@dataclass(frozen=True)
class Case:
    """One bad input: ``call()`` must raise ``error`` with ``fragment`` in its message."""

    id: str
    entry: str
    given: str
    error: type
    fragment: str
    call: Callable[[], object]
    needs: str | None = None        # a module the entry imports (the row is skipped without it)


# -- fixtures of the calls: a small host-backend cache, layer views, vLLM configs ------------------
def _config(**over) -> KVCacheConfig:
    base = dict(num_layers=4, num_kv_heads=2, head_dim=32, dtype=torch.float16, max_slots=4,
                max_context=300, group_size=2, page_budget=40 * (64 << 10), page_bytes=64 << 10,
                device="cpu", map_ahead_tokens=0)
    return KVCacheConfig(**(base | over))


def _on_cache(action: Callable[[VirtualKVCache], object]) -> Callable[[], object]:
    """A call running ``action`` on a fresh cache with slot 0 acquired (closed afterwards)."""
    def call():
        with VirtualKVCache(_config()) as cache:
            assert cache.acquire() == 0
            return action(cache)
    return call


def _after_close(action: Callable[[VirtualKVCache], object]) -> Callable[[], object]:
    """A call running ``action`` on a cache closed while slot 0 was acquired."""
    def call():
        cache = VirtualKVCache(_config())
        cache.acquire()
        cache.close()
        return action(cache)
    return call


def _release_twice(cache: VirtualKVCache) -> None:
    cache.release(0)
    cache.release(0)


def _ensure_after_release(cache: VirtualKVCache) -> None:
    cache.release(0)
    cache.ensure({0: 3})


def _fill_slots(cache: VirtualKVCache) -> None:
    for _ in range(cache.config.max_slots + 1):
        cache.acquire()


S, R, H, D = 3, 16, 2, 8                               # slots, rows per slot, kv heads, head dim


def _kv(**over) -> dict:
    """Arguments of a valid ``decode`` on ``[S, R, H, D]`` views, with ``over`` replacing some."""
    g = torch.Generator().manual_seed(0)
    base = dict(q=torch.randn(2, 2 * H, D, generator=g), k_cache=torch.randn(S, R, H, D, generator=g),
                v_cache=torch.randn(S, R, H, D, generator=g), slots=torch.tensor([0, 2], dtype=torch.int32),
                seqlens=torch.tensor([5, 16], dtype=torch.int32))
    return base | over


def _decode(**over) -> Callable[[], object]:
    from vattn.core.ops import decode
    return lambda: decode(**_kv(**over))


def _prefill(**over) -> Callable[[], object]:
    from vattn.core.ops import prefill
    kv = _kv()
    base = dict(q=torch.randn(7, 2 * H, D), k_cache=kv["k_cache"], v_cache=kv["v_cache"],
                cu_seqlens_q=torch.tensor([0, 3, 7], dtype=torch.int32), slots=kv["slots"],
                seqlens_k=torch.tensor([5, 16], dtype=torch.int32), max_seqlen_q=4, max_seqlen_k=16)
    return lambda: prefill(**(base | over))


def _store(**over) -> Callable[[], object]:
    from vattn.core.ops import store
    kv = _kv()
    base = dict(k_cache_rows=kv["k_cache"].flatten(0, 1), v_cache_rows=kv["v_cache"].flatten(0, 1),
                k_new=torch.randn(2, H, D), v_new=torch.randn(2, H, D), rows=torch.tensor([0, 17]))
    return lambda: store(**(base | over))


def _resolve(op="decode", **over) -> Callable[[], object]:
    from vattn.core.ops import resolve_backend
    base = dict(device="cpu", dtype=torch.float32, head_dim=D)
    return lambda: resolve_backend(op, **(base | over))


def _vllm_config(**over) -> NS:
    """A duck-typed ``VllmConfig`` that ``check_engine_config`` accepts, with ``over`` replacing parts."""
    base = dict(cache_config=NS(enable_prefix_caching=False, cache_dtype="auto"),
                model_config=NS(enable_sleep_mode=False, use_mla=False, dtype=torch.bfloat16),
                parallel_config=NS(decode_context_parallel_size=1, prefill_context_parallel_size=1),
                attention_config=NS(backend="CUSTOM"), speculative_config=None, kv_transfer_config=None)
    return NS(**(base | over))


def _vllm(function: str, *args, **kwargs) -> Callable[[], object]:
    return _call("vattn.adapters.vllm.gpu_layout", function, *args, **kwargs)


class FullAttentionSpec(NS):
    """A stand-in KV spec: ``check_kv_cache_config`` reads its class name and attributes."""


def _kv_groups(*specs, layers=("model.layers.0.self_attn.attn",)) -> NS:
    return NS(kv_cache_groups=[NS(kv_cache_spec=s, layer_names=list(layers)) for s in specs])


def _sglang(**over) -> Callable[[], object]:
    def call():
        from vattn.adapters.sglang.sizing import cache_config
        base = dict(num_tokens=1000, dtype=torch.float16, head_num=2, head_dim=64, layer_num=4,
                    device="cpu", max_context=512)
        return cache_config(**(base | over))
    return call


def _sglang_rows(rows, seqs, prefixes=None) -> Callable[[], object]:
    """``RowSlots.prepare`` of a fresh table over a small host cache (16-token page-sets)."""
    def call():
        from vattn.adapters.sglang.requests import RowSlots
        cache = VirtualKVCache(KVCacheConfig(num_layers=2, num_kv_heads=2, head_dim=32,
                                             dtype=torch.float32, max_slots=3, max_context=64,
                                             page_bytes=8192, page_budget=64 * 8192))
        table = RowSlots(cache, page_size=16)
        r2t = NS(req_to_token=torch.zeros(4, 64, dtype=torch.int32), alloc=lambda reqs: None,
                 free=lambda req: None, clear=lambda: None)
        r2t.req_to_token[1, :32] = torch.arange(16 * 9, 16 * 11, dtype=torch.int32)
        table.attach(r2t)
        try:
            return table.prepare(rows, seqs, prefixes)
        finally:
            cache.close()
    return call


def _stage_env():
    from vattn.core.config import stage_prefixes
    return stage_prefixes()


def _defer_env():
    from vattn.core.config import defer_mapping
    return defer_mapping()


def _pack_env():
    from vattn.core.config import pack_mb, pack_sets
    return pack_mb(), pack_sets()


def _with_env(call: Callable[[], object], **values) -> Callable[[], object]:
    """``call`` with environment variables set (restored afterwards)."""
    def wrapped():
        with mock.patch.dict(os.environ, values):
            return call()
    return wrapped


def _without_module(name: str, call: Callable[[], object]) -> Callable[[], object]:
    """``call`` in a process where importing ``name`` fails (as if it were not installed)."""
    def wrapped():
        with mock.patch.dict(sys.modules, {name: None}):
            return call()
    return wrapped


def _enable_transformers(model, **options) -> Callable[[], object]:
    def call():
        import vattn.adapters.transformers as vt
        return vt.enable(model, **options)
    return call


def _cli(*argv: str) -> Callable[[], object]:
    return lambda: run_command(list(argv))


def _call(module: str, function: str, *args, **kwargs) -> Callable[[], object]:
    """``module.function(*args, **kwargs)``, importing ``module`` inside the call."""
    return lambda: getattr(importlib.import_module(module), function)(*args, **kwargs)


_ENGINE_CONFIG = "vattn.adapters.vllm.gpu_layout.check_engine_config"


CASES = [
    # -- KVCacheConfig -------------------------------------------------------------------------------
    Case("config-num-layers-zero", "KVCacheConfig", "num_layers=0", ConfigError,
         "num_layers must be a positive int", lambda: _config(num_layers=0)),
    Case("config-head-dim-float", "KVCacheConfig", "head_dim=32.0", ConfigError,
         "head_dim must be a positive int", lambda: _config(head_dim=32.0)),
    Case("config-max-slots-bool", "KVCacheConfig", "max_slots=True", ConfigError,
         "max_slots must be a positive int", lambda: _config(max_slots=True)),
    Case("config-max-context-negative", "KVCacheConfig", "max_context=-5", ConfigError,
         "max_context must be a positive int", lambda: _config(max_context=-5)),
    Case("config-dtype-string", "KVCacheConfig", 'dtype="float16"', ConfigError,
         "dtype must be one of", lambda: _config(dtype="float16")),
    Case("config-dtype-int64", "KVCacheConfig", "dtype=torch.int64", ConfigError,
         "dtype must be one of", lambda: _config(dtype=torch.int64)),
    Case("config-group-not-divisor", "KVCacheConfig", "group_size=3 with num_layers=4", ConfigError,
         "group_size must divide num_layers=4", lambda: _config(group_size=3)),
    Case("config-split-kv-group", "KVCacheConfig", "split_kv=True with group_size=2", ConfigError,
         "split_kv=True needs group_size=1", lambda: _config(split_kv=True)),
    Case("config-split-kv-string", "KVCacheConfig", 'split_kv="yes"', ConfigError,
         "split_kv must be a bool", lambda: _config(split_kv="yes", group_size=1)),
    Case("config-budget-fraction", "KVCacheConfig", "page_budget=1.5", ConfigError,
         "a fractional page_budget must be in (0, 1]", lambda: _config(page_budget=1.5)),
    Case("config-budget-zero", "KVCacheConfig", "page_budget=0", ConfigError,
         "page_budget in bytes must be positive", lambda: _config(page_budget=0)),
    Case("config-budget-string", "KVCacheConfig", 'page_budget="1G"', ConfigError,
         "page_budget must be bytes (int) or a fraction (float)", lambda: _config(page_budget="1G")),
    Case("config-page-bytes-negative", "KVCacheConfig", "page_bytes=-1", ConfigError,
         "page_bytes must be a positive int or None", lambda: _config(page_bytes=-1)),
    Case("config-scrub-unknown", "KVCacheConfig", 'scrub="sometimes"', ConfigError,
         "scrub must be one of", lambda: _config(scrub="sometimes")),
    Case("config-map-ahead-negative", "KVCacheConfig", "map_ahead_tokens=-1", ConfigError,
         "map_ahead_tokens must be an int >= 0", lambda: _config(map_ahead_tokens=-1)),
    Case("config-stream-ordered-not-bool", "KVCacheConfig", 'stream_ordered="yes"', ConfigError,
         "stream_ordered must be a bool", lambda: _config(stream_ordered="yes")),
    Case("config-pack-pages-negative", "KVCacheConfig", "pack_pages=-8", ConfigError,
         "pack_pages must be an int >= 0", lambda: _config(pack_pages=-8)),
    Case("config-pack-sets-not-power-of-two", "KVCacheConfig", "pack_sets=6", ConfigError,
         "pack_sets must be a power of two >= 2", lambda: _config(pack_sets=6)),
    Case("config-free-reserve-negative", "KVCacheConfig", "free_reserve=-2", ConfigError,
         "free_reserve must be an int >= 0", lambda: _config(free_reserve=-2)),
    Case("config-free-reserve-no-worker", "KVCacheConfig", "free_reserve=8 with map_ahead_tokens=0",
         ConfigError, "free_reserve needs the map-ahead worker", lambda: _config(free_reserve=8, map_ahead_tokens=0)),
    Case("config-device-tpu", "KVCacheConfig", 'device="tpu"', ConfigError,
         "device must be 'cpu' or 'cuda[:N]'", lambda: _config(device="tpu")),
    # -- VirtualKVCache(config), get_driver ----------------------------------------------------------
    Case("cache-page-not-os-multiple", "VirtualKVCache(config)", "page_bytes=65537 (host backend)",
         DriverError, "granularity must be a positive multiple of",
         lambda: VirtualKVCache(_config(page_bytes=(64 << 10) + 1))),
    Case("cache-budget-too-small", "VirtualKVCache(config)", "page_budget of one page", ConfigError,
         "at least 4 are needed", lambda: VirtualKVCache(_config(page_budget=64 << 10))),
    Case("cache-va-too-large", "VirtualKVCache(config)", "max_slots=10**6, max_context=10**7",
         ConfigError, "of virtual address space",
         lambda: VirtualKVCache(_config(max_slots=10**6, max_context=10**7))),
    Case("cache-config-dict", "VirtualKVCache(config)", "a dict instead of a KVCacheConfig", ConfigError,
         "KVCacheConfig", lambda: VirtualKVCache({"num_layers": 4})),
    Case("driver-backend-device", "vattn.core.driver.get_driver", 'device="cpu", backend="cuda"',
         ConfigError, "the cuda backend serves CUDA devices",
         _call("vattn.core.driver", "get_driver", "cpu", backend="cuda")),
    Case("driver-backend-unknown", "vattn.core.driver.get_driver", 'backend="rocm"', ConfigError,
         "backend must be 'auto', 'host' or 'cuda'",
         _call("vattn.core.driver", "get_driver", "cpu", backend="rocm")),
    # -- acquire / ensure / step / release / prewarm -------------------------------------------------
    Case("acquire-length-negative", "VirtualKVCache.acquire", "expected_len=-1", ContextLengthError,
         "length must be an int >= 0", _on_cache(lambda c: c.acquire(expected_len=-1))),
    Case("acquire-length-beyond-max", "VirtualKVCache.acquire", "expected_len=301 (max_context=300)",
         ContextLengthError, "exceeds max_context=300", _on_cache(lambda c: c.acquire(expected_len=301))),
    Case("acquire-length-float", "VirtualKVCache.acquire", "expected_len=3.0", ContextLengthError,
         "length must be an int >= 0", _on_cache(lambda c: c.acquire(expected_len=3.0))),
    Case("acquire-all-busy", "VirtualKVCache.acquire", "a fifth acquire with max_slots=4", SlotError,
         "all 4 slots are in use", _on_cache(_fill_slots)),
    Case("ensure-list", "VirtualKVCache.ensure", "[0, 10] (not a mapping)", SlotError,
         "ensure expects {slot: length} or (slots, lengths)", _on_cache(lambda c: c.ensure([0, 10]))),
    Case("ensure-slot-out-of-range", "VirtualKVCache.ensure", "{9: 10}", SlotError,
         "slot must be an int in [0, 4)", _on_cache(lambda c: c.ensure({9: 10}))),
    Case("ensure-slot-negative", "VirtualKVCache.ensure", "{-1: 10}", SlotError,
         "slot must be an int in [0, 4)", _on_cache(lambda c: c.ensure({-1: 10}))),
    Case("ensure-padding-slot", "VirtualKVCache.ensure", "{4: 10} (the padding slot)", SlotError,
         "slot must be an int in [0, 4)", _on_cache(lambda c: c.ensure({4: 10}))),
    Case("ensure-slot-not-acquired", "VirtualKVCache.ensure", "{3: 10}, slot 3 never acquired",
         SlotError, "slot 3 is not acquired", _on_cache(lambda c: c.ensure({3: 10}))),
    Case("ensure-length-beyond-max", "VirtualKVCache.ensure", "{0: 301}", ContextLengthError,
         "length 301 is outside [0, max_context=300]", _on_cache(lambda c: c.ensure({0: 301}))),
    Case("ensure-length-negative", "VirtualKVCache.ensure", "{0: -1}", ContextLengthError,
         "length -1 is outside", _on_cache(lambda c: c.ensure({0: -1}))),
    Case("ensure-length-float", "VirtualKVCache.ensure", "{0: 10.5}", ContextLengthError,
         "lengths must be", _on_cache(lambda c: c.ensure({0: 10.5}))),
    Case("ensure-slot-string", "VirtualKVCache.ensure", '{"0": 10}', SlotError,
         "slots must be a 1-D sequence of ints", _on_cache(lambda c: c.ensure({"0": 10}))),
    Case("ensure-sizes-differ", "VirtualKVCache.ensure", "([0], [1, 2])", SlotError,
         "slots and lengths need equal sizes", _on_cache(lambda c: c.ensure([0], [1, 2]))),
    Case("ensure-duplicate-slot", "VirtualKVCache.ensure", "([0, 0], [1, 2])", SlotError,
         "listed twice", _on_cache(lambda c: c.ensure([0, 0], [1, 2]))),
    Case("bind-hit-unknown-key", "VirtualKVCache.bind", 'bind(0, 0, ["k"], hits=1), "k" never bound',
         SlotError, "which no page-set holds", _on_cache(lambda c: c.bind(0, 0, ["k"], hits=1))),
    Case("bind-key-twice", "VirtualKVCache.bind", 'bind(0, 0, ["k", "k"])', SlotError,
         "listed twice in one bind() call", _on_cache(lambda c: c.bind(0, 0, ["k", "k"]))),
    Case("bind-hits-beyond-keys", "VirtualKVCache.bind", 'bind(0, 0, ["k"], hits=2)', SlotError,
         "hits must be an int in [0, 1]", _on_cache(lambda c: c.bind(0, 0, ["k"], hits=2))),
    Case("bind-beyond-region", "VirtualKVCache.bind", "start past the slot's page-sets",
         ContextLengthError, "exceed the slot's",
         _on_cache(lambda c: c.bind(0, c.layout.pages_per_slot, ["k"]))),
    Case("bind-slot-not-acquired", "VirtualKVCache.bind", 'bind(3, 0, ["k"]), slot 3 never acquired',
         SlotError, "slot 3 is not acquired", _on_cache(lambda c: c.bind(3, 0, ["k"]))),
    Case("copy-block-unknown-key", "VirtualKVCache.copy_block", 'copy_block("a", "b"), neither bound',
         SlotError, "which no page-set holds", _on_cache(lambda c: c.copy_block("a", "b"))),
    Case("copy-block-onto-itself", "VirtualKVCache.copy_block", 'copy_block("k", "k")', SlotError,
         "onto itself", _on_cache(lambda c: (c.bind(0, 0, ["k"]), c.copy_block("k", "k")))),
    Case("stage-prefix-no-keys", "VirtualKVCache.stage_prefix", "stage_prefix([], 1)", SlotError,
         "at least one block key", _on_cache(lambda c: c.stage_prefix([], 1))),
    Case("stage-prefix-unknown-key", "VirtualKVCache.stage_prefix", 'stage_prefix(["k"], 1), "k" never bound',
         SlotError, "which no page-set holds", _on_cache(lambda c: c.stage_prefix(["k"], 1))),
    Case("stage-prefix-zero-copies", "VirtualKVCache.stage_prefix", 'stage_prefix(["k"], 0)', SlotError,
         "copies must be an int >= 1, got 0",
         _on_cache(lambda c: (c.bind(0, 0, ["k"]), c.stage_prefix(["k"], 0)))),
    Case("claim-slot-not-acquired", "VirtualKVCache.claim", "claim(3, 0), slot 3 never acquired",
         SlotError, "slot 3 is not acquired", _on_cache(lambda c: c.claim(3, 0))),
    Case("claim-negative-index", "VirtualKVCache.claim", "claim(0, -1)", SlotError,
         "index must be an int >= 0, got -1", _on_cache(lambda c: c.claim(0, -1))),
    Case("claim-beyond-region", "VirtualKVCache.claim", "an index past the slot's page-sets",
         ContextLengthError, "exceeds the slot's",
         _on_cache(lambda c: c.claim(0, c.layout.pages_per_slot))),
    Case("ensure-float-tensor", "VirtualKVCache.ensure", "slots as a float tensor", SlotError,
         "slots must be integers on the CPU",
         _on_cache(lambda c: c.ensure(torch.tensor([0.0]), torch.tensor([1])))),
    Case("ensure-2d-slots", "VirtualKVCache.ensure", "([[0]], [[1]])", SlotError,
         "1-D sequence of ints", _on_cache(lambda c: c.ensure([[0]], [[1]]))),
    Case("step-duplicate-slot", "VirtualKVCache.step", "([0, 0], [1, 2])", SlotError, "listed twice",
         _on_cache(lambda c: c.step([0, 0], [1, 2]))),
    Case("step-length-beyond-max", "VirtualKVCache.step", "{0: 10**6}", ContextLengthError,
         "is outside [0, max_context=300]", _on_cache(lambda c: c.step({0: 10**6}))),
    Case("release-twice", "VirtualKVCache.release", "slot 0 released twice", SlotError,
         "slot 0 is not acquired", _on_cache(_release_twice)),
    Case("ensure-after-release", "VirtualKVCache.ensure", "{0: 3} after release(0)", SlotError,
         "slot 0 is not acquired", _on_cache(_ensure_after_release)),
    Case("release-out-of-range", "VirtualKVCache.release", "slot 9", SlotError,
         "slot must be an int in [0, 4)", _on_cache(lambda c: c.release(9))),
    Case("release-string", "VirtualKVCache.release", 'slot "0"', SlotError,
         "slot must be an int in [0, 4)", _on_cache(lambda c: c.release("0"))),
    Case("prewarm-beyond-max", "VirtualKVCache.prewarm", "tokens_per_slot=301", ContextLengthError,
         "exceeds max_context=300", _on_cache(lambda c: c.prewarm(301))),
    Case("prewarm-negative", "VirtualKVCache.prewarm", "tokens_per_slot=-3", ContextLengthError,
         "length must be an int >= 0", _on_cache(lambda c: c.prewarm(-3))),
    Case("length-idle-slot", "VirtualKVCache.length", "slot 2, never acquired", SlotError,
         "slot 2 is not acquired", _on_cache(lambda c: c.length(2))),
    Case("mapped-tokens-out-of-range", "VirtualKVCache.mapped_tokens", "slot 99", SlotError,
         "slot must be an int in [0, 4)", _on_cache(lambda c: c.mapped_tokens(99))),
    Case("can-fit-negative", "VirtualKVCache.can_fit", "num_tokens=-5", ContextLengthError,
         "length must be an int >= 0", _on_cache(lambda c: c.can_fit(-5))),
    Case("can-fit-string", "VirtualKVCache.can_fit", 'num_tokens="5"', ContextLengthError,
         "length must be an int >= 0", _on_cache(lambda c: c.can_fit("5"))),
    # -- k / v views ------------------------------------------------------------------------------------
    Case("k-layer-out-of-range", "VirtualKVCache.k", "layer 4 of 4", ConfigError,
         "layer must be in [0, 4)", _on_cache(lambda c: c.k(4))),
    Case("v-layer-negative", "VirtualKVCache.v", "layer -1", ConfigError,
         "layer must be in [0, 4)", _on_cache(lambda c: c.v(-1))),
    Case("k-layer-string", "VirtualKVCache.k", 'layer "0"', ConfigError,
         "layer must be in [0, 4) as an int", _on_cache(lambda c: c.k("0"))),
    Case("v-layer-float", "VirtualKVCache.v_rows", "layer 1.0", ConfigError,
         "layer must be in [0, 4) as an int", _on_cache(lambda c: c.v_rows(1.0))),
    # -- use after close ---------------------------------------------------------------------------------
    Case("acquire-after-close", "VirtualKVCache.acquire", "after close()", SlotError,
         "the cache is closed", _after_close(lambda c: c.acquire())),
    Case("ensure-after-close", "VirtualKVCache.ensure", "after close()", SlotError,
         "the cache is closed", _after_close(lambda c: c.ensure({0: 3}))),
    Case("step-after-close", "VirtualKVCache.step", "after close()", SlotError,
         "the cache is closed", _after_close(lambda c: c.step({0: 3}))),
    Case("release-after-close", "VirtualKVCache.release", "after close()", SlotError,
         "the cache is closed", _after_close(lambda c: c.release(0))),
    Case("prewarm-after-close", "VirtualKVCache.prewarm", "after close()", SlotError,
         "the cache is closed", _after_close(lambda c: c.prewarm())),
    Case("k-after-close", "VirtualKVCache.k", "after close()", SlotError, "the cache is closed",
         _after_close(lambda c: c.k(0))),
    # -- vattn.core.ops -------------------------------------------------------------------------------
    Case("decode-cache-3d", "vattn.core.ops.decode", "k_cache [R, H, D]", TensorError,
         "Invalid shape of k_cache", _decode(k_cache=torch.zeros(R, H, D), v_cache=torch.zeros(R, H, D))),
    Case("decode-cache-list", "vattn.core.ops.decode", "k_cache a list", TensorError,
         "k_cache must be a torch.Tensor", _decode(k_cache=[0.0])),
    Case("decode-cache-int", "vattn.core.ops.decode", "int32 caches", TensorError,
         "Invalid dtype of k_cache", _decode(k_cache=torch.zeros(S, R, H, D, dtype=torch.int32),
                                             v_cache=torch.zeros(S, R, H, D, dtype=torch.int32))),
    Case("decode-cache-strides", "vattn.core.ops.decode", "[H, D] block not contiguous", TensorError,
         "Invalid strides of k_cache", _decode(k_cache=torch.zeros(S, R, D, H).transpose(2, 3),
                                               v_cache=torch.zeros(S, R, D, H).transpose(2, 3))),
    Case("decode-kv-shapes-differ", "vattn.core.ops.decode", "v_cache with 2 slots", TensorError,
         "must have equal shapes and strides", _decode(v_cache=torch.zeros(2, R, H, D))),
    Case("decode-q-2d", "vattn.core.ops.decode", "q [Hq, D]", TensorError, "Invalid shape of q",
         _decode(q=torch.zeros(2 * H, D))),
    Case("decode-q-dtype", "vattn.core.ops.decode", "q float16, caches float32", TensorError,
         "Invalid dtype of q", _decode(q=torch.zeros(2, 2 * H, D, dtype=torch.float16))),
    Case("decode-q-head-dim", "vattn.core.ops.decode", "q head_dim 16, caches 8", TensorError,
         "Invalid head_dim of q", _decode(q=torch.zeros(2, 2 * H, 16))),
    Case("decode-q-heads", "vattn.core.ops.decode", "3 q heads over 2 kv heads", TensorError,
         "must be a multiple of kv heads", _decode(q=torch.zeros(2, 3, D))),
    Case("decode-q-device", "vattn.core.ops.decode", "q on the meta device", TensorError,
         "q is on meta but the KV cache is on cpu", _decode(q=torch.zeros(2, 2 * H, D, device="meta"))),
    Case("decode-slots-length", "vattn.core.ops.decode", "1 slot for 2 requests", TensorError,
         "Invalid shape of slots", _decode(slots=torch.tensor([0], dtype=torch.int32))),
    Case("decode-slots-float", "vattn.core.ops.decode", "slots float32", TensorError,
         "Invalid dtype of slots", _decode(slots=torch.tensor([0.0, 2.0]))),
    Case("decode-seqlens-int16", "vattn.core.ops.decode", "seqlens int16", TensorError,
         "Invalid dtype of seqlens", _decode(seqlens=torch.tensor([5, 16], dtype=torch.int16))),
    Case("decode-max-seqlen-beyond", "vattn.core.ops.decode", "max_seqlen_k=17, rows_per_slot=16",
         TensorError, "max_seqlen_k must be a host int in [1, rows_per_slot=16]",
         _decode(max_seqlen_k=17)),
    Case("decode-out-shape", "vattn.core.ops.decode", "out [2, 4, 9] for q [2, 4, 8]", TensorError, "Invalid out",
         _decode(out=torch.zeros(2, 2 * H, 9))),
    Case("decode-scale-string", "vattn.core.ops.decode", 'scale="x"', TensorError,
         "scale must be a finite float > 0", _decode(scale="x")),
    Case("decode-backend-unknown", "vattn.core.ops.decode", 'backend="fa9"', UnsupportedError,
         "unknown backend 'fa9'", _decode(backend="fa9")),
    Case("decode-backend-needs-cuda", "vattn.core.ops.decode", 'backend="torch_fa2" on the CPU',
         UnsupportedError, "backend 'torch_fa2' needs a CUDA device",
         _decode(backend="torch_fa2")),
    Case("decode-slot-beyond-view", "vattn.core.ops.decode (reference)", "slot 5 of a 3-slot view",
         TensorError, "slots must be in [0, 3)", _decode(slots=torch.tensor([0, 5], dtype=torch.int32))),
    Case("decode-seqlen-beyond-rows", "vattn.core.ops.decode (reference)", "seqlens [5, 40], 16 rows",
         TensorError, "seqlens[1] must be in [1, rows_per_slot=16]",
         _decode(seqlens=torch.tensor([5, 40], dtype=torch.int32))),
    Case("decode-seqlen-zero", "vattn.core.ops.decode (reference)", "seqlens [0, 4]", TensorError,
         "seqlens[0] must be in [1, rows_per_slot=16]",
         _decode(seqlens=torch.tensor([0, 4], dtype=torch.int32))),
    Case("prefill-cu-too-short", "vattn.core.ops.prefill", "cu_seqlens_q [0]", TensorError,
         "Invalid cu_seqlens_q", _prefill(cu_seqlens_q=torch.tensor([0], dtype=torch.int32))),
    Case("prefill-max-seqlen-q-zero", "vattn.core.ops.prefill", "max_seqlen_q=0", TensorError,
         "max_seqlen_q must be a host int in [1, Nq=7]", _prefill(max_seqlen_q=0)),
    Case("prefill-cu-past-q", "vattn.core.ops.prefill (reference)", "cu_seqlens_q [0, 3, 9], 7 q rows",
         TensorError, "cu_seqlens_q must start at 0, not decrease and end at most at Nq=7",
         _prefill(cu_seqlens_q=torch.tensor([0, 3, 9], dtype=torch.int32), max_seqlen_q=6)),
    Case("prefill-keys-shorter", "vattn.core.ops.prefill (reference)", "3 q rows over 2 keys (causal)",
         TensorError, "seqlens_k[0] must be in [3, rows_per_slot=16]",
         _prefill(seqlens_k=torch.tensor([2, 16], dtype=torch.int32))),
    Case("store-new-2d", "vattn.core.ops.store", "k_new [H, D]", TensorError, "Invalid shape of k_new",
         _store(k_new=torch.zeros(H, D))),
    Case("store-new-dtype", "vattn.core.ops.store", "k_new float16, cache float32", TensorError,
         "k_new must match the cache", _store(k_new=torch.zeros(2, H, D, dtype=torch.float16))),
    Case("store-rows-int32", "vattn.core.ops.store", "rows int32", TensorError, "Invalid dtype of rows",
         _store(rows=torch.tensor([0, 17], dtype=torch.int32))),
    Case("store-row-outside", "vattn.core.ops.store", "row 999 of 48 (CPU)", TensorError,
         "rows must be in [0, 48)", _store(rows=torch.tensor([0, 999]))),
    Case("store-cache-list", "vattn.core.ops.store", "k_cache_rows a list", TensorError,
         "the cache must be a torch.Tensor", _store(k_cache_rows=[0.0])),
    Case("store-backend-unknown", "vattn.core.ops.store", 'backend="cuda"', UnsupportedError,
         "store backend must be 'auto', 'triton' or 'torch'", _store(backend="cuda")),
    Case("rows-for-list", "vattn.core.ops.rows_for", "slots a list", TensorError,
         "slots must be an integer torch.Tensor",
         _call("vattn.core.ops", "rows_for", [0, 1], torch.tensor([1, 2]), 16)),
    Case("resolve-op-unknown", "vattn.core.ops.resolve_backend", 'op="encode"', UnsupportedError,
         "unknown op 'encode'", _resolve("encode")),
    Case("resolve-device-bad", "vattn.core.ops.resolve_backend", 'device="gpu"', UnsupportedError,
         "device must be a torch.device or a string", _resolve(device="gpu")),
    Case("resolve-dtype-int", "vattn.core.ops.resolve_backend", "dtype=torch.int8 on the CPU",
         UnsupportedError, "dtype torch.int8 not supported", _resolve(dtype=torch.int8)),
    # -- layout_report and the vLLM adapter's engine-config checks ---------------------------------
    Case("layout-report-heads-zero", "vattn.core.layout_report", "num_kv_heads=0", ConfigError,
         "num_kv_heads must be a positive int",
         _call("vattn.core", "layout_report", num_layers=4, num_kv_heads=0, head_dim=64,
               dtype=torch.float16, group_size=2)),
    Case("vllm-page-fraction", "adapters.vllm.gpu_layout.tokens_per_page", "3 kv heads of 128 (bf16)",
         ConfigError, "needs a whole number",
         _vllm("tokens_per_page", num_kv_heads=3, head_dim=128, dtype=torch.bfloat16, group_size=1)),
    Case("vllm-page-tile", "adapters.vllm.gpu_layout.tokens_per_page", "group_size=32 (16 tokens)",
         ConfigError, "must be a multiple of 128",
         _vllm("tokens_per_page", num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, group_size=32)),
    Case("vllm-page-group-zero", "adapters.vllm.gpu_layout.tokens_per_page", "group_size=0",
         ConfigError, "group_size must be a positive int",
         _vllm("tokens_per_page", num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, group_size=0)),
    Case("vllm-page-dtype-string", "adapters.vllm.gpu_layout.tokens_per_page", 'dtype="bf16"',
         ConfigError, "dtype must be a torch.dtype",
         _vllm("tokens_per_page", num_kv_heads=8, head_dim=128, dtype="bf16", group_size=4)),
    Case("vllm-backend-not-custom", _ENGINE_CONFIG, 'attention backend "FLASH_ATTN"', ConfigError,
         "attention_backend='CUSTOM'",
         _vllm("check_engine_config", _vllm_config(attention_config=NS(backend="FLASH_ATTN")))),
    Case("vllm-speculative", _ENGINE_CONFIG, "a speculative_config", UnsupportedError,
         "speculative decoding", _vllm("check_engine_config", _vllm_config(speculative_config=object()))),
    Case("vllm-kv-fp8", _ENGINE_CONFIG, 'kv_cache_dtype="fp8"', UnsupportedError,
         "kv_cache_dtype='fp8' is not supported",
         _vllm("check_engine_config", _vllm_config(cache_config=NS(enable_prefix_caching=False,
                                                                     cache_dtype="fp8")))),
    Case("vllm-kv-groups", "adapters.vllm.gpu_layout.check_kv_cache_config", "two KV cache groups",
         UnsupportedError, "needs one KV cache group",
         _vllm("check_kv_cache_config", _kv_groups(FullAttentionSpec(block_size=128),
                                                   FullAttentionSpec(block_size=128)),
               block_size=128, page_set_bytes=1)),
    Case("vllm-block-size", "adapters.vllm.gpu_layout.check_kv_cache_config", "block_size=16, page 128",
         ConfigError, "vattn needs block_size=128",
         _vllm("check_kv_cache_config", _kv_groups(FullAttentionSpec(block_size=16)), block_size=128,
               page_set_bytes=1)),
    Case("vllm-group-env", "adapters.vllm.gpu_layout.group_size_for", "VATTN_GROUP_SIZE=x", ConfigError,
         "VATTN_GROUP_SIZE must be an int", _with_env(_vllm("group_size_for", 32), VATTN_GROUP_SIZE="x")),
    Case("vllm-exact-env", "adapters.vllm.gpu_layout.exact_kernel_path", "VATTN_VLLM_EXACT=yes",
         ConfigError, "VATTN_VLLM_EXACT must be 0 or 1",
         _with_env(_vllm("exact_kernel_path"), VATTN_VLLM_EXACT="yes")),
    Case("stage-prefixes-env", "core.config.stage_prefixes", "VATTN_STAGE_PREFIXES=on", ConfigError,
         "VATTN_STAGE_PREFIXES must be 0 or 1", _with_env(_stage_env, VATTN_STAGE_PREFIXES="on")),
    Case("defer-mapping-env", "core.config.defer_mapping", "VATTN_DEFER_MAPPING=yes", ConfigError,
         "VATTN_DEFER_MAPPING must be 0 or 1", _with_env(_defer_env, VATTN_DEFER_MAPPING="yes")),
    Case("pack-mb-env", "core.config.pack_mb", "VATTN_PACK_MB=-1", ConfigError,
         "VATTN_PACK_MB must be", _with_env(_pack_env, VATTN_PACK_MB="-1")),
    Case("pack-sets-env", "core.config.pack_sets", "VATTN_PACK_SETS=1", ConfigError,
         "VATTN_PACK_SETS must be", _with_env(_pack_env, VATTN_PACK_SETS="1")),
    Case("pack-sets-env-list", "core.config.pack_sets", "VATTN_PACK_SETS=8,x", ConfigError,
         "VATTN_PACK_SETS must be an integer >= 2 or a comma list", _with_env(_pack_env, VATTN_PACK_SETS="8,x")),
    Case("vllm-version", "adapters.vllm.version.check_version", '"0.5.0"', UnsupportedError,
         "was verified on vLLM", _call("vattn.adapters.vllm.version", "check_version", "0.5.0")),
    # -- the SGLang adapter's sizing ---------------------------------------------------------------
    Case("sglang-no-tokens", "adapters.sglang.sizing.cache_config", "num_tokens=0", ConfigError,
         "num_tokens must be a positive int", _sglang(num_tokens=0)),
    Case("sglang-group-not-divisor", "adapters.sglang.sizing.cache_config", "group_size=3, 4 layers",
         ConfigError, "group_size must divide num_layers=4", _sglang(group_size=3)),
    Case("sglang-group-env", "adapters.sglang.sizing.cache_config", "VATTN_SGLANG_GROUP_SIZE=two",
         ConfigError, "VATTN_SGLANG_GROUP_SIZE must be an integer",
         _with_env(_sglang(), VATTN_SGLANG_GROUP_SIZE="two")),
    Case("sglang-version", "adapters.sglang.version.check_version", '"0.4.0"', UnsupportedError,
         "is not supported by vattn", _call("vattn.adapters.sglang.version", "check_version", "0.4.0")),
    Case("sglang-tokens-string", "adapters.sglang.sizing.cache_config", 'num_tokens="1000"', ConfigError,
         "num_tokens", _sglang(num_tokens="1000")),
    Case("sglang-requests-negative", "adapters.sglang.sizing.cache_config", "max_requests=-4",
         ConfigError, "max_requests", _sglang(max_requests=-4)),
    Case("sglang-group-zero", "adapters.sglang.sizing.cache_config", "group_size=0", ConfigError,
         "group_size", _sglang(group_size=0)),
    Case("sglang-device-tpu", "adapters.sglang.sizing.cache_config", 'device="tpu"', ConfigError,
         "device must be 'cpu' or 'cuda[:N]'", _sglang(device="tpu")),
    Case("sglang-page-size-cuda", "adapters.sglang.sizing.cache_config",
         'page_size=16 on "cuda" (a page-set holds 1024)', ConfigError,
         "SGLang page_size must be 1024 with vattn on CUDA", _sglang(device="cuda", page_size=16)),
    Case("sglang-page-size-host", "adapters.sglang.sizing.cache_config", "page_size=3 on the host",
         ConfigError, "not a multiple of 4096: use a multiple of", _sglang(page_size=3)),
    Case("sglang-unaligned-new-prefix", "adapters.sglang.requests.RowSlots.prepare",
         "a new request row starting after 5 cached tokens (pages of 16)", SlotError,
         "not whole pages of 16", _sglang_rows([1], [40], [5])),
    Case("sglang-decode-unknown-row", "adapters.sglang.requests.RowSlots.prepare",
         "a decode of a row that never had an extend", SlotError, "never had an extend forward",
         _sglang_rows([1], [41])),
    Case("sglang-hit-unbound-page", "adapters.sglang.requests.RowSlots.prepare",
         "a new row whose 32-token prefix names pages no page-set holds", SlotError,
         "no page-set holds", _sglang_rows([1], [33], [32])),
    # -- the transformers and TGI adapters --------------------------------------------------------
    Case("transformers-unknown-option", "adapters.transformers.enable", "bogus=1", ConfigError,
         "unknown vattn option(s) ['bogus']", _enable_transformers(NS(), bogus=1)),
    Case("transformers-manager-exists", "adapters.transformers.enable", "a model with a manager",
         ConfigError, "already has a continuous batching manager",
         _enable_transformers(NS(_cached_continuous_batching_manager=object()))),
    Case("transformers-backend", "adapters.transformers.cache.resolve_backends",
         'decode="torch_fa2" on the CPU', UnsupportedError, "backend 'torch_fa2' needs a CUDA device",
         _call("vattn.adapters.transformers.cache", "resolve_backends", "cpu", torch.float32, 64,
               decode="torch_fa2"), needs="transformers"),
    Case("tgi-flag", "adapters.tgi.activate.enabled", "VATTN_TGI=yes", ConfigError,
         "VATTN_TGI must be '0' or '1'", _call("vattn.adapters.tgi.activate", "enabled", {"VATTN_TGI": "yes"})),
    Case("tgi-region", "adapters.tgi.regions.region_slots", "region 5 of 4", SlotError,
         "region must be in [0, 4)", _call("vattn.adapters.tgi.regions", "region_slots", 5, 3,
                                           rows_per_slot=16, max_context=16, num_regions=4)),
    Case("tgi-slots-int32", "adapters.tgi.regions.rewrite_request_slots", "int32 slots", TensorError,
         "Invalid dtype of slots",
         _call("vattn.adapters.tgi.regions", "rewrite_request_slots", torch.zeros(4, dtype=torch.int32),
               torch.tensor([0, 4]), 0, 1, rows_per_slot=16, max_context=16, num_regions=4)),
    Case("tgi-server-missing", "adapters.tgi.version.check_server", "a folder without TGI's files",
         UnsupportedError, "supports text_generation_server v3.3.7 only",
         _call("vattn.adapters.tgi.version", "check_server", Path("no-such-tgi-server"))),
    # -- conformance ------------------------------------------------------------------------------
    Case("engine-unknown", "vattn.conformance.engines.load_runner", '"nope"', ConfigError,
         "unknown engine 'nope'", _call("vattn.conformance.engines", "load_runner", "nope")),
    Case("engine-not-installed", "vattn.conformance.engines.load_runner", '"vllm" without vllm',
         UnsupportedError, "needs the Python module 'vllm'",
         _without_module("vllm", _call("vattn.conformance.engines", "load_runner", "vllm"))),
    Case("engine-option-unknown", "vattn.conformance.engines.load_runner", '"transformers", foo=1',
         ConfigError, "takes the options",
         _call("vattn.conformance.engines", "load_runner", "transformers", foo=1), needs="transformers"),
    Case("workload-unknown", "vattn.conformance.workloads.make_workload", '"nope"', ConfigError,
         "unknown workload 'nope'",
         _call("vattn.conformance.workloads", "make_workload", "nope", size="cpu", vocab_size=10)),
    # -- the vattn command (run_command raises what main prints on one line, exit status 2) ------------
    Case("cli-unknown-command", "vattn", "frob", UsageError, "invalid choice: 'frob'", _cli("frob")),
    Case("cli-unknown-flag", "vattn info", "--bogus", UsageError, "unrecognized arguments: --bogus",
         _cli("info", "--bogus")),
    Case("cli-contexts-negative", "vattn bench attention", "--contexts -5", UsageError,
         "argument --contexts: expected a comma-separated list of ints >= 1",
         _cli("bench", "attention", "--contexts", "-5")),
    Case("cli-dtype", "vattn bench attention", "--dtype bf17", UsageError, "invalid choice: 'bf17'",
         _cli("bench", "attention", "--dtype", "bf17")),
    Case("cli-models", "vattn bench attention", "--models llama3", UsageError,
         "argument --models: expected a comma-separated list of llama3-8b, yi-6b, yi-34b",
         _cli("bench", "attention", "--models", "llama3")),
    Case("cli-attention-too-big", "vattn bench attention", "--prefill-contexts 1048576 on the CPU",
         ConfigError, "prefill llama3-8b B=1 ctx=1048576 needs about",
         _cli("bench", "attention", "--device", "cpu", "--ops", "prefill", "--models", "llama3-8b",
              "--prefill-contexts", "1048576", "--no-report")),
    Case("cli-attention-no-shape", "vattn bench attention", "--batches 4096 --contexts 1024",
         ConfigError, "no shape to measure",
         _cli("bench", "attention", "--device", "cpu", "--ops", "decode", "--batches", "4096",
              "--contexts", "1024", "--no-report")),
    Case("cli-pages-zero", "vattn bench vmm", "--pages 0", UsageError,
         "argument --pages: expected an int >= 1", _cli("bench", "vmm", "--pages", "0")),
    Case("cli-vmm-shape", "vattn bench vmm", "--model-shape 4,2,64,3", UsageError,
         "group dividing layers", _cli("bench", "vmm", "--model-shape", "4,2,64,3")),
    Case("cli-vmm-busy-only-cpu", "vattn bench vmm", "--busy-only --device cpu", UnsupportedError,
         "--busy-only needs a CUDA device", _cli("bench", "vmm", "--busy-only", "--device", "cpu")),
    Case("cli-vmm-only-alias-without-threads", "vattn bench vmm", "--only alias (no --alias-threads)",
         UnsupportedError, "--only alias needs --alias-threads", _cli("bench", "vmm", "--only", "alias",
                                                                        "--device", "cpu")),
    Case("cli-vmm-alias-chunk-cpu", "vattn bench vmm", "--alias-chunk 2 --device cpu",
         UnsupportedError, "--alias-chunk 2 needs a CUDA device",
         _cli("bench", "vmm", "--only", "alias", "--alias-threads", "1", "--alias-chunk", "2",
              "--device", "cpu")),
    Case("cli-sched-unit-not-dividing", "vattn bench sched", "--block 128 --unit 48", UnsupportedError,
         "--unit 48 must divide --block 128", _cli("bench", "sched", "--block", "128", "--unit", "48")),
    Case("cli-sched-prefix-whole-prompt", "vattn bench sched", "--workload serve --shared 100 --prompt 100",
         UnsupportedError, "--shared 100 must be below --prompt 100",
         _cli("bench", "sched", "--workload", "serve", "--shared", "100", "--prompt", "100")),
    Case("cli-device-tpu", "vattn bench host", "--device tpu", UsageError,
         "argument --device: expected 'cpu' or 'cuda[:N]'", _cli("bench", "host", "--device", "tpu")),
    Case("cli-groups", "vattn bench layout", "--groups 3 (32 layers)", ConfigError,
         "a divisor of the model's 32 layers",
         _cli("bench", "layout", "--device", "cpu", "--groups", "3", "--no-report")),
    Case("cli-cases", "vattn bench layout", "--decode-cases 128x", UsageError,
         "argument --decode-cases: expected BATCHxCONTEXT", _cli("bench", "layout", "--decode-cases", "128x")),
    Case("cli-results-missing", "vattn bench engine", "--results no-such-results-dir", ConfigError,
         "no such folder", _cli("bench", "engine", "--results", "no-such-results-dir", "--no-report")),
    Case("cli-engine-unknown", "vattn conformance", "--engine foo", UsageError, "invalid choice: 'foo'",
         _cli("conformance", "--engine", "foo")),
    Case("cli-engine-option", "vattn conformance", "--engine-option oops", ConfigError,
         "--engine-option must be KEY=VALUE", _cli("conformance", "--engine-option", "oops")),
    Case("cli-num-requests", "vattn conformance", "--num-requests 0", UsageError,
         "argument --num-requests: expected an int >= 1", _cli("conformance", "--num-requests", "0")),
]


@pytest.mark.parametrize("case", [pytest.param(case, id=case.id) for case in CASES])
def test_bad_input_raises_its_typed_error(case: Case):
    if case.needs:
        pytest.importorskip(case.needs)
    with pytest.raises(case.error) as info:
        case.call()
    assert type(info.value) is case.error, f"expected exactly {case.error.__name__}, got {info.type.__name__}"
    assert case.fragment in str(info.value)


def test_case_ids_are_unique():
    ids = [case.id for case in CASES]
    assert len(ids) == len(set(ids)) and len(ids) >= 40


def render_table() -> str:
    """The markdown table of ``CASES`` (what ``docs/bad-input.md`` holds between its markers)."""
    code = lambda text: f"`{text}`".replace("|", "\\|")
    prose = lambda text: str(text).replace("|", "\\|").replace("*", "\\*")
    lines = ["| id | entry | input | raises | message contains |", "|---|---|---|---|---|"]
    for case in CASES:
        lines.append(f"| {code(case.id)} | {code(case.entry)} | {prose(case.given)} | "
                     f"{code(case.error.__name__)} | {code(case.fragment)} |")
    return "\n".join(lines)


def test_doc_lists_every_case():
    text = DOC.read_text()
    assert BEGIN in text and END in text, f"{DOC.name} lost its table markers"
    table = text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    assert table == render_table(), (f"{DOC.name} differs from CASES: write it again with "
                                     f"python tests/test_bad_input.py")


def _write_doc() -> None:
    text = DOC.read_text()
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    DOC.write_text(f"{head}{BEGIN}\n{render_table()}\n{END}{tail}")


if __name__ == "__main__":
    _write_doc()
    print(f"wrote {len(CASES)} rows to {DOC}")
