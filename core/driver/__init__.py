"""Virtual-memory backends behind one interface (:class:`~vattn.core.driver.base.Driver`)."""

from __future__ import annotations

import torch

from ..errors import ConfigError
from .base import DoneFence, Driver, Fence
from .faults import FaultInjector
from .host import HostDriver

__all__ = ["Driver", "Fence", "DoneFence", "HostDriver", "CudaDriver", "FaultInjector",
           "get_driver", "available_backends"]


def get_driver(device: torch.device | str, *, backend: str = "auto", granularity: int | None = None):
    """Return the backend for ``device``: ``"host"`` for CPU, ``"cuda"`` for CUDA devices."""
    device = torch.device(device)
    if backend == "auto":
        backend = "cuda" if device.type == "cuda" else "host"
    if backend == "host":
        if device.type != "cpu":
            raise ConfigError(f"the host backend serves device 'cpu', got device {str(device)!r}")
        return HostDriver(**({"granularity": granularity} if granularity else {}))
    if backend == "cuda":
        if device.type != "cuda":
            raise ConfigError(f"the cuda backend serves CUDA devices, got device {str(device)!r}")
        from .cuda import CudaDriver  # noqa: PLC0415
        return CudaDriver(device)
    raise ConfigError(f"backend must be 'auto', 'host' or 'cuda', got {backend!r}")


def available_backends() -> dict[str, str]:
    """Backend name -> 'ok' or why it is unavailable (for ``vattn info``)."""
    found = {"host": "ok"}
    try:
        import cuda.bindings.driver  # noqa: F401, PLC0415
        found["cuda"] = "ok" if torch.cuda.is_available() else "cuda-python present, no CUDA device"
    except ImportError:
        found["cuda"] = "cuda-python not installed"
    return found


def __getattr__(name: str):
    if name == "CudaDriver":
        from .cuda import CudaDriver  # noqa: PLC0415
        return CudaDriver
    raise AttributeError(name)
