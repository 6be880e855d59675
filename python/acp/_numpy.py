"""NumPy support: arrays and NumPy scalars in checkpoint states.

Imported by acp when a state holds a NumPy value (``np.random.get_state()``
holds an array, for one). Arrays are copied by the engine from their
addresses; a non-contiguous or big-endian array is first made a contiguous
little-endian copy. NumPy scalars (``np.float32(1.5)``) come back as NumPy
scalars of the same dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from acp._acp import InvalidInput
from acp._codec import Entry, TensorInfo, Transfer, check_host_disjoint

DTYPES: dict[str, str] = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint64": "U64",
    "uint32": "U32",
    "uint16": "U16",
    "uint8": "U8",
    "bool": "BOOL",
    "complex64": "C64",
}
"""NumPy dtype name -> safetensors dtype name."""

_FROM_NAME = {st: np.dtype(name) for name, st in DTYPES.items()}


def _where(key: str) -> str:
    return f"key `{key}`" if key else "the state"


def _address(a: np.ndarray[Any, Any]) -> int:
    return int(a.__array_interface__["data"][0])


class Adapter:
    """The codec adapter for NumPy (see ``acp._codec.Adapter``)."""

    framework = "numpy"

    def describe(self, obj: object, key: str) -> TensorInfo | None:
        scalar = isinstance(obj, np.generic)
        if not scalar and type(obj) is not np.ndarray:
            if isinstance(obj, np.ndarray):
                kind = type(obj)
                raise InvalidInput(
                    f"{_where(key)}: ndarray subclass `{kind.__module__}.{kind.__qualname__}` "
                    "is not supported"
                )
            return None
        a = np.asarray(obj)
        name = DTYPES.get(a.dtype.name) if a.dtype.kind in "biufc" else None
        if name is None:
            raise InvalidInput(f"{_where(key)}: NumPy dtype {a.dtype} has no safetensors name")
        meta: dict[str, Any] = {"scalar": True} if scalar else {}
        alias = None
        if a.nbytes and not scalar:
            alias = (_address(a), a.shape, a.strides, a.dtype.str)
        return TensorInfo(name, tuple(a.shape), int(a.nbytes), alias, meta)

    def encode_value(self, obj: object, key: str) -> Any:
        if isinstance(obj, np.dtype) and obj.fields is None and obj.kind in "biufc":
            return {"kind": "dtype", "v": obj.str}
        kind = type(obj)
        raise InvalidInput(
            f"{_where(key)}: a value of type `{kind.__module__}.{kind.__qualname__}` "
            "cannot be saved"
        )

    def decode_value(self, kind: str, value: Any, key: str) -> object:
        if kind == "dtype":
            return np.dtype(value)
        raise InvalidInput(f"{_where(key)}: unknown NumPy value {kind}={value!r}")

    def stage(self, staging: Any, items: Sequence[tuple[int, object, TensorInfo]]) -> Transfer:
        transfer = Transfer()
        for index, obj, info in items:
            a = np.asarray(obj)
            if not a.dtype.isnative and a.dtype.byteorder != "|":
                a = a.astype(a.dtype.newbyteorder("="))
            a = np.ascontiguousarray(a)
            transfer.keep.append(a)
            transfer.host.append((index, _address(a) if info.nbytes else 0, info.nbytes))
        return transfer

    def new_tensors(
        self, loaded: Any, items: Sequence[tuple[Entry, dict[str, Any]]], map_location: Any
    ) -> tuple[list[object], Transfer]:
        transfer = Transfer()
        arrays = []
        for entry, _ in items:
            dtype = _FROM_NAME.get(entry.dtype)
            if dtype is None:
                raise InvalidInput(f"tensor `{entry.name}`: dtype {entry.dtype} has no NumPy type")
            a = np.empty(entry.shape, dtype=dtype)
            arrays.append(a)
            transfer.host.append((entry.index, _address(a) if entry.nbytes else 0, entry.nbytes))
        return list(arrays), transfer

    def result(self, obj: object, ref: dict[str, Any]) -> object:
        return obj[()] if ref.get("scalar") else obj  # type: ignore[index]

    def fill_tensors(
        self, loaded: Any, items: Sequence[tuple[Entry, object]], keys: Sequence[str]
    ) -> Transfer:
        transfer = Transfer()
        seen: dict[tuple[int, int], str] = {}
        for (entry, obj), key in zip(items, keys):
            a = obj
            if not isinstance(a, np.ndarray):
                raise InvalidInput(
                    f"into=: {_where(key)}: a NumPy scalar cannot be filled in place"
                )
            if not a.flags.writeable:
                raise InvalidInput(f"into=: {_where(key)}: the array is read-only")
            if not (a.flags.c_contiguous and a.dtype.isnative):
                raise InvalidInput(
                    f"into=: {_where(key)}: only C-contiguous, native-endian arrays "
                    "are filled in place"
                )
            if entry.nbytes == 0 or (entry.index, _address(a)) in seen:
                continue
            seen[entry.index, _address(a)] = key
            transfer.host.append((entry.index, _address(a), entry.nbytes))
        check_host_disjoint(transfer.host, seen)
        return transfer

    def forget_memory(self) -> None:
        pass

    def close(self) -> None:
        pass
