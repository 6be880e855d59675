"""Loading into a network: ``load_into_net``, ``load_params``, ``resume``."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

from acp._acp import CheckpointCorrupt, CheckpointNotFound, InvalidInput
from acp._codec import Adapter as CodecAdapter
from acp._codec import Decoder, Entry, decoded_items, is_tensor_node, parse
from acp._load import _Fresh, entries_of, run_transfers
from acp._mindspore_codec import FLOATS, INTS, Convert, dtype_from_safetensors
from acp._rank import mindspore_or_env_rank
from acp._stats import load_stats
from acp.checkpointer import (
    Checkpointer,
    LoadStats,
    _step,
    internals,
)
from acp.mindspore.params import PARAMS, param_dict

__all__ = [
    "NetLoad",
    "Resume",
    "engine_load",
    "entry_of",
    "load_into_net",
    "load_params",
    "rank_and_world_size",
    "resume",
    "saved_params",
]

log = logging.getLogger("acp.mindspore")


@dataclass
class NetLoad:
    """What ``load_into_net`` did. Unpacks like the result of
    ``mindspore.load_param_into_net``::

        param_not_load, ckpt_not_load = acp.mindspore.load_into_net(ckpt, net)
    """

    step: int
    param_not_load: list[str]
    """Parameters of the network (and optimizer) the checkpoint did not have."""
    ckpt_not_load: list[str]
    """Parameters of the checkpoint that went nowhere."""
    values: dict[str, Any] = field(default_factory=dict)
    """The checkpoint's other top-level values (epoch, step, ...)."""
    stats: LoadStats | None = None

    def __iter__(self) -> Iterator[list[str]]:
        return iter((self.param_not_load, self.ckpt_not_load))


def saved_params(
    root: Any, decoder: Decoder
) -> tuple[dict[str, dict[str, Any]], list[tuple[Any, Any]]]:
    """The tensor references that are parameters, by parameter name, and
    the other top-level ``(key, node)`` pairs.

    A state written by ``save``/``AcpCheckpoint`` keeps them under
    ``"params"``; any other state (a plain parameter dict, a PyTorch state
    dict...) gives every tensor, named by its dotted key path."""
    if not (isinstance(root, dict) and root.get("t") in ("dict", "odict")):
        return {}, []
    items = decoded_items(root, decoder, "")
    holder = dict(items).get(PARAMS)
    if isinstance(holder, dict) and holder.get("t") in ("dict", "odict"):
        refs = {}
        for k, node in decoded_items(holder, decoder, PARAMS):
            if is_tensor_node(node):
                refs[str(k)] = node
        return refs, [(k, n) for k, n in items if k != PARAMS]
    refs = {}
    rest = []
    for k, node in items:
        if is_tensor_node(node):
            refs[str(k)] = node
            continue
        nested = list(_named_refs(node, decoder, str(k)))
        if nested:
            refs.update(nested)
        else:
            rest.append((k, node))
    return refs, rest


def _named_refs(node: Any, decoder: Decoder, key: str) -> Iterator[tuple[str, dict[str, Any]]]:
    if is_tensor_node(node):
        yield key, node
    elif isinstance(node, dict) and node.get("t") in ("dict", "odict"):
        for k, child in decoded_items(node, decoder, key):
            yield from _named_refs(child, decoder, f"{key}.{k}")
    elif isinstance(node, dict) and node.get("t") == "tuple":
        for i, child in enumerate(node["v"]):
            yield from _named_refs(child, decoder, f"{key}.{i}")
    elif isinstance(node, list):
        for i, child in enumerate(node):
            yield from _named_refs(child, decoder, f"{key}.{i}")


def _match(
    targets: Mapping[str, Any], saved: Sequence[str], strict_load: bool
) -> tuple[dict[str, str], list[str]]:
    """Network name -> checkpoint name, and the network names not found; as
    ``load_param_into_net``: exact names, then (unless ``strict_load``) a
    common prefix the checkpoint's names have (``model.`` for
    ``model.fc.weight`` vs ``fc.weight``)."""
    present = set(saved)
    matched: dict[str, str] = {}
    missing: list[str] = []
    for name in targets:
        if name in present:
            matched[name] = name
        elif not name.startswith("accu_grads"):
            missing.append(name)
    while missing and not strict_load:
        free = present - set(matched.values())  # each saved tensor goes to one parameter
        prefix = next(
            (
                s[: -len(n)]
                for n in missing
                for s in saved
                if s in free and s.endswith(n) and s != n
            ),
            None,
        )
        if prefix is None:
            break
        for n in missing:
            if prefix + n in free:
                matched[n] = prefix + n
                free.discard(prefix + n)
        missing = [n for n in missing if n not in matched]
    return matched, missing


