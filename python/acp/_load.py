"""Turning a loaded checkpoint back into state: fresh, or into existing
tensors and containers (``load(into=...)``)."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any, cast

from acp._acp import CheckpointCorrupt, InvalidInput, Loaded
from acp._codec import (
    Adapter,
    Adapters,
    Decoder,
    Entry,
    Transfer,
    _join,
    _where,
    decoded_items,
    is_tensor_node,
    node_kind,
    parse,
    tensor_refs,
)
from acp._plan import LoadPlan, Plans, parse_cached
from acp.distributed import Sources


def entries_of(loaded: Any) -> dict[str, Entry]:
    return {
        name: Entry(i, name, dtype, tuple(shape), nbytes)
        for i, (name, dtype, shape, nbytes) in enumerate(loaded.entries())
    }


def read_failed(loaded: Any) -> bool:
    """Whether ``loaded`` was a pending storage load whose read failed (a
    chunk that did not verify, an I/O error): the load failed, and a
    fallback may try the next source."""
    return bool(getattr(loaded, "failed", False))


def run_transfers(
    copy: Callable[[list[tuple[int, int, int]]], None],
    transfers: Sequence[Transfer],
    always: bool = False,
) -> None:
    """Starts the adapters' own copies, runs the one engine copy (parallel,
    GIL released) meanwhile, then waits for the adapters' copies. With
    ``always``, the engine copy runs even with nothing to copy (it is the
    read of a pending load)."""
    host = [r for t in transfers for r in t.host]
    jobs = [j for t in transfers for j in t.jobs]
    try:
        for job in jobs:
            job.start()
        if host or always:
            copy(host)
        for job in jobs:
            job.wait()
    finally:
        for job in jobs:
            job.close()


def _ALWAYS(i: int) -> bool:
    return True


def _NEVER(i: int) -> bool:
    return False


class _Fresh:
    """Fresh values for tree nodes: every tensor they reference is created
    and filled in one batch, then the nodes are decoded."""

    def __init__(
        self,
        loaded: Any,
        adapters: Adapters,
        entries: dict[str, Entry],
        zero_copy: bool = False,
        give: bool = False,
    ) -> None:
        self.loaded = loaded
        self.adapters = adapters
        self.entries = entries
        self.zero_copy = zero_copy
        self.give = give
        self.refs: dict[str, dict[str, Any]] = {}
        self.tensors: dict[str, tuple[Adapter, object]] = {}
        self.decoder = Decoder(adapters, self.value, loaded.step)

    def value(self, ref: dict[str, Any], key: str) -> object:
        adapter, obj = self.tensors[ref["name"]]
        return adapter.result(obj, ref)

    def want(self, node: Any) -> None:
        for ref in tensor_refs(node):
            name = ref.get("name")
            if not isinstance(name, str):
                raise CheckpointCorrupt(
                    f"step {self.loaded.step}: malformed tensor reference {ref!r}"
                )
            if name not in self.entries:
                raise CheckpointCorrupt(
                    f"step {self.loaded.step}: the values refer to tensor `{name}`, "
                    "which the checkpoint does not hold"
                )
            self.refs.setdefault(name, ref)

    def transfers(self, map_location: Any) -> list[Transfer]:
        groups: dict[str, list[tuple[Entry, dict[str, Any]]]] = {}
        for name, ref in self.refs.items():
            groups.setdefault(str(ref.get("fw")), []).append((self.entries[name], ref))
        adapters = {fw: self.adapters.get(fw, items[0][0].name) for fw, items in groups.items()}
        viewed = self._viewed(adapters)
        out = []
        for framework, items in groups.items():
            adapter = adapters[framework]
            view = getattr(adapter, "view_tensors", None)
            # Views of the image where it was handed over (by an adapter
            # that makes views), copies elsewhere.
            views = [it for it in items if view is not None and viewed(it[0].index)]
            copies = [it for it in items if view is None or not viewed(it[0].index)]
            for make, picked in ((view, views), (adapter.new_tensors, copies)):
                if make is None or not picked:
                    continue
                objs, transfer = make(self.loaded, picked, map_location)
                self.tensors.update((e.name, (adapter, obj)) for (e, _), obj in zip(picked, objs))
                out.append(transfer)
        return out

    def _viewed(self, adapters: dict[str, Adapter]) -> Callable[[int], bool]:
        """Whether the tensor at entry index ``i`` is made a view of the
        loaded image rather than a copy: a private image (not a ring slot)
        is handed to the tensors when every adapter can make views, since
        copying it would only double the memory (mixed with an adapter that
        copies, it is copied). Of several files (another rank's tensors,
        ``acp.distributed.Sources``), each file's image that is private."""
        if self.zero_copy:
            return _ALWAYS
        if not (self.give and all(hasattr(a, "view_tensors") for a in adapters.values())):
            return _NEVER
        give_each = getattr(self.loaded, "give_each", None)
        if give_each is not None:
            given: Callable[[int], bool] = give_each()
            return given
        return _ALWAYS if self.loaded.give() else _NEVER


