"""The vattn SGLang platform: stock CUDA, except that SGLang builds vattn's KV pool and allocator.

SGLang 0.5.17 lets an out-of-tree platform choose the KV pool and the paged allocator:
``KVCacheConfigurator`` calls ``current_platform.get_mha_kv_pool_cls()`` /
``get_paged_allocator_cls()`` when ``current_platform.is_out_of_tree()``. Platforms are found
through the entry-point group ``sglang.srt.platforms`` (``sglang.srt.platforms._resolve_platform``:
each entry point is a function returning a class's qualified name, or ``None`` to stay out;
``SGLANG_PLATFORM=vattn`` selects it when several are installed)::

    [project.entry-points."sglang.srt.platforms"]
    vattn = "vattn.adapters.sglang.platform:activate"

Opt-in: :func:`activate` returns the platform only with ``VATTN_SGLANG=1`` (SGLang resolves the
platform when its modules are imported, before any server argument exists); otherwise SGLang's
own platform is used, unchanged. With it active the attention backend defaults to ``vattn`` and
any other backend is refused (the pool exists for it).

:class:`VattnCudaPlatform` subclasses SGLang's ``CudaSRTPlatform`` and keeps ``is_cuda()`` true,
so every ``is_cuda()`` branch stays stock. Overriding ``is_out_of_tree()`` also routes SGLang's
other out-of-tree branches through this class; each is answered with the stock CUDA choice:
dispatch key ``"cuda"``, the model runner's own decode CUDA-graph runner, the CUDA piecewise
backend, ``"inductor"``, no platform quantization config. Three differ from stock: the device
memory capacity is read from torch instead of ``nvidia-smi`` (SGLang's OOT branch), RoPE for head
sizes other than 64/128/256/512 skips SGLang's CUDA rope kernel (its OOT branch), and SGLang's
default attention backend is ``vattn``.
"""

from __future__ import annotations

import functools
import logging
import os

from sglang.srt.platforms.cuda import CudaSRTPlatform

from vattn.core.errors import ConfigError, UnsupportedError

from .plugin import BACKEND_NAME, check_server_args, prefill_graph_backend
from .version import check_version

#: Environment variable that opts SGLang into the vattn platform.
OPT_IN = "VATTN_SGLANG"
QUALNAME = "vattn.adapters.sglang.platform.VattnCudaPlatform"

logger = logging.getLogger(__name__)


def opted_in() -> bool:
    """Whether ``VATTN_SGLANG`` asks for the vattn platform (``1``/``true``/``yes``)."""
    return os.environ.get(OPT_IN, "").strip().lower() in ("1", "true", "yes")


def activate() -> str | None:
    """SGLang platform entry point: the platform's qualified name when opted in, else ``None``.

    Raises
    ------
    UnsupportedError
        Opted in on an SGLang version the adapter was not written for (SGLang's auto-discovery
        logs this and keeps its own platform; with ``SGLANG_PLATFORM=vattn`` it is fatal).
    """
    if not opted_in():
        return None
    check_version()
    return QUALNAME


def _default_prefill_graph_off(server_args) -> None:
    """Turn SGLang's *default* prefill CUDA graph off (the backend supports decode graphs only);
    one the user asked for stays, and :func:`.plugin.check_server_args` refuses it by name."""
    locked = getattr(server_args, "_cuda_graph_config_locked", set())
    if prefill_graph_backend(server_args) not in (None, "disabled") \
            and ("prefill", "backend") not in locked:
        server_args.cuda_graph_config.prefill.backend = "disabled"
        logger.info("vattn: SGLang's prefill CUDA graph turned off (decode graphs stay on)")


def model_page_size(server_args) -> int:
    """The SGLang page size vattn needs for the served model: the tokens one page-set holds
    (KV heads of this rank, head size, KV dtype and layer group of the model SGLang loads)."""
    import torch

    from .sizing import page_size_for
    mc = server_args.get_model_config()
    kv_dtype = getattr(server_args, "kv_cache_dtype", "auto")
    if kv_dtype not in (None, "auto", "bfloat16", "float16"):
        raise UnsupportedError(f"vattn's SGLang pool does not support --kv-cache-dtype {kv_dtype}")
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(kv_dtype, mc.dtype)
    tp = max(1, int(getattr(server_args, "tp_size", 1) or 1))
    heads = mc.get_num_kv_heads(tp)
    return page_size_for(dtype=dtype, head_num=heads, head_dim=mc.head_dim,
                         layer_num=mc.num_hidden_layers)


