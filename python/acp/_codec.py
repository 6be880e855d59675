"""The state codec: nested Python state <-> (named tensors, JSON tree).

Framework-agnostic. A state is a nesting of dicts (str, int, float, bool or
None keys), lists, tuples, ints, floats (nan and inf included), strings,
bytes, bools, None and tensors. ``flatten`` turns it into a list of tensors
with unique dotted names and a JSON tree in which each tensor is a reference
to its name and every type JSON cannot tell apart carries a tag, so a round
trip gives back equal types and values: a tuple stays a tuple, an int key
stays an int, ``1.0`` stays a float, an ``OrderedDict`` stays one (with the
``_metadata`` PyTorch attaches to state dicts). Anything else (a function, a
set, an instance of a custom class) is refused with ``acp.InvalidInput``
naming its key path, e.g. ``optim.state.3.exp_avg``. Nothing is pickled.

Tensors are recognised by the module that defines their type (``torch``,
``numpy``, ``mindspore``), whose adapter is imported on first use, so
``import acp`` imports no framework.

The JSON tree (values JSON of a checkpoint) is
``{"acp.codec": 1, "state": NODE}`` where NODE is one of:

- ``null``, ``true``, ``false``, a string, a finite float, an int that fits
  in 64 bits, a list of NODEs;
- ``{"t": "dict" | "odict", "k": [KEY...], "v": [NODE...]}`` (``odict`` may
  carry ``"meta"``: the NODE of its ``_metadata`` attribute); a KEY is a
  string, an int, a float, a bool, null, or a tagged big int / float;
- ``{"t": "tuple", "v": [NODE...]}``;
- ``{"t": "int", "v": "<decimal>"}`` for ints beyond 64 bits;
- ``{"t": "float", "bits": "<16 hex digits>"}`` for nan and inf (exact bits);
- ``{"t": "bytes", "v": "<base64>"}``;
- ``{"t": "tensor", "fw": FRAMEWORK, "name": NAME, ...}`` (adapter fields);
- ``{"t": "value", "fw": FRAMEWORK, "kind": KIND, "v": ...}`` for framework
  values such as ``torch.dtype``.

A tree read from a checkpoint is checked against this grammar, iteratively
and at most ``MAX_DEPTH`` deep, before anything is decoded: a malformed node
(a missing or mistyped field, bad base64, an unknown tag or framework)
raises ``acp.CheckpointCorrupt`` naming the step and its key path, never a
raw Python error.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import importlib
import json
import math
import operator
import re
import struct
import sys
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, chain, compress, repeat
from typing import Any, Protocol, TypeVar

from acp._acp import MAX_VALUES_DEPTH, CheckpointCorrupt, InvalidInput, Unsupported

_FIRST = operator.itemgetter(0)
_SECOND = operator.itemgetter(1)
_S = TypeVar("_S", bound=tuple[Any, ...])

CODEC_VERSION = 1
"""The version of the JSON tree this build writes and the newest it reads."""

CODEC_KEY = "acp.codec"
STATE_KEY = "state"

_I64_MIN = -(2**63)
_U64_MAX = 2**64 - 1
_MAX_NAME_BYTES = 1024
# A name of at most this many characters is short enough in any encoding
# (UTF-8 takes at most 4 bytes per character).
_FAST_NAME_CHARS = (_MAX_NAME_BYTES - 16) // 4

MAX_STATE_DEPTH = (MAX_VALUES_DEPTH - 3) // 2
"""The deepest nesting of containers (dict, list, tuple; an OrderedDict's
``_metadata`` counts as one level inside its dict) a state may have, so that
its JSON tree fits the format's :data:`~acp._acp.MAX_VALUES_DEPTH` (127): the
tree is one object, a dict or tuple at level n is an object at JSON depth 2n
and its arrays at 2n + 1, and a leaf in them adds at most two (a framework
value such as ``{"t": "value", "v": [2, 3]}``). A list costs one level only,
so it fits with room to spare. 62."""

# The adapter module of each framework, by the top-level module of a type.
ADAPTER_MODULES = {
    "torch": "acp.torch",
    "numpy": "acp._numpy",
    "mindspore": "acp.mindspore",
}


# --------------------------------------------------------------------------
# Adapters


class TensorInfo:
    """What an adapter tells the codec about one tensor it accepts.

    A plain class with slots, not a dataclass: one is made per tensor in
    every save's stall, and this costs half as much to create."""

    __slots__ = ("alias", "dtype", "host", "meta", "nbytes", "shape")

    def __init__(
        self,
        dtype: str,
        shape: tuple[int, ...],
        nbytes: int,
        alias: Hashable | None,
        meta: dict[str, Any] | None = None,
        *,
        host: tuple[int, object] | None = None,
    ) -> None:
        self.dtype = dtype
        """The safetensors dtype name, e.g. ``"BF16"``."""
        self.shape = shape
        self.nbytes = nbytes
        self.alias = alias
        """Equal for two tensors that are the same bytes (tied weights): they
        are saved once and restored as one object. None when never shared."""
        self.meta: dict[str, Any] = {} if meta is None else meta
        """JSON fields stored in the tensor's reference (device, parameter...)."""
        self.host = host
        """``(address, owner)`` when the tensor's ``nbytes`` are contiguous host
        memory the engine may copy directly, ``owner`` keeping that memory
        alive (the tensor's storage: another thread may rebind the tensor
        while the copy runs without the GIL); None: the adapter's ``stage``
        plans the copy."""

    def __repr__(self) -> str:
        return (
            f"TensorInfo(dtype={self.dtype!r}, shape={self.shape!r}, nbytes={self.nbytes}, "
            f"alias={self.alias!r}, meta={self.meta!r}, host={self.host is not None})"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorInfo):
            return NotImplemented
        fields = ("alias", "dtype", "meta", "nbytes", "shape")
        return all(getattr(self, k) == getattr(other, k) for k in fields)

    __hash__ = None  # type: ignore[assignment]


