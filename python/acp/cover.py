"""A dying checkpoint that dead ranks cannot block: the survivors of a
replica group write the dead ranks' shares of the newest staged step. And
one whose ranks staged different steps (SIGTERM reached them a save
apart) commits the newest step they all hold.

**Which step.** After SIGTERM, each rank of a job with a store posts the
steps it holds resident (:func:`roll_call_held`) and waits for the
others' answers, at most :data:`ROLL_CALL` seconds. When every rank
answered, each persists the newest step they all hold (:func:`newest_held_by_all`), not its own
newest: a rank a save ahead of another would otherwise persist a step the
other never staged, and rank 0 would wait ``commit_timeout`` for a file
that never comes. Commits of newer steps (a rank's own persists queued by
the policy) are given up at once (``Engine.give_up_commits_from``). A rank
that did not answer is taken as dead: the others agree among themselves,
cover its share of the agreed step as below, and give up the commits of
other steps that wait for it (``Engine.give_up_commits_waiting_for``).

With ``save(step, state, replicated=True)`` every rank of a replica group
holds the same tensors and writes a share of them (``acp.distributed``).
When the job is stopped (SIGTERM) after some ranks died (SIGKILL, a lost
node), their shares of the agreed step would be missing and the step
could never commit. Here, in the dying checkpoint:

1. **Roll call.** Each rank posts the steps it holds in the job's store
   (above), then waits until every rank has, at most :data:`ROLL_CALL`
   seconds: a rank that has not answered by then is taken as dead. A
   rank alive but late is harmless (below).
2. **Cover.** In each replica group, the lowest rank that answered writes
   the share of every dead rank of its group: it opens an engine as that
   rank (a ring of its own in a temporary directory under the shared
   memory directory, removed afterwards), stages that rank's file of the
   step from its own copy of the state, and persists it. Rank 0's commit
   then finds every rank's file durable and commits the step, or, when
   rank 0 is the dead one, the engine opened as rank 0 commits it.
3. **Only the saved bytes.** The state is not copied again at the save:
   the share is staged from the tensors ``save`` was given. It is written
   only when none of them changed since that save: each tensor's version
   counter (torch bumps it on every in-place change, an optimizer step
   included) and data pointer are recorded at the save and compared, and
   so is the tree of plain values. A state that moved on since, a tensor
   without a version counter (NumPy), or ``replicated=`` naming only some
   keys (the rest is the dead rank's own) leaves the dead rank uncovered:
   the dying checkpoint then fails, naming the ranks, and the step is
   not committed (the previous committed one stays the newest).

Two writers of the same share (a rank taken as dead that was only late)
write identical bytes, so rank 0 commits either. The step commits when
every dead rank has a survivor in its replica group; when a whole group
is dead, nobody can write its share and the step is not committed. The
roll call goes through the store (``torch.distributed``'s, hosted by the
launcher's agent under torchrun, or by rank 0), never the training's
communicator; a store that is gone (its host died) leaves the dead ranks
uncovered.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from acp import _acp
from acp.distributed import flatten_replicated

if TYPE_CHECKING:
    from acp._codec import Adapters, Flat
    from acp.distributed import Coordinator

__all__ = [
    "ROLL_CALL",
    "Decision",
    "Saved",
    "Setup",
    "agree_held",
    "cover_dead_ranks",
    "newest_held_by_all",
    "record",
]

log = logging.getLogger("acp")

ROLL_CALL = 5.0
"""Seconds a rank waits in the dying checkpoint for every rank to answer
the roll call; a rank that has not answered by then is taken as dead."""

_POLL = 0.05

Version = tuple[int, int]


@dataclass(frozen=True)
class Setup:
    """What opening an engine as another rank of the job needs: the
    ``Checkpointer``'s own settings."""

    root: str
    job: str | None
    rank: int
    world_size: int
    group: list[int]
    shm_dir: str | None
    engine_kwargs: dict[str, Any]


@dataclass(frozen=True)
class Saved:
    """The newest ``replicated=True`` save, as a survivor needs it to write
    another rank's share of it again."""

    step: int
    state: object
    values_json: str
    extra: dict[str, str]
    versions: dict[str, Version]
    """Each tensor's version counter and data pointer at the save."""


def _version(obj: object) -> Version | None:
    """A tensor's version counter and data pointer; None when it has no
    version counter (NumPy, or a torch inference tensor)."""
    try:
        v = obj._version  # type: ignore[attr-defined]
        ptr = obj.data_ptr()  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError):
        return None
    if not isinstance(v, int) or not isinstance(ptr, int):
        return None
    return v, ptr


