"""Plans kept from one save or ``load(into=)`` to the next while the state's
structure is unchanged, so the per-tensor Python work of a training loop's
repeated saves and restores runs once.

A plan is reused only when a fresh walk of the state gives the same
*signature*: for every container, its type and keys (with their types) or
length, and its identity when a load plan assigns into it; for every
tensor, what the plan read of it (type, address, shape, strides, dtype,
device, layout, ``requires_grad``); for every other leaf, its type, and for
a save its value (it is in the checkpoint's JSON), unless the save plan
keeps a :class:`ValuesTemplate`: the values JSON with a hole for each plain
value, filled anew at each save, so a step counter or a scheduler's epoch
that changes at every save does not make it plan again.
Anything else the plan depends on is compared too: the checkpoint's values
and entries for a load, the options of a save. A state that changed in any
of these ways takes the full path, which checks it and plans afresh.

Only plans whose copies are all plain host copies are kept (contiguous CPU
tensors): device and strided copies need views of the slot of the save or
load in hand.
"""

from __future__ import annotations

import functools
import operator
import re
import secrets
import struct
from collections import OrderedDict
from collections.abc import Callable, Container
from typing import Any

from acp._acp import InvalidInput
from acp._codec import PLAIN_TYPES, Adapters, _join, dumps, parse_refs, plain_json, tensor_refs
from acp._overlap import Split

Signature = list[Any]
BatchFn = Callable[[list[object]], Any]
KeepFn = Callable[[list[object]], list[object]]

_PLAIN = tuple(PLAIN_TYPES)
_CONTAINERS = (dict, OrderedDict, list, tuple)


