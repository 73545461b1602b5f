"""The ``vllm.general_plugins`` entry point: vLLM calls :func:`register` in every process.

Registered in the distribution as::

    [project.entry-points."vllm.general_plugins"]
    vattn = "vattn.adapters.vllm.plugin:register"

Nothing happens unless ``VATTN_VLLM=1`` is set, so installing vattn never changes a stock vLLM.
With it set, the vLLM version is checked (untested versions raise), the attention backend is
registered — ``AttentionBackendEnum.CUSTOM`` on GPU (select it with ``--attention-backend CUSTOM``
or ``LLM(..., attention_backend="CUSTOM")``), the ``CPU_ATTN`` member on the CPU runner, which
offers no other slot — and the KV-cache hooks of :mod:`.kv_hooks` are installed.
``VATTN_ENGINE_PROFILE`` is the one switch read without it (a profile window of the engine-core
loop, for stock and vattn servers alike: :mod:`.loop_profile`).
"""

from __future__ import annotations

import os

__all__ = ["register", "enabled", "ENV"]

ENV = "VATTN_VLLM"
_BACKENDS = {"cpu": ("CPU_ATTN", "vattn.adapters.vllm.backend_cpu.VattnCPUBackend"),
             "gpu": ("CUSTOM", "vattn.adapters.vllm.backend_gpu.VattnFlashBackend")}


def enabled() -> bool:
    """Whether this process runs vLLM with vattn (``VATTN_VLLM=1``)."""
    return os.environ.get(ENV, "0") == "1"


def register() -> None:
    """Register the vattn backend and install the KV hooks (only with ``VATTN_VLLM=1``); with
    ``VATTN_ENGINE_PROFILE`` set, profile a window of the engine-core loop (stock too:
    :mod:`.loop_profile`)."""
    if os.environ.get("VATTN_ENGINE_PROFILE"):       # nothing imported otherwise
        from .loop_profile import install_loop_profile
        install_loop_profile()
    if not enabled():
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from .kv_hooks import install_hooks
    family = install_hooks()
    member, path = _BACKENDS[family]
    register_backend(AttentionBackendEnum[member], path)
