"""Conversions of the ``acp`` command line to and from framework formats:
``acp export --to torch|mindspore`` and ``acp import`` of torch state dicts
and MindSpore ``.ckpt`` files.

The command line itself is acp-core's (``acp._acp.cli_main``); it calls
:func:`export` and :func:`import_files` for the formats that need a
framework, which is imported only then. Each returns the report as a dict
(printed with ``--json``) and as text.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import stat
import struct
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Callable

from acp import _acp
from acp._acp import CheckpointCorrupt, CheckpointNotFound, InvalidInput

Progress = Callable[[str, int, int], object]


def export(
    root: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    step: int | None,
    rank: int | None,
    format: str,
    progress: Progress | None = None,
) -> tuple[dict[str, Any], str]:
    """Writes a step of ``root`` (the newest when None) to ``out`` as a
    ``torch.save`` file or a MindSpore ``.ckpt``, every byte verified first
    (a corrupt step is refused and nothing is written)."""
    if format not in ("torch", "mindspore"):
        raise InvalidInput(f"export: format {format!r}: convert writes 'torch' or 'mindspore'")
    _refuse_special(out)
    t0 = time.monotonic()
    info = json.loads(_acp.ops_inspect(root, step).json)
    step = int(info["step"])
    ranks = sorted(int(f["rank"]) for f in info["files"])
    if rank is not None:
        if rank not in ranks:
            raise CheckpointNotFound(f"rank {rank}'s file in step {step}: not found")
        ranks = [rank]
    with tempfile.TemporaryDirectory(prefix=".acp-export-", dir=_parent(out)) as tmp:
        states = {}
        for r in ranks:
            path = Path(tmp) / f"rank{r}.safetensors"
            # Verified byte for byte: a corrupt step stops here.
            _acp.ops_export(root, path, step, r, False, progress)
            states[r] = read_safetensors(path)
        if format == "torch":
            write_torch(states, out, Path(tmp))
        else:
            write_mindspore(states, out, Path(tmp))
    tensors = sum(len(s.tensors) for s in states.values())
    data = {
        "root": info["root"],
        "step": step,
        "out": os.fspath(out),
        "format": format,
        "ranks": ranks,
        "tensors": tensors,
        "bytes": os.path.getsize(out),
        "secs": time.monotonic() - t0,
    }
    text = (
        f"exported step {step} ({tensors} tensor(s), rank(s) {ranks}) to {os.fspath(out)} "
        f"as {format}"
    )
    return data, text


def import_files(
    files: Sequence[str | os.PathLike[str]],
    root: str | os.PathLike[str],
    *,
    step: int,
    format: str,
    force: bool,
    shm_dir: str | os.PathLike[str],
    progress: Progress | None = None,
) -> tuple[dict[str, Any], str]:
    """Commits torch state dicts (read with ``weights_only=True``: no
    pickled code runs) or MindSpore ``.ckpt`` files as ``step`` of
    ``root``."""
    del progress  # the save is one copy; nothing long to draw
    if format not in ("torch", "mindspore"):
        raise InvalidInput(f"import: format {format!r}: convert reads 'torch' or 'mindspore'")
    t0 = time.monotonic()
    names = [os.fspath(f) for f in files]
    state = read_torch(names) if format == "torch" else read_mindspore(names)
    stats = save_state(state, os.fspath(root), step, force, os.fspath(shm_dir))
    data = {
        "root": os.fspath(Path(root).resolve()),
        "step": step,
        "files": names,
        "format": format,
        "tensors": stats.tensors,
        "bytes": stats.bytes,
        "secs": time.monotonic() - t0,
    }
    text = (
        f"imported {stats.tensors} tensor(s) from {len(names)} {format} file(s) as step "
        f"{step} of {os.fspath(root)}"
    )
    return data, text


def _parent(path: str | os.PathLike[str]) -> str:
    return os.path.dirname(os.path.abspath(path))


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
    _publish(scratch, out)


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
        for key, v in plain_scalars(s.values_json):
            appended.setdefault(key, v)
    scratch = tmp / "out.ckpt"
    write_ckpt(tensors, scratch, format="ckpt", append=appended or None)
    _publish(scratch, out)


def _publish(scratch: Path, out: str | os.PathLike[str]) -> None:
    """Renames ``scratch`` (beside ``out``) to ``out``: a symlink or file at
    ``out`` is replaced, never followed (a link to a directory would have
    put the file inside it), as the safetensors export does; anything else
    there (a device such as ``/dev/null``, a FIFO) is refused, not
    replaced."""
    _refuse_special(out)
    os.replace(scratch, out)


def _refuse_special(out: str | os.PathLike[str]) -> None:
    """``InvalidInput`` when ``out`` exists and is neither a regular file
    nor a symlink (the safetensors export's rule)."""
    try:
        mode = os.lstat(out).st_mode
    except FileNotFoundError:
        return
    if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
        raise InvalidInput(
            f"{os.fspath(out)}: is not a regular file (a directory, device, FIFO or socket): "
            "export writes a new file; name a path for it"
        )


def plain_scalars(values_json: str) -> list[tuple[str, Any]]:
    """The scalars (bools, ints, floats, strings) of a values tree as saved,
    by their dotted key path, from acp-core's plain-values view (the one
    the command line's ``inspect`` prints, with tensors, bytes and other
    leaves that are not plain JSON left out)."""
    return list(_flat_scalars(json.loads(_acp.plain_values(values_json, describe=False))))


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
            state = torch.load(f, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise CheckpointNotFound(f"{f}: not found") from None
        except Exception as e:  # torch raises UnpicklingError, RuntimeError, ...
            raise CheckpointCorrupt(
                f"{f}: not a torch state dict that loads with weights_only=True: {e}"
            ) from e
        _check_claims(state, f)
        states.append(state)
    return _merge(states, files)


# A state whose containers, expanded where the unpickler's memo shares
# them, hold more values than this cannot be saved: every value takes at
# least two bytes of the header's JSON, which is at most 100 MB.
_MAX_EXPANDED_VALUES = 50_000_000


def _check_claims(state: Any, f: str) -> None:
    """Refuses what ``state`` (read from ``f``) would make the import
    spend out of proportion to the file: a tensor that claims more bytes
    than its storage holds (a view repeating its elements, stride 0, lets
    a few bytes claim terabytes, which the ring would be sized by and the
    copy write out), a dict, list or tuple that holds itself (the
    unpickler's memo builds cycles, which never end a walk), and shared
    containers that expand to more values than a checkpoint can hold (a
    list held twice at each of 60 levels is 2^60 values). A container
    shared without a cycle is fine (an optimizer's param groups share
    their default ``betas`` tuple): the walk counts each one once."""
    import torch

    def items(obj: Any) -> Iterable[tuple[Any, Any]]:
        return obj.items() if isinstance(obj, dict) else enumerate(obj)

    expanded: dict[int, int] = {}  # id -> values it holds, once walked
    on_path: set[int] = set()
    stack: list[tuple[str, Any, bool]] = [("", state, False)]
    while stack:
        key, obj, leaving = stack.pop()
        if leaving:
            on_path.discard(id(obj))
            n = 1 + sum(expanded.get(id(v), 1) for _, v in items(obj))
            if n > _MAX_EXPANDED_VALUES:
                raise CheckpointCorrupt(
                    f"{f}: `{key or 'the state'}` holds more than {_MAX_EXPANDED_VALUES} "
                    "values once its shared containers are expanded, more than a "
                    "checkpoint can hold"
                )
            expanded[id(obj)] = n
            continue
        if isinstance(obj, torch.Tensor):
            held = obj.untyped_storage().nbytes() - obj.storage_offset() * obj.element_size()
            if obj.nbytes > held:
                raise CheckpointCorrupt(
                    f"{f}: tensor `{key}` claims {obj.nbytes} bytes but its storage in the file "
                    f"holds {max(held, 0)}: a view that repeats elements cannot be imported"
                )
            continue
        if not isinstance(obj, (dict, list, tuple)) or id(obj) in expanded:
            continue
        if id(obj) in on_path:
            raise CheckpointCorrupt(
                f"{f}: `{key or 'the state'}` is a {type(obj).__name__} that holds itself "
                "(a cycle), which acp cannot import"
            )
        on_path.add(id(obj))
        stack.append((key, obj, True))
        stack.extend((f"{key}.{k}" if key else str(k), v, False) for k, v in items(obj))


def read_mindspore(files: Sequence[str]) -> Any:
    """MindSpore checkpoints as ``{name: array}`` (or MindSpore tensors when
    acp's MindSpore adapter is installed)."""
    import mindspore as ms

    from acp.mindspore.conversion import read_ckpt

    native = importlib.util.find_spec("acp.mindspore") is not None
    states = []
    for f in files:
        if not os.path.exists(f):
            raise CheckpointNotFound(f"{f}: not found")
        params = read_ckpt(f)
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