class Walker:
    """Signatures of states, with the per-type lookups of one checkpointer's
    adapters cached (a type's framework never changes).

    A walk records each container (its type, keys and key types or length,
    and the types of its values when all of them are framework values, the
    common case of a state dict) and each plain value; the framework values
    (tensors) are gathered in walk order and signed at the end, one batch
    per adapter (``Adapter.signatures``: what ``describe`` and the copy
    plans read of each, in as few interpreter steps as the framework
    allows)."""

    def __init__(self, adapters: Adapters) -> None:
        self.adapters = adapters
        # Per type: the batch signature of its framework, None when a value
        # of it cannot be planned from a signature (plain values and
        # containers are recorded by the walk itself).
        self.by_type: dict[type, BatchFn | None] = dict.fromkeys(_PLAIN + _CONTAINERS)
        # The types whose batch signature is known: a container whose
        # values are all of these is recorded in one step.
        self.leafy: dict[type, BatchFn] = {}
        self.keepers: dict[type, KeepFn] = {}

    def _batch_fn(self, kind: type, obj: object) -> BatchFn | None:
        framework = self.adapters.framework_of(obj)
        fn = keep = None
        if framework is not None:
            adapter = self.adapters.get(framework, "")
            fn = getattr(adapter, "signatures", None)
            keep = getattr(adapter, "keep_alive", None)
        if fn is None or keep is None:
            fn = None  # both or neither
        else:
            self.keepers[kind] = keep
            self.leafy[kind] = fn
        self.by_type[kind] = fn
        return fn

    def _all_leafy(self, kinds: set[type], vals: list[Any], types: tuple[type, ...]) -> bool:
        """Whether every type in ``kinds`` (those of ``vals``) has a batch
        signature; looks up the types not seen before."""
        leafy = self.leafy
        if kinds.issubset(leafy):
            return True
        for kind in kinds:
            if kind not in self.by_type:
                self._batch_fn(kind, vals[types.index(kind)])
        return kinds.issubset(leafy)

    def keep_alive(self, leaves: list[object]) -> list[object]:
        """What keeps the memory of ``leaves`` (a walk's) alive while an
        engine copy reads it without the GIL: the adapters' answer."""
        keepers = self.keepers
        keeps = {keepers[kind] for kind in set(map(type, leaves))}
        if len(keeps) == 1:
            return keeps.pop()(leaves)
        groups: dict[KeepFn, list[object]] = {}
        for v in leaves:
            groups.setdefault(keepers[type(v)], []).append(v)
        return [k for keep, objs in groups.items() for k in keep(objs)]

    def walk(
        self,
        state: object,
        *,
        values: bool,
        targets: Container[int] = (),
        limit: int | None = None,
    ) -> tuple[Signature, list[object], list[object]] | None:
        """``(signature, framework leaves, containers)`` of ``state``, or
        None when it cannot be planned from a signature (a leaf with no
        signature, a framework that gives none, more than ``limit`` entries:
        a state that grew, or contains itself). ``values``: plain leaves are
        recorded by value (a save), else by type (a load assigns them).
        ``targets``: the ids of the containers a load plan assigns into;
        those are recorded by identity too, and returned, for the plan to
        keep alive (an id is unique only among live objects); any other
        container is recorded by its structure alone (a load plan assigns
        into the targets and replaces what is under them; the containers
        above them only lead there, and a value it assigned, a fresh
        object each load, must not make the next load plan again)."""
        sig: Signature = []
        leaves: list[object] = []
        containers: list[object] = []
        append = sig.append
        stack = [state]
        pop, push, extend = stack.pop, stack.append, stack.extend
        by_type = self.by_type
        # Each turn appends one entry to ``sig``: ``limit`` bounds the turns.
        while stack:
            if limit is not None and len(sig) > limit:
                return None
            v = pop()
            t = type(v)
            if t in _CONTAINERS:
                ident = id(v) if id(v) in targets else 0
                vals, fast = self._container(v, t, ident, append)
                if ident:
                    containers.append(v)
                if t is OrderedDict:
                    push(getattr(v, "_metadata", None))
                if fast:
                    leaves.extend(vals)
                else:
                    extend(vals)
            elif t in _PLAIN:
                if not values:
                    append(t)
                elif t is float:
                    # By bits: -0.0 == 0.0 and nan != nan, but the JSON differs.
                    append((t, struct.pack(">d", v)))
                else:
                    append((t, v))
            else:
                try:
                    fn = by_type[t]
                except KeyError:
                    fn = self._batch_fn(t, v)
                if fn is None:
                    return None  # a container subclass, an unknown value
                append(t)  # its place; its signature comes with its batch
                leaves.append(v)
        try:
            sig.extend(self._sign(leaves))
        except Exception:
            return None  # e.g. a sparse tensor has no address: the full path says why
        return sig, leaves, containers

    def _container(
        self, v: Any, t: type, ident: int, append: Callable[[Any], None]
    ) -> tuple[list[Any], bool]:
        """Records container ``v`` of type ``t``: its type, ``ident`` (its
        id, or 0), keys and key types or length, and its values' types when
        they are all framework values; returns its values and whether they
        are (gathered as leaves, signed at the end; else walked)."""
        if t is dict or t is OrderedDict:
            keys = tuple(v)
            vals = list(v.values())
            types = tuple(map(type, vals))
            fast = self._all_leafy(set(types), vals, types)
            append((t, ident, keys, tuple(map(type, keys)), types if fast else None))
            return vals, fast
        types = tuple(map(type, v))
        fast = self._all_leafy(set(types), v, types)
        append((t, ident, len(v), types if fast else None))
        return v, fast

    def _sign(self, leaves: list[object]) -> list[Any]:
        """The batch signatures of ``leaves``, one per adapter, in the
        order the adapters first appear."""
        leafy = self.leafy
        fns = {leafy[kind] for kind in set(map(type, leaves))}
        if len(fns) <= 1:
            return [fn(leaves) for fn in fns]
        groups: dict[BatchFn, list[object]] = {}
        for v in leaves:
            groups.setdefault(leafy[type(v)], []).append(v)
        return [fn(objs) for fn, objs in groups.items()]


