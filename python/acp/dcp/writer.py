"""The DCP ``StorageWriter`` (and ``AsyncStager``) that saves through acp."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
import uuid
from typing import Any

import torch
from torch.distributed.checkpoint import storage as _storage
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.futures import Future

from acp.checkpointer import gc_paused
from acp.dcp.engine import EngineRef, done_future, parse_step, valid_checkpoint_id
from acp.dcp.metadata import DCP_VERSION, METADATA_KEY, local_metadata, metadata_to_json
from acp.dcp.planner import Item, StagePlanner, resolve
from acp.torch import DTYPES, slot_tensor

__all__ = ["Stager", "StorageWriter"]


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
    items: list[Item] | None = None
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
        self._ref = EngineRef(target, engine_kwargs)
        self._next: int | None = None if step is None else parse_step(step)
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
            return done_future(list(staged.results))
        items = resolve(plan, planner, self._name_prefix())
        results = _write_results(items)
        if self._ref.world_size > 1:
            # Only the coordinator's finish() sees the global metadata: every
            # rank stages now, with the metadata of its own items.
            step = self._take_step(self._save.requested)
            self._save.requested = step
            metadata = local_metadata(plan, self.storage_meta())
            with gc_paused():
                handle = self._commit(step, items, metadata, [results])
            self._save.staged = _Staged(step, handle, metadata, results, {})
            return done_future(results)
        self._save.items, self._save.results = items, results
        return done_future(results)

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
            with gc_paused():
                handle = self._commit(step, items, metadata, results)
        if self._wait and handle is not None:
            self._record(step, handle.wait())

    def storage_meta(self) -> StorageMeta | None:
        step = self._save.requested if self._save.requested is not None else self._next
        return StorageMeta(checkpoint_id=None if step is None else str(step), save_id=self._save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return valid_checkpoint_id(checkpoint_id)

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
        with gc_paused():
            return self._stage(state_dict)

    def _stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        step = self._take_step(self._save.requested)
        self._save.requested = None
        planner = self._stage_planner or StagePlanner()
        meta = StorageMeta(checkpoint_id=str(step), save_id=self._save_id)
        planner.set_up_planner(state_dict=state_dict, storage_meta=meta, is_coordinator=True)
        local = self.prepare_local_plan(planner.create_local_plan())
        # Each rank plans alone here (no collective in the stall): its
        # metadata is its own items', as write_data's with several ranks.
        plans, metadata = planner.create_global_plan([local])
        final = planner.finish_plan(plans[0])
        items = resolve(final, planner, self._name_prefix())
        results = _write_results(items)
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
        items: list[Item],
        metadata: Metadata,
        results: list[list[_storage.WriteResult]],
    ) -> Any:
        """Lays out ``items`` in a ring slot, copies them in, ends the stall."""
        metadata.version = metadata.version or DCP_VERSION
        metadata.storage_data = {wr.index: wr.storage_data for rs in results for wr in rs}
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta(checkpoint_id=str(step), save_id=self._save_id)
        values = json.dumps({METADATA_KEY: metadata_to_json(metadata)})
        specs = [
            (it.name, DTYPES[it.data.dtype], tuple(it.data.shape))
            if it.data.dtype in DTYPES
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


def _write_results(items: list[Item]) -> list[_storage.WriteResult]:
    """DCP's write results for ``items``: each names the acp tensor holding it."""
    return [
        _storage.WriteResult(
            index=it.write.index,
            size_in_bytes=it.data.numel() * it.data.element_size(),
            storage_data=it.name,
        )
        for it in items
    ]


class _BytesPlaceholder:
    """Stands in for a non-tensor value already staged as DCP bytes."""

    __slots__ = ("fqn",)

    def __init__(self, fqn: str) -> None:
        self.fqn = fqn

    def __repr__(self) -> str:
        return f"<acp staged value {self.fqn!r}>"


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
        dst = slot_tensor(view, t.dtype, t.shape)
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
