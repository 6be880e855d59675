"""Several ranks, one checkpoint: replica dedup, agreement, coordination.

What the :class:`~acp.Checkpointer` does with several ranks, beyond every
rank writing its own file and rank 0 committing the step once all are
durable (the engine's protocol, through the checkpoint directory only):

**Replicas are written once.** ``ckpt.save(step, state, replicated=True)``
declares that ``state`` is identical on every rank of the replica group
(data parallel: DDP, or the replicated dimension of HSDP; by default the
group is every rank). Each tensor is then written by one rank only, the
ranks sharing the bytes by a greedy balance (largest tensor first, to the
rank with the fewest bytes so far, ties to the lower rank; see
:func:`assign`), computed identically on every rank without any
communication. ``replicated=("model", "optim")`` declares only those
top-level keys replicated; the others are this rank's own. Every rank's
file holds the whole tree of plain values; a ``load`` reads its own file
and, for the tensors other ranks wrote, their files: from their slots on
this node when they are resident there (RAM, verified against the
committed digests), else from storage. The replicated part must have the
same structure on every rank of the group (as DDP guarantees).

**Every rank loads the same step.** With a coordinator (below),
``load()`` without a step first agrees on the newest step that every rank
sees committed, then every rank loads it, then the ranks tell each other
whether they succeeded: if one failed, every rank raises (naming the ranks
and their errors), or with ``fallback=True`` they all fall back to the
next older step together.

**Resident checkpoints are committed only when every rank has its part.**
After a restart, each rank's ring may hold an image newer than the newest
committed step (the save was cut short). Instead of each rank flushing it
on its own (``persist_on_open``, which would make rank 0 wait
``commit_timeout`` for a part that a replaced node or a rank killed in its
stall never had), the ranks exchange which steps they hold and persist
only those that every rank holds. This happens when the ``Checkpointer``
is constructed, which is therefore collective: every rank constructs it.

**Coordination runs on a store, never on the training communicator.** The
coordinator posts small keys in a ``torch.distributed`` store (the default
group's, or the ``store=`` given: anything with ``set``, ``get``,
``check`` and ``add``), and polls for the others' keys. Every wait is
bounded by ``commit_timeout`` and raises ``acp.AcpTimeout`` naming the
ranks that did not answer. Without torch.distributed initialised and
without ``store=``, ranks (from ``RANK``/``WORLD_SIZE``) do not
coordinate: each loads the newest step it sees, and each engine persists
its resident images on open.
"""

from __future__ import annotations

import bisect
import hashlib
import heapq
import json
import logging
import operator
import sys
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

from acp._acp import AcpError, AcpTimeout, CheckpointNotFound, ConfigError, InvalidInput
from acp._codec import STATE_KEY, Adapters, Flat, FlatTensor, flatten
from acp._plan import ref_names_cached

_FIRST = operator.itemgetter(0)

__all__ = ["Coordinator", "Store", "assign", "default_store"]

logger = logging.getLogger("acp")

# --------------------------------------------------------------------------- replicas


def assign(sizes: Sequence[tuple[str, int]], ranks: Sequence[int]) -> dict[str, int]:
    """Which rank writes each replicated tensor: ``sizes`` is ``(name,
    nbytes)`` per tensor. Largest first (by name on ties), each goes to the
    rank with the fewest bytes so far (the lower rank on ties). The result
    depends only on the arguments, so every rank computes the same one."""
    if not ranks:
        raise InvalidInput("replica group: no ranks")
    heap = [(0, r) for r in sorted(set(ranks))]
    heapq.heapify(heap)
    out: dict[str, int] = {}
    for name, nbytes in sorted(sizes, key=lambda s: (-s[1], s[0])):
        total, rank = heapq.heappop(heap)
        out[name] = rank
        heapq.heappush(heap, (total + nbytes, rank))
    return out


def replica_prefix(group: Sequence[int], world_size: int) -> str:
    """The name prefix of a replica group's tensors: none when the group is
    every rank, else ``group{lowest rank}.`` (names are unique over all the
    step's files)."""
    return "" if sorted(group) == list(range(world_size)) else f"group{min(group)}."