def record(
    step: int, state: object, flat: Flat, values_json: str, extra: dict[str, str]
) -> Saved | None:
    """What :func:`cover_dead_ranks` needs of a ``replicated=True`` save
    (after it staged), or None when some tensor has no version counter (a
    change could not be seen, so no share of it is ever written again).
    Reads two integers per tensor: no copy, no I/O."""
    # One comprehension (about 0.4 us a tensor): it runs on every
    # replicated save, right after the stall.
    try:
        stamps = [(t.obj._version, t.obj.data_ptr()) for t in flat.tensors]  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError, TypeError):
        return None
    versions = dict(zip([t.name for t in flat.tensors], stamps))
    return Saved(step, state, values_json, dict(extra), versions)


class _Uncoverable(Exception):
    pass


def roll_call(
    coord: Coordinator, step: int, wait: float, committed: Callable[[], bool]
) -> list[int]:
    """Posts this rank alive for the dying checkpoint of ``step``; returns
    the ranks that have not posted within ``wait`` seconds (dead), or none
    as soon as the step is ``committed()`` (nothing is missing then)."""
    store = coord.store
    keys = [coord.key(f"dying/{step}/alive/{r}") for r in range(coord.world_size)]
    store.set(keys[coord.rank], "1")
    deadline = time.monotonic() + wait
    while True:
        if committed():
            return []
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        if not missing or time.monotonic() >= deadline:
            return missing
        time.sleep(_POLL)


@dataclass(frozen=True)
class Decision:
    """What the ranks' roll call of held steps decided (:func:`agree_held`)."""

    answers: dict[int, list[int]]
    """The steps each rank that answered holds."""
    missing: list[int]
    """The ranks that did not answer in time: taken as dead."""
    step: int | None
    """The newest step every rank that answered holds."""


def agree_held(coord: Coordinator, held: list[int], wait: float) -> Decision:
    """Posts the steps this rank holds (``held``) for the dying checkpoint
    and returns the decision every rank adopts: the first rank whose roll
    call ends (every rank answered, or ``wait`` seconds passed) publishes
    it from the answers it saw; the others, a rank that comes late
    included, read it. A rank that finds no decision within ``wait``
    seconds more (its publisher died) decides from what it saw. Each
    dying checkpoint of the coordinator has keys of its own. An answer
    that is not a list of steps counts as none. Raises what the store
    raises (its host gone)."""
    store = coord.store
    n = coord.dying_rounds
    coord.dying_rounds += 1
    keys = [coord.key(f"dying/{n}/held/{r}") for r in range(coord.world_size)]
    decided = coord.key(f"dying/{n}/decision")
    store.set(keys[coord.rank], json.dumps(sorted(held)))
    deadline = time.monotonic() + wait
    while not store.check([decided]):
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        if not missing or time.monotonic() >= deadline:
            if store.add(coord.key(f"dying/{n}/decider"), 1) == 1:
                mine = _decision(_answers(store, keys, missing), missing)
                store.set(decided, json.dumps(_to_json(mine)))
                return mine
            break
        time.sleep(_POLL)
    deadline = time.monotonic() + wait
    while not store.check([decided]):
        if time.monotonic() >= deadline:
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
            return _decision(_answers(store, keys, missing), missing)
        time.sleep(_POLL)
    return _from_json(store.get(decided), coord.world_size)


def _answers(store: Any, keys: list[str], missing: list[int]) -> dict[int, list[int]]:
    answers: dict[int, list[int]] = {}
    for r, k in enumerate(keys):
        if r not in missing:
            try:
                got = json.loads(store.get(k))
            except ValueError:
                got = None
            answers[r] = got if _steps(got) else []
    return answers


def _steps(v: object) -> bool:
    return isinstance(v, list) and all(type(s) is int and s >= 0 for s in v)


def _decision(answers: dict[int, list[int]], missing: list[int]) -> Decision:
    return Decision(answers, missing, newest_held_by_all(answers))


def _to_json(d: Decision) -> dict[str, Any]:
    return {
        "answers": {str(r): a for r, a in d.answers.items()},
        "missing": d.missing,
        "step": d.step,
    }


def _from_json(raw: bytes, world_size: int) -> Decision:
    """The published decision; one that does not parse is refused."""
    try:
        v = json.loads(raw)
        answers = {int(r): a for r, a in v["answers"].items()}
        missing, step = v["missing"], v["step"]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise _acp.AcpError(f"the dying checkpoint's decision does not parse: {e}") from e
    ranks = [*answers, *(missing if isinstance(missing, list) else [None])]
    if (
        not all(_steps(a) for a in answers.values())
        or not _steps(missing)
        or not (step is None or (type(step) is int and step >= 0))
        or not all(type(r) is int and 0 <= r < world_size for r in ranks)
    ):
        raise _acp.AcpError(f"the dying checkpoint's decision is malformed: {v!r:.200}")
    return Decision(answers, missing, step)


