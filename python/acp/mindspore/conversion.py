"""Conversion to and from MindSpore's own formats (``.ckpt``, ``.safetensors``)."""

from __future__ import annotations

import ctypes
import logging
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import mindspore
import numpy as np

from acp._acp import CheckpointCorrupt, CheckpointNotFound, InvalidInput
from acp._codec import Entry, parse
from acp._load import _Fresh, entries_of, run_transfers
from acp._mindspore_codec import DTYPES, INTS, dtype_from_safetensors, host_tensor, type_name
from acp.checkpointer import Checkpointer, _step, internals
from acp.mindspore.network import engine_load, entry_of, saved_params
from acp.mindspore.params import PARAMS, check_name, check_param_dict

__all__ = ["export_ckpt", "import_ckpt", "read_ckpt", "write_ckpt"]

log = logging.getLogger("acp.mindspore")


def _format_of(path: Path, fmt: str | None, what: str) -> str:
    if fmt is None:
        fmt = "safetensors" if path.suffix == ".safetensors" else "ckpt"
    if fmt not in ("ckpt", "safetensors"):
        raise InvalidInput(f"{what}: format {fmt!r}: MindSpore writes 'ckpt' or 'safetensors'")
    return fmt


def _open(
    ckpt: Checkpointer | str | os.PathLike[str], open_kwargs: Mapping[str, Any]
) -> tuple[Checkpointer, bool]:
    if isinstance(ckpt, Checkpointer):
        return ckpt, False
    return Checkpointer(ckpt, **open_kwargs), True


def export_ckpt(
    ckpt: Checkpointer | str | os.PathLike[str],
    dest: str | os.PathLike[str],
    *,
    step: int | None = None,
    format: str | None = None,
    rank: int | None = None,
    storage_only: bool = False,
    open_kwargs: Mapping[str, Any] | None = None,
) -> Path:
    """Writes a step (the newest when None) of an acp checkpoint as a
    MindSpore checkpoint file that ``mindspore.load_checkpoint`` reads;
    returns its path.

    ``ckpt`` is a ``Checkpointer`` or a checkpoint directory (opened with
    ``open_kwargs``, closed after). ``format`` is ``"ckpt"`` or
    ``"safetensors"`` (default: from ``dest``'s suffix, else ``"ckpt"``;
    MindSpore adds the suffix when ``dest`` lacks it). Parameters are named
    as ``load_into_net`` names them (``"params"`` entries by name, other
    states by dotted key path); top-level ints, floats, bools and strings go
    into the file as MindSpore's ``append_dict`` does (strings only into
    ``.ckpt``: MindSpore's safetensors cannot hold them). Works for checkpoints
    written from any framework; tensors become MindSpore tensors without
    importing that framework.
    """
    path = Path(dest)
    fmt = _format_of(path, format, "export_ckpt")
    opened, owned = _open(ckpt, open_kwargs or {})
    try:
        loaded = engine_load(opened, step, storage_only, False, rank)
        adapters = internals(opened).adapters
        entries = entries_of(loaded)
        fresh = _Fresh(loaded, adapters, entries)
        refs, rest = saved_params(parse(loaded.values_json, loaded.step), fresh.decoder)
        adapter = adapters.get("mindspore", "")
        names = list(refs)
        for name in names:
            check_name(name, f"export_ckpt: step {loaded.step}: tensor `{name}`")
        items: list[tuple[Entry, dict[str, Any]]] = [
            (entry_of(entries, refs[name], loaded.step), {}) for name in names
        ]
        tensors, transfer = adapter.new_tensors(loaded, items, None)
        run_transfers(loaded.copy_into, [transfer])
        append: dict[str, Any] = {}
        for k, node in rest:
            if not isinstance(k, str) or not (
                isinstance(node, (bool, str)) or type(node) in (int, float)
            ):
                continue
            if k in refs:
                raise InvalidInput(f"export_ckpt: `{k}` is both a parameter and a value")
            append[k] = node
        saved_step = loaded.step
        del loaded
        save_obj = [{"name": n, "data": t} for n, t in zip(names, tensors)]
        out = _save_ms(save_obj, path, fmt, append)
        log.info("exported step %d (%d tensors) to %s", saved_step, len(names), out)
        return out
    finally:
        if owned:
            opened.close()