def flatten_replicated(
    state: object,
    adapters: Adapters,
    *,
    rank: int,
    world_size: int,
    replicated: bool | Collection[str],
    group: Sequence[int],
) -> tuple[Flat, list[FlatTensor]]:
    """The state's tree and all its tensors (``Flat``), and the tensors this
    rank writes: its share of the replicated ones and all of its own."""
    own_prefix = f"rank{rank}." if world_size > 1 else ""
    shared_prefix = replica_prefix(group, world_size)
    if isinstance(replicated, str):
        replicated = (replicated,)
    if replicated is True:
        flat = flatten(state, adapters, shared_prefix)
        shared = flat.tensors
    else:
        keys: set[Any] = set() if isinstance(replicated, bool) else set(replicated)
        if not isinstance(state, dict):
            raise InvalidInput(
                f"replicated={sorted(map(str, keys))} names top-level keys, but the state is "
                f"a {type(state).__name__}, not a dict"
            )
        missing = keys - set(state)
        if missing:
            raise InvalidInput(f"replicated: keys {sorted(map(str, missing))} are not in the state")
        flat, shared = _flatten_split(state, adapters, keys, shared_prefix, own_prefix)
    owners = assign([(t.name, t.info.nbytes) for t in shared], group)
    shared_names = {t.name for t in shared}
    mine = [t for t in flat.tensors if t.name not in shared_names or owners[t.name] == rank]
    return flat, mine


def _flatten_split(
    state: dict[Any, Any],
    adapters: Adapters,
    keys: set[Any],
    shared_prefix: str,
    own_prefix: str,
) -> tuple[Flat, list[FlatTensor]]:
    """Flattens the replicated keys and the others apart (each with its
    names' prefix) and joins their trees back into the state's dict node."""
    rep: dict[Any, Any] = type(state)()
    own: dict[Any, Any] = type(state)()
    for k, v in state.items():
        (rep if k in keys else own)[k] = v
    meta = getattr(state, "_metadata", None)
    if meta is not None:
        rep._metadata = meta  # type: ignore[attr-defined]
    a = flatten(rep, adapters, shared_prefix)
    b = flatten(own, adapters, own_prefix)
    node_a, node_b = a.tree[STATE_KEY], b.tree[STATE_KEY]
    names = {t.name for t in a.tensors}
    clash = [t.name for t in b.tensors if t.name in names]
    if clash:
        raise InvalidInput(
            f"replicated: tensor name `{clash[0]}` is both replicated and this rank's own; "
            "rename the key"
        )
    ks, vs = [], []
    at = {True: 0, False: 0}
    for k in state:
        shared = k in keys
        node = node_a if shared else node_b
        i = at[shared]
        at[shared] += 1
        ks.append(node["k"][i])
        vs.append(node["v"][i])
    node = {**node_a, "k": ks, "v": vs}
    tree = {**a.tree, STATE_KEY: node}
    return Flat(tree, a.tensors + b.tensors), a.tensors


# --------------------------------------------------------------------------- loads


@dataclass
class _Part:
    rank: int
    loaded: Any
    first: int  # index of its first entry among all entries