def load_into_net(
    ckpt: Checkpointer,
    net: Any,
    optimizer: Any = None,
    *,
    step: int | None = None,
    strict_load: bool = False,
    storage_only: bool = False,
    fallback: bool = False,
    rank: int | None = None,
) -> NetLoad:
    """Loads a step (the newest when None) into ``net`` and ``optimizer``
    in place, like ``mindspore.load_param_into_net(net,
    mindspore.load_checkpoint(...))``, from RAM when the step is resident.

    Parameters are matched by name; unless ``strict_load``, names the
    checkpoint has under a common prefix match too, and a float (int)
    parameter saved as another float (int) type is converted. Parameters on
    the CPU are filled in place by the engine (no intermediate copy).

    Works on any acp checkpoint: one written by ``save``/``AcpCheckpoint``
    (parameters under ``"params"``), a plain parameter dict, or another
    framework's state (tensors named by their key paths).

    Returns a ``NetLoad`` (unpacks as ``param_not_load, ckpt_not_load``).

    Raises:
        acp.InvalidInput: naming the parameter, before anything is copied,
            when a shape differs, a dtype differs (and cannot be converted),
            or the checkpoint's dtype has no MindSpore type.
        acp.CheckpointNotFound, acp.CheckpointCorrupt: as ``Checkpointer.load``.
    """
    targets = param_dict(net, optimizer)
    t0 = perf_counter()
    loaded = engine_load(ckpt, step, storage_only, fallback, rank)
    t1 = perf_counter()
    inner = internals(ckpt)
    adapters = inner.adapters
    entries = entries_of(loaded)
    fresh = _Fresh(loaded, adapters, entries)
    refs, rest = saved_params(parse(loaded.values_json, loaded.step), fresh.decoder)
    matched, param_not_load = _match(targets, list(refs), strict_load)
    used = set(matched.values())
    ckpt_not_load = [name for name in refs if name not in used]

    adapter = adapters.get("mindspore", "")
    fills: list[tuple[Entry, Any]] = []
    converts: list[tuple[Entry, Any]] = []
    for name, saved_name in matched.items():
        entry = entry_of(entries, refs[saved_name], loaded.step)
        convert = _check_param(
            adapter, name, targets[name], entry, loaded.step, strict_load=strict_load
        )
        (converts if convert else fills).append((entry, targets[name]))
    for _, node in rest:
        fresh.want(node)

    transfers = [adapter.fill_tensors(loaded, fills, [p.name for _, p in fills])]
    if converts:
        srcs, transfer = adapter.new_tensors(loaded, [(e, {}) for e, _ in converts], None)
        transfer.jobs.append(Convert([(p, s) for (_, p), s in zip(converts, srcs)]))
        transfers.append(transfer)
    transfers.extend(fresh.transfers(None))
    run_transfers(loaded.copy_into, transfers)
    values = {k: fresh.decoder.value(node, str(k)) for k, node in rest}
    copied = sum(e.nbytes for e, _ in fills + converts)
    copied += sum(entries[n].nbytes for n in fresh.refs)
    stats = load_stats(loaded.report(), t0, t1, perf_counter(), copied)
    del loaded
    ckpt.last_load = stats
    inner.metrics.loaded(stats)
    if param_not_load:
        log.warning(
            "load_into_net: %d parameters of the network are not in step %d: %s",
            len(param_not_load),
            stats.step,
            param_not_load,
        )
    return NetLoad(stats.step, param_not_load, ckpt_not_load, values, stats)


def engine_load(
    ckpt: Checkpointer, step: int | None, storage_only: bool, fallback: bool, rank: int | None
) -> Any:
    """The engine's load (``acp._acp.Loaded``), as ``Checkpointer.load`` does it."""
    ckpt.engine  # noqa: B018 (raises acp.EngineClosed when closed)
    return internals(ckpt).load(None if step is None else _step(step), storage_only, fallback, rank)


def entry_of(entries: Mapping[str, Entry], ref: Mapping[str, Any], step: int) -> Entry:
    name = ref.get("name")
    entry = entries.get(name) if isinstance(name, str) else None
    if entry is None:
        raise CheckpointCorrupt(
            f"step {step}: the values refer to tensor `{name}`, which the checkpoint does not hold"
        )
    return entry