@dataclass
class Entry:
    """A tensor of a loaded checkpoint."""

    index: int
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


class Job(Protocol):
    """Copies an adapter runs itself (device copies, strided copies)."""

    def start(self) -> None:
        """Issues the copies (may return before they complete)."""

    def wait(self) -> None:
        """Blocks until every copy is complete."""

    def close(self) -> None:
        """Drops every view of slot memory; idempotent; always called."""


@dataclass
class Transfer:
    """How an adapter moves its tensors between the ring and their memory."""

    host: list[tuple[int, int, int]] = field(default_factory=list)
    """``(tensor index, address, nbytes)`` for one engine copy, which runs in
    parallel with the GIL released."""
    keep: list[object] = field(default_factory=list)
    """Objects that must stay alive until the host copy is done."""
    jobs: list[Job] = field(default_factory=list)


def spans_meet(spans: Sequence[tuple[Any, ...]]) -> bool:
    """Whether any two of ``spans`` (``(start, end, ...)`` tuples sorted by
    start, none empty) overlap: a start before the furthest end before it,
    checked by C-level maps."""
    reach = accumulate(map(_SECOND, spans), max)
    return any(map(operator.lt, map(_FIRST, spans[1:]), reach))


def span_groups(spans: Sequence[_S]) -> list[list[_S]]:
    """``spans`` (sorted as for ``spans_meet``) cut into runs that reach
    into each other, in order; a span that meets no other is a run alone."""
    groups: list[list[_S]] = []
    reach = 0
    for span in spans:
        if not groups or span[0] >= reach:
            groups.append([])
        groups[-1].append(span)
        reach = max(reach, span[1])
    return groups


def shared_memory(first: str, second: str) -> InvalidInput:
    """The error for ``into=`` targets of two different checkpoint tensors,
    at keys ``first`` and ``second``, that share memory."""
    return InvalidInput(
        f"into=: {_where(first)} and {_where(second)} share memory but are different "
        "tensors in the checkpoint"
    )


def check_host_disjoint(host: list[tuple[int, int, int]], keys: dict[tuple[int, int], str]) -> None:
    """Refuses the contiguous ``into=`` targets ``host`` (``(index,
    address, nbytes)``, as ``Transfer.host``) when two of them overlap,
    naming both by ``keys[index, address]``, before anything is copied
    (the engine refuses them too, but can name only indices)."""
    spans = sorted((addr, addr + n, index) for index, addr, n in host if n)
    if not spans_meet(spans):
        return
    for group in span_groups(spans):
        if len(group) > 1:  # the second starts inside the first
            (a, _, i), (b, _, j) = group[0], group[1]
            raise shared_memory(keys[i, a], keys[j, b])