class Sources:
    """Several loaded files of one step seen as one ``Loaded``: the values
    of the first (this rank's file), the entries of all, in order. What the
    state codec's loaders need: ``step``, ``values_json``, ``entries()``,
    ``buffer(i)``, ``copy_into(items)``, ``report()``."""

    def __init__(self, parts: Sequence[tuple[int, Any]]) -> None:
        self._parts: list[_Part] = []
        self._entries: list[tuple[str, str, tuple[int, ...], int]] = []
        # Per entry, the position in ``_parts`` of the file holding it.
        self._owner: list[int] = []
        for k, (rank, loaded) in enumerate(parts):
            self._parts.append(_Part(rank, loaded, len(self._entries)))
            held = loaded.entries()
            self._entries.extend(held)
            self._owner.extend([k] * len(held))
        self._firsts = [p.first for p in self._parts]
        self._ends = [*self._firsts[1:], len(self._entries)]
        head = self._parts[0].loaded
        self.step: int = head.step
        self.values_json: str = head.values_json

    def _locate(self, i: int) -> tuple[int, int]:
        """The position in ``_parts`` of the file holding entry ``i``, and
        the entry's index in that file. A file without entries starts where
        the next one does: the last part starting at or before ``i`` is the
        one that holds it."""
        if not 0 <= i < len(self._entries):
            raise InvalidInput(
                f"load of step {self.step}: tensor index {i} out of range "
                f"(there are {len(self._entries)})"
            )
        k = bisect.bisect_right(self._firsts, i) - 1
        return k, i - self._parts[k].first

    def entries(self) -> list[tuple[str, str, tuple[int, ...], int]]:
        return list(self._entries)

    @property
    def pending(self) -> bool:
        """Whether a file is still to be read (by ``copy_into``)."""
        return any(getattr(p.loaded, "pending", False) for p in self._parts)

    def buffer(self, i: int) -> memoryview:
        k, j = self._locate(i)
        view: memoryview = self._parts[k].loaded.buffer(j)
        return view

    def give_each(self) -> Callable[[int], bool]:
        """Hands each file's image to the caller where it is private memory
        (another rank's tensors copied out of its slot, or read from
        storage; never a ring slot: ``Loaded.give``). Returns whether the
        tensor at entry index ``i`` is in an image handed over: ``buffer(i)``
        of it is then a writable view the caller's tensor owns."""
        given = [p.loaded.give() for p in self._parts]
        spans = [(p.first, end) for p, end, ok in zip(self._parts, self._ends, given) if ok]
        return lambda i: any(first <= i < end for first, end in spans)

    def copy_into(self, items: list[tuple[int, int, int]]) -> None:
        """Copies each item out of the file holding it. A pending file
        none of them is in is read all the same: its read is what verifies
        it (its values, when it is this rank's file), and it must happen
        before the caller uses anything of it."""
        subs: list[list[tuple[int, int, int]]] = [[] for _ in self._parts]
        owner, firsts, count = self._owner, self._firsts, len(self._entries)
        for i, addr, n in items:
            if not 0 <= i < count:
                self._locate(i)  # raises, naming it
            k = owner[i]
            subs[k].append((i - firsts[k], addr, n))
        for part, sub in zip(self._parts, subs):
            if sub or getattr(part.loaded, "pending", False):
                part.loaded.copy_into(sub)

    def sources(self) -> dict[int, str]:
        """Where each rank's file came from: ``"ram"`` or ``"storage"``."""
        return {p.rank: str(p.loaded.source) for p in self._parts}

    def report(self) -> dict[str, Any]:
        reports = [p.loaded.report() for p in self._parts]
        kinds = {r["source"] for r in reports}
        return {
            "step": self.step,
            "source": kinds.pop() if len(kinds) == 1 else "mixed",
            "bytes": sum(r["bytes"] for r in reports),
            "verified": all(r["verified"] for r in reports),
            "secs": sum(r["secs"] for r in reports),
        }


def with_other_ranks(
    engine: Any,
    loaded: Any,
    rank: int,
    storage_only: bool,
    defer: bool = False,
    *,
    group: Sequence[int] = (),
) -> Any:
    """``loaded`` (``rank``'s file) itself when its tree refers only to its
    own tensors; else a :class:`Sources` that adds the files holding the
    others (replicated tensors other ranks wrote), per the step's index.
    With ``defer`` (a load ``into=``), another rank's tensors resident in
    its slot on this node are read by the first ``copy_into``, each chunk
    checked on its way into the caller's tensors. A step not committed
    (restored from RAM: no index) takes the files of the other ranks of
    ``group`` from RAM, whole, until every tensor is found."""
    # The tree's names are kept from the last load of the same values: a
    # restore of the same structure again walks it once.
    missing = ref_names_cached(loaded.values_json, loaded.step).difference(
        map(_FIRST, loaded.entries())
    )
    if not missing:
        return loaded
    try:
        index = json.loads(engine.index_json(loaded.step))
    except CheckpointNotFound:
        if storage_only:
            raise
        return _with_uncommitted(engine, loaded, rank, set(missing), group)
    weight_map: dict[str, str] = index.get("weight_map", {})
    files: dict[str, Any] = index.get("metadata", {}).get("acp", {}).get("files", {})
    wanted: dict[int, list[str]] = {}
    for name in sorted(missing):
        file = weight_map.get(name)
        if file is None or file not in files:
            continue  # the state codec names the missing tensor
        wanted.setdefault(int(files[file]["rank"]), []).append(name)
    wanted.pop(rank, None)
    parts: list[tuple[int, Any]] = [(rank, loaded)]
    for r, names in sorted(wanted.items()):
        other = engine.load(
            step=loaded.step, storage_only=storage_only, rank=r, tensors=names, defer=defer
        )
        parts.append((r, other))
    return Sources(parts)


