"""`python -m ems demo [options]`: the end-to-end demo on the embedded pool (see `ems.tools.demo`)."""

from __future__ import annotations

import sys


def imported_folder() -> str | None:
    """The folder Python imported as `ems` when that is not this package but a namespace package: run from the parent
    of a clone named `ems`, the clone (no `__init__.py`) is found before an editable install's package, and only
    the submodules, this one included, come from the install. None when `ems` is this package."""
    package = sys.modules.get("ems")
    if package is None or getattr(package, "__file__", None) is not None:
        return None
    return ", ".join(getattr(package, "__path__", ()))


def main(argv: list[str] | None = None) -> int:
    folder = imported_folder()
    if folder is not None:
        print(
            f"python -m ems: Python imported the folder {folder} as the package ems (a namespace package: no "
            "__init__.py, a clone named ems in the current directory?), not the installed package, so "
            "`from ems import Ems` fails there too; run from another directory (the clone's root works) or rename "
            "the clone (README.md, Troubleshooting)",
            file=sys.stderr,
        )
        return 2
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
