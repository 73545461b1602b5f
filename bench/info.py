"""``vattn info``: what this machine offers vattn."""

from __future__ import annotations

import argparse
import json

import torch

from ..core.driver import available_backends, get_driver
from ..core.errors import VattnError
from .report import environment


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def collect() -> dict:
    info = {"environment": environment(), "backends": available_backends()}
    granularity = {}
    for name, device in (("host", "cpu"), ("cuda", "cuda")):
        if info["backends"].get(name) != "ok":
            continue
        try:
            drv = get_driver(device, backend=name)
            granularity[name] = drv.granularity
            if name == "cuda":
                info["gpu_free_bytes"] = drv.free_memory()
                info["gpu_total_bytes"] = torch.cuda.get_device_properties(0).total_memory
        except VattnError as exc:
            info["backends"][name] = f"error: {exc}"
    info["vmm_granularity_bytes"] = granularity
    info["attention_backends"] = _attention_backends()
    return info


def _attention_backends() -> dict:
    try:
        from ..core.ops import installed_backends as ops_backends  # noqa: PLC0415
    except ImportError as exc:
        return {"error": str(exc)}
    return {name: "installed" for name in sorted(ops_backends())}


def run(args) -> int:
    info = collect()
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    for key, value in info.items():
        if isinstance(value, dict):
            print(f"{key}:")
            for k, v in value.items():
                print(f"  {k}: {v}")
        else:
            print(f"{key}: {value}")
    return 0
