"""The DCP ``StorageReader`` that loads through acp: from the resident ring
slot when one holds the step, else from storage."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import time
import traceback
import uuid
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint import storage as _storage
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from acp import _acp
from acp.checkpointer import gc_paused
from acp.dcp.engine import EngineRef, done_future, parse_step, valid_checkpoint_id
from acp.dcp.metadata import METADATA_KEY, metadata_from_json
from acp.dcp.planner import narrow, resolve_tensor
from acp.torch import DTYPES, slot_tensor

__all__ = ["StorageReader"]


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
        self._ref = EngineRef(target, engine_kwargs)
        self._step: int | None = None if step is None else parse_step(step)
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
        try:
            values = json.loads(loaded.values_json)
            if not isinstance(values, dict) or METADATA_KEY not in values:
                raise ValueError(
                    f"acp.dcp: step {step} in {self._ref.root} was not saved through "
                    "torch.distributed.checkpoint (no DCP metadata); load it with "
                    "acp.Checkpointer"
                )
            metadata = metadata_from_json(values[METADATA_KEY], step=step)
            names = {e[0]: i for i, e in enumerate(loaded.entries())}
            for idx, name in (metadata.storage_data or {}).items():
                if name not in names:
                    raise _acp.CheckpointCorrupt(
                        f"step {step}: DCP metadata: key `{idx.fqn}`: field "
                        f"`storage_data`: names tensor `{name}`, which the file does not hold"
                    )
        except BaseException:
            # The exception's traceback keeps this frame and its locals: the
            # load would live on (its engine handle keeping the ring locked
            # after close()) until a garbage collection.
            del loaded
            raise
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self._load_id
        self._loaded = loaded
        self._names = names
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
            md = metadata_from_json(values[METADATA_KEY], step=step, rank=r)
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
            with gc_paused():
                self._read_ranks(self._ranks_step, plan, planner)
            return done_future(None)
        loaded, self._loaded = self._loaded, None  # the slot is unpinned when this returns
        if loaded is None:
            raise RuntimeError("acp.dcp: read_data() before read_metadata()")
        with gc_paused():
            self._read_all(loaded, plan, planner)
        return done_future(None)

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
            # Deferred: the bytes are read and checked by the first
            # copy_into, on their way into the state dict's tensors.
            loaded = self._ref.engine.load(
                step=step, storage_only=self._storage_only, rank=r, tensors=names, defer=True
            )
            try:
                self._names = {e[0]: i for i, e in enumerate(loaded.entries())}
                self._read_all(loaded, dataclasses.replace(plan, items=groups[r]), planner)
                sources[r] = loaded.source
                nbytes += loaded.report()["bytes"]
            except BaseException as e:
                # The frames the exception's traceback keeps hold the load
                # too (`_read_all`'s): freed, so that it does not keep the
                # ring locked after close() until a garbage collection.
                traceback.clear_frames(e.__traceback__)
                raise
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
            _check_entry(loaded.step, req, md.properties.dtype, chunk_sizes, entries[i])
            target = resolve_tensor(planner, req).detach()
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
        # An item read through a view needs its entry's bytes kept by the
        # load, which a deferred copy_into of another rank's entry does not
        # keep: such an entry is read through views for every item.
        viewed = {self._entry(req) for req, _ in slow}
        slow += [(req, t) for req, t, i in fast if i in viewed]
        fast = [f for f in fast if f[2] not in viewed]
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
            src = slot_tensor(buf, md.properties.dtype, self._chunk_sizes(req, md))
            src = narrow(src, req.storage_offsets, req.lengths)
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
        return valid_checkpoint_id(checkpoint_id)

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


_TYPED_SINCE_V1 = frozenset(
    {
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint64,
        torch.uint32,
        torch.uint16,
        torch.uint8,
        torch.bool,
    }
)
"""The dtypes acp.dcp has always stored under their own safetensors dtype;
the others (complex64, the fnuz/e8m0 fp8s) were stored as raw ``U8`` bytes
before they had one, and such entries stay readable."""


def _check_entry(
    step: int,
    req: ReadItem,
    dtype: torch.dtype,
    chunk_sizes: Sequence[int],
    entry: tuple[str, str, Sequence[int], int],
) -> None:
    """Refuses a stored entry that does not hold the chunk the DCP metadata
    describes: another dtype (its bytes would be reinterpreted) or another
    byte size.

    Raises:
        acp.CheckpointCorrupt: naming the step, the key, the entry and both
            dtypes or sizes.
    """
    name, stored, shape, nbytes = entry
    code = DTYPES.get(dtype)
    raw = stored == "U8" and len(shape) == 1 and dtype not in _TYPED_SINCE_V1
    if stored != code and not raw:
        raise _acp.CheckpointCorrupt(
            f"step {step}: DCP key `{req.storage_index.fqn}`: its metadata says dtype "
            f"{dtype} ({code or 'raw bytes'}), but its stored tensor `{name}` has dtype "
            f"{stored}"
        )
    want = math.prod(chunk_sizes) * dtype.itemsize
    if nbytes != want:
        raise _acp.CheckpointCorrupt(
            f"step {step}: DCP key `{req.storage_index.fqn}`: its metadata says a chunk of "
            f"{tuple(chunk_sizes)} {dtype} ({want} bytes), but its stored tensor `{name}` "
            f"holds {nbytes} bytes"
        )


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