def _check_param(
    adapter: CodecAdapter, name: str, param: Any, entry: Entry, step: int, *, strict_load: bool
) -> bool:
    """Checks that ``entry`` can be loaded into ``param``; True when its
    dtype must be converted (``load_param_into_net`` converts float to
    float and int to int unless ``strict_load``)."""
    dtype_from_safetensors(entry.dtype, f"parameter `{name}`")
    have = adapter.describe(param, name)
    if have is None:
        raise InvalidInput(f"parameter `{name}`: not a MindSpore tensor")
    if tuple(have.shape) != entry.shape:
        raise InvalidInput(
            f"parameter `{name}`: shape mismatch: the checkpoint (step {step}) has "
            f"{list(entry.shape)}, the network {list(have.shape)}; nothing was loaded"
        )
    if have.dtype == entry.dtype:
        return False
    kinds = {have.dtype, entry.dtype}
    if not strict_load and (kinds <= FLOATS or kinds <= INTS):
        return True
    raise InvalidInput(
        f"parameter `{name}`: dtype mismatch: the checkpoint (step {step}) has "
        f"{entry.dtype}, the network {have.dtype}; nothing was loaded"
    )


def load_params(
    ckpt: Checkpointer,
    step: int | None = None,
    *,
    storage_only: bool = False,
    fallback: bool = False,
    rank: int | None = None,
) -> dict[str, Any]:
    """A step's parameters as fresh ``Parameter`` objects by name, like
    ``mindspore.load_checkpoint`` (for ``mindspore.load_param_into_net``)."""
    state = ckpt.load(step, storage_only=storage_only, fallback=fallback, rank=rank)
    params = state.get(PARAMS) if isinstance(state, dict) else None
    if not isinstance(params, dict):
        raise InvalidInput(
            f"step {ckpt.last_load.step if ckpt.last_load else step}: no `{PARAMS}` dict "
            "(not written by acp.mindspore.save); use Checkpointer.load"
        )
    return params


def rank_and_world_size() -> tuple[int, int]:
    """This process's rank and the world size, MindSpore's way: from its
    communication state when ``mindspore.communication.init()`` was called,
    else ``RANK_ID``/``RANK_SIZE`` (ModelArts, Ascend launchers), else
    ``RANK``/``WORLD_SIZE`` (msrun, torchrun), else 0 and 1. Pass them to
    ``acp.Checkpointer(rank=..., world_size=...)``, whose own default looks
    at MindSpore's communication state too but reads ``RANK`` first."""
    return mindspore_or_env_rank((("RANK_ID", "RANK_SIZE"), ("RANK", "WORLD_SIZE")))


@dataclass
class Resume:
    """Where ``resume`` left the training."""

    step: int
    """The global step of the checkpoint."""
    epoch: int | None
    """The (1-based) epoch the checkpoint was taken in, when it was saved."""
    initial_epoch: int
    """Pass to ``Model.train(..., initial_epoch=...)``: the epochs completed.
    A checkpoint taken mid-epoch (``step_in_epoch < batch_num``) resumes at
    the start of its epoch; save at epoch ends (``every_n_steps`` a multiple
    of the dataset size) to continue exactly."""
    step_in_epoch: int | None
    batch_num: int | None
    values: dict[str, Any]
    load: NetLoad


def resume(
    ckpt: Checkpointer,
    net: Any,
    optimizer: Any = None,
    *,
    step: int | None = None,
    strict_load: bool = False,
    allow_missing: bool = False,
) -> Resume | None:
    """Restores ``net`` and ``optimizer`` in place from a step (the newest
    when None; from RAM when it is resident) and returns where to continue,
    or None when there is no checkpoint yet::

        r = acp.mindspore.resume(ckpt, net, opt)
        model.train(epochs, data, callbacks=[cb], initial_epoch=r.initial_epoch if r else 0)

    Pass ``model.train_network`` as ``net`` to restore everything the
    callback saved (a dynamic loss scale included).

    Raises ``acp.InvalidInput`` naming the parameters the checkpoint lacks,
    unless ``allow_missing``."""
    try:
        report = load_into_net(ckpt, net, optimizer, step=step, strict_load=strict_load)
    except CheckpointNotFound:
        if step is not None:
            raise
        return None
    if report.param_not_load and not allow_missing:
        raise InvalidInput(
            f"step {report.step}: the checkpoint has no parameter "
            f"{', '.join(f'`{n}`' for n in report.param_not_load[:10])}"
            f"{' ...' if len(report.param_not_load) > 10 else ''}; they were not restored "
            "(pass allow_missing=True to go on)"
        )
    internals(ckpt).resumed_step = report.step
    values = report.values
    epoch = _int_or_none(values.get("epoch"))
    in_epoch = _int_or_none(values.get("step_in_epoch"))
    batch_num = _int_or_none(values.get("batch_num"))
    saved_step = _int_or_none(values.get("step"))
    at = saved_step if saved_step is not None else report.step
    if epoch is None:
        initial = at // batch_num if batch_num else 0
    elif in_epoch is not None and batch_num is not None and in_epoch < batch_num:
        initial = epoch - 1
    else:
        initial = epoch
    return Resume(at, epoch, max(initial, 0), in_epoch, batch_num, values, report)


def _int_or_none(v: object) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None