def load_state(loaded: Any, adapters: Adapters, map_location: Any, zero_copy: bool = False) -> Any:
    """A fresh state from a loaded checkpoint. With ``zero_copy``, the
    tensors restored on the CPU (by adapters that can: ``acp.torch``) view
    the loaded image instead of owning copies: the image is made read-only
    (``Loaded.protect``) and stays pinned until every such tensor is gone.
    When it cannot be protected, they are copied.

    Without ``zero_copy``, an image in private memory (a peer's replica,
    another rank's slot copied out, a storage read with no slot free; never
    a ring slot) is handed to the tensors (``Loaded.give``): they are
    writable views of it, which own it together, and nothing is copied."""
    node = parse(loaded.values_json, loaded.step)
    ours = type(loaded) is Loaded
    zero_copy = zero_copy and ours and loaded.protect()
    give = (ours or hasattr(loaded, "give_each")) and not zero_copy
    fresh = _Fresh(loaded, adapters, entries_of(loaded), zero_copy, give=give)
    try:
        fresh.want(node)
        # Also with nothing to copy: a pending load's read (which verifies
        # the values too) is this call.
        pending = bool(getattr(loaded, "pending", False))
        run_transfers(loaded.copy_into, fresh.transfers(map_location), always=pending)
        return fresh.decoder.value(node, "")
    finally:
        # `fresh` is in a reference cycle (its decoder calls back into it):
        # it must keep neither the checkpoint nor the tensors made of it
        # (zero-copy views own the image, and pin its ring slot), which
        # would otherwise live until the garbage collector runs, after the
        # caller dropped them (and `save`, waiting for a slot, pauses it).
        fresh.loaded = None
        fresh.tensors.clear()


_NAME = operator.itemgetter("name")
_DTYPE_SHAPE = operator.attrgetter("dtype", "shape")

_KEEP = object()
"""A plan result: the target object stays, updated in place."""

Builder = Callable[[], Any]


