"""MindSpore support: parameter dicts, in-place loads, a ``Model.train``
callback, resume, and conversion to and from MindSpore's own formats.

Importing this module imports MindSpore; ``import acp`` never does. The
codec imports it by itself when a state holds a MindSpore tensor, so
``ckpt.save(step, {"w": parameter})`` works without importing it first.

Tensors. Every dtype acp stores has a MindSpore type (``float64`` to
``bool_``, ``bfloat16``, ``float16``, ``float8_e4m3fn``, ``float8_e5m2``);
MindSpore-only types (complex, ``hifloat8``, ``int4``) are refused naming
the key. On the CPU a tensor's memory is its host memory: ``data_ptr()``
is handed to the engine, which copies it into the ring slot with the GIL
released (no ``asnumpy()``, no extra copy); a non-contiguous view is first
made contiguous. A tensor on a device (Ascend, GPU) is brought to the host
with ``asnumpy()`` first; bf16 and fp8 go through an unsigned view of the
same width, since NumPy has no such types. ``Parameter`` names and
``requires_grad`` come back with the parameters.

Networks. ``param_dict(net, optimizer)`` is what ``mindspore.save_checkpoint``
saves: every parameter by its ``name``. ``save`` writes
``{"params": param_dict(...), **values}``; ``load_into_net`` copies a
checkpoint in place into an existing network and optimizer, straight from
the resident ring slot into the parameters' memory, and reports
``param_not_load`` / ``ckpt_not_load`` the way
``mindspore.load_param_into_net`` does (prefix matching and float/int type
conversion included unless ``strict_load``). ``AcpCheckpoint`` saves from
``Model.train``; ``resume`` restores a network, optimizer and the epoch.

Conversion. ``export_ckpt`` writes any acp checkpoint as a MindSpore
``.ckpt`` or ``.safetensors`` file; ``import_ckpt`` reads one into a
checkpoint.
"""

from __future__ import annotations

import ctypes
import logging
import operator
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from time import perf_counter
from types import FrameType
from typing import Any

import mindspore
import numpy as np
from mindspore import Tensor
from mindspore.train import Callback

from acp._acp import (
    AcpError,
    CheckpointCorrupt,
    CheckpointNotFound,
    ConfigError,
    InvalidInput,
)
from acp._codec import Adapter as CodecAdapter
from acp._codec import (
    Adapters,
    Decoder,
    Entry,
    decoded_items,
    is_tensor_node,
    parse,
)
from acp._load import _Fresh, entries_of, run_transfers
from acp._mindspore_codec import (
    DTYPES,
    FLOATS,
    INTS,
    Adapter,
    Convert,
    dtype_from_safetensors,
    dtype_to_safetensors,
    host_tensor,
    type_name,
)
from acp.checkpointer import Checkpointer, LoadStats, SaveHandle, _step

__all__ = [
    "DTYPES",
    "PARAMS",
    "AcpCheckpoint",
    "Adapter",
    "NetLoad",
    "Resume",
    "check_param_dict",
    "dtype_from_safetensors",
    "dtype_to_safetensors",
    "export_ckpt",
    "import_ckpt",
    "load_into_net",
    "load_params",
    "param_dict",
    "rank_and_world_size",
    "resume",
    "save",
    "state_dict",
    "write_ckpt",
]

log = logging.getLogger("acp.mindspore")

PARAMS = "params"
"""The key under which ``save`` and ``AcpCheckpoint`` store the parameters."""

_MAX_NAME_CHARS = 1024  # MindSpore's PARAMETER_NAME_PREFIX_MAX_LEN

# --------------------------------------------------------------------------
# Parameter dicts