_parsed: list[tuple[str, Any, list[dict[str, Any]] | None]] = []
"""The last ``(values JSON, tree, its tensor references or None)``
:func:`parse_cached` parsed (``acp._codec.parse_refs``)."""


def _parse_held(values_json: str, step: int) -> tuple[str, Any, list[dict[str, Any]] | None]:
    held = _parsed[0] if _parsed else None
    if held is not None and held[0] == values_json:
        return held
    node, refs = parse_refs(values_json, step)
    _parsed[:] = [(values_json, node, refs)]
    return _parsed[0]


def parse_cached(values_json: str, step: int) -> Any:
    """:func:`acp._codec.parse` of ``values_json``, the last tree kept:
    restoring the same checkpoint structure again parses and checks it
    once. Callers must not modify the tree."""
    return _parse_held(values_json, step)[1]


_NAME = operator.itemgetter("name")

_names: list[tuple[str, frozenset[str]]] = []
"""The last ``(values JSON, tensor names)`` :func:`ref_names_cached` gave."""


def ref_names_cached(values_json: str, step: int) -> frozenset[str]:
    """The names of the tensors the values tree ``values_json`` refers to
    (those given as strings; :mod:`acp._load` names a malformed one), the
    last answer kept as :func:`parse_cached` keeps its tree."""
    held = _names[0] if _names else None
    if held is not None and held[0] == values_json:
        return held[1]
    _, node, refs = _parse_held(values_json, step)
    if refs is not None:  # the quick check's, names checked to be strings
        names = frozenset(map(_NAME, refs))
    else:
        names = frozenset(
            name for ref in tensor_refs(node) if isinstance(name := ref.get("name"), str)
        )
    _names[:] = [(values_json, names)]
    return names


HostCopy = tuple[int, int, int]
"""``(tensor index, address, nbytes)``: one range of an engine copy."""

Spec = tuple[str, str, tuple[int, ...]]
"""``(name, dtype, shape)`` of a tensor being saved."""


class LoadPlan:
    """A ``load(into=)`` of host tensors, kept for the next load of the same
    checkpoint structure into the same ``into`` structure."""

    __slots__ = (
        "assigns",
        "containers",
        "copied",
        "entries",
        "host",
        "sig",
        "targets",
        "values_json",
    )

    def __init__(
        self,
        values_json: str,
        entries: list[Any],
        host: list[HostCopy],
        assigns: list[tuple[Any, Any, Callable[[], Any]]],
        copied: int,
    ) -> None:
        self.values_json = values_json
        self.entries = entries
        self.host = host
        self.assigns = assigns
        self.copied = copied
        # Values assigned into containers: the same containers, by identity.
        self.targets = frozenset(id(c) for c, _, _ in assigns)
        self.sig: Signature = []
        self.containers: list[object] = []


_META = object()
"""The step of a :class:`ValuesTemplate` path into an ``OrderedDict``'s
``_metadata``."""