class _IntoPlanner:
    def __init__(self, loaded: Any, adapters: Adapters) -> None:
        self.loaded = loaded
        self.adapters = adapters
        self.entries = entries_of(loaded)
        self.fresh = _Fresh(loaded, adapters, self.entries)
        self.fills: dict[str, list[tuple[Entry, object, str]]] = {}
        self.assigns: list[tuple[Any, Any, Builder]] = []
        # Tensors of the types an adapter reads in bulk (``target_types``,
        # ``targets``), per framework: (tensor, its node, key), checked
        # against their entries by `check_pending` once the walk is done.
        self.pending: dict[str, list[tuple[object, dict[str, Any], str]]] = {}
        self.bulk: dict[type, str | None] = {}

    def release(self) -> None:
        """Drops what only the planning used. A kept plan's assigns still
        call into the planner (its decoder, for plain values), so the
        planner itself stays."""
        self.entries = self.fresh.entries = {}
        self.fills = {}
        self.pending = {}
        self.bulk = {}
        self.fresh.refs = {}
        self.fresh.tensors = {}

    def error(self, key: str, reason: str) -> InvalidInput:
        return InvalidInput(f"into=: {_where(key)}: {reason}; nothing was loaded")

    def tensor_info(self, obj: object, key: str) -> tuple[str, str, tuple[int, ...]] | None:
        """``(framework, dtype, shape)`` of a tensor ``obj``, else None:
        the adapter's ``target`` where it has one (what a load needs, read
        once per tensor in a first restore), else its ``describe``."""
        framework = self.adapters.framework_of(obj)
        if framework is None:
            return None
        adapter = self.adapters.get(framework, key)
        target = getattr(adapter, "target", None)
        if target is not None:
            got = target(obj, key)
            return None if got is None else (framework, *got)
        info = adapter.describe(obj, key)
        return None if info is None else (framework, info.dtype, info.shape)

    def bulk_framework(self, obj: object, key: str) -> str | None:
        """The framework of ``obj`` when its adapter reads targets of its
        type in bulk, else None."""
        kind = type(obj)
        try:
            return self.bulk[kind]
        except KeyError:
            pass
        framework = self.adapters.framework_of(obj)
        if framework is not None:
            adapter = self.adapters.get(framework, key)
            if kind not in getattr(adapter, "target_types", ()):
                framework = None
        self.bulk[kind] = framework
        return framework

    def fill(self, target: object, node: dict[str, Any], key: str) -> bool:
        """Plans filling the tensor ``target`` from the tensor node
        ``node``; False when ``target`` is not a tensor."""
        framework = self.bulk_framework(target, key)
        if framework is not None:
            self.pending.setdefault(framework, []).append((target, node, key))
            return True
        tensor = self.tensor_info(target, key)
        if tensor is None:
            return False
        framework, dtype, shape = tensor
        entry = self.entry(node, dtype, shape, key)
        self.fills.setdefault(framework, []).append((entry, target, key))
        return True

    def entry(self, node: dict[str, Any], dtype: str, shape: Sequence[int], key: str) -> Entry:
        """The entry of the tensor node ``node``, checked against a target
        of ``dtype`` and ``shape``."""
        entry = self.entries.get(node.get("name"))  # type: ignore[arg-type]
        if entry is None:
            raise CheckpointCorrupt(
                f"step {self.loaded.step}: the values refer to tensor `{node.get('name')}`, "
                "which the checkpoint does not hold"
            )
        if dtype != entry.dtype or tuple(shape) != entry.shape:
            raise self.error(
                key,
                f"the checkpoint has {entry.dtype} {list(entry.shape)}, "
                f"into= has {dtype} {list(shape)}",
            )
        return entry

    def check_pending(self) -> None:
        """Reads the pending tensors' dtypes and shapes in bulk and checks
        them against their entries, as `fill` does one at a time."""
        for framework, items in self.pending.items():
            adapter = self.adapters.get(framework, items[0][2])
            tensors, nodes, keys = map(list, zip(*items))
            targets = adapter.targets(tensors, keys)  # type: ignore[attr-defined]
            found = list(map(self.entries.get, map(_NAME, nodes)))
            if None in found or list(map(_DTYPE_SHAPE, found)) != targets:
                for node, (dtype, shape), key in zip(nodes, targets, keys):
                    self.entry(node, dtype, shape, key)  # raises for the first that differs
            checked = cast("list[Entry]", found)  # none missing: the loop raised
            self.fills.setdefault(framework, []).extend(zip(checked, tensors, keys))
        self.pending.clear()

    def holds_tensor(self, obj: object, key: str) -> bool:
        if isinstance(obj, dict):
            return any(self.holds_tensor(v, key) for v in obj.values())
        if isinstance(obj, (list, tuple)):
            return any(self.holds_tensor(v, key) for v in obj)
        return self.tensor_info(obj, key) is not None

    def new_value(self, node: Any, key: str) -> Builder:
        self.fresh.want(node)
        return lambda: self.fresh.decoder.value(node, key)

    def replace(self, target: object, node: Any, key: str) -> Builder:
        if self.holds_tensor(target, key):
            raise self.error(
                key,
                f"into= has a {type(target).__name__} of tensors, "
                f"the checkpoint a {node_kind(node)}",
            )
        return self.new_value(node, key)

    def plan(self, target: object, node: Any, key: str, top: bool = False) -> Any:
        if is_tensor_node(node):
            return _KEEP if self.fill(target, node, key) else self.replace(target, node, key)
        if self.tensor_info(target, key) is not None:
            raise self.error(key, f"into= has a tensor, the checkpoint a {node_kind(node)}")
        tag = node.get("t") if isinstance(node, dict) else None
        if isinstance(target, dict) and tag in ("dict", "odict"):
            items = decoded_items(node, self.fresh.decoder, key)
            saved = {k for k, _ in items}
            for k in target:
                if k not in saved:
                    raise self.error(
                        _join(key, k), f"not in the checkpoint (step {self.loaded.step})"
                    )
            plan, fill = self.plan, self.fill
            for k, child in items:
                if k in target:
                    sub, t = _join(key, k), target[k]
                    # A tensor into a tensor, the common case, planned here.
                    if type(child) is dict and child.get("t") == "tensor" and fill(t, child, sub):
                        continue
                    result = plan(t, child, sub)
                    if result is not _KEEP:
                        self.assigns.append((target, k, result))
                elif not top:
                    self.assigns.append((target, k, self.new_value(child, _join(key, k))))
            return _KEEP
        if isinstance(target, list) and isinstance(node, list):
            if len(target) != len(node):
                self.assigns.append((target, slice(None), self.replace(target, node, key)))
                return _KEEP
            for i, (t, child) in enumerate(zip(target, node)):
                result = self.plan(t, child, _join(key, i))
                if result is not _KEEP:
                    self.assigns.append((target, i, result))
            return _KEEP
        if isinstance(target, tuple) and tag == "tuple" and len(target) == len(node["v"]):
            results = [
                self.plan(t, c, _join(key, i)) for i, (t, c) in enumerate(zip(target, node["v"]))
            ]
            if all(r is _KEEP for r in results):
                return _KEEP
            parts = list(zip(target, results))
            return lambda: tuple(t if r is _KEEP else r() for t, r in parts)
        return self.replace(target, node, key)