class Adapter(Protocol):
    """One framework's tensors. Implemented by ``acp.torch`` and friends."""

    framework: str

    def describe(self, obj: object, key: str) -> TensorInfo | None:
        """The tensor's info; None when ``obj`` is a non-tensor value of
        this framework; raises ``InvalidInput`` for a refused tensor."""

    def encode_value(self, obj: object, key: str) -> Any:
        """A JSON encoding of a non-tensor framework value (a dtype, a
        device, a size...); raises ``InvalidInput`` when it has none."""

    def decode_value(self, kind: str, value: Any, key: str) -> object:
        """The value ``encode_value`` encoded."""

    def stage(self, staging: Any, items: Sequence[tuple[int, object, TensorInfo]]) -> Transfer:
        """Plans copying tensors ``(slot index, tensor, info)`` into the slot."""

    def new_tensors(
        self, loaded: Any, items: Sequence[tuple[Entry, dict[str, Any]]], map_location: Any
    ) -> tuple[list[object], Transfer]:
        """Fresh tensors for ``(entry, reference fields)``, and how to fill them."""

    def result(self, obj: object, ref: dict[str, Any]) -> object:
        """The value for a reference, from its tensor once it is filled."""

    def fill_tensors(
        self, loaded: Any, items: Sequence[tuple[Entry, object]], keys: Sequence[str]
    ) -> Transfer:
        """Plans copying entries into existing tensors (already checked)."""

    def forget_memory(self) -> None:
        """Drops what the adapter keeps about ring memory (pinned ranges):
        a load may remap a slot."""

    def close(self) -> None:
        """Releases what the adapter holds for its checkpointer."""


class Adapters:
    """The adapters of one checkpointer, created on first use.

    The adapter modules of the frameworks the process has already imported
    are imported here, when the checkpointer opens, so that a restarted
    process's first load does not pay for them (about 1 ms for ``acp.torch``
    from its bytecode, 20 ms or more where the bytecode cannot be cached,
    e.g. under ``PYTHONDONTWRITEBYTECODE``). A framework that is not imported
    yet stays unimported: a NumPy-only job never imports torch."""

    def __init__(self) -> None:
        self._by_framework: dict[str, Adapter] = {}
        # A type's module does not change: the MRO walk runs once per type.
        self._framework_by_type: dict[type, str | None] = {}
        for framework, module_name in ADAPTER_MODULES.items():
            if framework in sys.modules:
                # A failure is reported, naming the module, by get() when
                # a value of that framework is met.
                with contextlib.suppress(ImportError):
                    importlib.import_module(module_name)

    def framework_of(self, obj: object) -> str | None:
        """The framework of ``obj``'s type, or of a base class (so that a
        framework's adapter sees, and can refuse, subclasses of its types)."""
        kind = type(obj)
        try:
            return self._framework_by_type[kind]
        except KeyError:
            pass
        framework = None
        for cls in kind.__mro__[:-1]:
            top = (cls.__module__ or "").partition(".")[0]
            if top in ADAPTER_MODULES:
                framework = top
                break
        self._framework_by_type[kind] = framework
        return framework

    def get(self, framework: str, key: str) -> Adapter:
        adapter = self._by_framework.get(framework)
        if adapter is None:
            module_name = ADAPTER_MODULES.get(framework)
            if module_name is None:
                raise InvalidInput(f"{_where(key)}: unknown framework {framework!r}")
            try:
                module = importlib.import_module(module_name)
            except ImportError as e:
                raise InvalidInput(
                    f"{_where(key)}: {framework} values need {module_name}, "
                    f"which cannot be imported: {e}"
                ) from e
            adapter = module.Adapter()
            self._by_framework[framework] = adapter
        return adapter

    def loaded(self) -> Iterator[Adapter]:
        return iter(list(self._by_framework.values()))

    def forget_memory(self) -> None:
        for adapter in self.loaded():
            adapter.forget_memory()

    def close(self) -> None:
        for adapter in self.loaded():
            adapter.close()


def _where(key: str) -> str:
    return f"key `{key}`" if key else "the state"


def _join(key: str, part: object) -> str:
    return f"{key}.{part}" if key else str(part)


# --------------------------------------------------------------------------
# flatten


class FlatTensor:
    """A tensor of a state being saved (slots: one per tensor per save)."""

    __slots__ = ("adapter", "info", "key", "name", "obj")

    def __init__(self, name: str, key: str, obj: object, info: TensorInfo, adapter: Adapter):
        self.name = name
        self.key = key
        self.obj = obj
        self.info = info
        self.adapter = adapter

    def __repr__(self) -> str:
        return f"FlatTensor(name={self.name!r}, key={self.key!r}, info={self.info!r})"


