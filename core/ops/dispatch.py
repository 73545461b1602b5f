"""Backend resolution: a pure function of what is installed, the device and the dtype.

``resolve_backend`` never imports a kernel library: ``installed_backends()`` only looks for the
packages on disk (``importlib.util.find_spec``), the chosen backend is imported when first run.
Resolve once (per model / per layer shape) and pass the name on: ``backend="auto"`` in the ops
resolves on every call, which is cheap but not free.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from ..errors import UnsupportedError

__all__ = [
    "BACKENDS", "DECODE_ORDER", "PREFILL_ORDER", "installed_backends", "is_supported",
    "resolve_backend", "device_capability",
]

#: Every backend name. "reference" (fp32 math) and "torch_fa2" need nothing beyond torch.
BACKENDS = ("vllm_fa3", "sgl_fa3", "vllm_fa2", "flash_attn", "flashinfer", "triton",
            "torch_fa2", "reference")
#: Fastest first. FlashInfer is explicit-only: its plan() reads lengths on the host (a sync per
#: call through this API, not CUDA-graph safe), so "auto" prefers the Triton kernel.
DECODE_ORDER = ("vllm_fa3", "sgl_fa3", "vllm_fa2", "flash_attn", "triton", "torch_fa2")
PREFILL_ORDER = ("vllm_fa3", "sgl_fa3", "vllm_fa2", "flash_attn", "torch_fa2")
_OPS = ("decode", "prefill")
_HALF = (torch.float16, torch.bfloat16)
_NEEDS = {  # backend -> packages that must be present
    "vllm_fa3": ("vllm.vllm_flash_attn",), "vllm_fa2": ("vllm.vllm_flash_attn",),
    "sgl_fa3": ("sgl_kernel",), "flash_attn": ("flash_attn",), "flashinfer": ("flashinfer",),
    "triton": ("triton",), "torch_fa2": (), "reference": (),
}


@functools.cache
def installed_backends() -> frozenset:
    """Backends whose packages are on disk (nothing is imported). Memoized: a fact of the process."""
    return frozenset(name for name, pkgs in _NEEDS.items() if all(_present(p) for p in pkgs))


def _present(dotted: str) -> bool:
    top, _, sub = dotted.partition(".")
    spec = importlib.util.find_spec(top)
    if spec is None:
        return False
    if not sub:
        return True
    # a subpackage is looked up on disk: importing vllm just to ask would be slow and noisy
    return any(os.path.isdir(os.path.join(loc, *sub.split(".")))
               for loc in (spec.submodule_search_locations or ()))


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """``(major, minor)`` of a CUDA device, ``None`` for any other device."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return tuple(torch.cuda.get_device_capability(device))


def is_supported(backend: str, *, op: str, device_type: str, dtype: torch.dtype, head_dim: int,
                 capability: tuple[int, int] | None = None,
                 installed: frozenset | None = None) -> bool:
    """Whether ``backend`` can run ``op`` here (pure when ``installed`` is given)."""
    return _why_not(backend, op=op, device_type=device_type, dtype=dtype, head_dim=head_dim,
                    capability=capability, installed=installed) is None


def _why_not(backend, *, op, device_type, dtype, head_dim, capability, installed) -> str | None:
    installed = installed_backends() if installed is None else installed
    if backend not in BACKENDS:
        return f"unknown backend {backend!r}; expected one of {BACKENDS}"
    if op not in _OPS:
        return f"unknown op {op!r}; expected one of {_OPS}"
    if backend == "reference":
        return None if dtype in (*_HALF, torch.float32) else f"dtype {dtype} not supported"
    if backend not in installed:
        return f"backend {backend!r} needs {_NEEDS[backend]}, which is not installed"
    if device_type != "cuda":
        return f"backend {backend!r} needs a CUDA device, got {device_type!r}"
    if op == "prefill" and backend in ("triton", "flashinfer"):
        return f"backend {backend!r} implements decode only"
    if dtype not in _HALF:
        return f"backend {backend!r} needs float16 or bfloat16, got {dtype}"
    if head_dim % 8 or not 8 <= head_dim <= 256:
        return f"backend {backend!r} needs head_dim a multiple of 8 in [8, 256], got {head_dim}"
    major = (capability or (0, 0))[0]
    if backend in ("vllm_fa3", "sgl_fa3") and major != 9:
        return f"backend {backend!r} (FlashAttention-3) needs a Hopper GPU (sm90), got {capability}"
    if backend in ("vllm_fa2", "flash_attn", "torch_fa2") and major < 8:
        return f"backend {backend!r} needs sm80 or newer, got {capability}"
    return None


def _auto_skips(backend: str, capability: tuple[int, int] | None) -> str | None:
    """Why ``"auto"`` passes over a backend that would run, or ``None``."""
    if backend == "vllm_fa2" and (capability or (0, 0))[0] >= 9:
        # vLLM 0.26.0's FA2 library holds sm80 cubins and PTX only: on sm90 the driver compiles
        # its PTX at first use, 110-185 s per kernel family on the H200 (measured 2026-12-04)
        return ("auto skips 'vllm_fa2' on sm90+ (vLLM ships it as sm80 code: the driver JIT-compiles"
                " it at first use, minutes); pass backend='vllm_fa2' to use it anyway")
    return None


def _device(device) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise UnsupportedError(f"device must be a torch.device or a string like 'cpu' or 'cuda:0', "
                               f"got {device!r}") from exc


def resolve_backend(op: str, *, device: torch.device | str, dtype: torch.dtype, head_dim: int,
                    backend: str = "auto", capability: tuple[int, int] | None = None,
                    installed: frozenset | None = None) -> str:
    """Pick the backend for ``op`` ("decode" or "prefill"), or validate an explicit one.

    Parameters
    ----------
    op : {"decode", "prefill"}
    device, dtype, head_dim
        Where and what the op runs on.
    backend : str
        ``"auto"`` (the first supported entry of ``DECODE_ORDER`` / ``PREFILL_ORDER`` on CUDA,
        except ``vllm_fa2`` on sm90+, ``"reference"`` elsewhere) or a name from ``BACKENDS``.
    capability, installed
        Override the probes (tests pass them to make resolution pure).

    Raises
    ------
    UnsupportedError
        ``device`` names no device, the explicit backend cannot run here, or nothing can (the
        message says why).
    """
    device = _device(device)
    if capability is None and device.type == "cuda":
        capability = device_capability(device)
    args = dict(op=op, device_type=device.type, dtype=dtype, head_dim=head_dim,
                capability=capability, installed=installed)
    if backend != "auto":
        why = _why_not(backend, **args)
        if why:
            raise UnsupportedError(f"{op}: {why}")
        return backend
    if op not in _OPS:
        raise UnsupportedError(f"unknown op {op!r}; expected one of {_OPS}")
    if device.type != "cuda":
        why = _why_not("reference", **args)
        if why:
            raise UnsupportedError(f"{op} on {device.type}: {why}")
        return "reference"
    order = DECODE_ORDER if op == "decode" else PREFILL_ORDER
    reasons = []
    for name in order:
        why = _why_not(name, **args) or _auto_skips(name, capability)
        if why is None:
            return name
        reasons.append(why)
    raise UnsupportedError(f"{op}: no backend supports this case on {device}: " + "; ".join(reasons))