def load_into(
    loaded: Any,
    adapters: Adapters,
    into: object,
    map_location: Any = None,
    plans: Plans | None = None,
) -> int:
    """Copies a loaded checkpoint into ``into``; returns the bytes copied.

    Every tensor of ``into`` must be in the checkpoint with the same dtype
    and shape; every key of its dicts must be in the checkpoint. Tensors are
    filled in place; other values are assigned into their (mutable)
    containers; keys of the checkpoint that ``into``'s dicts lack are added,
    except at the top level, where ``into``'s keys select what is loaded.
    Everything is checked before anything is copied.

    ``loaded`` may be pending (``Engine.load(defer=True)``, a step read
    from storage): its entries and values come from its header, not yet
    verified; the one engine copy is then its read, each chunk verified
    (the header's too, which must be the one planned with) and copied into
    the tensors as it lands, and the values are assigned only after it
    succeeded. A plan refused (``InvalidInput``) reads the step first, so
    that a changed header raises ``CheckpointCorrupt`` instead. When it fails, the exception
    propagates and ``into``'s tensors hold, each, their old bytes or bytes
    of this step (a mix, which may include bytes of a resident chunk that
    failed its check): they must not be used.

    With ``plans``, a load of the same checkpoint structure into an
    ``into`` of the same signature (``acp._plan``) as the last one reuses
    its plan: one engine copy, then the same assigns.
    """
    try:
        return _load_into_planned(loaded, adapters, into, map_location, plans)
    except InvalidInput:
        if getattr(loaded, "pending", False):
            # Planned from a header not verified yet: read (and verify)
            # the step, so that a changed header is reported as the
            # corruption it is, not as a mismatch of into=.
            loaded.copy_into([])
        raise


def _load_into_planned(
    loaded: Any,
    adapters: Adapters,
    into: object,
    map_location: Any,
    plans: Plans | None,
) -> int:
    # Plans are kept for one file, or for the files of a replicated state
    # (``Sources``: its entries are all of theirs, in order).
    keep = plans is not None and (type(loaded) is Loaded or type(loaded) is Sources)
    if keep:
        assert plans is not None
        entries = loaded.entries()
        found = plans.for_load(loaded.values_json, entries, into)
        if found is not None:
            plan, alive = found
            # Also with no tensors: a pending load's read is this call.
            loaded.copy_into(plan.host)
            del alive  # the copy is done: the tensors may go
            for container, k, build in plan.assigns:
                container[k] = build()
            return plan.copied
    node = parse_cached(loaded.values_json, loaded.step)
    planner = _IntoPlanner(loaded, adapters)
    try:
        copied, transfers = _load_into(planner, into, node, map_location)
        if keep:
            assert plans is not None
            if planner.fresh.refs or any(t.jobs or t.keep for t in transfers):
                plans.load = None  # not all plain host copies
            else:
                host = [r for t in transfers for r in t.host]
                plan = LoadPlan(loaded.values_json, entries, host, list(planner.assigns), copied)
                plans.loaded(plan, into)
        return copied
    finally:
        # The planner's builders close over it (a reference cycle): it must
        # not keep the checkpoint's ring slot pinned until the next collection.
        planner.loaded = None
        planner.fresh.loaded = None
        planner.assigns.clear()
        # Nor keep what only the planning needs (an entry and a fill per
        # tensor): a cycle is freed by the collector alone, and all of it
        # would wait for it there, and make its next pass slower (at
        # 20,000 tensors, 30 ms at the end of a first load).
        planner.release()


def _load_into(
    planner: _IntoPlanner, into: object, node: Any, map_location: Any
) -> tuple[int, list[Transfer]]:
    loaded, adapters = planner.loaded, planner.adapters
    if planner.plan(into, node, "", top=True) is not _KEEP:
        raise InvalidInput(
            "into=: must be a dict, list or tensor matching the checkpoint's state "
            f"(the checkpoint holds a {node_kind(node)}); nothing was loaded"
        )
    planner.check_pending()
    transfers = []
    copied = 0
    for framework, items in planner.fills.items():
        adapter = adapters.get(framework, items[0][2])
        pairs = [(entry, target) for entry, target, _ in items]
        transfers.append(adapter.fill_tensors(loaded, pairs, [k for _, _, k in items]))
        copied += sum(e.nbytes for e, _ in pairs)
    transfers.extend(planner.fresh.transfers(map_location))
    copied += sum(planner.entries[name].nbytes for name in planner.fresh.refs)
    run_transfers(loaded.copy_into, transfers, always=True)
    for container, k, build in planner.assigns:
        container[k] = build()
    return copied, transfers