@dataclass
class Flat:
    tree: dict[str, Any]
    tensors: list[FlatTensor]

    def json(self) -> str:
        # The flattener builds a new tree and refuses cyclic states: no cycle check.
        return dumps(self.tree)

    def frameworks(self) -> set[str]:
        return {t.adapter.framework for t in self.tensors}


class _Flattener:
    def __init__(self, adapters: Adapters, prefix: str) -> None:
        self.adapters = adapters
        self.prefix = prefix
        self.tensors: list[FlatTensor] = []
        self.names: set[str] = set()
        # Per type: (framework, adapter, its tensors by alias), once a
        # framework's adapter took a value of that type.
        self.by_type: dict[type, tuple[str, Adapter, dict[Hashable, FlatTensor]]] = {}
        self.aliases: dict[str, dict[Hashable, FlatTensor]] = {}
        self.open_containers: set[int] = set()
        # The containers open around the value being flattened: checked
        # before recursing, so a state deeper than the limit is refused with
        # its key path instead of reaching Python's recursion limit.
        self.depth = 0

    def unique_name(self, key: str) -> str:
        name = self.prefix + (key or "tensor")
        # The common case (short, no NUL, not taken) costs a few dict and
        # string operations: this runs once per tensor in the stall.
        if (
            len(name) <= _FAST_NAME_CHARS
            and name not in self.names
            and "\0" not in name
            and name != "__metadata__"
        ):
            self.names.add(name)
            return name
        name = name.replace("\0", "\\0")
        if name == "__metadata__":
            name = "__metadata__#1"
        if len(name.encode()) > _MAX_NAME_BYTES - 16:
            name = name.encode()[: _MAX_NAME_BYTES - 32].decode(errors="ignore") + "~"
        candidate, n = name, 1
        while candidate in self.names:
            n += 1
            candidate = f"{name}#{n}"
        self.names.add(candidate)
        return candidate

    def scalar_key(self, k: object, key: str) -> Any:
        t = type(k)
        if t is str:
            _check_str(k, key)  # type: ignore[arg-type]
            return k
        if t in (int, float, bool) or k is None:
            return self.node(k, key)
        raise InvalidInput(
            f"{_where(key)}: a dict key of type `{_type_name(k)}` cannot be saved "
            "(keys must be str, int, float, bool or None)"
        )

    def node(self, obj: object, key: str) -> Any:
        t = type(obj)
        fast = self.by_type.get(t)
        if fast is not None:  # a type an adapter took before: most of a state's values
            return self.framework_value(fast, obj, key)
        if t in PLAIN_TYPES:
            return plain_node(obj, key)
        if t in (dict, OrderedDict, list, tuple):
            return self.container(obj, key)
        framework = self.adapters.framework_of(obj)
        if framework is not None:
            aliases = self.aliases.setdefault(framework, {})
            fast = self.by_type[t] = (framework, self.adapters.get(framework, key), aliases)
            return self.framework_value(fast, obj, key)
        raise InvalidInput(
            f"{_where(key)}: a value of type `{_type_name(obj)}` cannot be saved "
            "(acp stores tensors and plain values: dict, list, tuple, str, int, float, "
            "bool, bytes, None; never pickle)"
        )

    def container(self, obj: Any, key: str) -> Any:
        if id(obj) in self.open_containers:
            raise InvalidInput(f"{_where(key)}: the state contains itself")
        if self.depth >= MAX_STATE_DEPTH:
            raise InvalidInput(
                f"{_where(key)}: the state nests dicts, lists and tuples deeper than "
                f"{MAX_STATE_DEPTH} levels, the most a checkpoint holds"
            )
        self.open_containers.add(id(obj))
        self.depth += 1
        try:
            t = type(obj)
            if t is list:
                return [self.node(v, _join(key, i)) for i, v in enumerate(obj)]
            if t is tuple:
                return {"t": "tuple", "v": [self.node(v, _join(key, i)) for i, v in enumerate(obj)]}
            subkeys = [f"{key}.{k}" for k in obj] if key else [str(k) for k in obj]
            keys = [
                k if type(k) is str and k.isascii() else self.scalar_key(k, sub)
                for k, sub in zip(obj, subkeys)
            ]
            values = [self.node(v, sub) for v, sub in zip(obj.values(), subkeys)]
            out: dict[str, Any] = {
                "t": "odict" if t is OrderedDict else "dict",
                "k": keys,
                "v": values,
            }
            meta = getattr(obj, "_metadata", None) if t is OrderedDict else None
            if meta is not None:
                out["meta"] = self.node(meta, _join(key, "_metadata"))
            return out
        finally:
            self.depth -= 1
            self.open_containers.discard(id(obj))

    def framework_value(
        self, fast: tuple[str, Adapter, dict[Hashable, FlatTensor]], obj: object, key: str
    ) -> Any:
        """A framework's value: ``fast`` is the framework, its adapter and
        the tensors seen by alias (per framework: a torch tensor and a NumPy
        array over the same bytes stay two values of two types)."""
        framework, adapter, aliases = fast
        info = adapter.describe(obj, key)
        if info is None:
            return {"t": "value", "fw": framework, **adapter.encode_value(obj, key)}
        alias = info.alias
        shared = None if alias is None else aliases.get(alias)
        if shared is None:
            shared = FlatTensor(self.unique_name(key), key, obj, info, adapter)
            self.tensors.append(shared)
            if alias is not None:
                aliases[alias] = shared
        ref = {"t": "tensor", "fw": framework, "name": shared.name}
        if info.meta:
            ref.update(info.meta)
        return ref


