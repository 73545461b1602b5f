"""CLI of the TGI adapter: ``serve`` (TGI's server with the hook), hook files, version check."""

from __future__ import annotations

import argparse
import os

from vattn.core.errors import VattnError

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="tgi_command", required=True)
    sub.add_parser("serve", help="run text-generation-server with vattn (VATTN_TGI=1 implied)")
    for name in ("install-hook", "uninstall-hook"):
        p = sub.add_parser(name, help=f"{name.split('-')[0]} the VATTN_TGI .pth hook")
        p.add_argument("--site-dir", default=None, help="site-packages directory (default: this interpreter's)")
    sub.add_parser("check", help="verify the importable text_generation_server is v3.3.7")


def run(args) -> int:
    from . import activate
    from .version import check_server
    try:
        if args.tgi_command == "check":
            print(f"text_generation_server v{check_server()}: supported")
        elif args.tgi_command == "install-hook":
            print(f"wrote {activate.write_pth(args.site_dir)}")
        elif args.tgi_command == "uninstall-hook":
            print("removed" if activate.remove_pth(args.site_dir) else "no hook file found")
        else:
            os.environ["VATTN_TGI"] = "1"
            activate.install()
            from text_generation_server.cli import app
            app(args=["serve", *getattr(args, "rest", [])])
    except VattnError as exc:
        print(f"error: {exc}")
        return 1
    return 0
