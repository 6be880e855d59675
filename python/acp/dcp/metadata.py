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

from acp._acp import CheckpointCorrupt

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


def _ints(seq: Iterable[int] | None) -> list[int] | None:
    return None if seq is None else [int(x) for x in seq]


def _index_to_json(index: MetadataIndex) -> dict[str, Any]:
    return {"fqn": index.fqn, "offset": _ints(index.offset), "index": index.index}


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


def _json_kind(value: object) -> str:
    """What a JSON value is, in words: for messages about a field of the wrong type."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, (int, float)):
        return f"the number {repr(value)[:64]}"
    if isinstance(value, str):
        return f"the string {value[:64]!r}"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


_MAX_INT = 2**63 - 1
"""The largest size, offset or stride torch.Size holds."""


class _Doc:
    """Reads one stored DCP metadata document, checking every field it
    reads: a hostile document is refused with ``CheckpointCorrupt`` naming
    the step, the DCP key and the field, never a raw KeyError or TypeError."""

    def __init__(self, origin: str) -> None:
        self.origin = origin

    def bad(self, fqn: str | None, field: str, what: str) -> CheckpointCorrupt:
        at = "" if fqn is None else f"key `{fqn}`: "
        return CheckpointCorrupt(f"{self.origin}DCP metadata: {at}field `{field}`: {what}")

    def obj(self, value: Any, fqn: str | None, field: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.bad(fqn, field, f"is {_json_kind(value)}, not an object")
        return value

    def get(self, d: dict[str, Any], name: str, fqn: str | None, field: str) -> Any:
        if name not in d:
            raise self.bad(fqn, field, "is missing")
        return d[name]

    def str_or_none(self, value: Any, fqn: str | None, field: str) -> str | None:
        if value is not None and not isinstance(value, str):
            raise self.bad(fqn, field, f"is {_json_kind(value)}, not a string")
        return value

    def flag(self, value: Any, fqn: str, field: str) -> bool:
        if not isinstance(value, bool):
            raise self.bad(fqn, field, f"is {_json_kind(value)}, not a boolean")
        return value

    def count(self, value: Any, fqn: str | None, field: str) -> int:
        """A non-negative int (a JSON boolean is none)."""
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.bad(fqn, field, f"is {_json_kind(value)}, not a non-negative integer")
        if not 0 <= value <= _MAX_INT:
            raise self.bad(fqn, field, f"{_json_kind(value)} is out of range (0 to {_MAX_INT})")
        return value

    def counts(self, value: Any, fqn: str, field: str) -> list[int]:
        if not isinstance(value, list):
            raise self.bad(fqn, field, f"is {_json_kind(value)}, not a list of integers")
        return [self.count(v, fqn, f"{field}[{i}]") for i, v in enumerate(value)]

    def torch_attr(self, value: Any, kind: type, fqn: str, field: str) -> Any:
        """``torch.<value>`` when it is a ``kind`` (a dtype, layout, memory format)."""
        if not isinstance(value, str):
            raise self.bad(fqn, field, f"is {_json_kind(value)}, not a torch {kind.__name__} name")
        try:
            return _torch_attr(value, kind, field.rpartition(".")[2].replace("_", " "))
        except ValueError as e:
            raise self.bad(fqn, field, str(e).removeprefix("DCP metadata: ")) from None

    def properties(self, value: Any, fqn: str) -> TensorProperties:
        d = self.obj(value, fqn, "properties")
        extra: dict[str, Any] = {}
        strides = d.get("strides")
        if strides is not None:
            strides = tuple(self.counts(strides, fqn, "properties.strides"))
        if _HAS_STRIDES:
            extra["strides"] = strides
        return TensorProperties(
            dtype=self.torch_attr(
                self.get(d, "dtype", fqn, "properties.dtype"), torch.dtype, fqn, "properties.dtype"
            ),
            layout=self.torch_attr(
                d.get("layout", "torch.strided"), torch.layout, fqn, "properties.layout"
            ),
            requires_grad=self.flag(d.get("requires_grad", False), fqn, "properties.requires_grad"),
            memory_format=self.torch_attr(
                d.get("memory_format", "torch.contiguous_format"),
                torch.memory_format,
                fqn,
                "properties.memory_format",
            ),
            pin_memory=self.flag(d.get("pin_memory", False), fqn, "properties.pin_memory"),
            **extra,
        )

    def tensor(self, md: dict[str, Any], fqn: str) -> TensorStorageMetadata:
        properties = self.properties(self.get(md, "properties", fqn, "properties"), fqn)
        size = self.counts(self.get(md, "size", fqn, "size"), fqn, "size")
        raw_chunks = self.get(md, "chunks", fqn, "chunks")
        if not isinstance(raw_chunks, list):
            raise self.bad(fqn, "chunks", f"is {_json_kind(raw_chunks)}, not a list")
        chunks = []
        for i, raw in enumerate(raw_chunks):
            at = f"chunks[{i}]"
            c = self.obj(raw, fqn, at)
            offsets = self.counts(
                self.get(c, "offsets", fqn, f"{at}.offsets"), fqn, f"{at}.offsets"
            )
            sizes = self.counts(self.get(c, "sizes", fqn, f"{at}.sizes"), fqn, f"{at}.sizes")
            for field, dims in ((f"{at}.offsets", offsets), (f"{at}.sizes", sizes)):
                if len(dims) != len(size):
                    raise self.bad(
                        fqn, field, f"has {len(dims)} dimension(s), the tensor {len(size)}"
                    )
            for dim, (o, n, whole) in enumerate(zip(offsets, sizes, size)):
                if o + n > whole:
                    raise self.bad(
                        fqn,
                        at,
                        f"offset {o} + size {n} at dimension {dim} exceeds the tensor's "
                        f"size {whole} (size {size})",
                    )
            chunks.append(
                ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            )
        return TensorStorageMetadata(properties=properties, size=torch.Size(size), chunks=chunks)

    def entry(self, fqn: str, md: Any) -> TensorStorageMetadata | BytesStorageMetadata:
        md = self.obj(md, fqn, "state_dict_metadata")
        kind = self.get(md, "type", fqn, "type")
        if kind == "bytes":
            return BytesStorageMetadata()
        if kind == "tensor":
            return self.tensor(md, fqn)
        raise self.bad(fqn, "type", f'{_json_kind(kind)} is neither "tensor" nor "bytes"')

    def storage(
        self, value: Any, sdm: dict[str, TensorStorageMetadata | BytesStorageMetadata]
    ) -> dict[MetadataIndex, str]:
        if not isinstance(value, list):
            raise self.bad(None, "storage_data", f"is {_json_kind(value)}, not a list")
        out: dict[MetadataIndex, str] = {}
        for i, raw in enumerate(value):
            at = f"storage_data[{i}]"
            e = self.obj(raw, None, at)
            index = self.obj(self.get(e, "index", None, f"{at}.index"), None, f"{at}.index")
            fqn = self.get(index, "fqn", None, f"{at}.index.fqn")
            if not isinstance(fqn, str):
                raise self.bad(None, f"{at}.index.fqn", f"is {_json_kind(fqn)}, not a string")
            md = sdm.get(fqn)
            if md is None:
                raise self.bad(fqn, f"{at}.index.fqn", "names no key of state_dict_metadata")
            offset = index.get("offset")
            if offset is not None:
                offset = self.counts(offset, fqn, f"{at}.index.offset")
                if not isinstance(md, TensorStorageMetadata):
                    raise self.bad(fqn, f"{at}.index.offset", "is set for a bytes entry")
                if all(list(c.offsets) != offset for c in md.chunks):
                    raise self.bad(fqn, f"{at}.index.offset", f"{offset} is no chunk's offsets")
            hint = index.get("index")
            if hint is not None:
                hint = self.count(hint, fqn, f"{at}.index.index")
            name = self.get(e, "name", fqn, f"{at}.name")
            if not isinstance(name, str):
                raise self.bad(fqn, f"{at}.name", f"is {_json_kind(name)}, not a tensor name")
            out[MetadataIndex(fqn, offset, hint)] = name
        return out

    def planner_data(self, value: Any, field: str = "planner_data") -> Any:
        """:func:`_unplain`, checking the tagged tuples and floats."""
        if isinstance(value, list):
            return [self.planner_data(v, f"{field}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, dict):
            if set(value) == {"__tuple__"}:
                items = value["__tuple__"]
                if not isinstance(items, list):
                    raise self.bad(
                        None, f"{field}.__tuple__", f"is {_json_kind(items)}, not a list"
                    )
                return tuple(self.planner_data(v, f"{field}[{i}]") for i, v in enumerate(items))
            if set(value) == {"__float__"}:
                text = value["__float__"]
                if text not in ("nan", "inf", "-inf"):
                    raise self.bad(
                        None, f"{field}.__float__", f"{_json_kind(text)} is not nan, inf or -inf"
                    )
                return float(text)
            return {k: self.planner_data(v, f"{field}.{k}") for k, v in value.items()}
        return value

    def storage_meta(self, value: Any) -> StorageMeta | None:
        if value is None:
            return None
        sm = self.obj(value, None, "storage_meta")
        modules = sm.get("modules") or []
        if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
            raise self.bad(None, "storage_meta.modules", "is not a list of strings")
        return StorageMeta(
            checkpoint_id=self.str_or_none(
                sm.get("checkpoint_id"), None, "storage_meta.checkpoint_id"
            ),
            save_id=self.str_or_none(sm.get("save_id"), None, "storage_meta.save_id"),
            load_id=self.str_or_none(sm.get("load_id"), None, "storage_meta.load_id"),
            modules=list(modules),
        )


def metadata_from_json(data: Any, *, step: int | None = None, rank: int | None = None) -> Metadata:
    """Rebuilds DCP ``Metadata`` from :func:`metadata_to_json`'s output,
    checking every field it reads.

    Args:
        data: the stored document.
        step: the step it was read from, and ``rank``, the rank whose file
            held it: both only name the document in errors.

    Raises:
        ValueError: for a newer format version.
        acp.CheckpointCorrupt: for anything else this module does not write,
            naming the step, the DCP key and the field: a missing field, one
            of the wrong type, a negative or out-of-range size or offset, a
            chunk past its tensor's size, a storage entry of an unknown key,
            a name that is no torch dtype/layout/memory format.
    """
    origin = "" if step is None else f"step {step}: "
    if rank is not None:
        origin = f"{origin}rank {rank}'s file: "
    doc = _Doc(origin)
    data = doc.obj(data, None, METADATA_KEY)
    if data.get("format") != _FORMAT:
        raise doc.bad(None, "format", f"{data.get('format')!r} is not {_FORMAT!r}")
    version = doc.count(data.get("format_version", 0), None, "format_version")
    if version > _FORMAT_VERSION:
        raise ValueError(
            f"{origin}DCP metadata: format version {version} is newer than this acp "
            f"reads ({_FORMAT_VERSION}); upgrade acp"
        )
    raw_sdm = doc.obj(
        doc.get(data, "state_dict_metadata", None, "state_dict_metadata"),
        None,
        "state_dict_metadata",
    )
    sdm = {fqn: doc.entry(fqn, md) for fqn, md in raw_sdm.items()}
    storage = doc.storage(doc.get(data, "storage_data", None, "storage_data"), sdm)
    return Metadata(
        state_dict_metadata=sdm,
        planner_data=doc.planner_data(data.get("planner_data")),
        storage_data=storage,
        storage_meta=doc.storage_meta(data.get("storage_meta")),
        version=doc.str_or_none(data.get("version"), None, "version"),
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
