"""The ``acp`` command line: see and repair checkpoints without writing code.

Every subcommand has ``--help`` and ``--json`` (the report as one JSON
object on stdout, for scripts). Long operations draw a progress bar on
stderr when it is a terminal, and nothing when it is piped. The work is
done by the Rust engine (``acp._acp.ops_*``); the torch and MindSpore
export and import paths are here, and import their framework only when
asked for.

Exit codes:

====  =====================================================================
0     success; for ``verify``, every byte checked is intact
1     a checkpoint is corrupt or failed verification
2     usage: bad arguments or input (argparse errors too)
3     not found: no such root, step, rank or file
4     any other error (I/O, no space, timeout, ...)
5     busy: a live process holds the job's shared-memory slots
6     unsupported: written by a newer acp
====  =====================================================================
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib.util
import json
import os
import re
import shutil
import struct
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Callable

from acp import _acp
from acp._acp import (
    AcpError,
    BusyError,
    CheckpointCorrupt,
    CheckpointExists,
    CheckpointNotFound,
    ConfigError,
    InvalidInput,
    Unsupported,
)

EXIT_OK = 0
EXIT_CORRUPT = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_ERROR = 4
EXIT_BUSY = 5
EXIT_UNSUPPORTED = 6

EXIT_CODES_HELP = """\
exit codes:
  0  success (verify: intact)        4  other error (I/O, no space, timeout)
  1  corrupt / verification failed   5  busy: a live process holds the slots
  2  usage error                     6  unsupported: written by a newer acp
  3  not found (root, step, file)
"""

DEFAULT_SHM_DIR = "/dev/shm"


class UsageError(Exception):
    """A command-line mistake found after parsing (exit code 2)."""


def exit_code(e: BaseException) -> int:
    """The exit code for an error (see the module docs)."""
    if isinstance(e, CheckpointCorrupt):
        return EXIT_CORRUPT
    if isinstance(e, (UsageError, InvalidInput, ConfigError, CheckpointExists)):
        return EXIT_USAGE
    if isinstance(e, (CheckpointNotFound, FileNotFoundError)):
        return EXIT_NOT_FOUND
    if isinstance(e, BusyError):
        return EXIT_BUSY
    if isinstance(e, Unsupported):
        return EXIT_UNSUPPORTED
    return EXIT_ERROR


# --------------------------------------------------------------------------
# Output


class ProgressBar:
    """A one-line progress bar on a terminal; callable as the engine's
    ``progress(phase, done, total)``."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.started = time.monotonic()
        self.phase = ""
        self.drawn = False

    def __call__(self, phase: str, done: int, total: int) -> None:
        if phase != self.phase:
            self.phase, self.started = phase, time.monotonic()
        width = 30
        frac = min(1.0, done / total) if total else 1.0
        filled = int(frac * width)
        secs = max(time.monotonic() - self.started, 1e-9)
        line = (
            f"\r{phase:<24.24} [{'#' * filled}{'.' * (width - filled)}] {frac * 100:5.1f}% "
            f"{_size(done)}/{_size(total)} {_size(int(done / secs))}/s"
        )
        self.stream.write(line)
        self.stream.flush()
        self.drawn = True

    def close(self) -> None:
        if self.drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self.drawn = False


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class Out:
    """Where a command's results go: JSON or text on stdout, a progress bar
    on a terminal's stderr."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.json = bool(getattr(args, "json", False))
        quiet = bool(getattr(args, "quiet", False))
        self.bar = ProgressBar(sys.stderr) if sys.stderr.isatty() and not quiet else None

    @property
    def progress(self) -> Callable[[str, int, int], None] | None:
        return self.bar

    def report(self, r: _acp.Report) -> dict[str, Any]:
        self.done()
        data: dict[str, Any] = json.loads(r.json)
        if self.json:
            print(json.dumps(data, indent=2))
        else:
            sys.stdout.write(r.text)
        return data

    def data(self, data: dict[str, Any], text: str) -> None:
        self.done()
        if self.json:
            print(json.dumps(data, indent=2))
        else:
            sys.stdout.write(text if text.endswith("\n") else text + "\n")

    def done(self) -> None:
        if self.bar is not None:
            self.bar.close()


# --------------------------------------------------------------------------
# Arguments


def parse_size(text: str) -> int:
    """``"256MiB"``, ``"1G"``, ``"4096"`` → bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*", text, re.IGNORECASE)
    if m is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 256MiB or 1G")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    value = int(float(m.group(1)) * scale)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the size must be positive")
    return value


