"""Memory a benchmark may use here, checked before anything is allocated.

A benchmark whose flags (or defaults) ask for more memory than the device has is refused with a
:class:`~vattn.core.errors.ConfigError` naming the shape, the bytes it needs, the bytes available
and the flags to change, instead of dying in the allocator (or being killed by the OS) minutes in.
"""

from __future__ import annotations

import os

import torch

from ..core.errors import ConfigError

__all__ = ["available_bytes", "check_fits", "FIT_SHARE"]

#: share of the available memory one benchmark shape may plan to use
FIT_SHARE = 0.8


def available_bytes(device: torch.device | str) -> int:
    """Free memory of ``device``: the CUDA allocator's free bytes, or the host's available RAM."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return _host_available()


def _host_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_fits(what: str, need_bytes: int, device: torch.device | str, *, hint: str) -> None:
    """Raise :class:`ConfigError` if ``need_bytes`` exceeds :data:`FIT_SHARE` of what is free.

    Parameters
    ----------
    what : str
        The shape or run that needs the memory (named in the message).
    need_bytes : int
        Its estimated peak.
    device : torch.device or str
        Where it would be allocated.
    hint : str
        What the user can do instead (the flags to lower, another device).
    """
    have = available_bytes(device)
    if need_bytes > FIT_SHARE * have:
        raise ConfigError(f"{what} needs about {need_bytes / 2**30:.1f} GiB on {device}, more than "
                          f"{FIT_SHARE:.0%} of the {have / 2**30:.1f} GiB free there; {hint}")