def newest_held_by_all(answers: dict[int, list[int]]) -> int | None:
    """The newest step that every rank's answer holds, or None. (Every rank
    holds a step being committed: each flush keeps its slot until then.)"""
    common = set.intersection(*(set(a) for a in answers.values())) if answers else set()
    return max(common, default=None)


def cover_dead_ranks(
    setup: Setup,
    coord: Coordinator,
    saved: Saved,
    adapters: Adapters,
    *,
    timeout: float | None,
    committed: Callable[[], bool],
    dead: list[int] | None = None,
) -> tuple[list[int], list[int], str | None]:
    """The dying checkpoint's part for dead ranks (module docs): returns
    the dead ranks, those this rank wrote the share of, and an error naming
    the dead ranks of this rank's group that it could not cover (None when
    none, or when the step got ``committed()`` meanwhile). ``dead``: the
    ranks that did not answer a roll call already taken (none is taken
    again). Never raises an ``AcpError`` or an ``OSError``."""
    if dead is None:
        try:
            wait = ROLL_CALL if timeout is None else min(ROLL_CALL, timeout)
            dead = roll_call(coord, saved.step, wait, committed)
        except Exception as e:  # the store is gone with its host
            return [], [], f"step {saved.step}: the roll call of the dying checkpoint failed: {e}"
    if not dead:
        return [], [], None
    group = setup.group
    alive = [r for r in group if r not in dead]
    mine = [r for r in group if r in dead]
    if not mine or not alive or alive[0] != setup.rank:
        return dead, [], None
    covered: list[int] = []
    failed: list[str] = []
    for r in mine:
        try:
            _write_as(setup, saved, adapters, r, timeout)
            covered.append(r)
        except (_Uncoverable, _acp.AcpError, OSError) as e:
            failed.append(f"rank {r}: {e}")
    error = None
    if failed and not committed():
        error = f"step {saved.step}: dead ranks not covered by rank {setup.rank}: " + "; ".join(
            failed
        )
    return dead, covered, error


def _write_as(
    setup: Setup, saved: Saved, adapters: Adapters, rank: int, timeout: float | None
) -> None:
    """Stages and persists ``rank``'s file of ``saved.step`` from this
    rank's copy of the state, once it is known unchanged since the save."""
    from acp.checkpointer import _fill

    flat, tensors = flatten_replicated(
        saved.state,
        adapters,
        rank=rank,
        world_size=setup.world_size,
        replicated=True,
        group=setup.group,
    )
    if flat.json() != saved.values_json:
        raise _Uncoverable(f"the state's plain values changed since step {saved.step} was saved")
    for t in tensors:
        if _version(t.obj) != saved.versions.get(t.name):
            raise _Uncoverable(
                f"tensor `{t.name}` changed since step {saved.step} was saved "
                "(or has no version counter)"
            )
    parent = setup.shm_dir if setup.shm_dir is not None else "/dev/shm"
    if not os.path.isdir(parent):
        parent = None  # type: ignore[assignment]
    where = tempfile.mkdtemp(prefix="acp-cover-", dir=parent)
    try:
        total = sum(t.info.nbytes for t in tensors)
        engine = _acp.Engine(
            setup.root,
            job=setup.job,
            rank=rank,
            world_size=setup.world_size,
            shm_dir=where,
            ring_slots=1,
            ring_bytes=total + 4 * len(saved.values_json) + (16 << 20),
            mlock=False,
            persist_on_open=False,
            release_on_close=True,
            shm_ttl=0,
            **setup.engine_kwargs,
        )
        try:
            specs = [(t.name, t.info.dtype, t.info.shape) for t in tensors]
            staging = engine.begin_save(
                saved.step, specs, saved.values_json, False, saved.extra or None, True
            )
            if staging is None:
                raise _Uncoverable("the ring had no slot for it")
            try:
                _fill(staging, tensors)
                handle = staging.finish()
            except BaseException:
                staging.abort()
                raise
            handle.wait(timeout)
        finally:
            engine.close()
    finally:
        shutil.rmtree(where, ignore_errors=True)
    log.warning("acp: dying checkpoint: wrote dead rank %d's share of step %d", rank, saved.step)
