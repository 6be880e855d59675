"""Parameter dicts: a network's parameters by name, checked the way
MindSpore checks them, and saving them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import mindspore
from mindspore import Tensor

from acp._acp import InvalidInput
from acp._mindspore_codec import type_name
from acp.checkpointer import Checkpointer, SaveHandle

__all__ = ["PARAMS", "check_name", "check_param_dict", "param_dict", "save", "state_dict"]

PARAMS = "params"
"""The key under which ``save`` and ``AcpCheckpoint`` store the parameters."""

_MAX_NAME_CHARS = 1024  # MindSpore's PARAMETER_NAME_PREFIX_MAX_LEN

# --------------------------------------------------------------------------
# Parameter dicts


def check_name(name: object, what: str) -> str:
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
        name = check_name(k, f"{what}: parameter {k!r}")
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
            name = check_name(p.name, f"{type(cell).__name__}")
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