def _with_uncommitted(
    engine: Any, loaded: Any, rank: int, missing: set[str], group: Sequence[int]
) -> Any:
    """``loaded`` and the files of the other ranks of ``group`` holding the
    tensors in ``missing``, for a step that is not committed: each rank's
    whole image from RAM (its slot on this node, a replica slot here, or
    one a restore fetched from a peer), verified against the sums or
    digests recorded with it. Which rank wrote which tensor is in no index
    yet: each file is read in turn, in rank order, until none is missing;
    what is still missing then is named by the state codec."""
    parts: list[tuple[int, Any]] = [(rank, loaded)]
    for r in sorted(set(group) - {rank}):
        if not missing:
            break
        try:
            other = engine.load(step=loaded.step, rank=r)
        except CheckpointNotFound as e:
            raise CheckpointNotFound(
                f"step {loaded.step} is not committed and rank {r}'s file of it, which holds "
                f"tensors rank {rank}'s state refers to (e.g. `{min(missing)}`), is not in "
                f"RAM on this node nor fetched from a peer: {e}"
            ) from None
        held = missing.intersection(map(_FIRST, other.entries()))
        if held:
            parts.append((r, other))
            missing -= held
    return Sources(parts) if len(parts) > 1 else loaded


# --------------------------------------------------------------------------- coordination


class Store(Protocol):
    """The subset of ``torch.distributed.Store`` the coordinator uses."""

    def set(self, key: str, value: str) -> None: ...
    def get(self, key: str) -> bytes: ...
    def check(self, keys: list[str]) -> bool: ...
    def add(self, key: str, amount: int) -> int: ...