def _graph_runner(model_runner):
    """The decode CUDA-graph runner stock SGLang builds for a CUDA ``ModelRunner``, telling
    vattn's backend the request ids of each batch it loads (:func:`graph_runner_cls`)."""
    return graph_runner_cls(model_runner._decode_cuda_graph_runner_cls())(model_runner)


@functools.cache
def graph_runner_cls(base: type) -> type:
    """``base`` (SGLang's decode CUDA-graph runner class) whose ``load_batch`` hands the batch's
    request ids to vattn's attention backend while it prepares the replay.

    SGLang 0.5.17's ``DecodeCudaGraphRunner.load_batch`` passes the backend a replay view of the
    batch (``build_replay_fb_view``) that carries no request ids; without them the backend would
    copy the batch's rows to the host before every decode step, and that wait costs SGLang's
    overlap scheduler its overlap.
    """
    def load_batch(self, forward_batch, *args, **kwargs):
        backend = getattr(self, "attn_backend", None)
        if not hasattr(backend, "replaying"):
            return base.load_batch(self, forward_batch, *args, **kwargs)
        with backend.replaying(getattr(forward_batch, "rids", None)):
            return base.load_batch(self, forward_batch, *args, **kwargs)

    return type("Vattn" + base.__name__, (base,), {"load_batch": load_batch,
                                                   "__doc__": graph_runner_cls.__doc__})


class VattnCudaPlatform(CudaSRTPlatform):
    """SGLang's CUDA platform whose KV pool / paged allocator are vattn's (host-side only)."""

    def is_out_of_tree(self) -> bool:
        """True: registered through ``sglang.srt.platforms`` (turns on the pool hooks)."""
        return True

    def get_mha_kv_pool_cls(self) -> type:
        from .pool import VattnMHATokenToKVPool
        return VattnMHATokenToKVPool

    def get_paged_allocator_cls(self) -> type:
        from .allocator import VattnTokenAllocator
        return VattnTokenAllocator

    def get_mla_kv_pool_cls(self) -> type:
        raise UnsupportedError("vattn's SGLang platform does not support MLA models")

    def get_dsa_kv_pool_cls(self) -> type:
        raise UnsupportedError("vattn's SGLang platform does not support DSA (MLA) models")

    def get_default_attention_backend(self) -> str:
        return BACKEND_NAME

    def apply_server_args_defaults(self, server_args) -> None:
        """Default ``--attention-backend vattn`` and ``--page-size`` = the tokens of one vattn
        page-set (:func:`.sizing.page_size_for`); refuse what cannot work.

        Raises
        ------
        ConfigError
            Another attention backend, a ``--page-size`` other than one page-set, the
            hierarchical cache, or a prefill CUDA graph asked for by name (SGLang's default one
            is turned off here).
        UnsupportedError
            A device other than CUDA.
        """
        if getattr(server_args, "device", "cuda") not in (None, "cuda"):
            raise UnsupportedError(f"{OPT_IN}=1 (vattn's SGLang platform) runs on CUDA only, got "
                                   f"--device {server_args.device}")
        for name in ("attention_backend", "prefill_attention_backend",
                     "decode_attention_backend"):
            value = getattr(server_args, name, None)
            if value not in (None, BACKEND_NAME):
                raise ConfigError(f"{OPT_IN}=1 builds vattn's KV pool, which needs "
                                  f"--attention-backend {BACKEND_NAME}; got {name}={value!r}")
        server_args.attention_backend = BACKEND_NAME
        page_size = model_page_size(server_args)
        if getattr(server_args, "page_size", None) is None:
            server_args.page_size = page_size
        elif server_args.page_size != page_size:
            raise ConfigError(f"--page-size {server_args.page_size}: with {OPT_IN}=1 one SGLang "
                              f"page is one vattn page-set, {page_size} tokens for this model; "
                              "drop --page-size or pass that value")
        _default_prefill_graph_off(server_args)
        check_server_args(server_args)

    def get_graph_runner_cls(self):
        return _graph_runner

    def get_piecewise_backend_cls(self) -> type:
        from sglang.srt.compilation.cuda_piecewise_backend import CUDAPiecewiseBackend
        return CUDAPiecewiseBackend

    def get_dispatch_key_name(self) -> str:
        return "cuda"

    def get_compile_backend(self, mode: str | None = None) -> str:
        return "inductor"

    def get_torch_profiler_activity_str(self) -> str:
        return "CUDA"  # not one of SGLang's own "CPU" / "GPU": no second profiler is added

    def get_torch_profiler_activity(self):
        import torch
        return torch.profiler.ProfilerActivity.CUDA
