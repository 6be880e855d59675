"""The ``acp`` command line: see and repair checkpoints without writing code.

The program is acp-core's (the same clap program as the Rust binary built
with ``cargo build -p acp-core --features cli``); this module runs it in
the wheel, where ``export --to torch|mindspore`` and ``import`` of torch
and MindSpore files are handed to :mod:`acp.convert`. ``acp --help`` and
``acp COMMAND --help`` describe every option.

Every subcommand has ``--json`` (the report as one JSON object on stdout,
for scripts). Long operations draw a progress bar on stderr when it is a
terminal, and nothing when it is piped.

Exit codes:

====  =====================================================================
0     success; for ``verify``, every byte checked is intact
1     a checkpoint is corrupt or failed verification
2     usage: bad arguments or input
3     not found: no such root, step, rank or file
4     any other error (I/O, no space, timeout, ...)
5     busy: a live process holds the job's shared-memory slots
6     unsupported: written by a newer acp
====  =====================================================================
"""

from __future__ import annotations

import sys

from acp import _acp


def main(argv: list[str] | None = None) -> int:
    """Runs ``acp`` with ``argv`` (default: this process's arguments) and
    returns the exit code."""
    args = sys.argv[1:] if argv is None else argv
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        return _acp.cli_main(["acp", *args])
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