PLAIN_TYPES = frozenset((type(None), bool, str, int, float, bytes))
"""The types of the plain values a state holds (leaves that are neither
containers nor framework values)."""


def plain_node(obj: object, key: str) -> Any:
    """The tree node of plain value ``obj`` (its type in
    :data:`PLAIN_TYPES`) at key path ``key``.

    Raises:
        InvalidInput: a string that is not valid Unicode, naming ``key``.
    """
    t = type(obj)
    if obj is None or t is bool:
        return obj
    if t is str:
        _check_str(obj, key)  # type: ignore[arg-type]
        return obj
    if t is int:
        if _I64_MIN <= obj <= _U64_MAX:  # type: ignore[operator]
            return obj
        return {"t": "int", "v": str(obj)}
    if t is float:
        if math.isfinite(obj):  # type: ignore[arg-type]
            return obj
        return {"t": "float", "bits": struct.pack(">d", obj).hex()}
    return {"t": "bytes", "v": base64.b64encode(obj).decode()}  # type: ignore[arg-type]


def plain_json(obj: object, key: str) -> str:
    """The values JSON text of plain value ``obj`` (its type in
    :data:`PLAIN_TYPES`) at key path ``key``: :func:`dumps` of its
    :func:`plain_node`, written directly for the common ints, finite
    floats, None and bools.

    Raises:
        InvalidInput: as :func:`plain_node`.
    """
    t = type(obj)
    if t is int and _I64_MIN <= obj <= _U64_MAX:  # type: ignore[operator]
        return int.__repr__(obj)
    if t is float and math.isfinite(obj):  # type: ignore[arg-type]
        return float.__repr__(obj)
    if obj is None:
        return "null"
    if t is bool:
        return "true" if obj else "false"
    return dumps(plain_node(obj, key))


def dumps(tree: Any) -> str:
    """The values JSON text of ``tree`` (a values tree or a node of one)."""
    return json.dumps(
        tree,
        allow_nan=False,
        ensure_ascii=False,
        separators=(",", ":"),
        check_circular=False,
    )


def flatten(state: object, adapters: Adapters, name_prefix: str = "") -> Flat:
    """The tensors of ``state`` and its JSON tree. Tensor names are the
    dotted key paths, after ``name_prefix``.

    Raises:
        InvalidInput: naming the key of the first value that cannot be saved.
    """
    f = _Flattener(adapters, name_prefix)
    tree = {CODEC_KEY: CODEC_VERSION, STATE_KEY: f.node(state, "")}
    return Flat(tree, f.tensors)


def _check_str(s: str, key: str) -> None:
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidInput(f"{_where(key)}: string is not valid Unicode ({e.reason})") from e


def _type_name(obj: object) -> str:
    t = type(obj)
    module = t.__module__
    return t.__qualname__ if module in ("builtins", None) else f"{module}.{t.__qualname__}"


# --------------------------------------------------------------------------
# load


MAX_DEPTH = MAX_VALUES_DEPTH
"""The deepest nesting of JSON arrays and objects a values tree may have:
the format's limit, which the engine enforces on every file it reads; the
recursive decoder relies on the bound."""

_DECIMAL = re.compile(r"-?[0-9]{1,4300}")  # 4300: Python's int() digit limit
_HEX64 = re.compile(r"[0-9a-fA-F]{16}")


def parse(values_json: str, step: int) -> Any:
    """The state node of a checkpoint's values JSON, checked by
    :func:`check_tree`: the decoder never meets a malformed node.

    Raises:
        as :func:`parse_refs`.
    """
    return parse_refs(values_json, step)[0]


