"""torch.distributed.checkpoint (DCP) storage plugins backed by acp.

``StorageWriter`` and ``StorageReader`` let ``dcp.save``, ``dcp.async_save``
and ``dcp.load`` keep their planners, resharding and state-dict handling while
acp does the storage: tensors are copied into a shared-memory ring slot, the
engine flushes, hashes and commits the step in the background, and a load
restores from the resident slot (RAM) when one holds the step, else from
storage::

    import torch.distributed.checkpoint as dcp
    import acp
    import acp.dcp

    ckpt = acp.Checkpointer("/mnt/ckpt/run1")
    writer = acp.dcp.StorageWriter(ckpt)
    dcp.save(state_dict, checkpoint_id=100, storage_writer=writer, no_dist=True)

    # async: the staging copy *is* the copy into the ring slot
    writer.reset(200)  # async_save hands checkpoint_id to the writer only after staging
    future = dcp.async_save(state_dict, storage_writer=writer, async_stager=acp.dcp.Stager(writer))
    future.result()  # committed

    reader = acp.dcp.StorageReader(ckpt)
    dcp.load(state_dict, checkpoint_id=200, storage_reader=reader, no_dist=True)

``checkpoint_id`` is the step: an ``int``, a string of digits, or the path of
a step directory under the checkpoint root (``<root>/step-000000000200``).

**Metadata without pickle.** DCP's ``FileSystemWriter`` pickles its
``Metadata``; this writer stores it as JSON among the checkpoint's values
(dtypes, sizes, chunks, tensor properties, the planner's flattening map and
the storage map), and the reader rebuilds the dataclasses from it. A value
JSON cannot hold (a custom planner's ``planner_data``, say) is refused at
save time with its key named.

**Non-tensor values are DCP's pickles, read with ``weights_only=True``.**
DCP's planner turns every non-tensor value of the state dict (``epoch``, an
optimizer's ``param_groups`` entries, ...) into ``torch.save`` bytes before
the storage layer sees it; acp stores those bytes as opaque ``uint8``
tensors. DCP's own planner would load them back with
``torch.load(weights_only=False)``, which runs whatever code a crafted
pickle names. So by default the reader first decodes each such entry itself
with ``torch.load(weights_only=True, map_location="cpu")`` (plain values,
containers and tensors only; anything else is refused with an error naming
the key) and hands the planner a fresh ``torch.save`` of that decoded value,
never the stored bytes: what the planner unpickles can hold only what
``weights_only`` allowed. Tensors inside such values come back on the CPU.
``StorageReader(..., load_bytes=False)`` refuses every such entry;
``StorageReader(..., allow_pickle=True)`` hands the stored bytes to the
planner unchanged, as DCP's ``FileSystemReader`` does: a checkpoint that
someone else could have written can then run arbitrary code in this process,
so pass it only for checkpoints you trust. ``acp.Checkpointer.save`` stores
plain values as JSON and needs neither.

**Several ranks, and resharding.** With a process group, give each rank a
writer on its own ``acp.Checkpointer`` (whose rank and world size come from
torch.distributed), and name the step with ``checkpoint_id``. Each rank's
``write_data`` copies its items (its shards; DCP's planner has already
given each replicated item to one rank) into its own acp file, whose values
hold the DCP metadata of those items; the engine commits the step once
every rank's file is durable (rank 0 assembles the index; coordination goes
through the checkpoint directory, never the process group). The reader
merges every rank's metadata (read from the verified headers only) and reads
each item from whichever rank's file holds it: its own from its ring slot,
another rank's from that rank's slot when it is resident on this node, else
from storage. So a checkpoint saved with one world size or sharding (FSDP,
DTensor, ...) loads into another, as DCP's planners arrange. Each item is
named ``rank{N}/`` + its key in the files. ``async_save`` stages each rank's
whole local state before DCP's planning runs, so replicated items are
written by every rank there (the reader takes one).

``AsyncCheckpointerType.PROCESS`` cannot carry the writer (its engine) to
another process; DCP's thread executor works.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import io
import json
import math
import os
import re
import threading
import time
import uuid
import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint import storage as _storage
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.staging import AsyncStager
from torch.futures import Future

from acp import _acp
from acp.checkpointer import Checkpointer, rank_and_world_size

__all__ = [
    "METADATA_KEY",
    "Stager",
    "StorageReader",
    "StorageWriter",
    "metadata_from_json",
    "metadata_to_json",
]

#: The key of acp's checkpoint values under which the DCP metadata is stored.
METADATA_KEY = "torch.distributed.checkpoint"
_FORMAT = "acp-dcp"
_FORMAT_VERSION = 1
#: The version DCP's own FileSystemWriter stamps on its metadata.
_DCP_VERSION = "1.0.0"
_STEP_DIR = re.compile(r"step-(\d{12,})")

# torch dtype -> safetensors name; other dtypes are stored as raw bytes (U8)
# and reinterpreted from the DCP metadata on load.
_ST_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _st in (
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
):
    if isinstance(getattr(torch, _name, None), torch.dtype):
        _ST_DTYPES[getattr(torch, _name)] = _st


# --------------------------------------------------------------------------- metadata as JSON


def _torch_attr(name: str, kind: type, what: str) -> Any:
    """``torch.<name>`` when it is a ``kind`` (a dtype, layout, memory format)."""
    short = name[len("torch.") :] if name.startswith("torch.") else name
    value = getattr(torch, short, None) if short.isidentifier() else None
    if not isinstance(value, kind):
        raise ValueError(f"DCP metadata: {what} {name!r} is not a torch {kind.__name__}")
    return value


def _plain(value: Any, where: str) -> Any:
    """``value`` as JSON-ready data, tuples tagged so they come back as tuples."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return {"__float__": repr(value)}
        return value
    if isinstance(value, tuple):
        return {"__tuple__": [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        if any(k.startswith("__") and k.endswith("__") for k in value):
            raise TypeError(f"DCP metadata: {where}: dunder keys are reserved")
        return {k: _plain(v, f"{where}.{k}") for k, v in value.items()}
    raise TypeError(
        f"DCP metadata: {where} is a {type(value).__name__}, which acp stores only as JSON "
        "(no pickle); use a planner whose planner_data holds plain values"
    )


def _unplain(value: Any) -> Any:
    if isinstance(value, list):
        return [_unplain(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {"__tuple__"}:
            return tuple(_unplain(v) for v in value["__tuple__"])
        if set(value) == {"__float__"}:
            return float(value["__float__"])
        return {k: _unplain(v) for k, v in value.items()}
    return value


def _ints(seq: Iterable[int] | None) -> list[int] | None:
    return None if seq is None else [int(x) for x in seq]


def _index_to_json(index: MetadataIndex) -> dict[str, Any]:
    return {"fqn": index.fqn, "offset": _ints(index.offset), "index": index.index}


def _index_from_json(d: dict[str, Any]) -> MetadataIndex:
    return MetadataIndex(d["fqn"], d.get("offset"), d.get("index"))


def _properties_to_json(p: TensorProperties) -> dict[str, Any]:
    return {
        "dtype": str(p.dtype),
        "layout": str(p.layout),
        "requires_grad": bool(p.requires_grad),
        "memory_format": str(p.memory_format),
        "pin_memory": bool(p.pin_memory),
        "strides": _ints(p.strides),
    }


def _properties_from_json(d: dict[str, Any]) -> TensorProperties:
    strides = d.get("strides")
    return TensorProperties(
        dtype=_torch_attr(d["dtype"], torch.dtype, "dtype"),
        layout=_torch_attr(d.get("layout", "torch.strided"), torch.layout, "layout"),
        requires_grad=bool(d.get("requires_grad", False)),
        memory_format=_torch_attr(
            d.get("memory_format", "torch.contiguous_format"), torch.memory_format, "memory format"
        ),
        pin_memory=bool(d.get("pin_memory", False)),
        strides=None if strides is None else tuple(int(s) for s in strides),
    )


def metadata_to_json(metadata: Metadata) -> dict[str, Any]:
    """DCP ``Metadata`` as JSON-ready data (no pickle anywhere).

    ``storage_data`` must map each ``MetadataIndex`` to the name of the acp
    tensor that holds it, as this module's writer leaves it.

    Raises:
        TypeError: naming the field that JSON cannot hold.
    """
    sdm: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            sdm[fqn] = {
                "type": "tensor",
                "properties": _properties_to_json(md.properties),
                "size": _ints(md.size),
                "chunks": [
                    {"offsets": _ints(c.offsets), "sizes": _ints(c.sizes)} for c in md.chunks
                ],
            }
        elif isinstance(md, BytesStorageMetadata):
            sdm[fqn] = {"type": "bytes"}
        else:
            raise TypeError(f"DCP metadata: `{fqn}` has unknown storage type {type(md).__name__}")
    storage = []
    for index, name in (metadata.storage_data or {}).items():
        if not isinstance(name, str):
            raise TypeError(f"DCP metadata: storage data of `{index.fqn}` is not an acp name")
        storage.append({"index": _index_to_json(index), "name": name})
    sm = metadata.storage_meta
    return {
        "format": _FORMAT,
        "format_version": _FORMAT_VERSION,
        "version": metadata.version,
        "state_dict_metadata": sdm,
        "planner_data": _plain(metadata.planner_data, "planner_data"),
        "storage_data": storage,
        "storage_meta": None
        if sm is None
        else {
            "checkpoint_id": None if sm.checkpoint_id is None else str(sm.checkpoint_id),
            "save_id": sm.save_id,
            "load_id": sm.load_id,
            "modules": list(sm.modules),
        },
    }


def metadata_from_json(data: dict[str, Any]) -> Metadata:
    """Rebuilds DCP ``Metadata`` from :func:`metadata_to_json`'s output.

    Raises:
        ValueError: for another format, a newer format version, or a field
            that names no torch dtype/layout/memory format.
    """
    if data.get("format") != _FORMAT:
        raise ValueError(f"DCP metadata: format {data.get('format')!r} is not {_FORMAT!r}")
    if int(data.get("format_version", 0)) > _FORMAT_VERSION:
        raise ValueError(
            f"DCP metadata: format version {data['format_version']} is newer than this acp "
            f"reads ({_FORMAT_VERSION}); upgrade acp"
        )
    sdm: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    for fqn, md in data["state_dict_metadata"].items():
        if md["type"] == "bytes":
            sdm[fqn] = BytesStorageMetadata()
        elif md["type"] == "tensor":
            sdm[fqn] = TensorStorageMetadata(
                properties=_properties_from_json(md["properties"]),
                size=torch.Size(md["size"]),
                chunks=[
                    ChunkStorageMetadata(
                        offsets=torch.Size(c["offsets"]), sizes=torch.Size(c["sizes"])
                    )
                    for c in md["chunks"]
                ],
            )
        else:
            raise ValueError(f"DCP metadata: `{fqn}` has unknown type {md['type']!r}")
    storage = {_index_from_json(e["index"]): e["name"] for e in data["storage_data"]}
    sm = data.get("storage_meta")
    return Metadata(
        state_dict_metadata=sdm,
        planner_data=_unplain(data.get("planner_data")),
        storage_data=storage,
        storage_meta=None
        if sm is None
        else StorageMeta(
            checkpoint_id=sm.get("checkpoint_id"),
            save_id=sm.get("save_id"),
            load_id=sm.get("load_id"),
            modules=list(sm.get("modules") or []),
        ),
        version=data.get("version"),
    )


# --------------------------------------------------------------------------- engine access


def _parse_step(checkpoint_id: Any) -> int:
    """The step a ``checkpoint_id`` names: an int, digits, or a step directory."""
    if isinstance(checkpoint_id, bool):
        raise ValueError(f"checkpoint_id {checkpoint_id!r} is not a step")
    if isinstance(checkpoint_id, int):
        step = checkpoint_id
    elif isinstance(checkpoint_id, str) and checkpoint_id.isdigit():
        step = int(checkpoint_id)
    elif isinstance(checkpoint_id, (str, os.PathLike)):
        name = os.path.basename(os.path.normpath(os.fspath(checkpoint_id)))
        m = _STEP_DIR.fullmatch(name)
        if m is None:
            raise ValueError(
                f"checkpoint_id {os.fspath(checkpoint_id)!r} is neither a step number nor a "
                "step directory `<root>/step-NNNNNNNNNNNN`"
            )
        step = int(m.group(1))
    else:
        raise ValueError(f"checkpoint_id {checkpoint_id!r} is not a step")
    if step < 0:
        raise ValueError(f"checkpoint_id {checkpoint_id!r}: steps are non-negative")
    return step


def _valid_checkpoint_id(checkpoint_id: Any) -> bool:
    try:
        _parse_step(checkpoint_id)
    except ValueError:
        return False
    return True


class _EngineRef:
    """The acp engine a writer or reader uses, whether it owns it, and the
    engine's rank and world size."""

    def __init__(self, target: Any, engine_kwargs: dict[str, Any]) -> None:
        self.owned = False
        self.engine: Any
        self.rank, self.world_size = 0, 1
        if isinstance(target, _acp.Engine):
            self.engine = target
        elif isinstance(target, Checkpointer):
            # The Checkpointer's engine: this writes DCP's layout, not the
            # Checkpointer's state codec, through the same ring and root.
            self.engine = target._engine
            self.rank, self.world_size = target.rank, target.world_size
        elif isinstance(target, (str, os.PathLike)):
            rank, world = rank_and_world_size()
            engine_kwargs.setdefault("rank", rank)
            engine_kwargs.setdefault("world_size", world)
            self.rank, self.world_size = engine_kwargs["rank"], engine_kwargs["world_size"]
            self.engine = _acp.Engine(os.fspath(target), **engine_kwargs)
            self.owned = True
        else:
            raise TypeError(
                "expected an acp.Checkpointer, an _acp.Engine or a checkpoint root path, "
                f"got {type(target).__name__}"
            )
        if engine_kwargs and not self.owned:
            raise TypeError("engine options apply only when a root path is given")
        self.root = os.fspath(self.engine.root)

    def check_rank(self, kwargs: dict[str, Any]) -> None:
        """Refuses a DCP rank other than the engine's: every rank needs a
        writer or reader on its own engine."""
        rank = kwargs.get("rank")
        if rank is not None and rank != self.rank:
            raise ValueError(
                f"acp.dcp: DCP runs this as rank {rank}, but the acp engine is rank "
                f"{self.rank} of {self.world_size}; give each rank its own acp.Checkpointer "
                "(it takes its rank from torch.distributed)"
            )

    def step_of(self, checkpoint_id: Any) -> int:
        """:func:`_parse_step`, also checking a path lies under this root."""
        step = _parse_step(checkpoint_id)
        if isinstance(checkpoint_id, os.PathLike) or (
            isinstance(checkpoint_id, str) and not checkpoint_id.isdigit()
        ):
            parent = os.path.dirname(os.path.normpath(os.path.abspath(os.fspath(checkpoint_id))))
            if os.path.realpath(parent) != os.path.realpath(self.root):
                raise ValueError(
                    f"checkpoint_id {os.fspath(checkpoint_id)!r} is not under this checkpoint "
                    f"root {self.root!r}"
                )
        return step

    def close(self) -> None:
        if self.owned and self.engine is not None:
            self.engine.close()
            # Dropping the engine releases its ring, so the job can be opened again.
            self.engine = None


def _storage_dtype(dtype: torch.dtype) -> str:
    return _ST_DTYPES.get(dtype, "U8")


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pauses the cyclic garbage collector for a stall. Planning allocates
    several objects per tensor, which triggers full collections that walk
    the whole heap (every tensor of the model): measured at a third of the
    stall for a state of 2,000 tensors. Nothing made here forms cycles."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _done_future(value: Any) -> Future[Any]:
    fut: Future[Any] = Future()
    fut.set_result(value)
    return fut


def _narrow(t: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    for dim, (off, n) in enumerate(zip(offsets, lengths)):
        if off != 0 or n != t.shape[dim]:
            t = t.narrow(dim, off, n)
    return t


def _reencoded(raw: bytes, fqn: str) -> io.BytesIO:
    """A fresh ``torch.save`` of what ``raw`` (a DCP byte entry) holds,
    decoded with ``weights_only=True``: the planner's
    ``torch.load(weights_only=False)`` of it can only rebuild objects that
    the restricted unpickler already accepted, never a global the stored
    bytes name.

    Raises:
        ValueError: naming ``fqn`` when ``weights_only`` refuses the bytes
            (a global it does not allow, or bytes that are no torch.save).
    """
    try:
        value = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
    except Exception as e:
        # torch's message is a multi-line advice to retry with
        # weights_only=False; keep only the line that says what was refused.
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        why = next((ln for ln in lines if "Unsupported" in ln), lines[-1] if lines else "")
        raise ValueError(
            f"acp.dcp: `{fqn}` is a DCP value that torch.load(weights_only=True) refuses "
            f"({type(e).__name__}: {why}); pass StorageReader(..., allow_pickle=True) only "
            "if you trust this checkpoint: unpickling it can run arbitrary code"
        ) from e
    out = io.BytesIO()
    torch.save(value, out)
    out.seek(0)
    return out


def _readonly_view(buf: memoryview, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """A tensor over read-only bytes; only ever read (the source of a copy)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        raw = torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else torch.empty(0)
    return raw.view(torch.uint8).view(dtype).reshape(tuple(shape))


# --------------------------------------------------------------------------- writer


@dataclasses.dataclass
class _Item:
    """One DCP write item resolved to its data, with its acp name."""

    write: WriteItem
    name: str
    data: torch.Tensor  # the chunk's tensor, or uint8 bytes of DCP's torch.save


@dataclasses.dataclass
class _Staged:
    """A save staged by :meth:`StorageWriter.stage`, waiting for DCP's save."""

    step: int
    handle: Any
    metadata: Metadata
    results: list[_storage.WriteResult]
    placeholders: dict[str, Any]


class _SaveState(threading.local):
    """Per-thread state of the save in progress (async_save runs it in a thread)."""

    requested: int | None = None
    items: list[_Item] | None = None
    results: list[_storage.WriteResult] | None = None
    staged: _Staged | None = None


class StorageWriter(_storage.StorageWriter, AsyncStager):
    """A DCP ``StorageWriter`` that saves through an acp engine.

    Args:
        target: an ``acp.Checkpointer`` or ``_acp.Engine`` to share, or a
            checkpoint root path (the writer then opens its own engine with
            ``engine_kwargs`` and closes it in :meth:`close`).
        step: the step of the next save; otherwise ``checkpoint_id`` names it,
            or the writer takes the step after the newest it knows.
        wait: make ``dcp.save`` (and ``async_save``'s future) return only once
            the step is committed (default). ``False`` returns once the bytes
            are in the ring: resident and restorable, not yet durable.
        overwrite: replace an already committed step.
        stage_planner: the planner :meth:`stage` plans with (default: DCP's
            ``DefaultSavePlanner``, with a faster path for plain tensors);
            pass the same kind you give ``async_save``.

    The writer is also DCP's ``AsyncStager``: ``dcp.async_save`` with this
    writer and no ``async_stager`` (or with ``Stager(writer)``) copies the
    state straight into a ring slot while the caller waits, which is all the
    stall there is; planning and the flush then run in the background.
    ``async_save`` hands its ``checkpoint_id`` to the writer only after
    staging, so name the step with ``step=`` or :meth:`reset` beforehand; a
    ``checkpoint_id`` that disagrees with the staged step fails the future.
    """

    _synchronize_after_execute = False  # stage() is synchronous

    def __init__(
        self,
        target: Any,
        *,
        step: int | None = None,
        wait: bool = True,
        overwrite: bool = False,
        stage_planner: SavePlanner | None = None,
        **engine_kwargs: Any,
    ) -> None:
        super().__init__()
        self._ref = _EngineRef(target, engine_kwargs)
        self._next: int | None = None if step is None else _parse_step(step)
        self._last: int | None = None
        self._wait = wait
        self._overwrite = overwrite
        self._stage_planner = stage_planner
        self._lock = threading.Lock()
        self._save = _SaveState()
        self._placeholders: dict[int, _Staged] = {}
        self._save_id = str(uuid.uuid4())
        #: Figures of the last save: step, stall_secs, and (once committed)
        #: the engine's report.
        self.last_save: dict[str, Any] | None = None

    # ---- DCP StorageWriter protocol

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Starts a new checkpoint; ``checkpoint_id`` names its step."""
        self._save_id = str(uuid.uuid4())
        self._save.items = self._save.results = self._save.staged = None
        self._save.requested = None
        if checkpoint_id is not None:
            self._save.requested = self._ref.step_of(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._ref.check_rank(kwargs)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if len(plans) != self._ref.world_size:
            raise ValueError(
                f"acp.dcp: {len(plans)} ranks save, but the acp engine was opened for a world "
                f"size of {self._ref.world_size}"
            )
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[Any]:
        staged = self._find_staged(plan, planner)
        if staged is not None:
            self._save.staged = staged
            return _done_future(list(staged.results))
        items = _resolve(plan, planner, self._name_prefix())
        results = [
            _storage.WriteResult(
                index=it.write.index,
                size_in_bytes=it.data.numel() * it.data.element_size(),
                storage_data=it.name,
            )
            for it in items
        ]
        if self._ref.world_size > 1:
            # Only the coordinator's finish() sees the global metadata: every
            # rank stages now, with the metadata of its own items.
            step = self._take_step(self._save.requested)
            self._save.requested = step
            metadata = _local_metadata(plan, self.storage_meta())
            with _gc_paused():
                handle = self._commit(step, items, metadata, [results])
            self._save.staged = _Staged(step, handle, metadata, results, {})
            return _done_future(results)
        self._save.items, self._save.results = items, results
        return _done_future(results)

    def finish(self, metadata: Metadata, results: list[list[_storage.WriteResult]]) -> None:
        state = self._save
        staged, state.staged = state.staged, None
        requested, state.requested = state.requested, None
        if staged is not None and not staged.placeholders:  # staged by write_data
            metadata.storage_data = {wr.index: wr.storage_data for rs in results for wr in rs}
            handle = staged.handle
            step = staged.step
        elif staged is not None:
            if requested is not None and requested != staged.step:
                if staged.handle is not None:
                    staged.handle.wait()  # the data is committed as the staged step
                raise ValueError(
                    f"acp.dcp: the state was staged as step {staged.step}, but async_save's "
                    f"checkpoint_id names step {requested}; call writer.reset({requested}) (or "
                    "pass step=) before async_save. Step "
                    f"{staged.step} holds the data."
                )
            # Give back the metadata that was stored, not the placeholders'.
            metadata.state_dict_metadata = staged.metadata.state_dict_metadata
            metadata.planner_data = staged.metadata.planner_data
            metadata.storage_data = staged.metadata.storage_data
            metadata.storage_meta = staged.metadata.storage_meta
            metadata.version = staged.metadata.version
            handle = staged.handle
            step = staged.step
        else:
            items, state.items = state.items, None
            if items is None:
                raise RuntimeError("acp.dcp: finish() without write_data()")
            step = self._take_step(requested)
            with _gc_paused():
                handle = self._commit(step, items, metadata, results)
        if self._wait and handle is not None:
            self._record(step, handle.wait())

    def storage_meta(self) -> StorageMeta | None:
        step = self._save.requested if self._save.requested is not None else self._next
        return StorageMeta(checkpoint_id=None if step is None else str(step), save_id=self._save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return _valid_checkpoint_id(checkpoint_id)

    @property
    def checkpoint_id(self) -> int | None:
        """The step the next save goes to, when known."""
        return self._next

    # ---- AsyncStager protocol

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Plans the save and copies the state into a ring slot (the stall).

        Returns placeholders (meta tensors) in place of the data, which DCP's
        background ``save`` then plans again and hands to :meth:`write_data`:
        nothing reads the training tensors after this returns.
        """
        with _gc_paused():
            return self._stage(state_dict)

    def _stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        step = self._take_step(self._save.requested)
        self._save.requested = None
        planner = self._stage_planner or _StagePlanner()
        meta = StorageMeta(checkpoint_id=str(step), save_id=self._save_id)
        planner.set_up_planner(state_dict=state_dict, storage_meta=meta, is_coordinator=True)
        local = self.prepare_local_plan(planner.create_local_plan())
        # Each rank plans alone here (no collective in the stall): its
        # metadata is its own items', as write_data's with several ranks.
        plans, metadata = planner.create_global_plan([local])
        final = planner.finish_plan(plans[0])
        items = _resolve(final, planner, self._name_prefix())
        results = [
            _storage.WriteResult(
                index=it.write.index,
                size_in_bytes=it.data.numel() * it.data.element_size(),
                storage_data=it.name,
            )
            for it in items
        ]
        metadata.storage_meta = meta
        handle = self._commit(step, items, metadata, [results])
        placeholders: dict[str, Any] = {}
        for it in items:
            fqn = it.write.index.fqn
            if it.write.type == WriteItemType.BYTE_IO:
                placeholders[fqn] = _BytesPlaceholder(fqn)
            elif fqn not in placeholders:
                md = metadata.state_dict_metadata[fqn]
                assert isinstance(md, TensorStorageMetadata)
                placeholders[fqn] = torch.empty(md.size, dtype=md.properties.dtype, device="meta")
        staged = _Staged(step, handle, metadata, results, placeholders)
        with self._lock:
            for obj in placeholders.values():
                self._placeholders[id(obj)] = staged
        return placeholders

    def synchronize_staging(self) -> None:
        """Nothing to do: :meth:`stage` returns once the copy is complete."""

    def close(self) -> None:
        """Closes the engine when the writer opened it."""
        self._ref.close()

    # ---- internals

    def _name_prefix(self) -> str:
        """Items' names are unique over all ranks' files (the step's index
        maps each to its file); with several ranks they carry the rank."""
        return f"rank{self._ref.rank}/" if self._ref.world_size > 1 else ""

    def _take_step(self, requested: int | None) -> int:
        with self._lock:
            if requested is not None:
                step = requested
            elif self._next is not None:
                step = self._next
            else:
                latest = self._ref.engine.latest()
                known = [s for s in (latest, self._last) if s is not None]
                step = max(known) + 1 if known else 0
            self._next = None
            self._last = step if self._last is None else max(self._last, step)
            return step

    def _find_staged(self, plan: SavePlan, planner: SavePlanner) -> _Staged | None:
        """The staged save whose placeholders ``planner`` is planning, if any."""
        with self._lock:
            if not self._placeholders:
                return None
        lookup = getattr(planner, "lookup_object", None)
        for item in plan.items:
            if lookup is not None:
                obj = lookup(item.index)
            elif item.type != WriteItemType.BYTE_IO:
                obj = planner.resolve_data(item)
            else:
                continue
            with self._lock:
                staged = self._placeholders.get(id(obj))
                if staged is not None and staged.placeholders.get(item.index.fqn) is obj:
                    for p in staged.placeholders.values():
                        self._placeholders.pop(id(p), None)
                    return staged
            return None
        return None

    def _commit(
        self,
        step: int,
        items: list[_Item],
        metadata: Metadata,
        results: list[list[_storage.WriteResult]],
    ) -> Any:
        """Lays out ``items`` in a ring slot, copies them in, ends the stall."""
        metadata.version = metadata.version or _DCP_VERSION
        metadata.storage_data = {wr.index: wr.storage_data for rs in results for wr in rs}
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta(checkpoint_id=str(step), save_id=self._save_id)
        values = json.dumps({METADATA_KEY: metadata_to_json(metadata)})
        specs = [
            (it.name, _storage_dtype(it.data.dtype), tuple(it.data.shape))
            if it.data.dtype in _ST_DTYPES
            else (it.name, "U8", (it.data.numel() * it.data.element_size(),))
            for it in items
        ]
        started = time.perf_counter()
        staging = self._ref.engine.begin_save(step, specs, values, overwrite=self._overwrite)
        if staging is None:  # no free slot and on_full="skip"
            self.last_save = {"step": step, "skipped": True}
            return None
        try:
            _copy_into_slot(staging, [it.data for it in items])
        except BaseException:
            staging.abort()
            raise
        handle = staging.finish()
        self.last_save = {"step": step, "stall_secs": time.perf_counter() - started}
        return handle

    def _record(self, step: int, report: dict[str, Any]) -> None:
        last = self.last_save if self.last_save and self.last_save.get("step") == step else {}
        self.last_save = {**report, **last, "committed": True}


def _local_metadata(plan: SavePlan, storage_meta: StorageMeta | None) -> Metadata:
    """The DCP metadata of one rank's items (its chunks of each tensor, its
    bytes entries, its planner data); a reader merges every rank's."""
    sdm: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    for wi in plan.items:
        fqn = wi.index.fqn
        td = wi.tensor_data
        if wi.type == WriteItemType.BYTE_IO or td is None:
            sdm[fqn] = BytesStorageMetadata()
            continue
        md = sdm.get(fqn)
        if not isinstance(md, TensorStorageMetadata):
            md = TensorStorageMetadata(properties=td.properties, size=td.size, chunks=[])
            sdm[fqn] = md
        md.chunks.append(td.chunk)
    return Metadata(
        state_dict_metadata=sdm,
        planner_data=plan.planner_data,
        storage_meta=storage_meta,
    )


class _BytesPlaceholder:
    """Stands in for a non-tensor value already staged as DCP bytes."""

    __slots__ = ("fqn",)

    def __init__(self, fqn: str) -> None:
        self.fqn = fqn

    def __repr__(self) -> str:
        return f"<acp staged value {self.fqn!r}>"


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _plain_tensor(obj: object) -> bool:
    """A tensor of exactly these types: not a DTensor, ShardedTensor or other
    subclass with its own checkpoint protocol."""
    return type(obj) in _PLAIN_TENSORS


def _tensor_item(fqn: str, t: torch.Tensor) -> WriteItem:
    """The write item DCP's default planner makes for a plain tensor."""
    offsets = torch.Size([0] * t.dim())
    return WriteItem(
        index=MetadataIndex(fqn, offsets),
        type=WriteItemType.TENSOR,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=offsets, sizes=t.size()),
            properties=TensorProperties.create_from_tensor(t),
            size=t.size(),
        ),
    )


class _StagePlanner(DefaultSavePlanner):
    """DCP's default planner, with its per-tensor checks for DTensors and
    other checkpointable types skipped for plain tensors: those checks are a
    runtime ``Protocol`` ``isinstance`` each, which dominates the stall of a
    state with thousands of tensors. Anything else takes DCP's own path."""

    def create_local_plan(self) -> SavePlan:
        items = []
        for fqn, obj in self.state_dict.items():
            if _plain_tensor(obj):
                items.append(_tensor_item(fqn, obj))
            elif isinstance(obj, torch.Tensor) or hasattr(obj, "__create_write_items__"):
                return super().create_local_plan()
            else:
                items.append(WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO))
        plan = SavePlan(items)
        if self.flatten_state_dict:
            plan = dataclasses.replace(plan, planner_data=self.mappings)
        self.plan = plan
        return plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        if write_item.type != WriteItemType.BYTE_IO:
            obj = self.state_dict.get(write_item.index.fqn)
            if _plain_tensor(obj):
                return obj  # type: ignore[return-value]
        return super().resolve_data(write_item)


def _resolve_one(planner: SavePlanner, wi: WriteItem) -> Any:
    """``planner.resolve_data(wi)``; for DCP's own default planner, a plain
    tensor is looked up directly (what its lookup returns, without the
    checks for checkpointable types)."""
    if type(planner) is DefaultSavePlanner and wi.type != WriteItemType.BYTE_IO:
        obj = planner.state_dict.get(wi.index.fqn)
        if _plain_tensor(obj):
            return obj
    return planner.resolve_data(wi)


def _resolve_tensor(planner: LoadPlanner, req: ReadItem) -> torch.Tensor:
    """``planner.resolve_tensor(req)``; for DCP's own default planner, a plain
    tensor is looked up and narrowed directly (what it does, without the
    checks for checkpointable types)."""
    if type(planner) is DefaultLoadPlanner:
        obj = planner.state_dict.get(req.dest_index.fqn)
        if _plain_tensor(obj):
            return _narrow(obj, req.dest_offsets, req.lengths)  # type: ignore[arg-type]
    return planner.resolve_tensor(req)


def _resolve(plan: SavePlan, planner: SavePlanner, prefix: str = "") -> list[_Item]:
    """Resolves every write item to the tensor (or DCP bytes) it stores,
    named ``prefix`` + its key (and chunk offsets)."""
    items: list[_Item] = []
    used: set[str] = set()
    for wi in plan.items:
        data = _resolve_one(planner, wi)
        if wi.type == WriteItemType.BYTE_IO:
            if not isinstance(data, io.BytesIO):
                raise TypeError(f"DCP gave {type(data).__name__} for bytes item `{wi.index.fqn}`")
            raw = data.getvalue()
            tensor = (
                torch.frombuffer(bytearray(raw), dtype=torch.uint8)
                if raw
                else torch.empty(0, dtype=torch.uint8)
            )
            name = wi.index.fqn
        else:
            if not isinstance(data, torch.Tensor):
                raise TypeError(f"DCP gave {type(data).__name__} for tensor `{wi.index.fqn}`")
            tensor = data.detach()
            td = wi.tensor_data
            name = wi.index.fqn
            if td is not None and (
                any(o != 0 for o in td.chunk.offsets) or tuple(td.chunk.sizes) != tuple(td.size)
            ):
                name += "@" + ",".join(str(o) for o in td.chunk.offsets)
        name = prefix + name
        base, n = name, 1
        while name in used:
            n += 1
            name = f"{base}#{n}"
        used.add(name)
        items.append(_Item(wi, name, tensor))
    return items


def _copy_into_slot(staging: Any, tensors: list[torch.Tensor]) -> None:
    """Copies every tensor into its slot bytes: contiguous CPU ones by address
    in one parallel Rust copy (GIL released), the rest (strided, on a device)
    through torch into a view of the slot."""
    direct = []
    other = []
    for i, t in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        if t.device.type == "cpu" and t.is_contiguous() and not t.is_conj() and not t.is_neg():
            direct.append((i, t.data_ptr() if nbytes else 0, nbytes))
        else:
            other.append(i)
    if direct:
        staging.copy_from(direct)
    for i in other:
        _copy_through_view(staging, i, tensors[i])


def _copy_through_view(staging: Any, i: int, t: torch.Tensor) -> None:
    """Copies ``t`` into slot tensor ``i`` with torch; the view and the tensor
    over it are gone when this returns, error or not."""
    view = staging.buffer(i)
    dst = None
    try:
        dst = torch.frombuffer(view, dtype=torch.uint8).view(t.dtype).reshape(t.shape)
        dst.copy_(t.resolve_conj().resolve_neg())
    finally:
        del dst
        view.release()
        del view


class Stager(AsyncStager):
    """The ``async_stager`` for ``dcp.async_save`` with an acp :class:`StorageWriter`.

    ``stage`` copies the state straight into a ring slot of the writer's
    engine (there is no second staging buffer); the writer, called by DCP's
    background save, then only waits for the commit. Equivalent to passing
    the writer itself, which is a stager too.
    """

    _synchronize_after_execute = False

    def __init__(self, writer: StorageWriter) -> None:
        if not isinstance(writer, StorageWriter):
            raise TypeError("Stager needs an acp.dcp.StorageWriter")
        self.writer = writer

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return self.writer.stage(state_dict)

    def synchronize_staging(self) -> None:
        """Nothing to do: staging is synchronous."""

    def close(self) -> None:
        """Nothing to free: the ring belongs to the writer's engine."""


# --------------------------------------------------------------------------- reader


class StorageReader(_storage.StorageReader):
    """A DCP ``StorageReader`` that loads through an acp engine: from the
    resident ring slot when one holds the step (RAM), else from storage.

    Args:
        target: an ``acp.Checkpointer`` or ``_acp.Engine``, or a root path
            (an engine is then opened with ``engine_kwargs``).
        step: the step to load; otherwise ``checkpoint_id``, else the newest
            committed step.
        storage_only: read from storage even when the step is resident.
        load_bytes: load non-tensor entries (DCP's ``torch.save`` bytes).
            ``False`` refuses every such entry, naming its key.
        allow_pickle: hand the stored bytes of non-tensor entries to DCP's
            planner unchanged; its ``load_bytes`` unpickles them with
            ``torch.load(weights_only=False)``, so **a crafted checkpoint
            runs arbitrary code in this process**: only for checkpoints you
            trust. By default (``False``) each entry is decoded with
            ``torch.load(weights_only=True, map_location="cpu")``, refused
            with an error naming its key when that refuses it, and the
            planner gets a fresh ``torch.save`` of the decoded value.

    After a load, :attr:`last_load` holds its figures (``source`` is
    ``"ram"`` or ``"storage"``, ``"mixed"`` when several ranks' files were
    read from different places; ``ranks`` then says where each came from).
    """

    def __init__(
        self,
        target: Any,
        *,
        step: int | None = None,
        storage_only: bool = False,
        load_bytes: bool = True,
        allow_pickle: bool = False,
        **engine_kwargs: Any,
    ) -> None:
        super().__init__()
        self._ref = _EngineRef(target, engine_kwargs)
        self._step: int | None = None if step is None else _parse_step(step)
        self._storage_only = storage_only
        self._load_bytes = load_bytes
        self._allow_pickle = allow_pickle
        self._loaded: Any = None
        self._names: dict[str, int] = {}
        self._storage_data: dict[MetadataIndex, str] = {}
        self._sdm: dict[str, Any] = {}
        self._load_id = str(uuid.uuid4())
        # Several ranks' files: the step, and which rank's file holds each item.
        self._ranks_step: int | None = None
        self._holder: dict[MetadataIndex, int] = {}
        self.last_load: dict[str, Any] | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._loaded = None
        self._names = {}
        self._storage_data = {}
        self._ranks_step = None
        self._holder = {}
        self._load_id = str(uuid.uuid4())
        if checkpoint_id is not None:
            self._step = self._ref.step_of(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        self._ref.check_rank(kwargs)
        started = time.perf_counter()
        engine = self._ref.engine
        step = self._step if self._step is not None else engine.latest()
        if step is None:
            raise _acp.CheckpointNotFound(f"committed checkpoint in {self._ref.root}: not found")
        index = json.loads(engine.index_json(step))
        files = index.get("metadata", {}).get("acp", {}).get("files", {})
        ranks = sorted({int(f["rank"]) for f in files.values()})
        if ranks != [self._ref.rank]:
            return self._read_rank_metadata(step, ranks, started)
        loaded = engine.load(step=step, storage_only=self._storage_only)
        values = json.loads(loaded.values_json)
        if not isinstance(values, dict) or METADATA_KEY not in values:
            raise ValueError(
                f"acp.dcp: step {loaded.step} in {self._ref.root} was not saved through "
                "torch.distributed.checkpoint (no DCP metadata); load it with acp.Checkpointer"
            )
        metadata = metadata_from_json(values[METADATA_KEY])
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self._load_id
        self._loaded = loaded
        self._names = {e[0]: i for i, e in enumerate(loaded.entries())}
        self.last_load = {**loaded.report(), "metadata_secs": time.perf_counter() - started}
        return metadata

    def _read_rank_metadata(self, step: int, ranks: list[int], started: float) -> Metadata:
        """Merges the DCP metadata of every rank's file of ``step`` (read from
        their verified headers) and notes which file holds each item: this
        rank's own when it holds it, else the lowest rank's."""
        sdm: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        storage: dict[MetadataIndex, str] = {}
        planner_data: dict[str, Any] = {}
        first: Metadata | None = None
        for r in ranks:
            values = json.loads(self._ref.engine.read_values(step, r))
            if not isinstance(values, dict) or METADATA_KEY not in values:
                raise ValueError(
                    f"acp.dcp: step {step} in {self._ref.root}: rank {r}'s file was not saved "
                    "through torch.distributed.checkpoint (no DCP metadata); load it with "
                    "acp.Checkpointer"
                )
            md = metadata_from_json(values[METADATA_KEY])
            first = first or md
            for idx, name in (md.storage_data or {}).items():
                if idx not in self._holder or r == self._ref.rank:
                    self._holder[idx] = r
                    storage[idx] = name
            for fqn, m in md.state_dict_metadata.items():
                have = sdm.get(fqn)
                if have is None:
                    sdm[fqn] = (
                        dataclasses.replace(m, chunks=list(m.chunks))
                        if isinstance(m, TensorStorageMetadata)
                        else m
                    )
                elif isinstance(have, TensorStorageMetadata) and isinstance(
                    m, TensorStorageMetadata
                ):
                    known = {tuple(c.offsets) for c in have.chunks}
                    have.chunks.extend(c for c in m.chunks if tuple(c.offsets) not in known)
            if isinstance(md.planner_data, dict):
                planner_data.update(md.planner_data)
        assert first is not None
        meta = first.storage_meta or StorageMeta()
        meta.load_id = self._load_id
        self._ranks_step = step
        self.last_load = {
            "step": step,
            "files": len(ranks),
            "metadata_secs": time.perf_counter() - started,
        }
        return Metadata(
            state_dict_metadata=sdm,
            planner_data=planner_data or first.planner_data,
            storage_data=storage,
            storage_meta=meta,
            version=first.version,
        )

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self._ref.check_rank(kwargs)
        self._storage_data = dict(metadata.storage_data or {})
        self._sdm = metadata.state_dict_metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[Any]:
        if self._ranks_step is not None:
            with _gc_paused():
                self._read_ranks(self._ranks_step, plan, planner)
            return _done_future(None)
        loaded, self._loaded = self._loaded, None  # the slot is unpinned when this returns
        if loaded is None:
            raise RuntimeError("acp.dcp: read_data() before read_metadata()")
        with _gc_paused():
            self._read_all(loaded, plan, planner)
        return _done_future(None)

    def _read_ranks(self, step: int, plan: LoadPlan, planner: LoadPlanner) -> None:
        """Reads each item from the file that holds it, one file at a time
        (this rank's first): from its slot when resident on this node."""
        started = time.perf_counter()
        groups: dict[int, list[ReadItem]] = {}
        for req in plan.items:
            holder = self._holder.get(req.storage_index)
            if holder is None:
                self._entry(req)  # raises, naming the item
                continue
            groups.setdefault(holder, []).append(req)
        sources: dict[int, str] = {}
        nbytes = 0
        for r in sorted(groups, key=lambda r: (r != self._ref.rank, r)):
            # This rank's own file is loaded whole (from its ring slot when
            # resident); of another's, only the chunks under the wanted items.
            names = None
            if r != self._ref.rank:
                names = sorted({self._storage_data[req.storage_index] for req in groups[r]})
            loaded = self._ref.engine.load(
                step=step, storage_only=self._storage_only, rank=r, tensors=names
            )
            try:
                self._names = {e[0]: i for i, e in enumerate(loaded.entries())}
                self._read_all(loaded, dataclasses.replace(plan, items=groups[r]), planner)
                sources[r] = loaded.source
                nbytes += loaded.report()["bytes"]
            finally:
                del loaded
        kinds = set(sources.values())
        self.last_load = {
            **(self.last_load or {}),
            "source": kinds.pop() if len(kinds) == 1 else "mixed",
            "ranks": sources,
            "bytes": nbytes,
            "copy_secs": time.perf_counter() - started,
        }

    def _read_all(self, loaded: Any, plan: LoadPlan, planner: LoadPlanner) -> None:
        started = time.perf_counter()
        entries = loaded.entries()
        fast: list[tuple[ReadItem, torch.Tensor, int]] = []  # engine copies, in parallel
        fast_used: set[int] = set()
        slow: list[tuple[ReadItem, torch.Tensor | None]] = []
        for req in plan.items:
            i = self._entry(req)
            if req.type == LoadItemType.BYTE_IO:
                slow.append((req, None))
                continue
            md = self._sdm[req.storage_index.fqn]
            assert isinstance(md, TensorStorageMetadata)
            chunk_sizes = self._chunk_sizes(req, md)
            target = _resolve_tensor(planner, req).detach()
            whole = all(o == 0 for o in req.storage_offsets) and tuple(req.lengths) == tuple(
                chunk_sizes
            )
            if (
                whole
                and i not in fast_used
                and target.device.type == "cpu"
                and target.dtype == md.properties.dtype
                and target.is_contiguous()
                and tuple(target.shape) == tuple(chunk_sizes)
                and target.numel() * target.element_size() == entries[i][3]
            ):
                fast.append((req, target, i))
                fast_used.add(i)
            else:
                slow.append((req, target))
        if fast:
            loaded.copy_into(
                [(i, t.data_ptr() if entries[i][3] else 0, entries[i][3]) for _, t, i in fast]
            )
            for req, done, _ in fast:
                planner.commit_tensor(req, done)
        for req, maybe in slow:
            if maybe is None and not self._load_bytes:
                raise ValueError(
                    f"acp.dcp: `{req.storage_index.fqn}` is a pickled DCP value and "
                    "load_bytes=False refuses to unpickle it"
                )
            self._read_one(loaded, req, maybe, planner)
        if self.last_load is not None:
            self.last_load["copy_secs"] = time.perf_counter() - started

    def _read_one(
        self, loaded: Any, req: ReadItem, target: torch.Tensor | None, planner: LoadPlanner
    ) -> None:
        """Reads one item through a view of the slot. The view and any tensor
        over it are dropped before this returns, error or not: slot views
        must not outlive the call in a traceback's frames."""
        buf = loaded.buffer(self._entry(req))
        src = None
        try:
            if target is None:
                raw = bytes(buf)
                if self._allow_pickle:
                    planner.load_bytes(req, io.BytesIO(raw))
                else:
                    planner.load_bytes(req, _reencoded(raw, req.storage_index.fqn))
                return
            md = self._sdm[req.storage_index.fqn]
            assert isinstance(md, TensorStorageMetadata)
            src = _readonly_view(buf, md.properties.dtype, self._chunk_sizes(req, md))
            src = _narrow(src, req.storage_offsets, req.lengths)
            if target.shape != src.shape:
                raise ValueError(
                    f"acp.dcp: `{req.dest_index.fqn}`: checkpoint chunk has shape "
                    f"{tuple(src.shape)}, the state dict's tensor {tuple(target.shape)}"
                )
            target.copy_(src)
            planner.commit_tensor(req, target)
        finally:
            del src
            buf.release()
            del buf

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return _valid_checkpoint_id(checkpoint_id)

    @property
    def checkpoint_id(self) -> int | None:
        """The step to load (None: the newest committed)."""
        return self._step

    def close(self) -> None:
        """Closes the engine when the reader opened it."""
        self._loaded = None
        self._ref.close()

    def _entry(self, req: ReadItem) -> int:
        name = self._storage_data.get(req.storage_index)
        if name is None or name not in self._names:
            raise ValueError(
                f"acp.dcp: `{req.storage_index.fqn}` (offset {req.storage_index.offset}) is "
                "not in the checkpoint"
            )
        return self._names[name]

    @staticmethod
    def _chunk_sizes(req: ReadItem, md: TensorStorageMetadata) -> Sequence[int]:
        idx = req.storage_index
        if idx.index is not None and idx.index < len(md.chunks):
            chunk = md.chunks[idx.index]
            if idx.offset is None or tuple(chunk.offsets) == tuple(idx.offset):
                return chunk.sizes
        for chunk in md.chunks:
            if idx.offset is None or tuple(chunk.offsets) == tuple(idx.offset):
                return chunk.sizes
        raise ValueError(f"acp.dcp: no chunk of `{idx.fqn}` at offset {idx.offset}")
