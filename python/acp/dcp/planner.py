"""Resolving DCP's plans to the tensors they name, with a fast path for
plain tensors through DCP's default planners."""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

__all__ = ["Item", "StagePlanner", "narrow", "resolve", "resolve_tensor"]


@dataclasses.dataclass
class Item:
    """One DCP write item resolved to its data, with its acp name."""

    write: WriteItem
    name: str
    data: torch.Tensor  # the chunk's tensor, or uint8 bytes of DCP's torch.save


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


class StagePlanner(DefaultSavePlanner):
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


def resolve_tensor(planner: LoadPlanner, req: ReadItem) -> torch.Tensor:
    """``planner.resolve_tensor(req)``; for DCP's own default planner, a plain
    tensor is looked up and narrowed directly (what it does, without the
    checks for checkpointable types)."""
    if type(planner) is DefaultLoadPlanner:
        obj = planner.state_dict.get(req.dest_index.fqn)
        if _plain_tensor(obj):
            return narrow(obj, req.dest_offsets, req.lengths)  # type: ignore[arg-type]
    return planner.resolve_tensor(req)


def resolve(plan: SavePlan, planner: SavePlanner, prefix: str = "") -> list[Item]:
    """Resolves every write item to the tensor (or DCP bytes) it stores,
    named ``prefix`` + its key (and chunk offsets)."""
    items: list[Item] = []
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
        items.append(Item(wi, name, tensor))
    return items


def narrow(t: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    for dim, (off, n) in enumerate(zip(offsets, lengths)):
        if off != 0 or n != t.shape[dim]:
            t = t.narrow(dim, off, n)
    return t