def write_ckpt(
    tensors: Iterable[tuple[str, str, Sequence[int], Any]],
    dest: str | os.PathLike[str],
    *,
    format: str | None = None,
    append: Mapping[str, Any] | None = None,
) -> Path:
    """Writes named raw tensors as a MindSpore checkpoint file; returns its
    path. For tools that already hold the bytes (``acp export --to
    mindspore`` reads them from a verified safetensors export).

    ``tensors`` yields ``(name, safetensors dtype, shape, buffer)``; the
    buffer (bytes, memoryview, array...) holds the tensor's little-endian
    bytes. Every dtype acp stores keeps its type, bf16 and fp8 included.
    ``append`` holds scalar values (int, float, bool, str) for MindSpore's
    ``append_dict``. ``format`` as in ``export_ckpt``.

    Raises ``acp.InvalidInput`` naming the tensor for a name MindSpore
    would reject, a dtype it lacks, or a buffer of the wrong size.
    """
    path = Path(dest)
    fmt = _format_of(path, format, "write_ckpt")
    save_obj = []
    for name, dtype, dims, buffer in tensors:
        check_name(name, f"write_ckpt: tensor `{name}`")
        dtype_from_safetensors(dtype, f"write_ckpt: tensor `{name}`")
        src = np.frombuffer(buffer, dtype=np.uint8)
        shape = tuple(int(d) for d in dims)
        t, addr = host_tensor(dtype, shape)
        if src.size != int(t.nbytes):
            raise InvalidInput(
                f"write_ckpt: tensor `{name}`: {src.size} bytes for {dtype} {list(shape)} "
                f"({int(t.nbytes)} expected)"
            )
        if src.size:
            ctypes.memmove(addr, src.ctypes.data, src.size)
        save_obj.append({"name": name, "data": t})
    return _save_ms(save_obj, path, fmt, dict(append or {}))


def _save_ms(save_obj: list[dict[str, Any]], path: Path, fmt: str, append: dict[str, Any]) -> Path:
    """``mindspore.save_checkpoint``, replacing a read-only file it left."""
    c64 = [o["name"] for o in save_obj if DTYPES.get(o["data"].dtype) == "C64"]
    if c64:
        # It writes them, to .ckpt and .safetensors, and then fails to load
        # the whole file: refused rather than a file that cannot be read.
        raise InvalidInput(
            f"tensor `{c64[0]}`: MindSpore {mindspore.__version__} cannot read complex64 "
            "tensors back from its checkpoint files; keep them in acp's own checkpoints"
        )
    fp8 = [o["name"] for o in save_obj if DTYPES.get(o["data"].dtype) in ("F8_E4M3", "F8_E5M2")]
    if fp8 and fmt == "safetensors":
        raise InvalidInput(
            f"tensor `{fp8[0]}`: MindSpore {mindspore.__version__} cannot write fp8 tensors to "
            "safetensors (its NumPy has no fp8 type); export to .ckpt"
        )
    if fp8:
        log.warning(
            "tensor `%s`: MindSpore %s on the CPU writes fp8 to .ckpt but cannot read it back",
            fp8[0],
            mindspore.__version__,
        )
    for k, v in list(append.items()):
        if isinstance(v, str) and fmt == "safetensors":
            log.warning("MindSpore's safetensors cannot hold string `%s`; left out", k)
            del append[k]
        elif not isinstance(v, (bool, int, float, str)):
            raise InvalidInput(f"append `{k}`: a {type_name(v)} is not an int, float, bool or str")
    out = path if path.name.endswith(f".{fmt}") else path.with_name(f"{path.name}.{fmt}")
    if out.exists():
        out.chmod(0o600)  # MindSpore leaves its files read-only
    mindspore.save_checkpoint(save_obj, os.fspath(path), append_dict=append or None, format=fmt)
    return out