class ValuesTemplate:
    """The values JSON of a save with a hole for each plain value: ``parts``
    around the holes, and for each hole (in the text's order) the path of
    its value from the state's root (dict keys, list and tuple indices,
    :data:`_META`). A state with the plan's signature (plain values by type)
    has a value of the same type at each path; :meth:`render` encodes them
    as the codec does (:func:`acp._codec.plain_json`) and fills the holes."""

    __slots__ = ("parts", "paths")

    def __init__(self, parts: list[str], paths: list[tuple[Any, ...]]) -> None:
        self.parts = parts
        self.paths = paths

    @classmethod
    def of(cls, state: object, tree: dict[str, Any], values_json: str) -> ValuesTemplate | None:
        """The template of ``state``, whose values tree is ``tree`` (the
        flattener's, put back as it was before this returns) and whose
        values JSON is ``values_json``; None when ``state`` holds no plain
        value or the template does not give ``values_json`` back."""
        holes: list[tuple[Any, Any, Any]] = []
        _holes(state, tree, "state", (), holes)
        spots = [(where, at) for where, at, _ in holes]
        paths = [path for _, _, path in holes]
        if not spots:
            return None
        nonce = secrets.token_hex(8)
        kept = [where[at] for where, at in spots]
        try:
            for i, (where, at) in enumerate(spots):
                where[at] = f"\0acp{nonce}:{i}\0"
            text = dumps(tree)
        finally:
            for (where, at), node in zip(spots, kept):
                where[at] = node
        pieces = re.split(r'"\\u0000acp' + nonce + r':(\d+)\\u0000"', text)
        order = [int(i) for i in pieces[1::2]]
        if sorted(order) != list(range(len(spots))):
            return None
        template = cls(pieces[0::2], [paths[i] for i in order])
        try:
            if template.render(state) != values_json:
                return None
        except Exception:
            return None
        return template

    def render(self, state: object) -> str:
        """The values JSON of ``state`` (with the template's signature).

        Raises:
            InvalidInput: a value the codec refuses (a string that is not
                valid Unicode), naming its key path.
        """
        parts = self.parts
        out = [parts[0]]
        for path, part in zip(self.paths, parts[1:]):
            v: Any = state
            for step in path:
                v = v._metadata if step is _META else v[step]
            try:
                out.append(plain_json(v, ""))
            except InvalidInput:
                plain_json(v, _key_of(path))  # raises again, naming the key
                raise
            out.append(part)
        return "".join(out)


def _key_of(path: tuple[Any, ...]) -> str:
    """The key path of a :class:`ValuesTemplate` path, as the codec writes
    key paths in its messages."""
    return functools.reduce(_join, ("_metadata" if s is _META else s for s in path), "")


def _holes(
    obj: object, where: Any, at: Any, path: tuple[Any, ...], out: list[tuple[Any, Any, Any]]
) -> None:
    """Appends to ``out``, for each plain value under ``obj`` (whose tree
    node is ``where[at]``), where its node is in the tree and its path from
    the state's root. Tensors and framework values are left alone;
    containers are followed as the codec lays them out."""
    t = type(obj)
    if t in PLAIN_TYPES:
        out.append((where, at, path))
        return
    node = where[at]
    if t is dict or t is OrderedDict:
        vals = node["v"]
        for i, (k, v) in enumerate(obj.items()):  # type: ignore[attr-defined]
            _holes(v, vals, i, (*path, k), out)
        meta = getattr(obj, "_metadata", None) if t is OrderedDict else None
        if meta is not None:
            _holes(meta, node, "meta", (*path, _META), out)
    elif t is list:
        for i, v in enumerate(obj):  # type: ignore[arg-type]
            _holes(v, node, i, (*path, i), out)
    elif t is tuple:
        vals = node["v"]
        for i, v in enumerate(obj):  # type: ignore[arg-type]
            _holes(v, vals, i, (*path, i), out)


class SavePlan:
    """A save of host tensors, kept for the next save of a state with the
    same signature: with ``template``, plain values by type (each save
    renders its values JSON from it), else by value (they are in
    ``values_json``). ``engine`` is the engine's own plan of the same
    tensors, values and copy ranges (``Engine.save_plan``): a save from it
    passes no list, and its values JSON only when it differs."""

    __slots__ = (
        "engine",
        "frameworks",
        "sig",
        "specs",
        "split",
        "template",
        "tensor_bytes",
        "values_json",
    )

    def __init__(
        self,
        *,
        engine: Any,
        specs: list[Spec],
        values_json: str,
        frameworks: set[str],
        tensor_bytes: int,
        sig: Signature,
        split: Split | None,
        template: ValuesTemplate | None = None,
    ) -> None:
        self.engine = engine
        self.specs = specs
        self.values_json = values_json
        self.frameworks = frameworks
        self.tensor_bytes = tensor_bytes
        self.sig = sig
        self.split = split
        """Which tensors an overlapped save copies in its stall (acp._overlap)."""
        self.template = template

    def values_of(self, state: object) -> str:
        """The values JSON of a save of ``state`` (with this plan's
        signature): rendered from the template, else the plan's."""
        return self.values_json if self.template is None else self.template.render(state)


