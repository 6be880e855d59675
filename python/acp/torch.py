"""PyTorch support: tensors in checkpoint states.

Imported by acp when a state holds a torch tensor; importing it imports
torch. What it does:

- maps every dtype safetensors names to torch's (bf16, fp8 and complex64
  included) and refuses the others (complex128, float4, quantized, sparse,
  tensor subclasses) with ``acp.InvalidInput`` naming the key;
- saves CPU tensors by handing their addresses to the engine, which copies
  them into the ring slot over its copy threads with the GIL released; a
  non-contiguous tensor (a transposed view, a slice) is first made
  contiguous, which costs one extra copy of that tensor;
- saves CUDA tensors with device-to-host copies straight into the slot,
  registered as pinned memory (``cudaHostRegister``, cached per slot range),
  issued non-blocking on a side stream per device and batched with
  ``torch._foreach_copy_``; the save's stall ends when they are complete;
- saves tensors that share storage with the same offset, shape and strides
  (tied weights) once, and restores them as one tensor object;
- restores into fresh tensors (``load()``), copied by the engine in parallel
  into memory they own, or in place (``load(into=...)``), from the resident
  slot: host-to-device straight from the slot for CUDA tensors.

A restored tensor is contiguous: strides and the sharing of partly
overlapping views are not kept. ``nn.Parameter`` and ``requires_grad`` are.
"""

from __future__ import annotations

import math
import operator
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, cast

import torch

from acp._acp import CheckpointCorrupt, InvalidInput, read_only_target
from acp._codec import (
    Entry,
    TensorInfo,
    Transfer,
    check_host_disjoint,
    shared_memory,
    span_groups,
    spans_meet,
)

__all__ = [
    "DTYPES",
    "Adapter",
    "Stager",
    "StorageReader",
    "StorageWriter",
    "dtype_from_safetensors",
    "dtype_to_safetensors",
]

if TYPE_CHECKING:
    from acp.dcp import Stager, StorageReader, StorageWriter

_DCP_NAMES = ("StorageWriter", "StorageReader", "Stager")


def __getattr__(name: str) -> Any:
    # The torch.distributed.checkpoint plugins live in acp.dcp, imported on
    # first use: importing torch.distributed.checkpoint is slow.
    if name in _DCP_NAMES:
        from acp import dcp

        return getattr(dcp, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint64: "U64",
    torch.uint32: "U32",
    torch.uint16: "U16",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
}
"""torch dtype -> safetensors dtype name, for every dtype acp stores."""

# Format version 5's fp8 variants, where this torch has them (2.2 and 2.7).
for _attr, _name in (
    ("float8_e4m3fnuz", "F8_E4M3FNUZ"),
    ("float8_e5m2fnuz", "F8_E5M2FNUZ"),
    ("float8_e8m0fnu", "F8_E8M0"),
):
    if isinstance(getattr(torch, _attr, None), torch.dtype):
        DTYPES[getattr(torch, _attr)] = _name

# What to do instead, for the dtypes acp has no name for.
_INSTEAD = {
    torch.complex128: "torch.view_as_real() stores it as float64 pairs",
    torch.complex32: "torch.view_as_real() stores it as float16 pairs",
}
if isinstance(getattr(torch, "float4_e2m1fn_x2", None), torch.dtype):
    # safetensors' F4 counts 4-bit elements, torch's x2 type byte pairs.
    _INSTEAD[torch.float4_e2m1fn_x2] = "t.view(torch.uint8) stores its bytes"

_FROM_NAME = {name: dtype for dtype, name in DTYPES.items()}

# The tensor types whose fields ``TorchAdapter.signatures`` reads in bulk.
_PLAIN_TENSORS = frozenset((torch.Tensor, torch.nn.Parameter))
_data_ptr = torch.Tensor.data_ptr
_stride = torch.Tensor.stride
_storage = torch.Tensor.untyped_storage
# `is_cpu`, not `device`: a device is a new object per read, and plans are
# kept only for host tensors (any other device is refused or replanned).
_fields = operator.attrgetter("shape", "dtype", "is_cpu", "layout", "requires_grad")
_is_cpu = operator.attrgetter("is_cpu")
_dtype = operator.attrgetter("dtype")
_shape = operator.attrgetter("shape")
_index = operator.attrgetter("index")
_nbytes = operator.attrgetter("nbytes")
_layout = operator.attrgetter("layout")
_is_contiguous = torch.Tensor.is_contiguous


