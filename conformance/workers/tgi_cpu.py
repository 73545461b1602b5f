"""CPU stand-ins for the CUDA kernels TGI v3.3.7's flash model code calls (exercise only).

TGI does not run its flash models on a plain CPU: with ``SYSTEM == "cpu"`` (no CUDA, no
Intel extension) its v3.3.7 server stops at, in import/call order,

1. ``layers/attention/__init__.py``: ``ImportError("System cpu doesn't support flash/paged
   attention")`` — vattn replaces this package body anyway (:mod:`vattn.adapters.tgi.patches`);
2. ``layers/moe/__init__.py``: ``from moe_kernels.fused_moe import ...`` (a CUDA/ROCm kernel
   package, only an sdist that needs CUDA to build), imported by ``flash_llama_modeling``;
3. ``layers/layernorm.py``: ``FastLayerNorm`` is defined only for cuda / rocm / ipex, so
   ``from ...layernorm import FastLayerNorm`` fails;
4. ``FlashCausalLM.__init__``: ``NotImplementedError("... is only available on GPU")``;
5. ``PositionRotaryEmbedding.forward`` and ``FastRMSNorm.forward``: ``ValueError("Your system
   seem to be not supported ...")``.

:func:`apply` gets past each with the smallest change: an empty ``moe_kernels`` (raises if a
MoE model calls it), a torch ``FastLayerNorm``, ``FlashCausalLM.__init__``'s CPU branch (the
one TGI takes with the Intel extension on CPU) by rebinding that module's ``SYSTEM``, and torch
versions of the two CUDA kernels TGI's own cuda branches call (``rotary.apply_rotary``,
``dropout_layer_norm.dropout_add_ln_fwd`` in its RMS mode). Everything else — weight
loading, the model, batching, ``KVCache.store``, sampling — is TGI's code. Never used by the
serving hook: this exists so the TGI worker (:mod:`.tgi`) can run TGI generations on a CPU dev
box or in CI.
"""

from __future__ import annotations

import sys
import types

import torch

from vattn.core.errors import UnsupportedError

__all__ = ["apply", "apply_rotary", "dropout_add_ln_fwd"]


def apply_rotary(x1, x2, cos, sin, out1, out2, conj: bool) -> None:
    """flash-attn's rotary kernel (non-interleaved): ``x1, x2`` ``[T, H, R]``, ``cos, sin``
    ``[T, 1, R]``; writes ``out1 = x1 cos - x2 sin``, ``out2 = x2 cos + x1 sin`` in place."""
    sin = -sin if conj else sin
    a, b, c, s = x1.float(), x2.float(), cos.float(), sin.float()
    o1, o2 = a * c - b * s, b * c + a * s      # both before writing: out1 may alias x1
    out1.copy_(o1)
    out2.copy_(o2)


def dropout_add_ln_fwd(x0, residual, gamma, beta, rowscale, colscale, x0_subset, z_subset,
                       dropout_p, epsilon, rowscale_const, z_numrows, gen, residual_in_fp32,
                       is_rms_norm):
    """flash-attn's ``dropout_add_ln_fwd`` for what TGI calls: no dropout, no row/col scale.

    Returns ``(z, x, None, None, None)``; ``x = x0 + residual`` is ``None`` without a residual
    (the kernel's convention, which TGI's ``FastRMSNorm`` relies on).
    """
    if dropout_p or rowscale is not None or colscale is not None or x0_subset is not None:
        raise UnsupportedError("the CPU stand-in of dropout_add_ln_fwd has no dropout / scales")
    x = x0 if residual is None else x0 + residual
    xf = x.float()
    if is_rms_norm:
        z = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + epsilon)
    else:
        z = torch.nn.functional.layer_norm(xf, xf.shape[-1:], eps=epsilon)
    z = z.to(x.dtype) * gamma
    if beta is not None:
        z = z + beta
    return z, (None if residual is None else x), None, None, None


class FastLayerNorm(torch.nn.LayerNorm):
    """``LayerNorm`` returning ``(normed, residual)`` like TGI's cuda ``FastLayerNorm``."""

    def forward(self, hidden_states, residual=None):
        if residual is not None:
            hidden_states = hidden_states + residual
        return super().forward(hidden_states), hidden_states


def _moe_stub() -> types.ModuleType:
    def missing(*args, **kwargs):
        raise UnsupportedError("MoE kernels (moe_kernels) are not available on CPU")
    pkg, sub = types.ModuleType("moe_kernels"), types.ModuleType("moe_kernels.fused_moe")
    sub.fused_topk = sub.grouped_topk = sub.fused_moe = missing
    pkg.fused_moe, pkg.__vattn_stub__ = sub, True
    return pkg


def apply() -> list[str]:
    """Install the stand-ins; call after the vattn hook and before TGI's model files import.

    Returns
    -------
    list[str]
        What was changed, for the record.

    Raises
    ------
    UnsupportedError
        CUDA is available (use TGI's real kernels there) or the server is not v3.3.7.
    """
    if torch.cuda.is_available():
        raise UnsupportedError("the TGI CPU stand-ins are for machines without CUDA")
    from vattn.adapters.tgi.version import check_server
    check_server()
    done = []
    if "moe_kernels" not in sys.modules:
        stub = _moe_stub()
        sys.modules.update({"moe_kernels": stub, "moe_kernels.fused_moe": stub.fused_moe})
        done.append("moe_kernels stub")
    from text_generation_server.layers import layernorm, rotary
    if not hasattr(layernorm, "FastLayerNorm"):
        layernorm.FastLayerNorm = FastLayerNorm
        done.append("layernorm.FastLayerNorm")
    layernorm.SYSTEM, layernorm.dropout_layer_norm = "cuda", types.SimpleNamespace(
        dropout_add_ln_fwd=dropout_add_ln_fwd)
    rotary.SYSTEM, rotary.rotary = "cuda", types.SimpleNamespace(apply_rotary=apply_rotary)
    done += ["layernorm.dropout_layer_norm", "rotary.apply_rotary"]
    from text_generation_server.models import flash_causal_lm
    flash_causal_lm.SYSTEM = "ipex"                       # read only by FlashCausalLM.__init__
    flash_causal_lm.init_cpu_threads_env = lambda rank_id, world_size: None
    done.append("FlashCausalLM.__init__ cpu branch")
    return done
