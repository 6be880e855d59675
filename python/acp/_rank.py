"""This process's rank and the world size, found without importing a
framework: what ``acp.rank_and_world_size`` (the ``Checkpointer``'s
default) and ``acp.mindspore.rank_and_world_size`` share."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from acp._acp import ConfigError

__all__ = ["mindspore_or_env_rank", "rank_and_world_size"]


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"config `{name}`: {value!r} is not an integer") from None


def rank_and_world_size() -> tuple[int, int]:
    """This process's rank and the world size: from torch.distributed when
    torch is already imported and a process group is initialised, or from
    MindSpore's communication state when ``mindspore.communication.init()``
    was called; else from ``RANK``/``WORLD_SIZE``, else Ascend's
    ``RANK_ID``/``RANK_SIZE``, else 0 and 1. Never imports a framework."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None:
        try:
            if dist.is_available() and dist.is_initialized():
                return int(dist.get_rank()), int(dist.get_world_size())
        except (RuntimeError, ValueError):
            pass
    return mindspore_or_env_rank((("RANK", "WORLD_SIZE"), ("RANK_ID", "RANK_SIZE")))


def mindspore_or_env_rank(env: Sequence[tuple[str, str]]) -> tuple[int, int]:
    """The rank and world size from MindSpore's communication state when
    ``mindspore.communication.init()`` was called, else from the first pair
    of ``env`` (rank, size variable names) of which one is set, else 0 and
    1. Never imports a framework. What ``rank_and_world_size`` here and in
    ``acp.mindspore`` share: they differ only in which variables come first."""
    comm = sys.modules.get("mindspore.communication.management")
    if comm is not None and getattr(getattr(comm, "GlobalComm", None), "INITED", False):
        return int(comm.get_rank()), int(comm.get_group_size())
    for rank_var, size_var in env:
        rank, size = _env_int(rank_var), _env_int(size_var)
        if rank is not None or size is not None:
            return rank or 0, size or 1
    return 0, 1