class Plans:
    """The plans of one checkpointer: the last save's and the last load's.

    A load plan that assigns values keeps ``into``'s containers alive until
    it is replaced or :meth:`clear` is called (``close()``)."""

    def __init__(self, adapters: Adapters) -> None:
        self.walker = Walker(adapters)
        self.save: SavePlan | None = None
        self.load: LoadPlan | None = None
        self.eager_names: set[str] = set()
        """Tensors an overlapped save found changed: copied in the stall
        from then on (acp._overlap)."""

    def clear(self) -> None:
        self.save = None
        self.load = None

    # --- save ---

    def saved(
        self,
        state: object,
        *,
        engine: Any,
        specs: list[Spec],
        values_json: str,
        frameworks: set[str],
        tensor_bytes: int,
        host: list[tuple[int, int, int]] | None = None,
        objs: list[object] | None = None,
        tree: dict[str, Any] | None = None,
    ) -> list[object] | None:
        """Keeps the plan of a save that took the full path; ``engine``
        None: not all plain host copies, nothing kept. ``host`` and
        ``objs``: the save's copy ranges and its tensors, in entry order
        (for overlapped saves). ``tree``: the save's values tree, from
        which a :class:`ValuesTemplate` is made. Returns the walk's leaves
        (the state's tensors, in walk order) when a plan is kept."""
        self.save = None
        if engine is None:
            return None
        template = None if tree is None else ValuesTemplate.of(state, tree, values_json)
        walked = self.walker.walk(state, values=template is None)
        if walked is not None:
            split = None
            if host is not None and objs is not None:
                split = Split(host, walked[1], objs, [s[0] for s in specs], self.eager_names)
            self.save = SavePlan(
                engine=engine,
                specs=specs,
                values_json=values_json,
                frameworks=frameworks,
                tensor_bytes=tensor_bytes,
                sig=walked[0],
                split=split,
                template=template,
            )
            return walked[1]
        return None

    def for_save(self, state: object) -> tuple[SavePlan, list[object], list[object]] | None:
        """The kept plan when ``state`` has its signature, with what keeps
        its tensors' memory alive while the copy runs, and the walk's
        leaves (its tensors, in walk order)."""
        plan = self.save
        if plan is None:
            return None
        walked = self.walker.walk(state, values=plan.template is None, limit=len(plan.sig))
        if walked is None or walked[0] != plan.sig:
            return None
        return plan, self.walker.keep_alive(walked[1]), walked[1]

    # --- load ---

    def loaded(self, plan: LoadPlan, into: object) -> None:
        """Keeps ``plan``, once its assigns ran (its signature is of
        ``into`` as the load left it)."""
        self.load = None
        walked = self.walker.walk(into, values=False, targets=plan.targets)
        if walked is not None:
            plan.sig, _, plan.containers = walked
            self.load = plan

    def for_load(
        self, values_json: str, entries: list[Any], into: object
    ) -> tuple[LoadPlan, list[object]] | None:
        """The kept plan when ``into`` has its signature, with what keeps
        the memory of ``into``'s tensors alive while the copy writes it
        without the GIL (another thread may rebind a tensor meanwhile: its
        memory, freed, would be another object's by then)."""
        plan = self.load
        if plan is None or values_json != plan.values_json or entries != plan.entries:
            return None
        walked = self.walker.walk(into, values=False, targets=plan.targets, limit=len(plan.sig))
        if walked is None or walked[0] != plan.sig:
            return None
        return plan, self.walker.keep_alive(walked[1])
