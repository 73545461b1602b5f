"""``python -m vattn.adapters.tgi {serve,install-hook,uninstall-hook,check}``."""

import argparse
import sys

from .cli import add_arguments, run

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m vattn.adapters.tgi")
    add_arguments(parser)
    args, rest = parser.parse_known_args()
    args.rest = rest
    sys.exit(run(args))
