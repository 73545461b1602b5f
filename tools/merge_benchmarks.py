"""Merge the sections of a BENCHMARKS.md written elsewhere (e.g. on a GPU machine) into ours."""

import re
import sys
from pathlib import Path


def sections(text: str) -> dict[str, str]:
    parts = re.split(r"^(?=## )", text, flags=re.M)
    return {p.splitlines()[0][3:].strip(): p.rstrip() + "\n" for p in parts if p.startswith("## ")}


def main(src: str, dst: str = "BENCHMARKS.md") -> None:
    ours = Path(dst).read_text() if Path(dst).exists() else "# Benchmarks\n"
    for title, body in sections(Path(src).read_text()).items():
        pattern = re.compile(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", re.S | re.M)
        if pattern.search(ours):
            ours = pattern.sub(lambda _: body + "\n", ours)
        else:
            ours = ours.rstrip("\n") + "\n\n" + body
        print("merged:", title)
    Path(dst).write_text(ours)


if __name__ == "__main__":
    main(*sys.argv[1:])
