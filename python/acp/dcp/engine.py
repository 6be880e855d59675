"""How a DCP writer or reader reaches its acp engine, and the steps that
``checkpoint_id`` names."""

from __future__ import annotations

import os
import re
from typing import Any

from torch.futures import Future

from acp import _acp
from acp._env import CHECKPOINTER_ONLY, fill
from acp.checkpointer import Checkpointer, internals, rank_and_world_size

__all__ = ["EngineRef", "done_future", "parse_step", "valid_checkpoint_id"]

_STEP_DIR = re.compile(r"step-(\d{12,})")


def parse_step(checkpoint_id: Any) -> int:
    """The step a ``checkpoint_id`` names: an int, digits, or a step directory."""
    if isinstance(checkpoint_id, bool):
        raise ValueError(f"checkpoint_id {checkpoint_id!r} is not a step")
    if isinstance(checkpoint_id, int):
        step = checkpoint_id
    elif isinstance(checkpoint_id, str) and checkpoint_id.isdigit():
        step = int(checkpoint_id)
    elif isinstance(checkpoint_id, (str, os.PathLike)):
        name = os.path.basename(os.path.normpath(os.fspath(checkpoint_id)))
        m = _STEP_DIR.fullmatch(name)
        if m is None:
            raise ValueError(
                f"checkpoint_id {os.fspath(checkpoint_id)!r} is neither a step number nor a "
                "step directory `<root>/step-NNNNNNNNNNNN`"
            )
        step = int(m.group(1))
    else:
        raise ValueError(f"checkpoint_id {checkpoint_id!r} is not a step")
    if step < 0:
        raise ValueError(f"checkpoint_id {checkpoint_id!r}: steps are non-negative")
    return step


def valid_checkpoint_id(checkpoint_id: Any) -> bool:
    try:
        parse_step(checkpoint_id)
    except ValueError:
        return False
    return True


class EngineRef:
    """The acp engine a writer or reader uses, whether it owns it, and the
    engine's rank and world size."""

    def __init__(self, target: Any, engine_kwargs: dict[str, Any]) -> None:
        self.owned = False
        self.engine: Any
        self.rank, self.world_size = 0, 1
        if isinstance(target, _acp.Engine):
            self.engine = target
        elif isinstance(target, Checkpointer):
            # The Checkpointer's engine: this writes DCP's layout, not the
            # Checkpointer's state codec, through the same ring and root.
            self.engine = internals(target).engine
            self.rank, self.world_size = target.rank, target.world_size
        elif isinstance(target, (str, os.PathLike)):
            # The ACP_* variables fill in what the options leave out, as for
            # a Checkpointer (replicas are a Checkpointer's, not an engine's).
            filled, _ = fill(engine_kwargs)
            engine_kwargs = {k: v for k, v in filled.items() if k not in CHECKPOINTER_ONLY}
            rank, world = rank_and_world_size()
            engine_kwargs.setdefault("rank", rank)
            engine_kwargs.setdefault("world_size", world)
            self.rank, self.world_size = engine_kwargs["rank"], engine_kwargs["world_size"]
            self.engine = _acp.Engine(os.fspath(target), **engine_kwargs)
            self.owned = True
        else:
            raise TypeError(
                "expected an acp.Checkpointer, an _acp.Engine or a checkpoint root path, "
                f"got {type(target).__name__}"
            )
        if engine_kwargs and not self.owned:
            raise TypeError("engine options apply only when a root path is given")
        self.root = os.fspath(self.engine.root)

    def check_rank(self, kwargs: dict[str, Any]) -> None:
        """Refuses a DCP rank other than the engine's: every rank needs a
        writer or reader on its own engine."""
        rank = kwargs.get("rank")
        if rank is not None and rank != self.rank:
            raise ValueError(
                f"acp.dcp: DCP runs this as rank {rank}, but the acp engine is rank "
                f"{self.rank} of {self.world_size}; give each rank its own acp.Checkpointer "
                "(it takes its rank from torch.distributed)"
            )

    def step_of(self, checkpoint_id: Any) -> int:
        """:func:`parse_step`, also checking a path lies under this root."""
        step = parse_step(checkpoint_id)
        if isinstance(checkpoint_id, os.PathLike) or (
            isinstance(checkpoint_id, str) and not checkpoint_id.isdigit()
        ):
            parent = os.path.dirname(os.path.normpath(os.path.abspath(os.fspath(checkpoint_id))))
            if os.path.realpath(parent) != os.path.realpath(self.root):
                raise ValueError(
                    f"checkpoint_id {os.fspath(checkpoint_id)!r} is not under this checkpoint "
                    f"root {self.root!r}"
                )
        return step

    def close(self) -> None:
        if self.owned and self.engine is not None:
            self.engine.close()
            # Dropping the engine releases its ring, so the job can be opened again.
            self.engine = None


def done_future(value: Any) -> Future[Any]:
    fut: Future[Any] = Future()
    fut.set_result(value)
    return fut
