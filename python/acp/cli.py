"""The ``acp`` command line (list, inspect, verify, export, persist, gc).

Not implemented yet: this entry point only prints its help.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="acp",
        description="Inspect and manage acp checkpoints (commands are not implemented yet).",
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    args = parser.parse_args(argv)
    if args.version:
        from acp import __version__

        print(f"acp {__version__}")
        return 0
    parser.print_help(sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
