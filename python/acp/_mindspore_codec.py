"""The MindSpore codec adapter and dtype table (used by ``acp.mindspore``,
which re-exports them; imported only with MindSpore)."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import mindspore
import mindspore.common.dtype as mstype
import numpy as np
from mindspore import Parameter, Tensor, mint

from acp._acp import InvalidInput
from acp._codec import Entry, TensorInfo, Transfer, check_host_disjoint

log = logging.getLogger("acp.mindspore")

# (safetensors name, mindspore.common.dtype attribute, NumPy dtype of the
# host buffer). bf16 and fp8 have no NumPy type: an unsigned integer of the
# same width holds their bytes.
_TABLE: list[tuple[str, str, type[np.generic]]] = [
    ("F64", "float64", np.float64),
    ("F32", "float32", np.float32),
    ("F16", "float16", np.float16),
    ("BF16", "bfloat16", np.uint16),
    ("F8_E4M3", "float8_e4m3fn", np.uint8),
    ("F8_E5M2", "float8_e5m2", np.uint8),
    ("I64", "int64", np.int64),
    ("I32", "int32", np.int32),
    ("I16", "int16", np.int16),
    ("I8", "int8", np.int8),
    ("U64", "uint64", np.uint64),
    ("U32", "uint32", np.uint32),
    ("U16", "uint16", np.uint16),
    ("U8", "uint8", np.uint8),
    ("BOOL", "bool_", np.bool_),
    ("C64", "complex64", np.complex64),
]

DTYPES: dict[Any, str] = {
    getattr(mstype, attr): name for name, attr, _ in _TABLE if hasattr(mstype, attr)
}
"""MindSpore dtype -> safetensors dtype name, for every dtype acp stores
that this MindSpore has."""

_FROM_NAME: dict[str, Any] = {name: dtype for dtype, name in DTYPES.items()}
_HOST_NP: dict[str, np.dtype[Any]] = {name: np.dtype(host) for name, _, host in _TABLE}
FLOATS = {"F64", "F32", "F16", "BF16"}
INTS = {"I64", "I32", "I16", "I8"}


def dtype_to_safetensors(dtype: Any) -> str:
    """The safetensors name of a MindSpore dtype; ``acp.InvalidInput`` for
    one acp cannot store (complex128, ``hifloat8``, ``int4``...)."""
    try:
        return DTYPES[dtype]
    except (KeyError, TypeError):
        raise InvalidInput(f"MindSpore dtype {dtype} has no safetensors name") from None


def dtype_from_safetensors(name: str, what: str = "") -> Any:
    """The MindSpore dtype of a safetensors dtype name; ``acp.InvalidInput``
    (naming ``what``) when this MindSpore has none."""
    dtype = _FROM_NAME.get(name)
    if dtype is None:
        prefix = f"{what}: " if what else ""
        raise InvalidInput(f"{prefix}dtype {name} has no MindSpore type in MindSpore {_version()}")
    return dtype


def _version() -> str:
    return str(getattr(mindspore, "__version__", "?"))


def _where(key: str) -> str:
    return f"key `{key}`" if key else "the state"


def type_name(obj: object) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


def on_host(t: Any) -> bool:
    """Whether the tensor's data is host memory that ``data_ptr()`` points
    to (the CPU backend)."""
    try:
        device = str(t.device)
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return False
    return device.upper().startswith("CPU")


def _address(a: np.ndarray[Any, Any]) -> int:
    return int(a.__array_interface__["data"][0])


def _host_copy(t: Any, name: str) -> np.ndarray[Any, Any]:
    """The tensor's bytes in a contiguous host array (a device-to-host copy
    for tensors on a device). bf16 and fp8 are viewed as unsigned integers
    first: NumPy has no such types."""
    host = _HOST_NP[name]
    if name in ("BF16", "F8_E4M3", "F8_E5M2"):
        t = t.view(mstype.uint16 if host.itemsize == 2 else mstype.uint8)
    return np.ascontiguousarray(t.asnumpy()).view(host)


def _numpy_bf16() -> np.dtype[Any] | None:
    """MindSpore's NumPy bfloat16 type, when this NumPy can use it (it needs
    the NumPy major version MindSpore was built with)."""
    try:
        dtype: np.dtype[Any] = np.dtype(mstype.np_bfloat16)
        if Tensor.from_numpy(np.zeros(1, dtype)).dtype == mstype.bfloat16:
            return dtype
    except (AttributeError, RuntimeError, TypeError, ValueError):
        pass
    return None


# The NumPy dtype whose arrays Tensor.from_numpy turns into each dtype.
_FROM_NUMPY: dict[str, np.dtype[Any]] = {
    name: np.dtype(host) for name, _, host in _TABLE if name not in ("BF16", "F8_E4M3", "F8_E5M2")
}
_BF16 = _numpy_bf16()
if _BF16 is not None:
    _FROM_NUMPY["BF16"] = _BF16


def host_tensor(name: str, shape: tuple[int, ...]) -> tuple[Any, int]:
    """A fresh host tensor of safetensors dtype ``name`` and its address,
    its memory not yet touched (the engine's copy faults each page in once).

    NumPy allocates it (``Tensor.from_numpy`` shares the array): that costs
    a few microseconds and gets transparent huge pages for large arrays,
    where ``mint.empty`` dispatches an operator and ``data_ptr()`` then
    waits for MindSpore's queue (milliseconds per tensor). fp8, which NumPy
    lacks, takes that path."""
    np_dtype = _FROM_NUMPY.get(name)
    if np_dtype is None:
        t = mint.empty(shape, dtype=_FROM_NAME[name], device="CPU")
        return t, int(t.data_ptr())
    a = np.empty(shape, dtype=np_dtype)
    return Tensor.from_numpy(a), _address(a)


def new_parameter(t: Any, name: str | None, requires_grad: bool, dtype: str) -> Any:
    """A Parameter whose data is ``t``'s memory. ``Parameter(t)`` copies
    (and a lazily initialised one is filled with zeros when created), so a
    one-element Parameter takes ``t`` with ``set_data``, which swaps the data
    without a copy. Where MindSpore cannot make a Parameter of that dtype at
    all (fp8 on the CPU backend), the tensor itself is returned, with a
    warning."""
    np_dtype = _FROM_NUMPY.get(dtype)
    if np_dtype is not None:
        p = Parameter(
            Tensor.from_numpy(np.zeros((), np_dtype)), name=name, requires_grad=requires_grad
        )
        p.set_data(t)
        return p
    try:
        return Parameter(t, name=name, requires_grad=requires_grad)
    except (KeyError, RuntimeError, TypeError, ValueError) as e:
        log.warning(
            "parameter `%s`: MindSpore %s cannot make a %s Parameter here (%s); "
            "restored as a Tensor",
            name,
            _version(),
            t.dtype,
            str(e).splitlines()[0] if str(e) else type(e).__name__,
        )
        return t


# --------------------------------------------------------------------------
# The codec adapter


_MAP_PARAMETER: dict[type, bool] = {}


def _is_map_parameter(cls: type) -> bool:
    known = _MAP_PARAMETER.get(cls)
    if known is None:
        known = _MAP_PARAMETER[cls] = any(c.__name__ == "MapParameter" for c in cls.__mro__)
    return known


class Assign:
    """Copies host buffers into tensors MindSpore manages itself (on a
    device, or non-contiguous): run after the engine filled the buffers."""

    def __init__(self, pairs: list[tuple[Any, Any]]) -> None:
        self.pairs = pairs  # (destination tensor, source tensor over a host buffer)

    def start(self) -> None:
        pass

    def wait(self) -> None:
        for dst, src in self.pairs:
            if isinstance(dst, Parameter):
                dst.set_data(src)
            else:
                dst.assign_value(src)
        self.pairs = []

    def close(self) -> None:
        self.pairs = []


class Convert:
    """After the engine filled ``src`` (the checkpoint's dtype), sets
    ``param`` to it converted to the parameter's dtype (as
    ``load_param_into_net`` does for float and int parameters)."""

    def __init__(self, pairs: list[tuple[Any, Any]]) -> None:
        self.pairs = pairs

    def start(self) -> None:
        pass

    def wait(self) -> None:
        for param, src in self.pairs:
            param.set_data(src.astype(param.dtype))
        self.pairs = []

    def close(self) -> None:
        self.pairs = []


class Adapter:
    """The codec adapter for MindSpore (see ``acp._codec.Adapter``)."""

    framework = "mindspore"

    def __init__(self) -> None:
        self._params: dict[int, tuple[Any, Any]] = {}  # id(tensor) -> (tensor, Parameter)

    # --- save -------------------------------------------------------------

    def describe(self, obj: object, key: str) -> TensorInfo | None:
        if not isinstance(obj, Tensor):
            return None
        t: Any = obj
        if _is_map_parameter(type(t)):
            raise InvalidInput(f"{_where(key)}: MapParameter is not supported")
        is_param = isinstance(t, Parameter)
        if is_param and t.has_init:
            t.init_data()
        name = DTYPES.get(t.dtype)
        if name is None:
            raise InvalidInput(
                f"{_where(key)}: MindSpore dtype {t.dtype} has no safetensors name "
                f"(acp stores {', '.join(sorted(_FROM_NAME))})"
            )
        shape = tuple(int(d) for d in t.shape)
        nbytes = math.prod(shape) * _HOST_NP[name].itemsize
        meta: dict[str, Any] = {}
        if is_param:
            meta["param"] = True
            meta["pname"] = t.name
            if not t.requires_grad:
                meta["rg"] = False
        alias: tuple[object, ...] | None = None
        if nbytes:
            # Two Parameter objects are two parameters even over one buffer.
            alias = (str(t.device), t.data_ptr(), shape, name, id(t) if is_param else None)
        return TensorInfo(name, shape, nbytes, alias, meta)

    def encode_value(self, obj: object, key: str) -> Any:
        if type(obj).__module__.startswith("mindspore._c_expression.typing"):
            text = repr(obj).removeprefix("mindspore.")
            if getattr(mstype, text, None) == obj:
                return {"kind": "dtype", "v": text}
        hint = ""
        if isinstance(obj, mindspore.nn.Cell):
            hint = " (save its parameters: acp.mindspore.param_dict(cell))"
        raise InvalidInput(
            f"{_where(key)}: a value of type `{type_name(obj)}` cannot be saved{hint}"
        )

    def decode_value(self, kind: str, value: Any, key: str) -> object:
        if kind == "dtype" and isinstance(value, str):
            dtype = getattr(mstype, value, None)
            if dtype is not None:
                return dtype
        raise InvalidInput(f"{_where(key)}: unknown MindSpore value {kind}={value!r}")

    def stage(self, staging: Any, items: Sequence[tuple[int, object, TensorInfo]]) -> Transfer:
        transfer = Transfer()
        for index, obj, info in items:
            t: Any = obj
            if info.nbytes == 0:
                transfer.host.append((index, 0, 0))
            elif on_host(t):
                if not t.is_contiguous():
                    t = t.contiguous()
                transfer.keep.append(t)
                transfer.host.append((index, int(t.data_ptr()), info.nbytes))
            else:
                a = _host_copy(t, info.dtype)
                transfer.keep.append(a)
                transfer.host.append((index, _address(a), info.nbytes))
        return transfer

    # --- load -------------------------------------------------------------

    def new_tensors(
        self, loaded: Any, items: Sequence[tuple[Entry, dict[str, Any]]], map_location: Any
    ) -> tuple[list[object], Transfer]:
        if map_location is not None and str(map_location).upper() != "CPU":
            raise InvalidInput(
                f"map_location: {map_location!r}: MindSpore tensors are restored to the host "
                "(MindSpore moves them to the device when they are used)"
            )
        transfer = Transfer()
        out: list[object] = []
        for entry, _ in items:
            dtype_from_safetensors(entry.dtype, f"tensor `{entry.name}`")
            t, addr = host_tensor(entry.dtype, entry.shape)
            transfer.keep.append(t)
            transfer.host.append((entry.index, addr if entry.nbytes else 0, entry.nbytes))
            out.append(t)
        return out, transfer

    def result(self, obj: object, ref: dict[str, Any]) -> object:
        if not ref.get("param"):
            return obj
        # One Parameter per tensor, so tied references stay one object.
        known = self._params.get(id(obj))
        if known is None:
            pname = ref.get("pname")
            p = new_parameter(
                obj,
                pname if isinstance(pname, str) else None,
                ref.get("rg", True),
                DTYPES[obj.dtype],  # type: ignore[attr-defined]
            )
            known = (obj, p)
            self._params[id(obj)] = known
        return known[1]

    def fill_tensors(
        self, loaded: Any, items: Sequence[tuple[Entry, object]], keys: Sequence[str]
    ) -> Transfer:
        transfer = Transfer()
        seen: dict[tuple[int, int], str] = {}
        pairs: list[tuple[Any, Any]] = []
        for (entry, obj), key in zip(items, keys):
            t: Any = obj
            if entry.nbytes == 0:
                continue
            if on_host(t) and t.is_contiguous():
                addr = int(t.data_ptr())
                if (entry.index, addr) in seen:
                    continue  # a tied parameter already planned
                seen[entry.index, addr] = key
                transfer.host.append((entry.index, addr, entry.nbytes))
            else:
                src, addr = host_tensor(entry.dtype, entry.shape)
                seen[entry.index, addr] = key
                transfer.keep.append(src)
                transfer.host.append((entry.index, addr, entry.nbytes))
                pairs.append((t, src))
        check_host_disjoint(transfer.host, seen)
        if pairs:
            transfer.jobs.append(Assign(pairs))
        return transfer

    def forget_memory(self) -> None:
        self._params.clear()

    def close(self) -> None:
        self._params.clear()