def _check_name(name: object, what: str) -> str:
    """Refuses a parameter name MindSpore would reject or silently change."""
    if not isinstance(name, str):
        raise InvalidInput(
            f"{what}: parameter names are strings in MindSpore, got {type_name(name)} {name!r}"
        )
    if name.strip() == "":
        raise InvalidInput(f"{what}: an empty parameter name (MindSpore would generate one)")
    if name != name.strip():
        raise InvalidInput(
            f"{what}: parameter name {name!r} has leading or trailing whitespace "
            "(MindSpore strips it, so the name would not match on load)"
        )
    if len(name) > _MAX_NAME_CHARS:
        raise InvalidInput(
            f"{what}: parameter name `{name[:40]}...` is {len(name)} characters long; "
            f"MindSpore allows at most {_MAX_NAME_CHARS}"
        )
    if not name.isprintable():
        raise InvalidInput(f"{what}: parameter name {name!r} has a non-printable character")
    return name


def check_param_dict(params: Mapping[Any, Any], what: str = "params") -> dict[str, Any]:
    """Checks a parameter dict the way MindSpore would: string names that
    ``Parameter`` keeps as they are, MindSpore tensors as values. Returns it
    as a plain dict; raises ``acp.InvalidInput`` naming the parameter."""
    if not isinstance(params, Mapping):
        raise InvalidInput(f"{what}: expected a dict of parameters, got {type_name(params)}")
    out: dict[str, Any] = {}
    for k, v in params.items():
        name = _check_name(k, f"{what}: parameter {k!r}")
        if not isinstance(v, Tensor):
            raise InvalidInput(
                f"{what}: parameter `{name}`: a {type_name(v)} is not a MindSpore "
                "Parameter or Tensor"
            )
        out[name] = v
    return out


def param_dict(*cells: Any) -> dict[str, Any]:
    """The parameters of ``cells`` (a network, its optimizer, or a train
    network holding both) by ``Parameter.name``, as
    ``mindspore.save_checkpoint`` saves them; a parameter reachable from
    several cells appears once. Lazily initialised parameters are
    initialised. Raises ``acp.InvalidInput`` when two different parameters
    share a name, or a name MindSpore would change."""
    out: dict[str, Any] = {}
    for cell in cells:
        if cell is None:
            continue
        if not isinstance(cell, mindspore.nn.Cell):
            raise InvalidInput(f"expected a mindspore.nn.Cell, got {type_name(cell)}")
        cell.init_parameters_data()
        for _, p in cell.parameters_and_names():
            name = _check_name(p.name, f"{type(cell).__name__}")
            known = out.get(name)
            if known is not None and known is not p:
                raise InvalidInput(
                    f"parameter `{name}`: two different parameters have this name "
                    "(MindSpore needs unique names; rename one)"
                )
            out[name] = p
    return out


def state_dict(
    net: Any = None,
    optimizer: Any = None,
    *,
    params: Mapping[str, Any] | None = None,
    **values: Any,
) -> dict[str, Any]:
    """``{"params": {...}, **values}``: the parameters of ``net`` and
    ``optimizer`` (or the dict ``params``) and plain values such as the
    epoch, the step or the loss scale."""
    if PARAMS in values:
        raise InvalidInput(f"`{PARAMS}` is reserved for the parameters; name the value otherwise")
    if params is not None:
        if net is not None or optimizer is not None:
            raise InvalidInput("give either net/optimizer or params=, not both")
        found = check_param_dict(params)
    else:
        found = param_dict(net, optimizer)
    return {PARAMS: found, **values}


def save(
    ckpt: Checkpointer,
    step: int,
    net: Any = None,
    optimizer: Any = None,
    *,
    params: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    **values: Any,
) -> SaveHandle:
    """Saves ``state_dict(net, optimizer, params=params, **values)`` as
    ``step``; returns once the tensors are copied (see ``Checkpointer.save``)."""
    return ckpt.save(step, state_dict(net, optimizer, params=params, **values), overwrite=overwrite)


# --------------------------------------------------------------------------
# Loading into a network


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