def parse_refs(values_json: str, step: int) -> tuple[Any, list[dict[str, Any]] | None]:
    """:func:`parse`, with the tree's tensor references (their ``name``
    fields checked to be strings) when the quick check found them all,
    else None.

    Raises:
        Unsupported: written by a newer codec.
        InvalidInput: not written by this codec.
        CheckpointCorrupt: not JSON, a codec version that is no non-negative
            integer, or a malformed node (naming its key).
    """
    try:
        tree = json.loads(values_json)
    except (ValueError, RecursionError) as e:
        raise CheckpointCorrupt(f"step {step}: checkpoint values are not valid JSON: {e}") from e
    if not isinstance(tree, dict) or CODEC_KEY not in tree or STATE_KEY not in tree:
        raise InvalidInput(f"step {step}: values were not written by acp's state codec")
    version = tree[CODEC_KEY]
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise CheckpointCorrupt(
            f"step {step}: field `{CODEC_KEY}` of the checkpoint values: "
            f"{repr(version)[:64]} is not a state codec version (a non-negative integer)"
        )
    if version > CODEC_VERSION:
        raise Unsupported(
            f"step {step}: unsupported: state codec version {version!r} is newer than "
            f"this acp's {CODEC_VERSION}; upgrade acp"
        )
    node = tree[STATE_KEY]
    refs = _quick_refs(node)
    if refs is None:
        _full_check(node, step)
    return node, refs


def _corrupt(step: int | None, key: str, what: str) -> CheckpointCorrupt:
    at = "" if step is None else f"step {step}: "
    return CheckpointCorrupt(f"{at}{_where(key)}: malformed checkpoint values: {what}")


def _scalar(n: object) -> bool:
    return n is None or isinstance(n, (bool, int, float, str))


def check_tree(node: Any, step: int | None) -> None:
    """Checks that ``node`` is a tree :class:`Decoder` decodes without error
    (tags, fields and payloads as the module docs specify, at most
    :data:`MAX_DEPTH` deep), iteratively, so a hostile tree cannot exhaust
    the stack. Framework values and tensor fields beyond ``name`` and ``fw``
    are the adapters' to check.

    Raises:
        CheckpointCorrupt: naming the key path of the first malformed node.
    """
    if _quick_refs(node) is None:
        _full_check(node, step)


def _full_check(node: Any, step: int | None) -> None:
    """:func:`check_tree`'s rules, building the key path of every node to
    name the first that breaks one."""
    # (node, key path, JSON nesting depth of the node; the document is 1)
    stack: list[tuple[Any, str, int]] = [(node, "", 2)]
    while stack:
        n, key, depth = stack.pop()
        if _scalar(n):
            continue
        if depth > MAX_DEPTH:
            raise _corrupt(step, key, f"nested deeper than {MAX_DEPTH} levels")
        if isinstance(n, list):
            stack.extend((v, _join(key, i), depth + 1) for i, v in enumerate(n))
            continue
        if not isinstance(n, dict):
            raise _corrupt(step, key, f"unexpected {type(n).__name__}")
        tag = n.get("t")
        if tag in ("dict", "odict"):
            keys, values = n.get("k"), n.get("v")
            if not isinstance(keys, list) or not isinstance(values, list):
                raise _corrupt(step, key, "a dict node needs the lists `k` and `v`")
            if len(keys) != len(values):
                raise _corrupt(step, key, "keys and values differ in number")
            if "meta" in n:
                if tag != "odict":
                    raise _corrupt(step, key, "only an OrderedDict node carries `meta`")
                stack.append((n["meta"], _join(key, "_metadata"), depth + 1))
            for k, v in zip(keys, values):
                stack.append((v, _join(key, _key_text(k, key, step)), depth + 2))
        elif tag == "tuple":
            values = n.get("v")
            if not isinstance(values, list):
                raise _corrupt(step, key, "a tuple node needs the list `v`")
            stack.extend((v, _join(key, i), depth + 2) for i, v in enumerate(values))
        else:
            _check_leaf(n, tag, key, step)


_PLAIN = frozenset((str, int, float, bool, type(None)))
"""The types of JSON's scalars, as ``json.loads`` makes them."""


