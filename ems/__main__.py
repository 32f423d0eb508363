"""`python -m ems demo [options]`: the end-to-end demo on the embedded pool (see `ems.tools.demo`)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print("usage: python -m ems demo [--help] [options]\n       python -m ems.pool --listen HOST:PORT ...")
        return 0 if args else 2
    if args[0] == "demo":
        from ems.tools.demo import main as demo_main

        return demo_main(args[1:])
    print(f"unknown command {args[0]!r}; try: python -m ems demo", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
