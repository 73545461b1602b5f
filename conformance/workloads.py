"""Workloads: prompts (token ids), output length and optional Poisson arrivals, scaled by size."""

from __future__ import annotations

import random
from dataclasses import dataclass

from vattn.core.errors import ConfigError

from .models import random_prompts

__all__ = ["Workload", "WORKLOADS", "make_workload", "SIZES"]

WORKLOADS = ("identity", "decode-heavy", "prefill-heavy", "poisson")
SIZES = ("cpu", "gpu")

# (num_prompts, prompt_len range, max_new_tokens) per size
_SPECS = {
    "cpu": {"identity": (8, (8, 64), 16), "decode-heavy": (16, (16, 48), 32),
            "prefill-heavy": (2, (512, 768), 4), "poisson": (12, (16, 64), 16)},
    "gpu": {"identity": (32, (64, 1024), 64), "decode-heavy": (128, (256, 512), 256),
            "prefill-heavy": (8, (8192, 32768), 8), "poisson": (128, (128, 2048), 128)},
}


@dataclass(frozen=True, kw_only=True)
class Workload:
    name: str
    prompts: list[list[int]]
    max_new_tokens: int
    arrival_times: list[float] | None = None


def make_workload(name: str, *, size: str, vocab_size: int, seed: int = 0,
                  max_context: int | None = None, rate: float | None = None,
                  num: int | None = None) -> Workload:
    """Build a seeded workload.

    Parameters
    ----------
    name
        One of :data:`WORKLOADS`.
    size
        ``"cpu"`` (tiny model, 2 cores) or ``"gpu"`` (8B shape on one H200).
    vocab_size
        Token ids are drawn from ``[1, vocab_size)``.
    max_context
        Caps prompt + output length (the model's max position).
    rate
        Poisson arrival rate in requests/s (``poisson`` only; default: a size-based rate).
    num
        Number of prompts (default: the size's); lengths and output length stay the size's.
    """
    if name not in WORKLOADS:
        raise ConfigError(f"unknown workload {name!r}: expected one of {WORKLOADS}")
    if size not in SIZES:
        raise ConfigError(f"size must be one of {SIZES}, got {size!r}")
    default_num, (lo, hi), out = _SPECS[size][name]
    num = default_num if num is None else int(num)
    if num < 1:
        raise ConfigError(f"num must be >= 1, got {num}")
    if max_context is not None:
        hi = min(hi, max_context - out)
        lo = min(lo, hi)
    rng = random.Random(seed)
    lengths = [rng.randint(lo, hi) for _ in range(num)]
    prompts = random_prompts(num, lengths, vocab_size=vocab_size, seed=seed)
    arrivals = None
    if name == "poisson":
        lam = rate or (8.0 if size == "cpu" else 64.0)
        t, arrivals = 0.0, []
        for _ in range(num):
            arrivals.append(t)
            t += rng.expovariate(lam)
    return Workload(name=name, prompts=prompts, max_new_tokens=out, arrival_times=arrivals)
