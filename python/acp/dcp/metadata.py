"""DCP ``Metadata`` as JSON and back (no pickle), and the metadata of one
rank's share of a save."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

__all__ = [
    "DCP_VERSION",
    "METADATA_KEY",
    "local_metadata",
    "metadata_from_json",
    "metadata_to_json",
]

#: The key of acp's checkpoint values under which the DCP metadata is stored.
METADATA_KEY = "torch.distributed.checkpoint"
_FORMAT = "acp-dcp"
_FORMAT_VERSION = 1
#: The version DCP's own FileSystemWriter stamps on its metadata.
DCP_VERSION = "1.0.0"


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


_HAS_STRIDES = "strides" in {f.name for f in dataclasses.fields(TensorProperties)}
"""torch 2.12 and later record a tensor's strides in its DCP properties."""


def _properties_to_json(p: TensorProperties) -> dict[str, Any]:
    return {
        "dtype": str(p.dtype),
        "layout": str(p.layout),
        "requires_grad": bool(p.requires_grad),
        "memory_format": str(p.memory_format),
        "pin_memory": bool(p.pin_memory),
        "strides": _ints(getattr(p, "strides", None)),
    }


def _properties_from_json(d: dict[str, Any]) -> TensorProperties:
    strides = d.get("strides")
    extra: dict[str, Any] = {}
    if _HAS_STRIDES:
        extra["strides"] = None if strides is None else tuple(int(s) for s in strides)
    return TensorProperties(
        dtype=_torch_attr(d["dtype"], torch.dtype, "dtype"),
        layout=_torch_attr(d.get("layout", "torch.strided"), torch.layout, "layout"),
        requires_grad=bool(d.get("requires_grad", False)),
        memory_format=_torch_attr(
            d.get("memory_format", "torch.contiguous_format"), torch.memory_format, "memory format"
        ),
        pin_memory=bool(d.get("pin_memory", False)),
        **extra,
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


def local_metadata(plan: SavePlan, storage_meta: StorageMeta | None) -> Metadata:
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