def default_store() -> Store | None:
    """The store of torch.distributed's default group when torch is
    imported and a group is initialised; else None. Never imports torch."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return None
    try:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        from torch.distributed import distributed_c10d

        store: Store = distributed_c10d._get_default_store()
        return store
    except (AttributeError, ImportError, RuntimeError, ValueError):
        return None


_POLL_MIN = 0.002
_POLL_MAX = 0.05


class Coordinator:
    """Small all-gathers among the ranks of a job through a key-value store.

    Every rank of the job makes the same sequence of calls; each call names
    what it waits for, so a timeout says which exchange and which ranks.
    Keys are under ``acp/{job}/{generation}/``; the generation counts the
    coordinators this rank opened for the job, the same on every rank.
    """

    def __init__(self, store: Store, job: str, rank: int, world_size: int, timeout: float) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        tag = hashlib.blake2b(job.encode(), digest_size=8).hexdigest()
        generation = store.add(f"acp/{tag}/opened/r{rank}", 1)
        self._prefix = f"acp/{tag}/{generation}/"
        self._seq = 0
        self._written: dict[int, list[str]] = {}
        # Dying checkpoints run so far (acp.cover): each one's roll call has
        # keys of its own, the same on every rank.
        self.dying_rounds = 0

    def key(self, what: str) -> str:
        """A key of this job's coordination named ``what`` (the same on every
        rank), for exchanges outside :meth:`gather`."""
        return f"{self._prefix}{what}"

    def _key(self, seq: int, what: str, rank: int | str) -> str:
        return f"{self._prefix}{seq}/{what}/{rank}"

    def gather(self, what: str, payload: str) -> list[str]:
        """Every rank's ``payload``, by rank.

        Raises:
            AcpTimeout: after ``timeout`` seconds, naming the ranks whose
                payload did not arrive.
        """
        seq = self._seq
        self._seq += 1
        store = self.store
        mine = self._key(seq, what, self.rank)
        count = self._key(seq, what, "n")
        self._written[seq] = [mine, count] if self.rank == 0 else [mine]
        store.set(mine, payload)
        arrived = store.add(count, 1)
        deadline = time.monotonic() + self.timeout
        pause = _POLL_MIN
        while arrived < self.world_size:
            if time.monotonic() >= deadline:
                missing = [
                    r for r in range(self.world_size) if not store.check([self._key(seq, what, r)])
                ]
                raise AcpTimeout(
                    f"{what}: ranks {missing} did not answer (rank {self.rank} waited "
                    f"{self.timeout:.3f} s through the store)"
                )
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX)
            arrived = store.add(count, 0)
        out = [
            store.get(self._key(seq, what, r)).decode("utf-8", "replace")
            for r in range(self.world_size)
        ]
        self._forget(seq - 2)
        return out

    def _forget(self, seq: int) -> None:
        """Deletes the keys this rank wrote for exchange ``seq``: every rank
        has read them, since every rank has since posted to the next one."""
        keys = self._written.pop(seq, [])
        delete = getattr(self.store, "delete_key", None)
        if delete is None:
            return
        for key in keys:
            try:
                delete(key)
            except (RuntimeError, ValueError):  # a store without deletion
                return


def _error_payload(e: BaseException) -> str:
    return json.dumps({"type": type(e).__name__, "message": str(e)})


def _raise_for_others(step: int | None, failed: dict[int, dict[str, str]]) -> NoReturn:
    """Raises, on a rank that did its part, the error of the ranks that did
    not (the class of the lowest one's, when it is acp's)."""
    from acp import _acp

    first = failed[min(failed)]
    cls = getattr(_acp, first.get("type", ""), None)
    if not (isinstance(cls, type) and issubclass(cls, AcpError)):
        cls = AcpError
    detail = "; ".join(f"rank {r}: {f.get('message', '')}" for r, f in sorted(failed.items()))
    if step is None:
        raise cls(f"listing the committed steps failed on ranks {sorted(failed)} ({detail})")
    raise cls(f"step {step}: ranks {sorted(failed)} could not load it ({detail})")


def agreed_load(
    coord: Coordinator,
    engine: Any,
    load_step: Callable[[int], Any],
    *,
    step: int | None,
    fallback: bool,
) -> Any:
    """Runs ``load_step`` on ``step``, or (when None) on the newest step
    every rank sees committed, and returns its result once every rank has
    succeeded.

    Raises, on every rank, when any rank failed: the failing rank its own
    error, the others an error of the same class naming it. With
    ``fallback`` (and no ``step``), every rank moves to the next older step
    together instead, while one remains.
    """
    bound: int | None = None
    while True:
        if step is None:
            try:
                steps = engine.steps()
                steps = [s for s in steps if bound is None or s < bound]
                mine, listing = str(steps[-1] if steps else -1), None
            except Exception as e:  # every rank answers, whatever failed
                mine, listing = _error_payload(e), e
            posted = coord.gather("load: newest committed step", mine)
            failed = {r: json.loads(a) for r, a in enumerate(posted) if a.startswith("{")}
            if failed:
                if listing is not None:
                    raise listing
                _raise_for_others(None, failed)
            seen = [int(x) for x in posted]
            chosen = min(seen)
            if chosen < 0:
                none = [r for r, s in enumerate(seen) if s < 0]
                where = "" if bound is None else f" older than step {bound}"
                raise CheckpointNotFound(
                    f"committed checkpoint{where} in {engine.root}: not found by ranks {none}"
                )
        else:
            chosen = step
        result: Any = None
        error: BaseException | None = None
        try:
            result = load_step(chosen)
        except Exception as e:  # every rank answers, whatever failed
            error = e
        answer = "" if error is None else _error_payload(error)
        answers = coord.gather(f"load: step {chosen} loaded", answer)
        failed = {r: json.loads(a) for r, a in enumerate(answers) if a}
        if not failed:
            return result
        if fallback and step is None:
            logger.warning(
                "acp: step %d could not be loaded by ranks %s; every rank falls back",
                chosen,
                sorted(failed),
            )
            bound = chosen
            continue
        if error is not None:
            raise error
        _raise_for_others(chosen, failed)


def recover(coord: Coordinator, engine: Any) -> list[Any]:
    """Persists the resident images (left by this rank's previous process)
    of the steps newer than the newest committed one that every rank holds;
    returns their save handles. Images only some ranks hold are left alone
    (their step can never be committed)."""
    committed = set(engine.steps())
    latest = max(committed) if committed else -1
    report = engine.open_report()
    mine = sorted(
        {int(s) for s in report.get("resident_steps", []) if s > latest and s not in committed}
    )
    everyone = coord.gather("open: resident steps", json.dumps(mine))
    common = set(mine)
    for other in everyone:
        common &= {int(s) for s in json.loads(other)}
    handles = []
    for step in sorted(common):
        logger.info("acp: every rank holds step %d resident: committing it", step)
        try:
            handles.append(engine.persist_resident(step))
        except AcpError as e:
            logger.warning("acp: resident step %d could not be queued: %s", step, e)
    skipped = sorted(set(mine) - common)
    if skipped:
        logger.info(
            "acp: resident steps %s are not held by every rank: they will not be committed",
            skipped,
        )
    return handles


def replica_group_of(group: Sequence[int] | None, rank: int, world_size: int) -> list[int]:
    """The sorted replica group (every rank by default); it must hold ``rank``."""
    if group is None:
        return list(range(world_size))
    ranks = sorted({operator.index(r) for r in group})
    if rank not in ranks or not all(0 <= r < world_size for r in ranks):
        raise ConfigError(
            f"config `replica_group`: {ranks} must hold this rank ({rank}) and only ranks "
            f"below the world size ({world_size})"
        )
    return ranks