def _step(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a step number") from None
    if not 0 <= value < 2**64:
        raise argparse.ArgumentTypeError(f"{text}: steps are between 0 and 2**64 - 1")
    return value


def _count(text: str) -> int:
    value = _step(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: must be at least 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="acp",
        description="See, check and repair acp checkpoints.",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def command(name: str, help: str, description: str) -> argparse.ArgumentParser:
        p = sub.add_parser(
            name,
            help=help,
            description=description,
            epilog=EXIT_CODES_HELP,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        p.add_argument("--json", action="store_true", help="print the report as JSON")
        p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
        return p

    def shm(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--shm-dir",
            default=DEFAULT_SHM_DIR,
            help="where the ring's slot files are (default: %(default)s)",
        )

    _read_commands(command, shm)
    _write_commands(command, shm)
    return parser


def _read_commands(
    command: Callable[[str, str, str], argparse.ArgumentParser],
    shm: Callable[[argparse.ArgumentParser], None],
) -> None:
    p = command(
        "ls",
        "list committed steps",
        "List the committed steps of ROOT with their size, ranks and tensors, and which "
        "are resident in this node's shared memory (and any resident checkpoint that is "
        "not committed: `acp persist` commits it).",
    )
    p.add_argument("root", metavar="ROOT", help="the checkpoint directory")
    p.add_argument("--job", help="the job id the trainer used (default: the root path)")
    shm(p)

    p = command(
        "inspect",
        "show what a step holds",
        "Show a step's files (sizes, digests, format version), tensors (dtype, shape, bytes) "
        "and plain values. Headers are checked against their digests; tensor bytes are not "
        "read (see `verify`).",
    )
    p.add_argument("root", metavar="ROOT")
    p.add_argument("--step", type=_step, help="the step (default: the newest)")

    p = command(
        "verify",
        "re-hash a step against its index",
        "Re-hash every file of a step (or of every step with --all) against the digests of "
        "its index. Exits 0 only if every byte is intact; 1 naming each changed file and "
        "tensor otherwise.",
    )
    p.add_argument("root", metavar="ROOT")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--step", type=_step, help="the step (default: the newest)")
    g.add_argument("--all", action="store_true", help="every committed step")


def _write_commands(
    command: Callable[[str, str, str], argparse.ArgumentParser],
    shm: Callable[[argparse.ArgumentParser], None],
) -> None:
    p = command(
        "export",
        "write a step as safetensors, torch or MindSpore",
        "Write a step to OUT: `safetensors` (one plain file; a multi-rank step is merged), "
        "`torch` (a torch.save file of the saved state, tensors on CPU; several ranks give "
        "{'rank0': ..., 'rank1': ...}), or `mindspore` (a .ckpt of the tensors). Every byte is "
        "verified first: a corrupt step is refused and nothing is written.",
    )
    p.add_argument("root", metavar="ROOT")
    p.add_argument("out", metavar="OUT", help="the file to write")
    p.add_argument("--step", type=_step, help="the step (default: the newest)")
    p.add_argument(
        "--to",
        dest="format",
        choices=["safetensors", "torch", "mindspore"],
        default="safetensors",
        help="output format (default: %(default)s)",
    )
    p.add_argument("--rank", type=int, help="only this rank's file")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")

    p = command(
        "import",
        "commit files as a step",
        "Commit safetensors files, a torch state dict (read with "
        "torch.load(weights_only=True): no pickled code runs) or a MindSpore .ckpt as step "
        "STEP of ROOT, hashed and indexed like any save.",
    )
    p.add_argument("files", metavar="FILE", nargs="+")
    p.add_argument("--to", dest="root", metavar="ROOT", required=True)
    p.add_argument("--step", type=_step, required=True)
    p.add_argument(
        "--format",
        choices=["auto", "safetensors", "torch", "mindspore"],
        default="auto",
        help="input format (default: from the file's name and first bytes)",
    )
    p.add_argument("--force", action="store_true", help="replace the step if it exists")
    shm(p)

    p = command(
        "diff",
        "compare two steps",
        "Which tensors were added, removed or changed between two steps; for changed float "
        "tensors the largest absolute difference and the relative L2 norm of the difference, "
        "for others the count of differing bytes; and which plain values differ.",
    )
    p.add_argument("root", metavar="ROOT")
    p.add_argument(
        "--step",
        type=_step,
        action="append",
        required=True,
        metavar="N",
        help="give twice: --step A --step B",
    )

    p = command(
        "gc",
        "remove old steps and dead saves",
        "Keep the newest K committed steps (and every multiple of M), removing the rest "
        "atomically; with --pending also remove unfinished saves left by dead processes. "
        "Safe beside a live trainer: the newest step is always kept, and unfinished saves "
        "younger than --older-than are left alone.",
    )
    p.add_argument("root", metavar="ROOT")
    p.add_argument("--keep", type=_count, metavar="K", help="keep the newest K steps")
    p.add_argument("--every", type=_count, metavar="M", help="also keep multiples of M")
    p.add_argument("--pending", action="store_true", help="remove old unfinished saves")
    p.add_argument(
        "--older-than",
        type=float,
        default=3600.0,
        metavar="SECS",
        help="age of an unfinished save before --pending removes it (default: %(default)s)",
    )
    p.add_argument("--dry-run", action="store_true", help="only show what would be removed")

    p = command(
        "persist",
        "commit what a dead trainer left in RAM",
        "Flush and commit the checkpoints a dead process left resident in this node's shared "
        "memory that are newer than the newest committed step. Refuses (exit 5) while a live "
        "trainer holds the slots: it persists its own.",
    )
    p.add_argument("root", metavar="ROOT")
    p.add_argument("--job", help="the job id the trainer used (default: the root path)")
    p.add_argument(
        "--rank", type=int, action="append", help="only this rank (repeat; default: all found)"
    )
    p.add_argument("--world-size", type=int, help="default: read from the resident image")
    p.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="with several ranks, how long rank 0 waits for the others (default: %(default)s s)",
    )
    shm(p)

    p = command(
        "bench",
        "quick self-benchmark",
        "Measure this machine: memcpy, the save stall (copy into the ring), write+fsync "
        "against the flush, read against a load from storage, and a load from RAM, side by "
        "side with ratios.",
    )
    p.add_argument("--size", type=parse_size, default=256 << 20, help="default: 256MiB")
    p.add_argument(
        "--dir",
        default=None,
        help="directory on the storage to measure (default: the system temp directory)",
    )
    shm(p)


# --------------------------------------------------------------------------
# Commands


def cmd_ls(args: argparse.Namespace, out: Out) -> int:
    out.report(_acp.ops_list(args.root, args.job, args.shm_dir))
    return EXIT_OK


def cmd_inspect(args: argparse.Namespace, out: Out) -> int:
    out.report(_acp.ops_inspect(args.root, args.step))
    return EXIT_OK


def cmd_verify(args: argparse.Namespace, out: Out) -> int:
    data = out.report(_acp.ops_verify(args.root, args.step, args.all, out.progress))
    return EXIT_OK if data["ok"] else EXIT_CORRUPT


def cmd_diff(args: argparse.Namespace, out: Out) -> int:
    if len(args.step) != 2:
        raise UsageError("diff: give exactly two steps: --step A --step B")
    a, b = args.step
    out.report(_acp.ops_diff(args.root, a, b, out.progress))
    return EXIT_OK


def cmd_gc(args: argparse.Namespace, out: Out) -> int:
    if args.keep is None and not args.pending:
        raise UsageError("gc: say what to remove: --keep K and/or --pending")
    if args.every is not None and args.keep is None:
        raise UsageError("gc: --every needs --keep")
    out.report(
        _acp.ops_gc(
            args.root,
            keep_last=args.keep,
            keep_every=args.every,
            unfinished_older_than=args.older_than if args.pending else None,
            dry_run=args.dry_run,
        )
    )
    return EXIT_OK


def cmd_persist(args: argparse.Namespace, out: Out) -> int:
    out.report(
        _acp.ops_persist(
            args.root,
            job=args.job,
            ranks=args.rank,
            shm_dir=args.shm_dir,
            world_size=args.world_size,
            commit_timeout=args.timeout,
        )
    )
    return EXIT_OK


def cmd_bench(args: argparse.Namespace, out: Out) -> int:
    directory = args.dir if args.dir is not None else tempfile.gettempdir()
    out.report(_acp.ops_bench(directory, args.size, args.shm_dir, out.progress))
    return EXIT_OK


def cmd_export(args: argparse.Namespace, out: Out) -> int:
    if args.format == "safetensors":
        out.report(
            _acp.ops_export(args.root, args.out, args.step, args.rank, args.force, out.progress)
        )
        return EXIT_OK
    if not args.force and os.path.lexists(args.out):
        raise UsageError(f"{args.out}: exists; pass --force to replace it")
    t0 = time.monotonic()
    info = json.loads(_acp.ops_inspect(args.root, args.step).json)
    step = int(info["step"])
    ranks = sorted(int(f["rank"]) for f in info["files"])
    if args.rank is not None:
        if args.rank not in ranks:
            raise CheckpointNotFound(f"rank {args.rank}'s file in step {step}: not found")
        ranks = [args.rank]
    with tempfile.TemporaryDirectory(prefix=".acp-export-", dir=_parent(args.out)) as tmp:
        states = {}
        for r in ranks:
            path = Path(tmp) / f"rank{r}.safetensors"
            # Verified byte for byte: a corrupt step stops here.
            _acp.ops_export(args.root, path, step, r, False, out.progress)
            states[r] = read_safetensors(path)
        if args.format == "torch":
            write_torch(states, args.out, Path(tmp))
        else:
            write_mindspore(states, args.out, Path(tmp))
    tensors = sum(len(s.tensors) for s in states.values())
    out.data(
        {
            "root": info["root"],
            "step": step,
            "out": os.fspath(args.out),
            "format": args.format,
            "ranks": ranks,
            "tensors": tensors,
            "bytes": os.path.getsize(args.out),
            "secs": time.monotonic() - t0,
        },
        f"exported step {step} ({tensors} tensor(s), rank(s) {ranks}) to {args.out} "
        f"as {args.format}",
    )
    return EXIT_OK


def cmd_import(args: argparse.Namespace, out: Out) -> int:
    formats = {f: args.format if args.format != "auto" else sniff(f) for f in args.files}
    kinds = set(formats.values())
    if len(kinds) != 1:
        raise UsageError(f"import: the files are of different formats: {formats}")
    kind = kinds.pop()
    if kind == "safetensors":
        out.report(
            _acp.ops_import(
                args.files,
                args.root,
                args.step,
                overwrite=args.force,
                values_json=safetensors_values(args.files),
                shm_dir=args.shm_dir,
                progress=out.progress,
            )
        )
        return EXIT_OK
    t0 = time.monotonic()
    state = read_torch(args.files) if kind == "torch" else read_mindspore(args.files)
    stats = save_state(state, args.root, args.step, args.force, args.shm_dir)
    out.data(
        {
            "root": os.fspath(Path(args.root).resolve()),
            "step": args.step,
            "files": [os.fspath(f) for f in args.files],
            "format": kind,
            "tensors": stats.tensors,
            "bytes": stats.bytes,
            "secs": time.monotonic() - t0,
        },
        f"imported {stats.tensors} tensor(s) from {len(args.files)} {kind} file(s) as step "
        f"{args.step} of {args.root}",
    )
    return EXIT_OK


COMMANDS: dict[str, Callable[[argparse.Namespace, Out], int]] = {
    "ls": cmd_ls,
    "inspect": cmd_inspect,
    "verify": cmd_verify,
    "export": cmd_export,
    "import": cmd_import,
    "diff": cmd_diff,
    "gc": cmd_gc,
    "persist": cmd_persist,
    "bench": cmd_bench,
}


# --------------------------------------------------------------------------
# Formats


def _parent(path: str | os.PathLike[str]) -> str:
    return os.path.dirname(os.path.abspath(path))


def sniff(path: str | os.PathLike[str]) -> str:
    """The format of an input file: by its name, else by its first bytes."""
    name = os.fspath(path).lower()
    if name.endswith(".safetensors"):
        return "safetensors"
    if name.endswith((".pt", ".pth", ".bin", ".tar")):
        return "torch"
    if name.endswith(".ckpt"):
        return "mindspore"
    try:
        with open(path, "rb") as f:
            head = f.read(9)
            size = os.fstat(f.fileno()).st_size
    except FileNotFoundError:
        raise CheckpointNotFound(f"{os.fspath(path)}: not found") from None
    if head[:2] == b"PK":
        return "torch"
    if len(head) == 9 and head[8:9] == b"{" and struct.unpack("<Q", head[:8])[0] + 8 <= size:
        return "safetensors"
    raise UsageError(f"{os.fspath(path)}: unknown format; pass --format")


def _header(path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header: dict[str, Any] = json.loads(f.read(min(n, 100_000_000)))
    except FileNotFoundError:
        raise CheckpointNotFound(f"{os.fspath(path)}: not found") from None
    except (struct.error, ValueError) as e:
        raise CheckpointCorrupt(f"{os.fspath(path)}: not a safetensors file: {e}") from e
    return header


def safetensors_values(files: Sequence[str]) -> str | None:
    """The values tree to save with imported safetensors files: None (keep
    the file's own) for one file that acp wrote with its state codec, else
    a flat dict of its tensors by name, so ``Checkpointer.load`` returns
    ``{name: tensor}`` (torch tensors when torch is installed, else NumPy)."""
    from acp._codec import CODEC_KEY, CODEC_VERSION, STATE_KEY

    headers = [_header(f) for f in files]
    if len(headers) == 1:
        values = (headers[0].get("__metadata__") or {}).get("acp.values")
        tree = json.loads(values) if values is not None else None
        if isinstance(tree, dict) and CODEC_KEY in tree:
            return None
    fw = "torch" if importlib.util.find_spec("torch") is not None else "numpy"
    names = [name for h in headers for name in h if name != "__metadata__"]
    refs = [{"t": "tensor", "fw": fw, "name": name} for name in names]
    tree = {CODEC_KEY: CODEC_VERSION, STATE_KEY: {"t": "dict", "k": names, "v": refs}}
    return json.dumps(tree, separators=(",", ":"))


class SafetensorsFile:
    """A verified exported safetensors file, read whole, shaped like the
    engine's ``Loaded`` so the state codec can rebuild the saved state."""

    def __init__(self, path: Path) -> None:
        self.buf = bytearray(path.read_bytes())
        (n,) = struct.unpack_from("<Q", self.buf, 0)
        header = json.loads(bytes(self.buf[8 : 8 + n]))
        self.data_start = 8 + n
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self.tensors = sorted(
            (
                (name, t["dtype"], tuple(t["shape"]), t["data_offsets"])
                for name, t in header.items()
            ),
            key=lambda t: (t[3][0], t[3][1]),
        )
        self.step = int(self.metadata.get("acp.step", "0"))
        self.values_json = self.metadata.get("acp.values", "null")
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(self.buf))

    def entries(self) -> list[tuple[str, str, tuple[int, ...], int]]:
        return [(name, dt, shape, end - begin) for name, dt, shape, (begin, end) in self.tensors]

    def buffer(self, i: int) -> memoryview:
        begin, end = self.tensors[i][3]
        return memoryview(self.buf)[self.data_start + begin : self.data_start + end]

    def copy_into(self, items: list[tuple[int, int, int]]) -> None:
        for i, addr, nbytes in items:
            begin, end = self.tensors[i][3]
            if nbytes != end - begin:
                raise InvalidInput(f"tensor `{self.tensors[i][0]}`: size mismatch")
            if nbytes:
                ctypes.memmove(addr, self._base + self.data_start + begin, nbytes)

    def state(self) -> Any:
        """The saved state (as ``Checkpointer.load`` would return it, tensors
        on CPU), or, for files without acp's state codec, ``{name: tensor}``
        plus the plain values under ``"acp.values"``."""
        from acp._codec import Adapters
        from acp._load import load_state

        values = json.loads(self.values_json)
        if isinstance(values, dict) and "acp.codec" in values:
            # Every tensor comes back as a torch tensor, whatever framework
            # saved it: the bytes and dtypes are the same.
            self.values_json = json.dumps(_as_torch_refs(values))
            return load_state(self, Adapters(), "cpu")
        out: dict[str, Any] = {name: self.tensor(i) for i, name in enumerate(self.names())}
        if values is not None:
            out["acp.values"] = values
        return out

    def names(self) -> list[str]:
        return [t[0] for t in self.tensors]

    def tensor(self, i: int) -> Any:
        import torch

        from acp.torch import dtype_from_safetensors

        _, dt, shape, _ = self.tensors[i]
        t = torch.empty(shape, dtype=dtype_from_safetensors(dt))
        self.copy_into([(i, t.data_ptr(), t.numel() * t.element_size())])
        return t


def _as_torch_refs(node: Any) -> Any:
    """The values tree with every tensor reference made a torch one."""
    if isinstance(node, list):
        return [_as_torch_refs(v) for v in node]
    if isinstance(node, dict):
        out = {k: _as_torch_refs(v) for k, v in node.items()}
        if out.get("t") == "tensor":
            out["fw"] = "torch"
        return out
    return node


def read_safetensors(path: Path) -> SafetensorsFile:
    return SafetensorsFile(path)


def _to_torch(obj: Any) -> Any:
    """NumPy arrays and scalars in a state become torch tensors."""
    import torch

    if type(obj).__module__ == "numpy":
        return torch.from_numpy(obj) if hasattr(obj, "shape") and obj.shape else torch.tensor(obj)
    if isinstance(obj, dict):
        out = type(obj)() if type(obj) is not dict else {}
        for k, v in obj.items():
            out[k] = _to_torch(v)
        if hasattr(obj, "_metadata"):
            out._metadata = obj._metadata  # type: ignore[attr-defined]
        return out
    if isinstance(obj, list):
        return [_to_torch(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_to_torch(v) for v in obj)
    return obj


def write_torch(states: dict[int, SafetensorsFile], out: str | os.PathLike[str], tmp: Path) -> None:
    import torch

    built = {r: _to_torch(s.state()) for r, s in states.items()}
    obj = (
        next(iter(built.values())) if len(built) == 1 else {f"rank{r}": v for r, v in built.items()}
    )
    scratch = tmp / "out.pt"
    torch.save(obj, scratch)
    shutil.move(scratch, out)


def write_mindspore(
    states: dict[int, SafetensorsFile], out: str | os.PathLike[str], tmp: Path
) -> None:
    """A MindSpore checkpoint of every tensor (by its acp name, dtype kept)
    and the scalar plain values (ints, floats, bools, strings) as
    ``append_dict``."""
    from acp.mindspore import write_ckpt

    appended: dict[str, Any] = {}
    tensors = []
    for s in states.values():
        for i, (name, dt, shape, _) in enumerate(s.tensors):
            tensors.append((name, dt, shape, s.buffer(i)))
        values = json.loads(s.values_json)
        for key, v in _flat_scalars(_plain(values)):
            appended.setdefault(key, v)
    scratch = tmp / "out.ckpt"
    write_ckpt(tensors, scratch, format="ckpt", append=appended or None)
    shutil.move(scratch, out)


def _plain(values: Any) -> Any:
    from acp._codec import CODEC_KEY, STATE_KEY

    if isinstance(values, dict) and CODEC_KEY in values:
        return _plain_node(values.get(STATE_KEY))
    return values


def _plain_node(node: Any) -> Any:
    if isinstance(node, list):
        return [_plain_node(v) for v in node]
    if isinstance(node, dict):
        tag = node.get("t")
        if tag in ("dict", "odict"):
            return {str(_plain_node(k)): _plain_node(v) for k, v in zip(node["k"], node["v"])}
        if tag == "tuple":
            return [_plain_node(v) for v in node["v"]]
        return None  # tensors, bytes, framework values: not plain scalars
    return node


def _flat_scalars(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _flat_scalars(v, f"{prefix}{k}.")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _flat_scalars(v, f"{prefix}{i}.")
    elif isinstance(obj, (bool, int, float, str)):
        yield prefix.rstrip("."), obj


def read_torch(files: Sequence[str]) -> Any:
    """Torch state dicts, read with ``weights_only=True`` (no pickled code
    runs); several files are merged (keys must not repeat)."""
    import torch

    states = []
    for f in files:
        try:
            states.append(torch.load(f, map_location="cpu", weights_only=True))
        except FileNotFoundError:
            raise CheckpointNotFound(f"{f}: not found") from None
        except Exception as e:  # torch raises UnpicklingError, RuntimeError, ...
            raise CheckpointCorrupt(
                f"{f}: not a torch state dict that loads with weights_only=True: {e}"
            ) from e
    return _merge(states, files)


def read_mindspore(files: Sequence[str]) -> Any:
    """MindSpore checkpoints as ``{name: array}`` (or MindSpore tensors when
    acp's MindSpore adapter is installed)."""
    import mindspore as ms

    native = importlib.util.find_spec("acp.mindspore") is not None
    states = []
    for f in files:
        if not os.path.exists(f):
            raise CheckpointNotFound(f"{f}: not found")
        params = ms.load_checkpoint(f)
        state: dict[str, Any] = {}
        for name, p in params.items():
            if native or isinstance(p, (bool, int, float, str)):
                state[name] = p
            else:
                t = p if p.dtype != ms.bfloat16 else p.astype(ms.float32)
                state[name] = t.asnumpy()
        states.append(state)
    return _merge(states, files)


def _merge(states: list[Any], files: Sequence[str]) -> Any:
    if len(states) == 1:
        return states[0]
    merged: dict[Any, Any] = {}
    for state, f in zip(states, files):
        if not isinstance(state, dict):
            raise InvalidInput(f"{f}: holds a {type(state).__name__}, not a dict to merge")
        for k, v in state.items():
            if k in merged:
                raise InvalidInput(f"{f}: key {k!r} is in an earlier file too")
            merged[k] = v
    return merged


def save_state(state: Any, root: str, step: int, overwrite: bool, shm_dir: str) -> Any:
    """Commits ``state`` as ``step`` of ``root`` through a checkpointer with
    a private one-slot ring, removed afterwards."""
    from acp.checkpointer import Checkpointer

    nbytes = _tensor_bytes(state)
    with tempfile.TemporaryDirectory(prefix="acp-import-", dir=_shm_base(shm_dir)) as shm:
        ckpt = Checkpointer(
            root,
            job=f"import:{shm}",
            rank=0,
            world_size=1,
            shm_dir=shm,
            ring_slots=1,
            ring_bytes=nbytes + nbytes // 64 + (16 << 20),
            mlock=False,
            persist_on_open=False,
        )
        try:
            return ckpt.save(step, state, overwrite=overwrite).wait()
        finally:
            ckpt.close()


def _shm_base(shm_dir: str) -> str | None:
    return shm_dir if os.path.isdir(shm_dir) else None


def _tensor_bytes(obj: Any) -> int:
    total = 0
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
        else:
            n = getattr(o, "nbytes", None)
            if isinstance(n, int):
                total += n
    return total


# --------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from acp import __version__

        print(f"acp {__version__}")
        return EXIT_OK
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    out = Out(args)
    try:
        return COMMANDS[args.command](args, out)
    except (AcpError, UsageError, OSError) as e:
        out.done()
        print(f"acp {args.command}: error: {e}", file=sys.stderr)
        return exit_code(e)
    except KeyboardInterrupt:
        out.done()
        return 130
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