def _quick_refs(node: Any) -> list[dict[str, Any]] | None:
    """The tensor references of ``node`` when :func:`check_tree` passes it,
    judged without the key paths it builds for its errors (a restore of
    100,000 tensors built as many strings): a list only for a tree every
    rule of it passes, None for anything else, which ``check_tree`` then
    judges and names. Scalars are
    taken by exact type (``json.loads`` makes no subclasses). Tensor
    references, most of a state's nodes, are set aside and checked together
    by C-level maps."""
    plain = _PLAIN
    tensors: list[dict[str, Any]] = []
    stack: list[tuple[Any, int]] = [(node, 2)]
    pop, push, extend = stack.pop, stack.append, stack.extend
    while stack:
        n, depth = pop()
        kind = type(n)
        if kind in plain:
            continue
        if depth > MAX_DEPTH:
            return None
        if kind is list:
            extend([(v, depth + 1) for v in n])
            continue
        if kind is not dict:
            return None
        tag = n.get("t")
        if tag == "tensor":
            tensors.append(n)
        elif tag in ("dict", "odict"):  # a tuple: `tag` may be unhashable
            keys, values = n.get("k"), n.get("v")
            if type(keys) is not list or type(values) is not list or len(keys) != len(values):
                return None
            if not plain.issuperset(map(type, keys)):
                return None  # a tagged number, or worse
            if "meta" in n:
                if tag != "odict":
                    return None
                push((n["meta"], depth + 1))
            if depth + 2 <= MAX_DEPTH and set(map(type, values)) == _DICT:
                # All tagged nodes: the tensor references aside at once.
                tags = map(dict.get, values, repeat("t"))
                refs = list(map(operator.eq, tags, repeat("tensor")))
                tensors.extend(compress(values, refs))
                extend([(v, depth + 2) for v in compress(values, map(operator.not_, refs))])
            else:
                extend([(v, depth + 2) for v in values])
        elif tag == "tuple":
            values = n.get("v")
            if type(values) is not list:
                return None
            extend([(v, depth + 2) for v in values])
        else:
            try:
                _check_leaf(n, tag, "", None)
            except CheckpointCorrupt:
                return None
    return tensors if _plain_refs(tensors) else None


_DICT = {dict}


def _plain_refs(refs: list[dict[str, Any]]) -> bool:
    """Whether every tensor reference of ``refs`` passes ``_check_leaf``:
    a known framework, a string name, plain values only."""
    if not refs:
        return True
    try:
        frameworks = set(map(dict.get, refs, repeat("fw")))
    except TypeError:
        return False  # an unhashable one
    if not frameworks.issubset(ADAPTER_MODULES):  # its keys are strings
        return False
    if set(map(type, map(dict.get, refs, repeat("name")))) != {str}:
        return False
    return _PLAIN.issuperset(map(type, chain.from_iterable(map(dict.values, refs))))


def _check_leaf(n: dict[str, Any], tag: object, key: str, step: int | None) -> None:
    """Checks a tagged node that holds no other node."""
    if tag in ("int", "float"):
        _check_number(n, key, step)
    elif tag == "bytes":
        v = n.get("v")
        if not isinstance(v, str):
            raise _corrupt(step, key, "a bytes node needs the base64 string `v`")
        try:
            base64.b64decode(v, validate=True)
        except (binascii.Error, ValueError) as e:
            raise _corrupt(step, key, f"bytes are not base64 ({e})") from e
    elif tag in ("tensor", "value"):
        fw = n.get("fw")
        if not isinstance(fw, str) or fw not in ADAPTER_MODULES:
            raise _corrupt(step, key, f"unknown framework {fw!r}")
        field = "name" if tag == "tensor" else "kind"
        if not isinstance(n.get(field), str):
            raise _corrupt(step, key, f"a {tag} node needs the string `{field}`")
        if tag == "tensor":
            for f, v in n.items():
                if not _scalar(v):
                    raise _corrupt(step, key, f"tensor field `{f}` is not a plain value")
    else:
        raise _corrupt(step, key, f"unknown tag {tag!r}")


def _check_number(n: dict[str, Any], key: str, step: int | None) -> None:
    if n.get("t") == "int":
        v = n.get("v")
        if not isinstance(v, str) or _DECIMAL.fullmatch(v) is None:
            raise _corrupt(step, key, f"a big int node needs a decimal string, not {v!r}")
    else:
        bits = n.get("bits")
        if not isinstance(bits, str) or _HEX64.fullmatch(bits) is None:
            raise _corrupt(step, key, f"a float node needs 16 hex digits, not {bits!r}")