def read_ckpt(path: str | os.PathLike[str], fmt: str = "ckpt") -> dict[str, Any]:
    """``mindspore.load_checkpoint`` of a file from outside, checked first
    (a ``.ckpt``): MindSpore's loader pads a tensor whose bytes are fewer
    than its dims say with zeros, and sizes it by its dims, so a few bytes
    can claim terabytes. Each parameter's bytes must match its dims and
    type exactly.

    Raises:
        CheckpointCorrupt: naming the file (and the parameter) for a file
            that is not a MindSpore checkpoint or that MindSpore refuses.
    """
    name = os.fspath(path)
    if fmt == "ckpt":
        _check_ckpt_sizes(name)
    try:
        loaded: dict[str, Any] = mindspore.load_checkpoint(name, format=fmt)
    except (ValueError, TypeError, KeyError, RuntimeError) as e:
        raise CheckpointCorrupt(f"{name}: MindSpore cannot read it: {e}") from e
    return loaded


def _check_ckpt_sizes(name: str) -> None:
    """Refuses a ``.ckpt`` whose parameter bytes (the tensors of one tag,
    which MindSpore joins, with the dims of the last) differ from what
    their dims and type take. Strings and ``Int4`` (packed) are left to
    MindSpore, as are map parameters."""
    from google.protobuf.message import DecodeError  # type: ignore[import-untyped]
    from mindspore.common import dtype as mstype
    from mindspore.train.checkpoint_pb2 import Checkpoint
    from mindspore.train.serialization import tensor_to_ms_type

    data = Path(name).read_bytes()
    if data[-17:-10] == b"crc_num":  # MindSpore's CRC trailer
        data = data[:-17]
    proto = Checkpoint()
    try:
        proto.ParseFromString(data)
    except DecodeError as e:
        raise CheckpointCorrupt(f"{name}: not a MindSpore checkpoint: {e}") from e
    values = list(proto.value)
    for i, element in enumerate(values):
        if not element.HasField("tensor"):
            continue
        if i + 1 < len(values) and values[i + 1].tag == element.tag:
            continue  # MindSpore joins the run; the last element has its dims
        where = f"{name}: parameter `{element.tag}`"
        kind = element.tensor.tensor_type
        ms_type = tensor_to_ms_type.get(kind)
        if ms_type is None:
            raise CheckpointCorrupt(f"{where}: unknown tensor type {kind!r}")
        if kind in ("str", "Int4"):
            continue
        have = 0
        for j in range(i, -1, -1):
            if values[j].tag != element.tag:
                break
            have += len(values[j].tensor.tensor_content)
        dims = list(element.tensor.dims)
        numel = math.prod([] if dims == [0] else dims)
        want = numel * mstype.type_size_in_bytes(ms_type)
        if have != want:
            raise CheckpointCorrupt(f"{where}: {have} bytes for {kind} {dims} ({want} expected)")


def import_ckpt(
    src: str | os.PathLike[str],
    ckpt: Checkpointer | str | os.PathLike[str],
    step: int | None = None,
    *,
    format: str | None = None,
    overwrite: bool = False,
    open_kwargs: Mapping[str, Any] | None = None,
) -> int:
    """Saves a MindSpore ``.ckpt`` or ``.safetensors`` file as an acp step
    (committed when this returns); returns the step.

    Its parameters go under ``"params"`` (so ``load_into_net``, ``resume``
    and ``export_ckpt`` read it back); its string entries become plain
    values. ``step`` defaults to the file's ``step_num`` or ``step`` entry,
    else 0. ``format`` defaults to the suffix. ``ckpt`` is a
    ``Checkpointer`` or a checkpoint directory (opened with ``open_kwargs``).
    """
    path = Path(src)
    fmt = _format_of(path, format, "import_ckpt")
    if not path.is_file():
        raise CheckpointNotFound(f"import_ckpt: {path}: no such file")
    loaded = read_ckpt(path, fmt)
    params: dict[str, Any] = {}
    values: dict[str, Any] = {}
    for k, v in loaded.items():
        if isinstance(v, str):
            values[k] = v
        else:
            params[k] = v
    params = check_param_dict(params, f"import_ckpt: {path}")
    if step is None:
        for key in ("step_num", "step"):
            v = params.get(key)
            if v is not None and v.size == 1 and DTYPES.get(v.dtype) in INTS:
                step = int(v.asnumpy().reshape(-1)[0])
                break
    step = _step(0 if step is None else step)
    opened, owned = _open(ckpt, open_kwargs or {})
    try:
        opened.save(step, {PARAMS: params, **values}, overwrite=overwrite).wait()
    finally:
        if owned:
            opened.close()
    return step