def _saved_params(
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
    loaded = _engine_load(ckpt, step, storage_only, fallback, rank)
    t1 = perf_counter()
    adapters: Adapters = ckpt._adapters
    entries = entries_of(loaded)
    fresh = _Fresh(loaded, adapters, entries)
    refs, rest = _saved_params(parse(loaded.values_json, loaded.step), fresh.decoder)
    matched, param_not_load = _match(targets, list(refs), strict_load)
    used = set(matched.values())
    ckpt_not_load = [name for name in refs if name not in used]

    adapter = adapters.get("mindspore", "")
    fills: list[tuple[Entry, Any]] = []
    converts: list[tuple[Entry, Any]] = []
    for name, saved_name in matched.items():
        entry = _entry(entries, refs[saved_name], loaded.step)
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
    stats = _load_stats(loaded.report(), t0, t1, perf_counter(), copied)
    del loaded
    ckpt.last_load = stats
    ckpt._metrics.loaded(stats)
    if param_not_load:
        log.warning(
            "load_into_net: %d parameters of the network are not in step %d: %s",
            len(param_not_load),
            stats.step,
            param_not_load,
        )
    return NetLoad(stats.step, param_not_load, ckpt_not_load, values, stats)


def _engine_load(
    ckpt: Checkpointer, step: int | None, storage_only: bool, fallback: bool, rank: int | None
) -> Any:
    """The engine's load (``acp._acp.Loaded``), as ``Checkpointer.load`` does it."""
    engine = ckpt.engine  # raises acp.EngineClosed when closed
    if step is not None:
        step = _step(step)
    # A load from storage may regrow (remap) a ring slot.
    ckpt._adapters.forget_memory()
    return engine.load(step, storage_only, fallback, rank)


def _entry(entries: Mapping[str, Entry], ref: Mapping[str, Any], step: int) -> Entry:
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


def _load_stats(
    report: Mapping[str, Any], t0: float, t1: float, t2: float, copied: int
) -> LoadStats:
    return LoadStats(
        step=report["step"],
        source=report["source"],
        bytes=report["bytes"],
        verified=report["verified"],
        engine_secs=t1 - t0,
        copy_secs=t2 - t1,
        total_secs=t2 - t0,
        copied_bytes=copied,
        bytes_per_sec=copied / (t2 - t0) if t2 > t0 else 0.0,
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


# --------------------------------------------------------------------------
# Resume and the training callback


def rank_and_world_size() -> tuple[int, int]:
    """This process's rank and the world size, MindSpore's way: from its
    communication state when ``mindspore.communication.init()`` was called,
    else ``RANK_ID``/``RANK_SIZE`` (ModelArts, Ascend launchers), else
    ``RANK``/``WORLD_SIZE`` (msrun, torchrun), else 0 and 1. Pass them to
    ``acp.Checkpointer(rank=..., world_size=...)``, whose own default looks
    at MindSpore's communication state too but reads ``RANK`` first."""
    comm = sys.modules.get("mindspore.communication.management")
    if comm is not None and getattr(getattr(comm, "GlobalComm", None), "INITED", False):
        return int(comm.get_rank()), int(comm.get_group_size())
    for rank_var, size_var in (("RANK_ID", "RANK_SIZE"), ("RANK", "WORLD_SIZE")):
        rank = os.environ.get(rank_var, "").strip()
        size = os.environ.get(size_var, "").strip()
        if rank or size:
            try:
                return int(rank or 0), int(size or 1)
            except ValueError:
                raise ConfigError(
                    f"config `{rank_var}`/`{size_var}`: {rank!r}/{size!r} is not an integer"
                ) from None
    return 0, 1


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


def _positive(option: str, value: object, *, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool):
        raise ConfigError(f"config `{option}`: {value!r} is not a positive integer")
    try:
        n = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ConfigError(f"config `{option}`: {value!r} is not a positive integer") from None
    if n <= 0:
        raise ConfigError(f"config `{option}`: {n} is not a positive integer (it must be >= 1)")
    return int(n)


class AcpCheckpoint(Callback):  # type: ignore[misc]
    """A ``Model.train`` callback that saves through acp, in the spirit of
    ``ModelCheckpoint(config=CheckpointConfig(async_save=True,
    exception_save=True, keep_checkpoint_max=keep))``::

        ckpt = acp.Checkpointer("/mnt/ckpt/run1")
        cb = acp.mindspore.AcpCheckpoint(ckpt, every_n_steps=100, keep=3)
        r = acp.mindspore.resume(ckpt, model.train_network)
        model.train(epochs, data, callbacks=[cb], initial_epoch=r.initial_epoch if r else 0)

    - Every ``every_n_steps`` global steps it saves the train network's
      parameters (the network's and the optimizer's: moments, global step,
      learning rate, loss scale) with the epoch, the global step and the
      position in the epoch. Training waits only for the copy into the
      ring; the engine writes and commits in the background.
    - With ``keep``, only the newest ``keep`` committed steps stay on
      storage (the checkpointer's own ``keep_last`` works too).
    - When training ends, it saves the last step (``save_at_end``) and waits
      until everything is committed.
    - With ``exception_save``, when training raises, the newest complete
      resident checkpoint is flushed and committed before the exception
      leaves ``Model.train``; when the process receives SIGTERM (``sigterm``;
      main thread only), the same happens before the signal's previous
      handler runs (by default, the process then dies of SIGTERM).

    The global step is ``(epoch - 1) * batch_num + step in epoch``, which
    stays right when ``Model.train`` is resumed with ``initial_epoch``;
    ``initial_step`` overrides it (global step = ``initial_step`` + steps of
    this ``Model.train`` call).

    ``network`` saves another cell than the train network; ``extra``
    returns more plain values (e.g. RNG seeds) to store with each save.
    """

    def __init__(
        self,
        ckpt: Checkpointer,
        every_n_steps: int,
        *,
        keep: int | None = None,
        exception_save: bool = True,
        sigterm: bool = True,
        save_at_end: bool = True,
        overwrite: bool = False,
        network: Any = None,
        extra: Callable[[], Mapping[str, Any]] | None = None,
        initial_step: int | None = None,
        persist_timeout: float | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(ckpt, Checkpointer):
            raise ConfigError(f"config `ckpt`: expected an acp.Checkpointer, got {type_name(ckpt)}")
        self.ckpt = ckpt
        self.every_n_steps: int = _positive("every_n_steps", every_n_steps) or 0
        self.keep = _positive("keep", keep, allow_none=True)
        if initial_step is not None and (isinstance(initial_step, bool) or initial_step < 0):
            raise ConfigError(f"config `initial_step`: {initial_step!r} is not a step (>= 0)")
        self.initial_step = initial_step
        self.exception_save = bool(exception_save)
        self.sigterm = bool(sigterm)
        self.save_at_end = bool(save_at_end)
        self.overwrite = bool(overwrite)
        self.network = network
        self.extra = extra
        self.persist_timeout = persist_timeout
        self.last_saved: int | None = None
        """The newest step this callback saved."""
        self.handles: list[SaveHandle] = []
        """Saves not yet seen committed."""
        self.persisted: str | None = None
        """Why the exception path ran (``"exception"``, ``"SIGTERM"``), once it did."""
        self._step = 0
        self._previous_handler: Any = None
        self._installed = False

    # --- the callback protocol ---------------------------------------------

    def on_train_begin(self, run_context: Any) -> None:
        if self.sigterm:
            self._install()

    def on_train_step_end(self, run_context: Any) -> None:
        cb = run_context.original_args()
        self._step = self._global_step(cb)
        self._collect()
        if self._step % self.every_n_steps == 0:
            self._save(cb)

    def on_train_end(self, run_context: Any) -> None:
        cb = run_context.original_args()
        if self.save_at_end and self._step > 0 and self.last_saved != self._step:
            self._save(cb)
        self.ckpt.wait(self.persist_timeout)
        for h in self.handles:
            h.wait(0)  # raises a failed save's error
        self.handles.clear()
        self._retain(force=True)

    def __exit__(self, *exc: object) -> None:
        try:
            if exc and exc[0] is not None and self.exception_save and self.persisted is None:
                self._persist("exception")
        finally:
            self._uninstall()

    # --- internals ---------------------------------------------------------

    def _global_step(self, cb: Any) -> int:
        if self.initial_step is not None:
            return self.initial_step + int(cb.cur_step_num)
        batch = int(cb.batch_num)
        return (int(cb.cur_epoch_num) - 1) * batch + (int(cb.cur_step_num) - 1) % batch + 1

    def _save(self, cb: Any) -> None:
        network = self.network if self.network is not None else cb.train_network
        batch = int(cb.batch_num)
        values: dict[str, Any] = {
            "epoch": int(cb.cur_epoch_num),
            "step": self._step,
            "step_in_epoch": (int(cb.cur_step_num) - 1) % batch + 1,
            "batch_num": batch,
        }
        manager = getattr(cb, "loss_scale_mananger", None)  # sic, MindSpore's spelling
        if manager is not None:
            values["loss_scale"] = float(manager.get_loss_scale())
        if self.extra is not None:
            values.update(self.extra())
        state = state_dict(network, **values)
        handle = self.ckpt.save(self._step, state, overwrite=self.overwrite)
        self.last_saved = self._step
        self.handles.append(handle)

    def _collect(self) -> None:
        """Forgets committed saves; applies retention when one committed."""
        done = [h for h in self.handles if h.done()]
        if not done:
            return
        self.handles = [h for h in self.handles if not h.done()]
        for h in done:
            stats = h.stats
            if stats.error is not None:
                log.error("acp: saving step %d failed: %s", h.step, stats.error)
        self._retain(force=False)

    def _retain(self, *, force: bool) -> None:
        if self.keep is not None and (force or not self.handles):
            self.ckpt.retain(self.keep)

    def _persist(self, why: str) -> None:
        """Flushes and commits every complete resident save; never raises
        (it runs while another exception or a signal is on its way)."""
        self.persisted = why
        if self.ckpt.closed:
            return
        try:
            self.ckpt.wait(self.persist_timeout)
            log.warning(
                "acp: %s during training: checkpoints up to step %s are committed",
                why,
                self.ckpt.latest(),
            )
        except AcpError as e:
            log.error(
                "acp: %s during training: persisting the newest checkpoint failed: %s", why, e
            )

    def _install(self) -> None:
        if self._installed or threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGTERM)
        if previous is signal.SIG_IGN or previous is None:
            return  # ignored, or a handler Python cannot restore
        self._previous_handler = previous
        signal.signal(signal.SIGTERM, self._on_sigterm)
        self._installed = True

    def _uninstall(self) -> None:
        if not self._installed:
            return
        self._installed = False
        if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            signal.signal(signal.SIGTERM, self._previous_handler)

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        if self.exception_save:
            self._persist("SIGTERM")
        previous = self._previous_handler
        self._uninstall()
        if callable(previous):
            previous(signum, frame)
        else:  # SIG_DFL: die of the signal, as without this handler
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    def __repr__(self) -> str:
        return (
            f"AcpCheckpoint({self.ckpt!r}, every_n_steps={self.every_n_steps}, keep={self.keep}, "
            f"last_saved={self.last_saved})"
        )


# --------------------------------------------------------------------------
# Conversion to and from MindSpore's formats


def _format_of(path: Path, fmt: str | None, what: str) -> str:
    if fmt is None:
        fmt = "safetensors" if path.suffix == ".safetensors" else "ckpt"
    if fmt not in ("ckpt", "safetensors"):
        raise InvalidInput(f"{what}: format {fmt!r}: MindSpore writes 'ckpt' or 'safetensors'")
    return fmt


def _open(
    ckpt: Checkpointer | str | os.PathLike[str], open_kwargs: Mapping[str, Any]
) -> tuple[Checkpointer, bool]:
    if isinstance(ckpt, Checkpointer):
        return ckpt, False
    return Checkpointer(ckpt, **open_kwargs), True


def export_ckpt(
    ckpt: Checkpointer | str | os.PathLike[str],
    dest: str | os.PathLike[str],
    *,
    step: int | None = None,
    format: str | None = None,
    rank: int | None = None,
    storage_only: bool = False,
    open_kwargs: Mapping[str, Any] | None = None,
) -> Path:
    """Writes a step (the newest when None) of an acp checkpoint as a
    MindSpore checkpoint file that ``mindspore.load_checkpoint`` reads;
    returns its path.

    ``ckpt`` is a ``Checkpointer`` or a checkpoint directory (opened with
    ``open_kwargs``, closed after). ``format`` is ``"ckpt"`` or
    ``"safetensors"`` (default: from ``dest``'s suffix, else ``"ckpt"``;
    MindSpore adds the suffix when ``dest`` lacks it). Parameters are named
    as ``load_into_net`` names them (``"params"`` entries by name, other
    states by dotted key path); top-level ints, floats, bools and strings go
    into the file as MindSpore's ``append_dict`` does (strings only into
    ``.ckpt``: MindSpore's safetensors cannot hold them). Works for checkpoints
    written from any framework; tensors become MindSpore tensors without
    importing that framework.
    """
    path = Path(dest)
    fmt = _format_of(path, format, "export_ckpt")
    opened, owned = _open(ckpt, open_kwargs or {})
    try:
        loaded = _engine_load(opened, step, storage_only, False, rank)
        adapters: Adapters = opened._adapters
        entries = entries_of(loaded)
        fresh = _Fresh(loaded, adapters, entries)
        refs, rest = _saved_params(parse(loaded.values_json, loaded.step), fresh.decoder)
        adapter = adapters.get("mindspore", "")
        names = list(refs)
        for name in names:
            _check_name(name, f"export_ckpt: step {loaded.step}: tensor `{name}`")
        items: list[tuple[Entry, dict[str, Any]]] = [
            (_entry(entries, refs[name], loaded.step), {}) for name in names
        ]
        tensors, transfer = adapter.new_tensors(loaded, items, None)
        run_transfers(loaded.copy_into, [transfer])
        append: dict[str, Any] = {}
        for k, node in rest:
            if not isinstance(k, str) or not (
                isinstance(node, (bool, str)) or type(node) in (int, float)
            ):
                continue
            if k in refs:
                raise InvalidInput(f"export_ckpt: `{k}` is both a parameter and a value")
            append[k] = node
        saved_step = loaded.step
        del loaded
        save_obj = [{"name": n, "data": t} for n, t in zip(names, tensors)]
        out = _save_ms(save_obj, path, fmt, append)
        log.info("exported step %d (%d tensors) to %s", saved_step, len(names), out)
        return out
    finally:
        if owned:
            opened.close()


def write_ckpt(
    tensors: Iterable[tuple[str, str, Sequence[int], Any]],
    dest: str | os.PathLike[str],
    *,
    format: str | None = None,
    append: Mapping[str, Any] | None = None,
) -> Path:
    """Writes named raw tensors as a MindSpore checkpoint file; returns its
    path. For tools that already hold the bytes (``acp export --to
    mindspore`` reads them from a verified safetensors export).

    ``tensors`` yields ``(name, safetensors dtype, shape, buffer)``; the
    buffer (bytes, memoryview, array...) holds the tensor's little-endian
    bytes. Every dtype acp stores keeps its type, bf16 and fp8 included.
    ``append`` holds scalar values (int, float, bool, str) for MindSpore's
    ``append_dict``. ``format`` as in ``export_ckpt``.

    Raises ``acp.InvalidInput`` naming the tensor for a name MindSpore
    would reject, a dtype it lacks, or a buffer of the wrong size.
    """
    path = Path(dest)
    fmt = _format_of(path, format, "write_ckpt")
    save_obj = []
    for name, dtype, dims, buffer in tensors:
        _check_name(name, f"write_ckpt: tensor `{name}`")
        dtype_from_safetensors(dtype, f"write_ckpt: tensor `{name}`")
        src = np.frombuffer(buffer, dtype=np.uint8)
        shape = tuple(int(d) for d in dims)
        t, addr = host_tensor(dtype, shape)
        if src.size != int(t.nbytes):
            raise InvalidInput(
                f"write_ckpt: tensor `{name}`: {src.size} bytes for {dtype} {list(shape)} "
                f"({int(t.nbytes)} expected)"
            )
        if src.size:
            ctypes.memmove(addr, src.ctypes.data, src.size)
        save_obj.append({"name": name, "data": t})
    return _save_ms(save_obj, path, fmt, dict(append or {}))


def _save_ms(save_obj: list[dict[str, Any]], path: Path, fmt: str, append: dict[str, Any]) -> Path:
    """``mindspore.save_checkpoint``, replacing a read-only file it left."""
    fp8 = [o["name"] for o in save_obj if DTYPES.get(o["data"].dtype) in ("F8_E4M3", "F8_E5M2")]
    if fp8 and fmt == "safetensors":
        raise InvalidInput(
            f"tensor `{fp8[0]}`: MindSpore {mindspore.__version__} cannot write fp8 tensors to "
            "safetensors (its NumPy has no fp8 type); export to .ckpt"
        )
    if fp8:
        log.warning(
            "tensor `%s`: MindSpore %s on the CPU writes fp8 to .ckpt but cannot read it back",
            fp8[0],
            mindspore.__version__,
        )
    for k, v in list(append.items()):
        if isinstance(v, str) and fmt == "safetensors":
            log.warning("MindSpore's safetensors cannot hold string `%s`; left out", k)
            del append[k]
        elif not isinstance(v, (bool, int, float, str)):
            raise InvalidInput(f"append `{k}`: a {type_name(v)} is not an int, float, bool or str")
    out = path if path.name.endswith(f".{fmt}") else path.with_name(f"{path.name}.{fmt}")
    if out.exists():
        out.chmod(0o600)  # MindSpore leaves its files read-only
    mindspore.save_checkpoint(save_obj, os.fspath(path), append_dict=append or None, format=fmt)
    return out


def import_ckpt(
    src: str | os.PathLike[str],
    ckpt: Checkpointer | str | os.PathLike[str],
    step: int | None = None,
    *,
    format: str | None = None,
    overwrite: bool = False,
    open_kwargs: Mapping[str, Any] | None = None,
) -> int:
    """Saves a MindSpore ``.ckpt`` or ``.safetensors`` file as an acp step
    (committed when this returns); returns the step.

    Its parameters go under ``"params"`` (so ``load_into_net``, ``resume``
    and ``export_ckpt`` read it back); its string entries become plain
    values. ``step`` defaults to the file's ``step_num`` or ``step`` entry,
    else 0. ``format`` defaults to the suffix. ``ckpt`` is a
    ``Checkpointer`` or a checkpoint directory (opened with ``open_kwargs``).
    """
    path = Path(src)
    fmt = _format_of(path, format, "import_ckpt")
    if not path.is_file():
        raise CheckpointNotFound(f"import_ckpt: {path}: no such file")
    loaded = mindspore.load_checkpoint(os.fspath(path), format=fmt)
    params: dict[str, Any] = {}
    values: dict[str, Any] = {}
    for k, v in loaded.items():
        if isinstance(v, str):
            values[k] = v
        else:
            params[k] = v
    params = check_param_dict(params, f"import_ckpt: {path}")
    if step is None:
        for key in ("step_num", "step"):
            v = params.get(key)
            if v is not None and v.size == 1 and DTYPES.get(v.dtype) in INTS:
                step = int(v.asnumpy().reshape(-1)[0])
                break
    step = _step(0 if step is None else step)
    opened, owned = _open(ckpt, open_kwargs or {})
    try:
        opened.save(step, {PARAMS: params, **values}, overwrite=overwrite).wait()
    finally:
        if owned:
            opened.close()
    return step
