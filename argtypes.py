"""Argument types of the ``vattn`` command: each parses one flag or refuses it on one line.

Every function here is an ``argparse`` ``type=``: it returns the parsed value or raises
``argparse.ArgumentTypeError`` saying what was expected and what was given, which argparse prints
as ``vattn ...: error: argument --flag: expected ..., got ...`` and exits with status 2.

Example
-------
>>> parser.add_argument("--pages", type=positive_int, default=256)
>>> parser.add_argument("--batches", type=int_list, default=(1, 64, 256))
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

__all__ = ["positive_int", "non_negative_int", "positive_float", "non_negative_float", "int_list",
           "name_list", "name_list_or_ints", "cases", "device", "int_at_least", "name_path",
           "int_range", "share"]


def _number(text: str, kind: type, what: str, ok) -> int | float:
    try:
        value = kind(text)
    except (TypeError, ValueError):
        value = None
    if value is None or not ok(value) or value != value:       # value != value: NaN
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An int ``>= 1``."""
    return _number(text, int, "an int >= 1", lambda v: v >= 1)


def non_negative_int(text: str) -> int:
    """An int ``>= 0``."""
    return _number(text, int, "an int >= 0", lambda v: v >= 0)


def positive_float(text: str) -> float:
    """A finite float ``> 0``."""
    return _number(text, float, "a number > 0", lambda v: 0 < v < float("inf"))


def non_negative_float(text: str) -> float:
    """A finite float ``>= 0``."""
    return _number(text, float, "a number >= 0", lambda v: 0 <= v < float("inf"))


def int_range(text: str) -> tuple[int, int]:
    """``LOW:HIGH`` (ints, ``1 <= LOW <= HIGH``), or one int ``N`` for ``N:N``."""
    low, sep, high = text.partition(":")
    try:
        pair = (int(low), int(high if sep else low))
    except ValueError:
        pair = None
    if pair is None or not 1 <= pair[0] <= pair[1]:
        raise argparse.ArgumentTypeError(f"expected LOW:HIGH with 1 <= LOW <= HIGH (ints), got {text!r}")
    return pair


def share(text: str) -> float:
    """A number in ``[0, 1]``."""
    return _number(text, float, "a share in [0, 1]", lambda v: 0 <= v <= 1)


def int_at_least(low: int) -> Callable[[str], int]:
    """A type accepting an int ``>= low``."""
    def parse(text: str) -> int:
        return _number(text, int, f"an int >= {low}", lambda v: v >= low)

    parse.__name__ = f"int_at_least_{low}"
    return parse


def int_list(text: str) -> tuple[int, ...]:
    """A comma-separated, non-empty list of ints ``>= 1``: ``"1,16,64"`` -> ``(1, 16, 64)``."""
    parts = [p.strip() for p in text.split(",")]
    try:
        values = tuple(int(p) for p in parts)
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of ints >= 1 "
                                         f"(e.g. 1,16,64), got {text!r}")
    return values


def name_list(choices) -> Callable[[str], tuple[str, ...]]:
    """A type accepting a comma-separated, non-empty list of names from ``choices``."""
    return _names(tuple(choices), ints=False)


def name_list_or_ints(choices) -> Callable[[str], tuple[str, ...]]:
    """Like :func:`name_list`, each item a name from ``choices`` or an int ``>= 1`` (kept as text)."""
    return _names(tuple(choices), ints=True)


def _names(allowed: tuple[str, ...], *, ints: bool) -> Callable[[str], tuple[str, ...]]:
    what = ", ".join(allowed) + (" or ints >= 1" if ints else "")

    def parse(text: str) -> tuple[str, ...]:
        names = tuple(p.strip() for p in text.split(","))
        bad = [n for n in names if n not in allowed and not (ints and n.isdigit() and int(n) >= 1)]
        if not text.strip() or bad:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {what}; got {text!r} "
                                             f"({', '.join(map(repr, bad)) or 'empty'} unknown)")
        return names

    parse.__name__ = "name_list"
    return parse


def name_path(choices) -> Callable[[str], tuple[str, str]]:
    """A type accepting ``NAME=PATH``: ``NAME`` from ``choices``, ``PATH`` an executable file
    (e.g. ``vllm=.venvs/vllm/bin/python``) -> ``(NAME, PATH)``."""
    allowed = tuple(choices)

    def parse(text: str) -> tuple[str, str]:
        import os
        name, sep, path = text.partition("=")
        if not sep or name not in allowed or not path:
            raise argparse.ArgumentTypeError(f"expected NAME=PATH with NAME one of {', '.join(allowed)} "
                                             f"(e.g. {allowed[0]}=.venvs/{allowed[0]}/bin/python), got {text!r}")
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            raise argparse.ArgumentTypeError(f"expected {name}=PATH of an executable Python, got {text!r} "
                                             f"({path!r} is not an executable file)")
        return name, path

    parse.__name__ = "name_path"
    return parse


def cases(text: str) -> tuple[tuple[int, int], ...]:
    """``"BATCHxCONTEXT,..."``: ``"128x2048,32x8192"`` -> ``((128, 2048), (32, 8192))``; ``""`` -> ``()``."""
    if not text.strip():
        return ()
    try:
        return tuple(_case(c) for c in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BATCHxCONTEXT[,BATCHxCONTEXT...] with ints >= 1 "
                                         f"(e.g. 128x2048,32x8192), got {text!r}") from None


def _case(text: str) -> tuple[int, int]:
    batch, sep, context = text.strip().partition("x")
    pair = (int(batch), int(context))
    if not sep or min(pair) < 1:
        raise ValueError(text)
    return pair


def device(text: str) -> str:
    """``"cpu"`` or ``"cuda[:N]"`` naming a device torch can use here."""
    try:
        dev = torch.device(text)
    except (RuntimeError, TypeError, ValueError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected 'cpu' or 'cuda[:N]', got {text!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"expected a device torch can use, got {text!r}, but torch "
                                         f"{torch.__version__} sees no CUDA device here: pass "
                                         f"--device cpu or run on a GPU")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"expected a CUDA device index below "
                                         f"{torch.cuda.device_count()}, got {text!r}")
    return text