def _key_text(k: Any, key: str, step: int | None) -> object:
    """A dict key node as it reads in a key path, once checked: a scalar,
    or a tagged big int or non-finite float."""
    if _scalar(k):
        return k
    if isinstance(k, dict) and k.get("t") in ("int", "float"):
        _check_number(k, key, step)
        return k.get("v", k.get("bits"))
    raise _corrupt(step, key, f"a dict key must be a scalar or a tagged number, not {k!r}")


def tensor_refs(node: Any) -> Iterator[dict[str, Any]]:
    """Every tensor reference in a tree, depth first."""
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, list):
            stack.extend(reversed(n))
        elif isinstance(n, dict):
            tag = n.get("t")
            if tag == "tensor":
                yield n
            elif tag in ("dict", "odict"):
                if "meta" in n:
                    stack.append(n["meta"])
                stack.extend(reversed(n["v"]))
            elif tag == "tuple":
                stack.extend(reversed(n["v"]))


class Decoder:
    """Builds Python values from a tree that :func:`parse` checked; tensors
    come from ``tensor(ref, key)``. A malformed node (a tree not checked)
    raises ``CheckpointCorrupt`` naming its key, as does a framework value
    its adapter cannot rebuild."""

    def __init__(
        self,
        adapters: Adapters,
        tensor: Callable[[dict[str, Any], str], object],
        step: int | None = None,
    ) -> None:
        self.adapters = adapters
        self.tensor = tensor
        self.step = step

    def key(self, node: Any, key: str) -> Any:
        if isinstance(node, (str, int, float, bool)) or node is None:
            return node
        return self.value(node, key)

    def value(self, node: Any, key: str) -> Any:
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        if isinstance(node, list):
            return [self.value(v, _join(key, i)) for i, v in enumerate(node)]
        if not isinstance(node, dict):
            raise _corrupt(self.step, key, f"unexpected {type(node).__name__}")
        tag = node.get("t")
        if tag in ("dict", "odict"):
            keys = [self.key(k, key) for k in node["k"]]
            if len(keys) != len(node["v"]):
                raise _corrupt(self.step, key, "keys and values differ in number")
            out: dict[Any, Any] = OrderedDict() if tag == "odict" else {}
            for k, v in zip(keys, node["v"]):
                out[k] = self.value(v, _join(key, k))
            if len(out) != len(keys):
                raise _corrupt(self.step, key, "two keys are equal once decoded (1, 1.0, True)")
            if "meta" in node:
                out._metadata = self.value(node["meta"], _join(key, "_metadata"))  # type: ignore[attr-defined]
            return out
        if tag == "tuple":
            return tuple(self.value(v, _join(key, i)) for i, v in enumerate(node["v"]))
        if tag == "int":
            return int(node["v"])
        if tag == "float":
            return struct.unpack(">d", bytes.fromhex(node["bits"]))[0]
        if tag == "bytes":
            return base64.b64decode(node["v"])
        if tag == "tensor":
            return self.tensor(node, key)
        if tag == "value":
            return self.framework_value(node, key)
        raise _corrupt(self.step, key, f"unknown tag {tag!r}")

    def framework_value(self, node: dict[str, Any], key: str) -> object:
        """A ``value`` node through its adapter. Whatever the adapter raises
        while rebuilding one (an unknown kind, a payload of the wrong type)
        comes from the checkpoint's bytes: ``CheckpointCorrupt``."""
        adapter = self.adapters.get(node["fw"], key)
        kind, v = node["kind"], node.get("v")
        try:
            return adapter.decode_value(kind, v, key)
        except Exception as e:
            raise _corrupt(
                self.step, key, f"{node['fw']} value {kind}={v!r:.80}: {type(e).__name__}: {e}"
            ) from e


def decoded_items(node: dict[str, Any], decoder: Decoder, key: str) -> list[tuple[Any, Any]]:
    """``(key, child node)`` pairs of a dict node, keys decoded."""
    keys = [decoder.key(k, key) for k in node["k"]]
    if len(keys) != len(node["v"]):
        raise _corrupt(decoder.step, key, "keys and values differ in number")
    return list(zip(keys, node["v"]))


def is_tensor_node(node: Any) -> bool:
    return isinstance(node, dict) and node.get("t") == "tensor"


def node_kind(node: Any) -> str:
    """A short name of what a node holds, for error messages."""
    if isinstance(node, dict):
        tag = node.get("t")
        return {"odict": "dict", "value": "framework value"}.get(str(tag), str(tag))
    if isinstance(node, list):
        return "list"
    return type(node).__name__ if node is not None else "None"