def dtype_to_safetensors(dtype: torch.dtype) -> str:
    """The safetensors name of ``dtype``; raises ``acp.InvalidInput`` for a
    dtype acp cannot store."""
    try:
        return DTYPES[dtype]
    except KeyError:
        raise InvalidInput(_no_name(dtype)) from None


def dtype_from_safetensors(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name."""
    try:
        return _FROM_NAME[name]
    except KeyError:
        raise InvalidInput(f"dtype {name!r} has no torch equivalent") from None


def _where(key: str) -> str:
    return f"key `{key}`" if key else "the state"


def _subclass_hint(kind: type) -> str:
    """What to save instead of a tensor of the subclass ``kind``."""
    if kind.__name__ in ("DTensor", "ShardedTensor"):
        # FSDP's and tensor parallelism's shards: DCP saves and reshards them.
        return (
            "sharded state goes through torch.distributed.checkpoint with "
            "acp.dcp.StorageWriter and StorageReader"
        )
    return "save a plain tensor, e.g. its .data"


def _no_name(dtype: torch.dtype) -> str:
    """Why ``dtype`` is refused, and what to store instead where known."""
    hint = _INSTEAD.get(dtype)
    return f"dtype {dtype} has no safetensors name" + (f" ({hint})" if hint else "")


def slot_tensor(buf: memoryview, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """A tensor over slot bytes (also for ``acp.dcp``); an empty buffer
    gives an empty tensor of its own. Read-only buffers make torch warn
    that it cannot mark tensors read-only; we only read those."""
    if not buf.nbytes:
        return torch.empty(tuple(shape), dtype=dtype)
    if buf.readonly:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
            raw = torch.frombuffer(buf, dtype=torch.uint8)
    else:
        raw = torch.frombuffer(buf, dtype=torch.uint8)
    return raw.view(dtype).view(tuple(shape))


_PAGE = 4096
_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context


def _span(tensors: Sequence[torch.Tensor]) -> tuple[int, int]:
    """The page-aligned host range that covers ``tensors``."""
    start = min(t.data_ptr() for t in tensors)
    end = max(t.data_ptr() + t.numel() * t.element_size() for t in tensors)
    return start // _PAGE * _PAGE, -(-end // _PAGE) * _PAGE


def _cudart() -> Any:
    return torch.cuda.cudart()  # type: ignore[no-untyped-call]


def _register(start: int, end: int) -> bool:
    """Registers the range; False when CUDA refuses (the copies then run
    from pageable memory: correct, slower)."""
    try:
        rc = _cudart().cudaHostRegister(start, end - start, _HOST_REGISTER_PORTABLE)
    except (RuntimeError, AssertionError, AttributeError):
        return False
    return int(rc) == 0


def _unregister(start: int) -> None:
    _cudart().cudaHostUnregister(start)


class _Pins:
    """Slot memory registered with CUDA as pinned, so device copies run at
    full speed and truly asynchronously.

    Registering costs about as much as copying, so the ranges of save slots
    stay registered from one save to the next (the ring reuses its slots).
    That is safe only while the slot's mapping stays the same: the engine
    remaps a slot only to grow it, for an image larger than it ever held,
    so every registration is dropped when the image size changes. Load
    ranges are registered for the load only (the memory may be private to
    the checkpoint). Everything is unregistered when the checkpointer closes.
    """

    def __init__(self) -> None:
        self.ranges: dict[int, int] = {}  # start -> end, page aligned
        self.image_bytes: int | None = None
        self.failures = 0

    def for_save(self, image_bytes: int, host: Sequence[torch.Tensor]) -> None:
        if image_bytes != self.image_bytes:
            self.close()
            self.image_bytes = image_bytes
        start, end = _span(host)
        if any(s <= start and end <= e for s, e in self.ranges.items()):
            return
        for s in [s for s, e in self.ranges.items() if s < end and start < e]:
            _unregister(s)
            del self.ranges[s]
        if _register(start, end):
            self.ranges[start] = end
        else:
            self.failures += 1

    def for_load(self, host: Sequence[torch.Tensor]) -> Callable[[], None]:
        start, end = _span(host)
        if any(s <= start and end <= e for s, e in self.ranges.items()):
            return lambda: None
        if not _register(start, end):
            self.failures += 1
            return lambda: None
        return lambda: _unregister(start)

    def close(self) -> None:
        for s in self.ranges:
            _unregister(s)
        self.ranges.clear()
        self.image_bytes = None


class _DeviceCopies:
    """Copies between slot tensors and device tensors: non-blocking, on one
    side stream per device, batched per device; ``wait`` synchronises.

    ``pin`` registers the host side (the slot tensors) and returns what
    undoes it, called by ``close`` once the copies are complete."""

    def __init__(
        self,
        pairs: list[tuple[torch.Tensor, torch.Tensor]],
        pin: Callable[[list[torch.Tensor]], Callable[[], None]],
    ) -> None:
        self.pairs = pairs  # (destination, source)
        self.pin = pin
        self.unpin: Callable[[], None] = lambda: None
        self.streams: list[torch.cuda.Stream] = []

    def start(self) -> None:
        groups: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for dst, src in self.pairs:
            device = src.device if src.device.type == "cuda" else dst.device
            groups.setdefault(device, []).append((dst, src))
        self.unpin = self.pin([d if d.device.type == "cpu" else s for d, s in self.pairs])
        for device, pairs in groups.items():
            stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
            stream.wait_stream(torch.cuda.current_stream(device))
            dsts = [d for d, _ in pairs]
            srcs = [s for _, s in pairs]
            with torch.no_grad(), torch.cuda.stream(stream):
                try:
                    torch._foreach_copy_(dsts, srcs, non_blocking=True)
                except (RuntimeError, NotImplementedError):
                    for d, s in pairs:  # a dtype or device mix foreach refuses
                        d.copy_(s, non_blocking=True)
            self.streams.append(stream)

    def wait(self) -> None:
        for stream in self.streams:
            stream.synchronize()

    def close(self) -> None:
        self.wait()
        self.pairs = []
        self.streams = []
        unpin, self.unpin = self.unpin, lambda: None
        unpin()


class _HostCopies:
    """Strided copies on the CPU done by torch (to or from slot tensors)."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.pairs = pairs

    def start(self) -> None:
        with torch.no_grad():
            for dst, src in self.pairs:
                dst.copy_(src)

    def wait(self) -> None:
        pass

    def close(self) -> None:
        self.pairs = []


class _Devices:
    """:func:`_device` for the tensors of one load, each saved device's
    answer kept (a state's tensors are on one or two devices; checking the
    name and mapping it again for each of thousands of tensors costs more
    than making the tensor). The first tensor with a device raises for it,
    naming that tensor."""

    def __init__(self, map_location: Any, step: int) -> None:
        self.map_location = map_location
        self.step = step
        self.known: dict[str | None, torch.device] = {}

    def of(self, saved: object, key: str) -> torch.device:
        if saved is None or type(saved) is str:
            got = self.known.get(saved)
            if got is None:
                got = self.known[saved] = _device(saved, self.map_location, key, self.step)
            return got
        return _device(saved, self.map_location, key, self.step)  # checked each time


def _device(saved: object, map_location: Any, key: str, step: int) -> torch.device:
    """The device to restore tensor ``key`` of ``step`` on; ``saved`` is the
    device its reference records (from the checkpoint: checked)."""
    saved = saved or "cpu"
    try:
        if not isinstance(saved, str):
            raise TypeError(f"a {type(saved).__name__}")
        torch.device(saved)
    except (RuntimeError, TypeError, ValueError) as e:
        raise CheckpointCorrupt(
            f"step {step}: tensor `{key}`: malformed checkpoint values: saved device "
            f"{saved!r} is not a torch device name ({e})"
        ) from e
    if map_location is None:
        target = torch.device(saved)
    elif isinstance(map_location, (str, torch.device)):
        target = torch.device(map_location)
    elif isinstance(map_location, dict):
        target = torch.device(map_location.get(saved, saved))
    else:
        raise InvalidInput(
            f"map_location: {type(map_location).__name__} is not supported "
            "(give a device, a device name, or a dict of device names)"
        )
    if target.type == "cuda" and not torch.cuda.is_available():
        raise InvalidInput(
            f"{_where(key)}: saved on {saved}, but CUDA is not available; pass map_location='cpu'"
        )
    if target.type not in ("cpu", "cuda"):
        raise InvalidInput(f"{_where(key)}: device {target} is not supported")
    return target


class Adapter:
    """The codec adapter for torch (see ``acp._codec.Adapter``)."""

    framework = "torch"

    def __init__(self) -> None:
        self.pins = _Pins()

    # --- save -------------------------------------------------------------

    def describe(self, obj: object, key: str) -> TensorInfo | None:
        # Runs once per tensor in every save's stall: each torch attribute
        # costs 0.1-0.6 us, so read each once and test the common case first.
        kind = type(obj)
        if kind is not torch.Tensor and kind is not torch.nn.Parameter:
            if not isinstance(obj, torch.Tensor):
                return None
            raise InvalidInput(
                f"{_where(key)}: tensor subclass `{kind.__module__}.{kind.__qualname__}` "
                f"is not supported ({_subclass_hint(kind)})"
            )
        t: torch.Tensor = obj  # type: ignore[assignment]
        if t.layout is not torch.strided or t.is_nested:
            raise InvalidInput(f"{_where(key)}: {t.layout} tensors are not supported")
        if t.is_quantized:
            raise InvalidInput(f"{_where(key)}: quantized tensors are not supported")
        cpu = t.is_cpu
        if not cpu and not t.is_cuda:
            raise InvalidInput(
                f"{_where(key)}: tensors on {t.device} are not supported (move it to the CPU)"
            )
        torch_dtype = t.dtype
        dtype = DTYPES.get(torch_dtype)
        if dtype is None:
            raise InvalidInput(f"{_where(key)}: {_no_name(torch_dtype)}")
        shape = tuple(t.shape)
        nbytes = t.nbytes
        requires_grad = t.requires_grad
        meta: dict[str, Any] = {}
        if not cpu:
            meta["dev"] = str(t.device)
        if kind is torch.nn.Parameter:
            meta["param"] = True
        if requires_grad:
            meta["rg"] = True
        if not nbytes:
            return TensorInfo(dtype, shape, nbytes, None, meta)
        # The same first byte read with the same shape, strides and dtype is
        # the same bytes: saved once (tied weights).
        address = t.data_ptr()
        alias: tuple[Any, ...]
        if not cpu:
            alias = ((meta["dev"], address), shape, t.stride(), torch_dtype, kind, requires_grad)
            return TensorInfo(dtype, shape, nbytes, alias, meta)
        alias = (address, shape, t.stride(), torch_dtype, kind, requires_grad)
        # Contiguous host bytes go straight to the engine's copy; the
        # storage keeps them alive while it runs (without the GIL).
        host = (address, t.untyped_storage()) if t.is_contiguous() else None
        return TensorInfo(dtype, shape, nbytes, alias, meta, host=host)

    def target(self, obj: object, key: str) -> tuple[str, tuple[int, ...]] | None:
        """``describe``'s dtype and shape of ``obj``, for a load into it
        (``load(into=)``), reading only those: None for a non-tensor value;
        raises for a tensor subclass, a dtype with no safetensors name or a
        tensor with no shape (nested). What else ``describe`` refuses (a
        layout, a device) ``fill_tensors`` refuses, before any copy."""
        kind = type(obj)
        if kind is torch.Tensor or kind is torch.nn.Parameter:
            t: torch.Tensor = obj  # type: ignore[assignment]
            dtype = DTYPES.get(t.dtype)
            if dtype is not None and not t.is_nested:
                return dtype, t.shape
        info = self.describe(obj, key)  # None for a non-tensor; raises, naming why
        return None if info is None else (info.dtype, info.shape)

    target_types = _PLAIN_TENSORS
    """The types whose targets :meth:`targets` reads in bulk."""

    def targets(
        self, objs: Sequence[object], keys: Sequence[str]
    ) -> list[tuple[str, tuple[int, ...]]]:
        """:meth:`target` of each of ``objs`` (of :attr:`target_types`),
        each field read for all of them by one C-level map; raises as
        ``target`` does, naming the first refused one's key."""
        tensors = cast("Sequence[torch.Tensor]", objs)
        names = list(map(DTYPES.get, map(_dtype, tensors)))
        try:
            shapes = list(map(_shape, tensors))  # a nested tensor has none
        except RuntimeError:
            shapes = []
        if None in names or len(shapes) != len(tensors):
            out = []
            for t, key in zip(tensors, keys):
                got = self.target(t, key)  # raises for the refused one
                assert got is not None  # a plain tensor, or it raised
                out.append(got)
            return out
        return list(zip(names, shapes))  # type: ignore[arg-type]

    def signature(self, obj: object) -> Any:
        """What ``describe`` and the copy plans read of ``obj``, for
        ``acp._plan``: equal for two objects that plan alike. Raises for a
        tensor that ``describe`` refuses anyway (the full path says why)."""
        kind = type(obj)
        if kind is not torch.Tensor and kind is not torch.nn.Parameter:
            if isinstance(obj, torch.Tensor):
                raise TypeError("a tensor subclass")
            return (kind, obj)  # a dtype, a size, a device: by value
        t: torch.Tensor = obj  # type: ignore[assignment]
        return (
            kind,
            t.data_ptr(),
            t.shape,
            t.stride(),
            t.dtype,
            t.device,
            t.layout,
            t.requires_grad,
        )

    def signatures(self, objs: list[object]) -> Any:
        """:meth:`signature` of each of ``objs``, in a form that compares
        equal exactly when theirs do. For plain tensors, each field is read
        for all of them by one C-level ``map`` (a torch attribute read costs
        0.05-0.2 us; an interpreted loop around it as much again)."""
        if set(map(type, objs)).issubset(_PLAIN_TENSORS):
            # The types are the walk's; the rest as ``signature`` reads it.
            tensors = cast("list[torch.Tensor]", objs)
            return (
                list(map(_data_ptr, tensors)),
                list(map(_stride, tensors)),
                list(map(_fields, tensors)),
            )
        return list(map(self.signature, objs))

    def keep_alive(self, objs: Sequence[object]) -> list[object]:
        """What keeps the memory of the tensors among ``objs`` alive while
        an engine copy runs without the GIL (their storages: another thread
        may rebind a tensor meanwhile), as ``describe``'s ``host`` does."""
        if set(map(type, objs)).issubset(_PLAIN_TENSORS):
            return list(map(_storage, cast("Sequence[torch.Tensor]", objs)))
        return [t.untyped_storage() for t in objs if isinstance(t, torch.Tensor)]

    def encode_value(self, obj: object, key: str) -> Any:
        if isinstance(obj, torch.Size):
            return {"kind": "size", "v": list(obj)}
        if isinstance(obj, torch.dtype):
            return {"kind": "dtype", "v": str(obj).removeprefix("torch.")}
        if isinstance(obj, torch.device):
            return {"kind": "device", "v": str(obj)}
        kind = type(obj)
        hint = " (save its state_dict())" if hasattr(obj, "state_dict") else ""
        raise InvalidInput(
            f"{_where(key)}: a value of type `{kind.__module__}.{kind.__qualname__}` "
            f"cannot be saved{hint}"
        )

    def decode_value(self, kind: str, value: Any, key: str) -> object:
        if kind == "size":
            # torch.Size takes dimensions past 64 bits, and fails only once
            # the size is used: check them here.
            if not isinstance(value, list) or not all(
                type(d) is int and -(2**63) <= d < 2**63 for d in value
            ):
                raise ValueError("a size is a list of 64-bit signed integers")
            return torch.Size(value)
        if kind == "dtype":
            dtype = getattr(torch, str(value), None)
            if isinstance(dtype, torch.dtype):
                return dtype
        if kind == "device":
            return torch.device(value)
        raise InvalidInput(f"{_where(key)}: unknown torch value {kind}={value!r}")

    def stage(self, staging: Any, items: Sequence[tuple[int, object, TensorInfo]]) -> Transfer:
        transfer = Transfer()
        device_pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        host = transfer.host
        for index, obj, info in items:
            t: torch.Tensor = obj  # type: ignore[assignment]
            if info.nbytes == 0:
                host.append((index, 0, 0))
            elif t.is_cpu:
                if not t.is_contiguous():
                    t = t.detach().contiguous()
                    transfer.keep.append(t)  # a temporary: alive until copied
                # Otherwise the caller's state keeps the tensor alive.
                host.append((index, t.data_ptr(), info.nbytes))
            else:
                dst = slot_tensor(staging.buffer(index), t.dtype, info.shape)
                device_pairs.append((dst, t.detach()))
        if device_pairs:
            image_bytes = staging.image_bytes

            def pin(host: list[torch.Tensor]) -> Callable[[], None]:
                self.pins.for_save(image_bytes, host)
                return lambda: None

            transfer.jobs.append(_DeviceCopies(device_pairs, pin))
        return transfer

    # --- load -------------------------------------------------------------

    def new_tensors(
        self, loaded: Any, items: Sequence[tuple[Entry, dict[str, Any]]], map_location: Any
    ) -> tuple[list[object], Transfer]:
        transfer = Transfer()
        out: list[object] = []
        device_pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        devices = _Devices(map_location, loaded.step)
        for entry, ref in items:
            dtype = dtype_from_safetensors(entry.dtype)
            device = devices.of(ref.get("dev"), entry.name)
            t = torch.empty(entry.shape, dtype=dtype, device=device)
            if device.type == "cpu":
                transfer.host.append((entry.index, t.data_ptr(), entry.nbytes))
            elif entry.nbytes:
                src = slot_tensor(loaded.buffer(entry.index), dtype, entry.shape)
                device_pairs.append((t, src))
            if ref.get("param"):
                out.append(torch.nn.Parameter(t, requires_grad=bool(ref.get("rg"))))
            else:
                out.append(t.requires_grad_() if ref.get("rg") else t)
        if device_pairs:
            transfer.jobs.append(_DeviceCopies(device_pairs, self.pins.for_load))
        return out, transfer

    def view_tensors(
        self, loaded: Any, items: Sequence[tuple[Entry, dict[str, Any]]], map_location: Any
    ) -> tuple[list[object], Transfer]:
        """``new_tensors`` for ``load(zero_copy=True)``, and for a fresh
        load of a private image: each tensor restored on the CPU is a view
        of the loaded image (read-only when ``loaded.protect()`` made it so,
        writable when ``loaded.give()`` handed it over), nothing copied;
        tensors for other devices are copied there as ``new_tensors``
        does."""
        out: list[object | None] = []
        copies: list[tuple[int, tuple[Entry, dict[str, Any]]]] = []
        devices = _Devices(map_location, loaded.step)
        for entry, ref in items:
            device = devices.of(ref.get("dev"), entry.name)
            if device.type != "cpu":
                copies.append((len(out), (entry, ref)))
                out.append(None)
                continue
            dtype = dtype_from_safetensors(entry.dtype)
            t = slot_tensor(loaded.buffer(entry.index), dtype, entry.shape)
            if ref.get("param"):
                out.append(torch.nn.Parameter(t, requires_grad=bool(ref.get("rg"))))
            else:
                out.append(t.requires_grad_() if ref.get("rg") else t)
        transfer = Transfer()
        if copies:
            made, transfer = self.new_tensors(loaded, [item for _, item in copies], map_location)
            for (at, _), obj in zip(copies, made):
                out[at] = obj
        return list(out), transfer

    def result(self, obj: object, ref: dict[str, Any]) -> object:
        return obj

    def fill_tensors(
        self, loaded: Any, items: Sequence[tuple[Entry, object]], keys: Sequence[str]
    ) -> Transfer:
        transfer = Transfer()
        device_pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        host_pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        seen: dict[tuple[int, int], str] = {}
        strided: list[tuple[int, torch.Tensor, int]] = []  # host targets torch fills
        # Each field read for all tensors by one C-level map (as
        # `signatures` does): a first restore of many small tensors.
        tensors = cast("list[torch.Tensor]", [obj for _, obj in items])
        on_cpu = list(map(_is_cpu, tensors))
        if set(map(_layout, tensors)) - {torch.strided} or not all(on_cpu):
            for t, key, cpu in zip(tensors, keys, on_cpu):
                if not cpu or t.layout is not torch.strided:
                    self.describe(t, key)  # refuses a layout or device it cannot fill
        addresses = list(map(_data_ptr, tensors))
        dense = list(map(_is_contiguous, tensors))
        host = transfer.host
        if all(on_cpu) and all(dense):
            # Contiguous host tensors only, each once (no tied weights):
            # the engine's copy ranges, built without a loop.
            entries = [entry for entry, _ in items]
            indices = list(map(_index, entries))
            seen = dict(zip(zip(indices, addresses), keys))
            if len(seen) == len(items):
                spans = zip(indices, addresses, map(_nbytes, entries))
                host.extend(span for span in spans if span[2])
                _check_no_overlap(host, seen)
                return transfer
            seen.clear()
        for (entry, _), t, key, cpu, address, contiguous in zip(
            items, tensors, keys, on_cpu, addresses, dense
        ):
            if entry.nbytes == 0 or (entry.index, address) in seen:
                continue  # nothing to copy, or a tied tensor already planned
            seen[entry.index, address] = key
            if cpu and contiguous:
                host.append((entry.index, address, entry.nbytes))
                continue
            src = slot_tensor(loaded.buffer(entry.index), t.dtype, entry.shape)
            (host_pairs if cpu else device_pairs).append((t, src))
            if cpu:
                strided.append((entry.index, t, address))
        _check_no_overlap(transfer.host, seen, strided)
        if host_pairs:
            transfer.jobs.append(_HostCopies(host_pairs))
        if device_pairs:
            transfer.jobs.append(_DeviceCopies(device_pairs, self.pins.for_load))
        return transfer

    def forget_memory(self) -> None:
        self.pins.close()

    def close(self) -> None:
        self.pins.close()


def _check_no_overlap(
    host: list[tuple[int, int, int]],
    keys: dict[tuple[int, int], str],
    strided: Sequence[tuple[int, torch.Tensor, int]] = (),
) -> None:
    """Refuses ``load(into=)`` targets that would take two checkpoint
    tensors into the same memory (one's bytes would silently overwrite the
    other's), before anything is copied. ``host`` holds the contiguous
    host targets the engine fills, ``(index, address, nbytes)``;
    ``strided`` the other host targets, ``(index, tensor, address)``,
    which torch fills; ``keys`` names each ``(index, address)``.

    Spans are compared first: a contiguous target's bytes, and the memory
    from a strided target's first element to the end of its last. Where a
    strided target's span meets another's, the two may still be disjoint
    (two column blocks of one matrix): ``_check_shared`` marks their
    elements in a map of that memory to tell."""
    for index, t, address in strided:
        if any(s == 0 and n > 1 for n, s in zip(t.shape, t.stride())):
            raise InvalidInput(
                f"into=: {_where(keys[index, address])} is an expanded view: "
                "its elements share memory, so it cannot hold a loaded tensor"
            )
    if not strided:
        check_host_disjoint(host, keys)
        return
    # Torch fills these itself: a view of a zero-copy load's read-only
    # image among them would kill the process with SIGSEGV (the engine
    # refuses such contiguous targets itself).
    ro = read_only_target([(k, a, _extent(t, a)) for k, (_, t, a) in enumerate(strided)])
    if ro is not None:
        index, _, address = strided[ro]
        raise InvalidInput(
            f"into=: {_where(keys[index, address])}: its memory is a read-only view of a loaded "
            "checkpoint (`load(zero_copy=True)`); clone() it, or load without into=, to get "
            "tensors that can be written"
        )
    spans = sorted(
        [(addr, addr + n, index, -1) for index, addr, n in host if n]
        + [(addr, _extent(t, addr), index, k) for k, (index, t, addr) in enumerate(strided)]
    )
    tangled = {k for k, (_, t, _) in enumerate(strided) if not _apart(t)}
    if tangled or spans_meet(spans):
        for group in span_groups(spans):
            _check_shared(group, keys, strided, tangled)


# A target's memory in ``_check_no_overlap``: ``(start, end, index, k)``,
# ``k`` its place in ``strided``, -1 for contiguous bytes.
_Span = tuple[int, int, int, int]

# The largest map ``_check_shared`` makes (a byte per unit of the targets'
# common alignment): 1 GiB.
_SHARED_MAP_MAX = 1 << 30


def _extent(t: torch.Tensor, address: int) -> int:
    """The end of the memory from ``t``'s first element to its last."""
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return address + (last + 1) * t.element_size()


def _apart(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements plainly lie apart: taken by stride, each
    dimension steps past all the memory the smaller ones span (true of
    every slice, transpose or step of a dense tensor). False says only
    that it takes a map to tell."""
    reach = 0
    for s, n in sorted((s, n) for n, s in zip(t.shape, t.stride()) if n > 1):
        if s <= reach:
            return False
        reach += s * (n - 1)
    return True


def _check_shared(
    group: list[_Span],
    keys: dict[tuple[int, int], str],
    strided: Sequence[tuple[int, torch.Tensor, int]],
    tangled: set[int],
) -> None:
    """Refuses the first two targets of ``group`` (sorted spans that reach
    into each other) that share a byte, and a strided target whose own
    elements share one (looked for in those of ``tangled``, and wherever
    the group has more than one target)."""
    if len(group) < 2 and group[0][3] not in tangled:
        return

    def name(span: _Span) -> str:
        return _where(keys[span[2], span[0]])

    def refuse(a: _Span, b: _Span) -> NoReturn:
        raise shared_memory(keys[a[2], a[0]], keys[b[2], b[0]])

    if all(span[3] < 0 for span in group):
        refuse(group[0], group[1])  # contiguous: the second starts inside the first
    lo, hi = group[0][0], max(span[1] for span in group)
    unit = 0
    for start, end, _, k in group:
        unit = math.gcd(unit, start - lo, end - start)
        if k >= 0:
            unit = math.gcd(unit, strided[k][1].element_size())
    if (hi - lo) // unit > _SHARED_MAP_MAX:
        what = (
            f"{name(group[0])} and {name(group[1])} share"
            if len(group) > 1
            else f"{name(group[0])}'s elements share"
        )
        raise InvalidInput(
            f"into=: cannot tell whether {what} memory (strided views over {hi - lo} "
            "bytes); load into contiguous tensors"
        )
    marks = torch.zeros((hi - lo) // unit, dtype=torch.uint8)

    def held(span: _Span) -> torch.Tensor:
        """The marks of the memory ``span``'s target holds."""
        start, end, _, k = span
        at = (start - lo) // unit
        if k < 0:
            return marks[at : (end - lo) // unit]
        t = strided[k][1]
        per = t.element_size() // unit
        return marks.as_strided((*t.shape, per), (*(s * per for s in t.stride()), 1), at)

    done: list[_Span] = []
    for span in group:
        mine = held(span)
        if bool(mine.any()):
            # Which earlier target it meets, to name both.
            for other in done:
                marks.zero_()
                held(other).fill_(1)
                if bool(mine.any()):
                    refuse(other, span)
            refuse(group[0], span)  # unreachable: every mark is an earlier target's
        region = marks[(span[0] - lo) // unit : (span[1] - lo) // unit]
        before = int(region.sum())
        mine.fill_(1)
        if int(region.sum()) - before != mine.numel():
            raise InvalidInput(
                f"into=: {name(span)}'s elements share memory with each other, "
                "so it cannot hold a loaded tensor"
            )
        done.append(span)
