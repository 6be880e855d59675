"""The ``Checkpointer``: asynchronous save, restore from RAM or storage."""

from __future__ import annotations

import contextlib
import gc
import operator
import os
import threading
from collections.abc import Collection, Iterable, Iterator, Sequence
from time import perf_counter
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, overload

from acp import _acp, cover
from acp._acp import (
    AcpError,
    AcpTimeout,
    CheckpointCorrupt,
    CheckpointNotFound,
    ConfigError,
    EngineClosed,
    InvalidInput,
)
from acp._coalesce import Coalescer
from acp._codec import Adapters, Flat, FlatTensor, Transfer, flatten
from acp._env import from_environment
from acp._load import load_into, load_state, read_failed, run_transfers
from acp._metrics import Metrics, logger
from acp._overlap import Overlaps, Pending, Split
from acp._plan import Plans, SavePlan, Spec
from acp._rank import rank_and_world_size
from acp._stats import LoadStats, SaveHandle, SaveStats, load_stats, replicas_held
from acp.distributed import (
    Coordinator,
    Sources,
    Store,
    agreed_load,
    default_store,
    flatten_replicated,
    recover,
    replica_group_of,
    with_other_ranks,
)
from acp.guard import DyingReport, Guard, SigtermHandler, dying_checkpoint, install_sigterm_handler

if TYPE_CHECKING:
    from acp.replica import TorchReplicas

__all__ = ["Checkpointer", "LoadStats", "SaveHandle", "SaveStats", "rank_and_world_size"]


class Internals:
    """What acp's own modules use of a ``Checkpointer`` beyond its public
    API; not for applications. Got with :func:`internals`.

    - ``acp.guard``: the SIGTERM handler installed for it (``sigterm``),
      how many ``guard()`` blocks run in the main thread (``main_guards``),
      the newest save that finished staging (``last_staged``), and the
      engine even once closed (``Checkpointer.engine`` raises then);
    - ``acp.dcp``: the engine, to write DCP's layout through the same ring;
    - ``acp.mindspore``: the codec adapters, a raw engine load (``load``),
      the metrics its own loads report to, and the step ``resume()``
      restored (``resumed_step``), whose epoch ``Model.train`` replays from
      its start: the callback does not save the replayed steps again.

    One object instead of private attributes read from other modules: every
    use is typed and found under one name, and the ``Checkpointer``'s own
    fields stay its own. ``engine``, ``adapters`` and ``metrics`` are the
    objects the ``Checkpointer`` opened (fixed for its life); the other
    fields are state it shares with ``acp.guard``.
    """

    def __init__(self, engine: _acp.Engine, adapters: Adapters, metrics: Metrics) -> None:
        self.engine = engine
        self.adapters = adapters
        self.metrics = metrics
        self.last_staged: SaveHandle | None = None
        self.resumed_step: int | None = None
        self.main_guards = 0
        self.sigterm: SigtermHandler | None = None
        # The dying checkpoint's cover of dead ranks (acp.cover): the
        # coordinator, how to open an engine as another rank, and the
        # newest replicated save (None when it cannot be written again).
        self.coordinator: Coordinator | None = None
        self.cover_setup: cover.Setup | None = None
        self.saved: cover.Saved | None = None

    def load(
        self,
        step: int | None,
        storage_only: bool,
        fallback: bool,
        rank: int | None,
        defer: bool = False,
    ) -> _acp.Loaded:
        """The engine's load of ``step`` (checked by the caller); with
        ``defer``, a step read from storage, or held by this rank's
        resident slot, comes back pending (read, or checked, by its copy)."""
        loaded = self.engine.load(step, storage_only, fallback, rank, defer=defer)
        self.loaded_from([loaded.source])
        return loaded

    def loaded_from(self, sources: Iterable[str]) -> None:
        """Called after the engine's loads, before their bytes are copied.

        A load that read storage into a ring slot may have regrown (remapped)
        it, leaving what adapters registered about slot memory (CUDA's pinned
        ranges) stale: forget it before any copy uses it. A load served from
        resident slots maps nothing, so the registrations stay: registering a
        slot costs about as much as copying it, on every restore."""
        if any(s != "ram" for s in sources):
            self.adapters.forget_memory()


def internals(ckpt: Checkpointer) -> Internals:
    """``ckpt``'s :class:`Internals`, for acp's own modules."""
    return ckpt._in


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pauses Python's cyclic garbage collector for the stall or a load:
    walking a state of thousands of tensors, parsing its values and planning
    its load (or a DCP save or load of it, in ``acp.dcp``) allocate enough
    to trigger full collections that walk the whole heap, which can cost
    more than the copy itself. Nothing made there forms cycles: what it
    leaves behind is freed by reference counts before the collector runs
    again. Also a decorator."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class Checkpointer:
    """Saves and restores training state under ``root``.

    ``save`` returns as soon as the tensors are copied into a shared-memory
    ring slot; the engine flushes and commits in the background. The newest
    checkpoint stays resident in RAM, so ``load`` on the same node restores
    from memory, even after the process died.

    Each keyword but ``root``, ``rank``, ``world_size``, ``replica_group``,
    ``store`` and ``faults`` can also come from the variable
    ``ACP_<KEYWORD>`` (``ACP_RING_SLOTS=3``), read when the keyword is left
    out or None; a value that cannot be read raises ``acp.ConfigError``
    naming the variable. ``docs/configuration.md`` lists them.

    Args:
        root: the checkpoint directory (created, mode 0700).
        job: names this job's shared-memory slots; default: from ``root``.
        rank, world_size: default: torch.distributed when initialised, else
            ``RANK``/``WORLD_SIZE``, else ``RANK_ID``/``RANK_SIZE``, else 0/1.
        ring_bytes: the shared-memory budget over all slots; default: sized
            at open to 7/8 of the room ``/dev/shm`` (``shm_dir``) and
            ``MemAvailable`` leave, slots taking memory only as checkpoints
            need it. A ``/dev/shm`` with room for less than 4 MiB per slot is
            refused at open, and a checkpoint that does not fit at save,
            each naming the sizes and the fix (``docker run --shm-size``,
            ``ACP_SHM_DIR``, or an explicit ``ring_bytes``, which always wins).
            ``ACP_RING_BYTES`` gives it when the keyword does not.
        ring_slots: slots in the ring (default 2; with no ``ring_bytes``, 3
            with several ranks coalescing together and 4 with ``replicas``:
            see below and docs/distributed.md).
        shm_dir: the directory of the ring's slot files (default
            ``/dev/shm``; ``ACP_SHM_DIR`` gives it when the keyword does not).
        keep_last, keep_every: retention: keep the newest ``keep_last``
            committed steps and every multiple of ``keep_every``.
        on_full: when no slot is free, ``"wait"`` (at most ``full_timeout``
            seconds, default 600) or ``"skip"`` the save.
        commit_timeout: with several ranks, how long a save waits for the
            other ranks (rank 0 gathers and commits), and how long the ranks
            wait for each other when they coordinate; default 600 s; the
            error names the ranks that did not answer.
        replica_group: the ranks holding the same replicated state as this
            one (``save(..., replicated=...)``); default: every rank.
        store: the key-value store the ranks coordinate through (a
            ``torch.distributed.Store``, or anything with ``set``, ``get``,
            ``check`` and ``add``); default: torch.distributed's when it is
            initialised. With several ranks and a store, constructing the
            ``Checkpointer`` is collective and ``load`` agrees on the step;
            see ``acp.distributed``.
        release_on_close: ``close()`` removes this rank's ring from shared
            memory once every resident step is committed (default False, or
            ``ACP_RELEASE_ON_CLOSE``: the newest step stays resident for a
            fast restart and for ``acp persist``). A ring holding the only
            copy of a step is kept.
        keep_restored: after a restore from storage that no ring slot was
            ready for (a new node: the file was streamed into the tensors),
            read the step again into a ring slot in the background, so that
            it is resident and a crash before the next save restores it from
            RAM (default True, or ``ACP_KEEP_RESTORED``; skipped when a
            newer step is saved first). False saves that second read.
        shm_ttl: seconds after which opening removes the rings of other
            jobs of this user that no process holds and whose steps are all
            committed (default 24 h; 0 turns it off; see ``acp gc --shm``).
        persist_every, persist_interval, persist_policy: which saves are
            persisted (flushed to storage and committed) when ``save`` is
            given ``persist=None``; the others stay RAM snapshots in the
            ring. ``persist_every=N``: steps that are multiples of N;
            ``persist_interval=s``: at most one persist per ``s`` seconds;
            ``persist_policy="coalesce"``: the newest snapshot whenever the
            previous persist has finished (at most one in flight; a newer
            snapshot supersedes a waiting one, which is never written).
            Default, unless the environment gives a policy
            (``ACP_PERSIST_EVERY``, ``ACP_PERSIST_INTERVAL``,
            ``ACP_PERSIST_POLICY``; read only when none of the three
            keywords is given): ``"coalesce"``. With several ranks every
            rank must write the same steps, so with a store they coalesce
            together: rank 0 decides each save on a background thread
            (persisted iff the step it chose last has finished: committed
            by every rank, or failed) and posts the decision in the store;
            every rank holds each save resident until it reads the
            decision, so a rank ahead of rank 0 still has the chosen step.
            A step is persisted at the first save after the previous
            persist finished; the saves in between stay RAM snapshots on
            every rank, never written. A decision that does not come within
            ``commit_timeout`` (rank 0 gone) releases the hold, with a log
            line. Without a store several ranks persist every save.
            ``persist_interval`` is refused with several ranks (each rank
            would time it alone). Give the ring 3 slots or more when most
            saves are not persisted, so snapshots keep cycling while a
            persist is in flight; with several ranks coalescing and neither
            ``ring_slots`` nor ``ring_bytes`` given, the ring has 3 (the
            self-sized budget gives a slot memory only as images need it,
            but each slot holds at most a third of it). Every persisted step
            is written by every rank; a RAM-only step is lost if its node is
            lost before it is persisted or replicated.
        background_nice: the niceness (0-19) of the flush thread and its
            I/O threads, which also get the lowest best-effort I/O priority
            (default 10; 0 leaves priorities alone).
        compress: how persisted files are stored: ``"none"`` (plain
            safetensors, the default), ``"zstd"`` (each chunk's bytes grouped
            by dtype and zstd-compressed, by the flush threads, never in the
            stall), or ``"auto"`` (compressed when this engine measured that
            compressing makes the flush finish sooner). Default from
            ``ACP_COMPRESS``. The RAM image stays plain; ``acp export``
            writes a plain file.
        compress_level: the zstd level, 1-19 (default 1, or
            ``ACP_COMPRESS_LEVEL``).
        incremental: whether a persisted step references the chunks the
            newest committed step already holds (same bytes at the same
            place, e.g. frozen weights) instead of writing them again
            (default True, or ``ACP_INCREMENTAL``). Each step stays
            loadable on its own; retention keeps a step that a kept step
            references. ``False`` writes every step whole.
        overlap: overlapped saves (default False, or ``ACP_OVERLAP``):
            ``save`` returns once the small tensors are copied and the large
            ones are copied in the background while training goes on (the
            forward and backward passes do not change the state); the save
            is sealed at the next ``staged()``, which
            ``staged_before(optimizer)`` calls before each optimizer step,
            only if no tensor changed meanwhile (torch's version counters).
            States of contiguous CPU torch tensors (any other state is
            copied in the stall); see ``acp._overlap`` and docs/tuning.md.
    """

    @from_environment
    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        job: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        ring_bytes: int | None = None,
        ring_slots: int | None = None,
        keep_last: int | None = None,
        keep_every: int | None = None,
        on_full: str | None = None,
        full_timeout: float | None = None,
        copy_threads: int | None = None,
        io: str | None = None,
        direct_io: str | None = None,
        verify: str | None = None,
        mlock: bool | None = None,
        shm_dir: str | os.PathLike[str] | None = None,
        chunk_bytes: int | None = None,
        queue_depth: int | None = None,
        persist_on_open: bool | None = None,
        stall_timeout: float | None = None,
        commit_timeout: float | None = None,
        faults: _acp.FaultInjector | None = None,
        replica_group: Sequence[int] | None = None,
        store: Store | None = None,
        release_on_close: bool | None = None,
        keep_restored: bool | None = None,
        shm_ttl: float | None = None,
        persist_every: int | None = None,
        persist_interval: float | None = None,
        persist_policy: str | None = None,
        background_nice: int | None = None,
        replicas: int | None = None,
        replica_timeout: float | None = None,
        compress: str | None = None,
        compress_level: int | None = None,
        incremental: bool | None = None,
        overlap: bool | None = None,
    ) -> None:
        self._closed = True  # until the engine is open
        # A child this process forks holds a copy of this object but none
        # of the engine's threads: it must neither use nor close it.
        self._pid = os.getpid()
        # ACP_* variables filled in what the keywords left out (acp._env).
        shm_dir = None if shm_dir is None else os.fspath(shm_dir)
        self._replicas = _torch_replicas(replicas, replica_timeout)
        detected_rank, detected_world = rank_and_world_size()
        self.rank = detected_rank if rank is None else rank
        self.world_size = detected_world if world_size is None else world_size
        self.job = job
        self.replica_group = replica_group_of(replica_group, self.rank, self.world_size)
        if store is None and self.world_size > 1:
            store = default_store()
        coordinated = store is not None and self.world_size > 1
        # Unless told otherwise, the ranks decide together which resident
        # images to commit (the same choice on every rank: a collective).
        recover_together = coordinated and persist_on_open is None
        if recover_together:
            persist_on_open = False
        agreed, persist_policy, ring_slots = _persist_mode(
            self.world_size,
            coordinated,
            persist_every=persist_every,
            persist_interval=persist_interval,
            persist_policy=persist_policy,
            ring_slots=ring_slots,
            ring_bytes=ring_bytes,
        )
        if self._replicas is not None and ring_slots is None and ring_bytes is None:
            # The newest replicated snapshot stays resident (Engine.protect),
            # and so does the one being replicated (Engine.hold_replicating),
            # beside the newest one and the one being staged.
            ring_slots = 4
        _unsigned_config(
            ("rank", self.rank, 32),
            ("world_size", self.world_size, 32),
            ("ring_bytes", ring_bytes, 64),
            ("ring_slots", ring_slots, 64),
            ("copy_threads", copy_threads, 64),
            ("chunk_bytes", chunk_bytes, 64),
            ("queue_depth", queue_depth, 64),
            ("keep_last", keep_last, 64),
            ("keep_every", keep_every, 64),
            ("persist_every", persist_every, 64),
        )
        self._engine = _acp.Engine(
            os.fspath(root),
            job=job,
            rank=self.rank,
            world_size=self.world_size,
            ring_bytes=ring_bytes,
            ring_slots=ring_slots,
            shm_dir=shm_dir,
            mlock=mlock,
            copy_threads=copy_threads,
            chunk_bytes=chunk_bytes,
            queue_depth=queue_depth,
            io=io,
            direct_io=direct_io,
            on_full=on_full,
            full_timeout=full_timeout,
            verify=verify,
            keep_last=keep_last,
            keep_every=keep_every,
            persist_on_open=persist_on_open,
            stall_timeout=stall_timeout,
            commit_timeout=commit_timeout,
            faults=faults,
            release_on_close=release_on_close,
            keep_restored=keep_restored,
            shm_ttl=shm_ttl,
            persist_every=persist_every,
            persist_interval=persist_interval,
            persist_policy=persist_policy,
            background_nice=background_nice,
            replicas_held=None if self._replicas is None else len(self._replicas.sources),
            compress=compress,
            compress_level=compress_level,
            incremental=incremental,
        )
        if self._replicas is not None:
            self._replicas.attach(self._engine)
        self.root = self._engine.root
        self._coordinator: Coordinator | None = None
        self._recovering: list[_acp.SaveHandle] = []
        if coordinated:
            assert store is not None
            self._coordinator = self._coordinate(
                store, job, commit_timeout, recover_together=recover_together
            )
        self._coalescer = (
            Coalescer(self._engine, self._coordinator)
            if agreed and self._coordinator is not None
            else None
        )
        self._adapters = Adapters()
        # The last save's and load(into=)'s plans, reused while the state's
        # signature stays the same (acp._plan).
        self._plans = Plans(self._adapters)
        # Overlapped saves (acp._overlap): the default, the thread that
        # waits on their copies, and the one whose copy may still run.
        self._overlaps = Overlaps(bool(overlap))
        self._closed = False
        self._lock = threading.Lock()
        self._saves = 0
        self._skipped = 0
        self._stall_total = 0.0
        self._stall_max = 0.0
        self._last_save: SaveHandle | None = None
        self.last_load: LoadStats | None = None
        """The figures of the latest ``load``."""
        self.last_dying: DyingReport | None = None
        """What the latest dying checkpoint did (see ``guard()``)."""
        # Figures and log lines (acp._metrics).
        self._metrics = Metrics(os.fspath(self.root), job, self.rank)
        self._metrics.opened(self._engine.open_report())
        self._metrics.persist_source = self._engine.persist_stats
        self._in = Internals(self._engine, self._adapters, self._metrics)
        if self._coordinator is not None:
            self._in.coordinator = self._coordinator
            self._in.cover_setup = cover.Setup(
                os.fspath(self.root),
                job,
                self.rank,
                self.world_size,
                self.replica_group,
                shm_dir,
                {
                    "chunk_bytes": chunk_bytes,
                    "io": io,
                    "direct_io": direct_io,
                    "commit_timeout": commit_timeout,
                },
            )

    def _coordinate(
        self, store: Store, job: str | None, commit_timeout: float | None, *, recover_together: bool
    ) -> Coordinator:
        """Joins the job's other ranks through ``store``: the commit
        coordinator, and the resident images the ranks recover together."""
        try:
            coordinator = Coordinator(
                store,
                job if job is not None else os.fspath(self.root),
                self.rank,
                self.world_size,
                600.0 if commit_timeout is None else commit_timeout,
            )
            if recover_together:
                self._recovering = recover(coordinator, self._engine)
        except BaseException:
            self._engine.close()  # lets go of the ring: the job can be opened again
            raise
        return coordinator

    # --- saving -----------------------------------------------------------

    def save(
        self,
        step: int,
        state: object,
        *,
        overwrite: bool = False,
        metadata: dict[str, str] | None = None,
        replicated: bool | Collection[str] = False,
        persist: bool | None = None,
        overlap: bool | None = None,
    ) -> SaveHandle:
        """Saves ``state`` as ``step``; returns once its tensors are copied
        into the ring (the stall), while the engine writes and commits it.

        Every save is a RAM snapshot, resident in this node's shared memory
        (it survives a crash of the process, not the loss of the node).
        ``persist=True`` also writes and commits it to storage,
        ``persist=False`` keeps it in RAM only, and None (default) lets the
        persist policy decide (``persist_every``, ...; by default the
        newest snapshot whenever the previous persist has finished, agreed
        by the ranks when there are several with a store; several without
        a store persist every save). The newest snapshot is
        committed anyway by
        ``close()``, the dying checkpoint, a restarted trainer on this node
        and ``acp persist``.

        ``state`` nests dicts, lists, tuples, str, int, float, bool, bytes,
        None and tensors (torch, NumPy); its tensors are named by their key
        paths (``model.fc.weight``), after ``rank{N}.`` with several ranks. Anything else raises
        ``acp.InvalidInput`` naming its key before anything is written; a
        committed ``step`` raises ``acp.CheckpointExists`` unless
        ``overwrite``, which replaces it atomically. ``metadata`` adds
        string entries to the safetensors header.

        ``replicated=True`` declares ``state`` identical on every rank of
        the replica group (data parallel), so each tensor is written by one
        of them, the bytes shared out evenly; a collection of top-level keys
        declares only those replicated. ``load`` gives every rank all of
        its tensors. See ``acp.distributed``.

        ``overlap`` (default: the ``Checkpointer``'s ``overlap``) returns
        before the large tensors are copied: they are copied in the
        background while training goes on, and the save is sealed at the
        next ``staged()`` (call it, or let ``staged_before(optimizer)``
        call it, before anything changes the state), or at the next
        ``save``, ``load``, ``wait`` or ``close``, only if no tensor changed
        meanwhile; else it is dropped and its handle raises, naming the
        tensor. Only states of contiguous CPU torch tensors overlap (not
        ``replicated`` saves). See ``acp._overlap``.
        """
        self._check_open()
        self._settle()
        overlap = self._overlaps.default if overlap is None else overlap
        with gc_paused():
            return self._save(
                step,
                state,
                overwrite=overwrite,
                metadata=metadata,
                replicated=replicated,
                persist=persist,
                overlap=overlap and not replicated,
            )

    def staged(self, timeout: float | None = None) -> bool | None:
        """Ends the overlapped save whose copy may still run: waits for the
        copy (at most ``timeout`` seconds: ``acp.AcpTimeout``), then seals
        it (True) or, when one of its tensors changed since ``save()``
        returned, drops it (False: its handle raises, the failure is logged).
        None when no save was pending. Never raises the dropped save's
        error: call it from a hook."""
        if self._closed:
            return None
        return self._settle(timeout)

    def staged_before(self, optimizer: Any) -> Any:
        """Registers ``staged()`` to run before each step of ``optimizer``
        (a ``torch.optim.Optimizer``): what overlapped saves need in a loop
        that saves after the optimizer step. Returns the hook's handle
        (``.remove()`` takes it off)."""

        def hook(*_: object) -> None:
            self.staged()

        return optimizer.register_step_pre_hook(hook)

    def _settle(self, timeout: float | None = None) -> bool | None:
        """``staged()``: the pending overlapped save, sealed or dropped."""
        return self._overlaps.settle(timeout)

    def _queued(
        self,
        result: SaveHandle,
        handle: _acp.SaveHandle | None,
        coalescer: Coalescer | None,
    ) -> None:
        """What follows a sealed (or skipped) save: the coalescing decision
        and the replica exchange."""
        if coalescer is not None:
            coalescer.staged(result.step, handle)
        if self._replicas is not None:
            # Every rank queues every step, skipped or not: the exchange is
            # collective (a rank with no image says so).
            result._replicated = self._replicas.replicate(result.step)

    def reserve(self, state: object, *, replicated: bool | Collection[str] = False) -> int:
        """Creates the shared memory of the ring's free slots for checkpoints
        of ``state``'s size now, so that the first saves (one per slot)
        stall no longer than later ones: without it, the first save into
        each slot also creates its memory, at first-touch speed (about a
        second per GiB on a small VM). Call it before training, with the
        state you will save (``replicated`` as you will pass it to
        ``save``); returns how many slots are ready. Slots that hold
        checkpoints (a resident copy after a restart) are left alone.
        Nothing is saved.
        """
        self._check_open()
        self._settle()
        with gc_paused():
            flat, tensors = self._flatten(state, replicated)
            specs = [(t.name, t.info.dtype, t.info.shape) for t in tensors]
            return self._engine.reserve(specs, flat.json())

    def _flatten(
        self, state: object, replicated: bool | Collection[str]
    ) -> tuple[Flat, list[FlatTensor]]:
        # Tensor names are unique over all ranks' files (the step's index
        # maps each to its file): with several ranks, each rank's are
        # prefixed with it.
        prefix = f"rank{self.rank}." if self.world_size > 1 else ""
        if replicated:
            return flatten_replicated(
                state,
                self._adapters,
                rank=self.rank,
                world_size=self.world_size,
                replicated=replicated,
                group=self.replica_group,
            )
        flat = flatten(state, self._adapters, prefix)
        return flat, flat.tensors

    def _plan_save(
        self, state: object, replicated: bool | Collection[str], overlap: bool = False
    ) -> tuple[SavePlan | None, Flat | None, list[Any], list[object], list[Spec], str, set[str]]:
        """``(kept plan, flat, tensors, leaves, specs, values JSON,
        frameworks)``: a state with the last save's signature reuses its
        plan (its names, JSON and copy ranges, kept by the engine: one walk,
        no describe), and ``tensors`` are then the storages of the walk's
        tensors, alive while the copy runs, and ``leaves`` the tensors
        themselves, in walk order; else the full flatten (no leaves). An
        overlapped save does not reuse a plan kept without its split (kept
        by saves that did not overlap): it plans again, keeping one."""
        kept = None if replicated else self._plans.for_save(state)
        if kept is not None and overlap and kept[0].split is None:
            kept = None
        if kept is not None:
            plan, alive, leaves = kept
            values_json = plan.values_of(state)
            return plan, None, alive, leaves, plan.specs, values_json, plan.frameworks
        flat, tensors = self._flatten(state, replicated)
        specs = [(t.name, t.info.dtype, t.info.shape) for t in tensors]
        return None, flat, tensors, [], specs, flat.json(), flat.frameworks()

    def _engine_plan(
        self,
        kept: SavePlan | None,
        replicated: bool | Collection[str],
        tensors: list[Any],
        specs: list[Spec],
        values_json: str,
    ) -> tuple[_acp.SavePlan | None, list[tuple[int, int, int]] | None]:
        """The engine's plan of this save: the kept one, or (a state of
        plain host tensors, saved by this rank alone) a new one for the next
        saves, made before the save so that its layout is planned once;
        with the new one, its copy ranges."""
        if kept is not None:
            return kept.engine, None
        if replicated:
            return None, None
        host = _host_plan(tensors)
        if host is None:
            return None, None
        return self._engine.save_plan(specs, values_json, host), host

    def _save(
        self,
        step: int,
        state: object,
        *,
        overwrite: bool,
        metadata: dict[str, str] | None,
        replicated: bool | Collection[str],
        persist: bool | None,
        overlap: bool = False,
    ) -> SaveHandle:
        t0 = perf_counter()
        step = _step(step)
        coalescer = self._coalescer if persist is None else None
        try:
            result, handle = self._stage(
                t0,
                step,
                state,
                overwrite=overwrite,
                metadata=metadata,
                replicated=replicated,
                persist=persist,
                hold=coalescer is not None,
                overlap=overlap,
                coalescer=coalescer,
            )
        except BaseException:
            self._unstaged(step, coalescer)
            raise
        if not result._pending:
            self._queued(result, handle, coalescer)
        return result

    def _unstaged(self, step: int, coalescer: Coalescer | None) -> None:
        """A save that failed before it was sealed: rank 0 decides it "not
        persisted"; a hold that was staged before the error (nothing decides
        it now) is let go."""
        if coalescer is not None:
            coalescer.staged(step, None)
            with contextlib.suppress(AcpError):
                self._engine.decide(step, False)

    def _stage(
        self,
        t0: float,
        step: int,
        state: object,
        *,
        overwrite: bool,
        metadata: dict[str, str] | None,
        replicated: bool | Collection[str],
        persist: bool | None,
        hold: bool,
        overlap: bool,
        coalescer: Coalescer | None,
    ) -> tuple[SaveHandle, _acp.SaveHandle | None]:
        """``_save``'s work: the save handle, and the engine's handle of
        the staged save (None when skipped, or while an overlapped copy
        runs: the handle is then pending, and ``_settle`` seals it)."""
        kept, flat, tensors, leaves, specs, values_json, frameworks = self._plan_save(
            state, replicated, overlap
        )
        tensor_bytes = (
            kept.tensor_bytes if kept is not None else sum(t.info.nbytes for t in tensors)
        )
        count = len(specs)
        extra = {}
        if len(frameworks) == 1:
            extra["format"] = {"torch": "pt", "numpy": "np"}.get(next(iter(frameworks)), "")
        extra.update(metadata or {})
        extra = {k: v for k, v in extra.items() if v}
        engine_plan, host = self._engine_plan(kept, replicated, tensors, specs, values_json)
        # The walk's leaves of the plan this save keeps (when it keeps one).
        walked = (
            self._plans.saved(
                state,
                engine=engine_plan,
                specs=specs,
                values_json=values_json,
                frameworks=frameworks,
                tensor_bytes=tensor_bytes,
                # What an overlapped save needs kept (not built otherwise:
                # about 1 us per tensor, on the stall's path).
                host=host if overlap else None,
                objs=None if flat is None or not overlap else [t.obj for t in tensors],
                tree=None if flat is None else flat.tree,
            )
            if kept is None and not replicated
            else None
        )
        split, leaves = self._split(
            overlap, kept=kept, leaves=leaves or walked, host=host, flat=flat, tensors=tensors
        ) or (None, leaves)
        t1 = perf_counter()
        if engine_plan is not None:
            # A kept plan's values JSON, rendered anew, goes in only when it
            # changed (a step counter): the engine then writes a new header.
            fresh = kept is not None and values_json != kept.values_json
            staging = self._engine.begin_save_planned(
                step,
                engine_plan,
                overwrite,
                extra,
                persist,
                hold=hold,
                values_json=values_json if fresh else None,
            )
        else:
            staging = self._engine.begin_save(
                step, specs, values_json, overwrite, extra, persist, hold=hold
            )
        # From here until finish() returns, any exception (one raised by a
        # signal handler included: SIGTERM during the copy) aborts the
        # staging, so a half-filled slot is never sealed.
        try:
            if staging is None:
                handle = _acp.SaveHandle.skipped(step)
                copy_secs = 0.0
            elif split is not None and split.lazy:
                # Overlapped: the small tensors now, the rest in the
                # background, sealed by ``_settle`` (acp._overlap).
                t2 = perf_counter()
                if split.eager:
                    staging.copy_from(split.eager)
                copy = self._overlaps.copier.submit(staging.copy_from, split.lazy, background=True)
                copy_secs = perf_counter() - t2
                return self._overlapped(
                    Pending(
                        step=step,
                        staging=staging,
                        split=split,
                        leaves=leaves,
                        alive=tensors,
                        copy=copy,
                        seal=lambda *a: None,  # set below
                    ),
                    t0=t0,
                    t1=t1,
                    copy_secs=copy_secs,
                    coalescer=coalescer,
                )
            else:
                t2 = perf_counter()
                if engine_plan is not None:
                    # ``tensors`` holds the memory (the storages) the plan
                    # copies from, until the copy is done: the walk checked
                    # each tensor still has the plan's address, shape,
                    # strides and dtype.
                    staging.copy_planned(engine_plan)
                else:
                    _fill(staging, tensors)
                copy_secs = perf_counter() - t2
                handle = staging.finish()
        except BaseException:
            if staging is not None:
                staging.abort()
            raise
        stall = perf_counter() - t0
        stats = SaveStats(
            step=step,
            skipped=staging is None,
            done=staging is None,
            stall_secs=stall,
            flatten_secs=t1 - t0,
            copy_secs=copy_secs,
            tensors=count,
            tensor_bytes=tensor_bytes,
        )
        result = SaveHandle(handle, stats)
        self._count(result, staged=staging is not None)
        if staging is not None:
            self._in.last_staged = result
            if self._in.cover_setup is not None:
                # Only the dying checkpoint after SIGTERM uses it.
                # (A replicated save never reuses a plan: ``flat`` is there.)
                covers = (
                    replicated is True
                    and len(self.replica_group) > 1
                    and self._in.sigterm is not None
                )
                self._in.saved = (
                    cover.record(step, state, flat, values_json, extra)
                    if covers and flat is not None
                    else None
                )
        self._metrics.saved(result)
        return result, None if staging is None else handle

    def _split(
        self,
        overlap: bool,
        *,
        kept: SavePlan | None,
        leaves: list[object] | None,
        host: list[tuple[int, int, int]] | None,
        flat: Flat | None,
        tensors: list[Any],
    ) -> tuple[Split, list[object]] | None:
        """An overlapped save's split of its tensors and the leaves whose
        version counters it watches: those of the kept plan (the one this
        save reused, or the one it just kept: ``leaves`` are then its
        walk's), else a split made for this save (a state whose plan is
        not kept). None: copied in the stall."""
        plan = kept if kept is not None else self._plans.save if leaves else None
        if not overlap:
            return None
        if plan is not None and plan.split is not None and leaves:
            return plan.split, leaves
        if kept is not None or host is None or flat is None:
            return None
        objs = [t.obj for t in tensors]
        names = [t.name for t in tensors]
        return Split(host, objs, objs, names, self._plans.eager_names), objs

    def _count(self, result: SaveHandle, *, staged: bool) -> None:
        """Counts a save in ``stats()`` (its stall) and makes it the last."""
        stall = result._stall.stall_secs
        with self._lock:
            self._saves += 1
            self._skipped += not staged
            self._stall_total += stall
            self._stall_max = max(self._stall_max, stall)
            self._last_save = result

    def _overlapped(
        self,
        pending: Pending,
        *,
        t0: float,
        t1: float,
        copy_secs: float,
        coalescer: Coalescer | None,
    ) -> tuple[SaveHandle, None]:
        """The pending handle of an overlapped save whose background copy
        was started; ``_settle`` seals or drops it."""
        step, split = pending.step, pending.split
        stats = SaveStats(
            step=step,
            skipped=False,
            done=False,
            stall_secs=perf_counter() - t0,
            flatten_secs=t1 - t0,
            copy_secs=copy_secs,
            tensors=len(split.host),
            tensor_bytes=sum(r[2] for r in split.host),
        )
        result = SaveHandle(None, stats, pending=self._settle)

        def seal(
            handle: _acp.SaveHandle | None, error: BaseException | None, waited: float, took: float
        ) -> None:
            result._sealed(handle, error, waited, took)
            self._metrics.saved(result)
            if handle is None:
                self._unstaged(step, coalescer)
                if self._replicas is not None:
                    result._replicated = self._replicas.replicate(step)
                return
            self._in.last_staged = result
            self._queued(result, handle, coalescer)

        pending.seal = seal
        # A close() from another thread since this save began has settled
        # what was pending already: this save must not outlive it (its
        # staging would keep the engine's ring locked).
        with self._lock:
            closed = self._closed
            if not closed:
                self._overlaps.pending = pending
        if closed:
            # Dropped as a failed save, without the coalescing decision and
            # the replica exchange: both are closed.
            pending.seal = result._sealed
            pending.cancel(
                EngineClosed(f"save of step {step}: the checkpointer was closed during the save")
            )
        self._count(result, staged=not closed)
        return result, None

    # --- loading ----------------------------------------------------------

    @gc_paused()
    def load(
        self,
        step: int | None = None,
        *,
        into: object = None,
        map_location: Any = None,
        fallback: bool = False,
        storage_only: bool = False,
        rank: int | None = None,
        agree: bool | None = None,
        zero_copy: bool = False,
    ) -> Any:
        """Loads a step from RAM when it is resident, else from storage.
        ``step=None`` loads the newest committed step or, with one rank, a
        newer RAM snapshot of this rank once it is hashed (in the
        background, right after its save; ``wait()`` waits for it); a RAM
        snapshot that fails verification gives way to the next source. An
        explicit ``step`` that is not committed is loaded from RAM, verified
        against the digests recorded when it was hashed.

        Without ``into``, returns a fresh state whose tensors own their
        memory (on the device they were saved from, or ``map_location``: a
        device, a device name, or a dict mapping saved device names to
        others). A resident slot is copied out of; an image the load holds
        in private memory (fetched from a peer, another rank's file copied
        out of its slot, a storage read with no slot free) is handed to the
        CPU torch tensors instead: they are writable views of it, together
        keeping it mapped until the last of them is gone, and their storage
        cannot be resized. With ``into`` (a dict, list or tensor shaped like the saved
        state, e.g. ``{"model": model.state_dict()}``), copies into its
        tensors in place and assigns its other values, and returns the
        load's ``LoadStats``; a missing key or a tensor whose shape or dtype
        differs raises ``acp.InvalidInput`` naming the key before anything
        is copied. Keys present in the checkpoint but not at the top level of
        ``into`` are not loaded. From storage, ``into``'s tensors are filled
        in the read's own pass (each chunk copied and hashed a cache-sized
        block at a time, its digest compared at its end; no second pass
        over a full copy); on a node whose ring has no slot ready for the
        image (a replaced node's), the file is streamed through a few
        16 MiB buffers into the tensors, then read again into a ring slot
        in the background (``keep_restored``), which makes it resident
        once ``wait()`` returns; else it is read into a slot, which stays
        resident. From RAM, they are filled in the
        pass that checks the resident copy (each chunk copied and checked
        against its recorded sum the same way; a resident copy that fails
        its check is dropped and the step is read from storage instead,
        into every tensor, logged). When the load raises, each of them
        holds its old bytes or bytes of the step that failed (a mix, which
        may include bytes of a chunk that failed its check) and must not be
        used, and no other value was assigned; with ``fallback``, a step
        whose data fails verification during that read is skipped (logged)
        and the next intact one is loaded into every tensor. ``fallback``
        (with ``step=None``) falls back to the newest intact step when the
        latest is corrupt;
        ``storage_only`` ignores the resident copy; ``rank`` loads the file
        another rank wrote (each rank's file holds that rank's state).
        Tensors another rank wrote (``save(..., replicated=...)``) come from
        its file: from its slot when it is resident on this node, else from
        storage.

        ``zero_copy`` (fresh loads only, for evaluation, export and
        inference) makes each tensor restored on the CPU a view of the
        loaded image instead of a copy: of the resident ring slot when the
        step came from RAM (the slot stays pinned, so later saves use the
        other slots, until every such tensor is gone), else of the memory
        it was read into. The views are read-only: their pages are mapped
        read-only while they live, so a write through one (an in-place
        op, an optimizer step) kills the process with SIGSEGV rather than
        change the checkpoint; ``clone()`` a tensor to change it (given
        back as ``into=``, they are refused with ``InvalidInput``). Tensors
        for another device (``map_location``) are copied there, as are all
        tensors of frameworks other than torch; without ``zero_copy`` every
        tensor owns a copy.

        ``agree`` (default: with several coordinated ranks and neither
        ``step`` nor ``rank`` given) makes the load collective: every rank
        loads the newest step that all of them see committed, and if any
        rank fails, every rank raises (or, with ``fallback``, all move to
        the next older step). See ``acp.distributed``.

        Raises ``acp.CheckpointNotFound`` when there is no such step,
        ``acp.CheckpointCorrupt`` naming the file and tensor.
        """
        self._check_open()
        self._settle()  # a pending overlapped copy reads what into= writes
        if step is not None:
            step = _step(step)
        if rank is not None:
            rank = _unsigned("rank", rank, 32)
        if zero_copy and into is not None:
            raise InvalidInput("load(zero_copy=True) returns a fresh state: give no into=")
        self._reap_recovery()

        def load_step(s: int | None, fallback: bool) -> Any:
            return self._load(
                s,
                into=into,
                map_location=map_location,
                fallback=fallback,
                storage_only=storage_only,
                rank=rank,
                zero_copy=zero_copy,
            )

        if self._replicas is not None and step is None and rank is None:
            # Collective: the newest step every rank has somewhere, replicas
            # sent to the ranks that need them.
            step = self._replicas.restore(self.replica_group)
            if step is None:
                raise CheckpointNotFound(f"no step restorable on every rank of {self.root}")
            try:
                return load_step(step, fallback)
            finally:
                # Images the restore fetched that its load did not take
                # (another rank's file no tensor was missing from).
                self._engine.drop_peer_images()
        if agree is None:
            agree = self._coordinator is not None and step is None and rank is None
        if not agree:
            return load_step(step, fallback)
        if self._coordinator is None:
            raise InvalidInput("load(agree=True): the ranks have no store to coordinate through")
        return agreed_load(
            self._coordinator,
            self._engine,
            lambda s: load_step(s, False),
            step=step,
            fallback=fallback,
        )

    def _load(
        self,
        step: int | None,
        *,
        into: object,
        map_location: Any,
        fallback: bool,
        storage_only: bool,
        rank: int | None,
        defer: bool = True,
        zero_copy: bool = False,
    ) -> Any:
        t0 = perf_counter()
        # With into=, a step read from storage is opened pending: planned
        # from its header, then read, verified (the header too) and copied
        # into the tensors in one pass by the planner's copy (acp._load).
        # A fresh load of this rank's file opens it pending too: from RAM,
        # the fresh tensors are filled by the pass that checks the slot
        # (from storage it is read whole first, below, as before: its
        # image may be handed to the tensors). Other ranks' files are read
        # whole for a fresh load (their private images are handed over).
        ours = rank is None or rank == self.rank
        defer_other = defer and into is not None
        defer = defer_other or (defer and ours)
        own = self._in.load(step, storage_only, fallback, rank, defer)
        from_ram = getattr(own, "source", None) == "ram"
        # Replicated tensors other ranks wrote are in their files.
        loaded = with_other_ranks(
            self._engine,
            own,
            self.rank if rank is None else rank,
            storage_only,
            defer_other,
            group=self.replica_group,
        )
        ranks = loaded.sources() if isinstance(loaded, Sources) else None
        if ranks:  # other ranks' files, loaded by with_other_ranks
            self._in.loaded_from(ranks.values())
        t1 = perf_counter()
        try:
            if into is None:
                if getattr(own, "pending", False) and not from_ram:
                    own.copy_into([])  # read whole: give() may hand it over
                result = load_state(loaded, self._adapters, map_location, zero_copy)
                copied = sum(nbytes for _, _, _, nbytes in loaded.entries())
            else:
                copied = load_into(loaded, self._adapters, into, map_location, self._plans)
        except AcpError as e:
            # ``failed``: the read of the step's file failed (storage).
            failed_step, why = loaded.step, e
            failed = read_failed(loaded) or read_failed(own)
            del loaded, own
            if from_ram and not storage_only and isinstance(e, CheckpointCorrupt):
                # The resident copy failed its check (the slot is
                # dropped): the same step from the next source,
                # storage, planned afresh from its own header.
                logger.warning(
                    "acp: the resident copy of step %d failed verification, "
                    "reading it from storage: %s",
                    failed_step,
                    e,
                )
                try:
                    return self._load(
                        failed_step,
                        into=into,
                        map_location=map_location,
                        fallback=fallback,
                        storage_only=True,
                        rank=rank,
                        defer=defer,
                        zero_copy=zero_copy,
                    )
                except CheckpointNotFound:
                    # A RAM snapshot only: with no step asked for,
                    # the next source, whatever ``fallback`` says
                    # (as the engine does for one it checks).
                    if step is not None:
                        raise e from None
                except AcpError as again:
                    # Storage's copy fails too: with ``fallback``
                    # and no step asked for, the newest intact step.
                    if not (fallback and step is None):
                        raise
                    why = again
            elif not (fallback and step is None and failed):
                raise
            # The failed step's slot is gone, or its read is
            # marked failed: the engine loads another step.
            logger.warning("acp: step %d cannot be loaded, falling back: %s", failed_step, why)
            return self._load(
                None,
                into=into,
                map_location=map_location,
                fallback=fallback,
                storage_only=storage_only,
                rank=rank,
                defer=False,
                zero_copy=zero_copy,
            )
        t2 = perf_counter()
        if ranks:
            # Where each file came from in the end: a deferred read of
            # another rank's slot may have read storage instead.
            ranks = loaded.sources()
        report = loaded.report()
        del loaded, own
        stats = load_stats(report, t0, t1, t2, copied, ranks=ranks)
        self.last_load = stats
        self._metrics.loaded(stats)
        return result if into is None else stats

    def _reap_recovery(self) -> None:
        """Waits for the resident steps the ranks chose to commit at open,
        logging a failure (their step stays uncommitted, as if never saved)."""
        handles, self._recovering = self._recovering, []
        for h in handles:
            try:
                h.wait()
            except AcpError as e:
                logger.warning("acp: resident step %d was not committed: %s", h.step, e)

    # --- the rest ---------------------------------------------------------

    def steps(self) -> list[int]:
        """The committed steps (persisted in storage), ascending; RAM
        snapshots are ``snapshots()``."""
        self._check_open()
        return self._engine.steps()

    def snapshots(self) -> list[int]:
        """The RAM snapshots of this rank on this node: the steps resident
        in its shared-memory ring (persisted or not), newest first."""
        self._check_open()
        return self._engine.snapshots()

    def latest(self) -> int | None:
        """The newest committed step, or None."""
        self._check_open()
        return self._engine.latest()

    def retain(self, keep_last: int, keep_every: int | None = None) -> list[int]:
        """Deletes committed steps that are neither among the newest
        ``keep_last`` nor a multiple of ``keep_every``; returns them."""
        self._check_open()
        return self._engine.retain(keep_last, keep_every)

    def wait(self, timeout: float | None = None) -> None:
        """Blocks until every save so far has finished (committed or failed;
        a RAM snapshot once it is hashed, so that ``load()`` can serve it;
        with several ranks coalescing, once the ranks' decision is applied;
        an overlapped save's copy first, which seals or drops it)."""
        self._check_open()
        self._settle()
        if self._coalescer is not None:
            started = perf_counter()
            if not self._coalescer.drain(timeout):
                raise AcpTimeout(
                    f"rank {self.rank}: persist decisions (coalescing) of {self.root}: "
                    f"timed out after {timeout:.3f} s"
                )
            if timeout is not None:
                timeout = max(0.0, timeout - (perf_counter() - started))
        self._engine.wait_idle(timeout)
        self._metrics.collect()

    @overload
    def stats(self, format: Literal["dict"] = "dict") -> dict[str, Any]: ...
    @overload
    def stats(self, format: Literal["prometheus"]) -> str: ...

    def stats(self, format: str = "dict") -> dict[str, Any] | str:
        """Totals and the latest figures of this checkpointer; ``"figures"``
        holds the aggregates of every save and load (see ``acp.metrics``).
        ``format="prometheus"`` gives them in the Prometheus text format."""
        if format == "prometheus":
            return self._metrics.prometheus()
        if format != "dict":
            raise InvalidInput(f"stats: format {format!r} is not 'dict' or 'prometheus'")
        with self._lock:
            last = self._last_save
            out: dict[str, Any] = {
                "root": os.fspath(self.root),
                "job": self.job,
                "rank": self.rank,
                "world_size": self.world_size,
                "saves": self._saves,
                "skipped": self._skipped,
                "stall_secs_total": self._stall_total,
                "stall_secs_max": self._stall_max,
            }
        out["last_save"] = None if last is None else last.stats.as_dict()
        out["last_load"] = None if self.last_load is None else self.last_load.as_dict()
        out["engine"] = None if self._closed else self._engine.open_report()
        out["persist"] = None if self._closed else self._engine.persist_stats()
        out["replicas"] = None if self._closed else replicas_held(self._engine.replicas())
        coalescer = self._coalescer
        out["coalesce"] = None if coalescer is None else coalescer.stats()
        out["figures"] = self._metrics.summary()
        return out

    # --- faults -----------------------------------------------------------

    def guard(self, *, timeout: float | None = None, sigterm: bool = False) -> Guard:
        """A context manager for the training loop: when an exception
        escapes it, every completely staged checkpoint is flushed and
        committed (waiting at most ``timeout`` seconds, and never past the
        watchdog), then the exception goes on. With ``sigterm=True``, acp's
        SIGTERM handler is installed for the block (see
        ``install_sigterm_handler``). A save interrupted while staging is
        aborted; the one before it is what gets committed. If the dying
        checkpoint fails, the process exits with status 74. See
        ``acp.guard`` for the exit statuses."""
        return Guard(self, timeout=timeout, sigterm=sigterm)

    def install_sigterm_handler(self, *, timeout: float | None = None) -> SigtermHandler:
        """Opt-in SIGTERM handling (call from the main thread): on SIGTERM,
        every completely staged checkpoint is flushed and committed, the
        previous handler is called, and the process exits with 143 (all
        committed) or 74 (the dying checkpoint failed). Inside ``guard()``
        the handler unwinds the block first. Returns the handler;
        ``uninstall()`` puts the previous one back."""
        return install_sigterm_handler(self, timeout=timeout)

    def dying_checkpoint(self, timeout: float | None = None) -> DyingReport:
        """Waits until every completely staged checkpoint is committed (at
        most ``timeout`` seconds, never past the watchdog) and reports the
        outcome without raising. What ``guard()`` and the SIGTERM handler do."""
        return dying_checkpoint(self, cause="call", timeout=timeout)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Commits the newest RAM snapshot when it is not persisted, waits
        for the queued flushes, then stops the engine. Resident
        checkpoints stay in shared memory, unless ``release_on_close`` was
        set: then this rank's ring is removed, if every resident step is
        committed, and so are the replica rings it holds for other ranks
        (``replicas=``), if every step they hold is (a ring holding the
        only copy of a step is kept, and a warning logged). Raises the
        first flush error no handle reported. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if os.getpid() != self._pid:
            # A forked child's copy: the parent's threads, locks and queued
            # work are not its to finish; the engine's drop leaves them be.
            return
        interrupted: BaseException | None = None
        try:
            self._settle()  # sealed (or dropped) before the newest is committed
        except AcpError as e:
            logger.warning("acp: overlapped save not sealed at close: %s", e)
        except BaseException as e:
            # Interrupted while the copy ran: the save is dropped, the
            # engine still closed, then the interrupt goes on.
            interrupted = e
            pending, self._overlaps.pending = self._overlaps.pending, None
            if pending is not None:
                pending.cancel(EngineClosed(f"save of step {pending.step}: close() interrupted"))
        self._overlaps.close()
        self._plans.clear()
        if self._in.sigterm is not None:
            self._in.sigterm.uninstall()
        if self._coalescer is not None:
            # The held saves are decided first: a rank never lets go of a
            # step that rank 0 chose to persist.
            self._coalescer.close()
        if self._replicas is not None:
            self._replicas.close()
        try:
            self._adapters.close()
        finally:
            try:
                kept = self._engine.close()
                if kept:
                    logger.warning(
                        "acp: release_on_close: the ring (or replica rings) of %s rank %d "
                        "is kept in shared memory: it holds the only copy of step(s) %s (not "
                        "committed; `acp persist` commits it, `acp gc --shm --force` drops it)",
                        self.root,
                        self.rank,
                        kept,
                    )
            finally:
                self._metrics.close()
        if interrupted is not None:
            raise interrupted

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def engine(self) -> _acp.Engine:
        """The underlying ``acp._acp.Engine`` (for storage plugins and tools)."""
        self._check_open()
        return self._engine

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosed(f"engine for {os.fspath(self.root)}: closed")
        if os.getpid() != self._pid:
            raise InvalidInput(
                f"engine for {os.fspath(self.root)}: opened by process {self._pid}; process "
                f"{os.getpid()} is a child it forked, which cannot use it (the engine's threads "
                "were not copied): open a Checkpointer of its own"
            )

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"Checkpointer({os.fspath(self.root)!r}, rank={self.rank}, {state})"


def _torch_replicas(replicas: int | None, timeout: float | None) -> TorchReplicas | None:
    """The replica exchange ``replicas`` asks for, with ``timeout`` seconds
    (None: the default); both already filled in from the environment."""
    if not replicas:
        return None
    from .replica import DEFAULT_TIMEOUT, TorchReplicas

    return TorchReplicas(replicas, DEFAULT_TIMEOUT if timeout is None else timeout)


def _persist_mode(
    world_size: int,
    coordinated: bool,
    *,
    persist_every: int | None,
    persist_interval: float | None,
    persist_policy: str | None,
    ring_slots: int | None,
    ring_bytes: int | None,
) -> tuple[bool, str | None, int | None]:
    """The default persist policy: whether the ranks coalesce together
    (``acp._coalesce``), and the engine's ``persist_policy`` and
    ``ring_slots``. One rank coalesces in its engine; several with a store
    coalesce together (the engine persists what rank 0 decides, every save
    held until then); several without a store persist every save."""
    agreed = False
    if persist_every is None and persist_interval is None:
        if persist_policy is None and world_size == 1:
            persist_policy = "coalesce"
        elif persist_policy in (None, "coalesce") and world_size > 1:
            agreed = coordinated
            persist_policy = None if agreed else persist_policy
    if agreed and ring_slots is None and ring_bytes is None:
        # A slot for the persist in flight, one for the newest snapshot and
        # one to stage into: snapshots keep cycling meanwhile. The
        # self-sized budget gives slots memory only as images need it.
        ring_slots = 3
    return agreed, persist_policy, ring_slots


def _step(step: object) -> int:
    return _unsigned("step", step, 64)


def _unsigned(name: str, value: object, bits: int, error: type[AcpError] = InvalidInput) -> int:
    """``value`` as an integer from 0 to ``2**bits - 1``, else ``error``
    naming ``name`` (the engine's conversion raised a bare
    ``OverflowError``)."""
    try:
        got = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise error(f"{name}: {value!r} is not an integer") from None
    if not 0 <= got < 2**bits:
        raise error(f"{name}: {got} is not between 0 and 2**{bits} - 1")
    return got


def _unsigned_config(*fields: tuple[str, int | None, int]) -> None:
    """:func:`_unsigned` of each integer ``(name, value, bits)`` as
    ``ConfigError`` naming the field; None is a default, and a value of
    another type is left to the engine's conversion."""
    for name, value, bits in fields:
        if isinstance(value, int):
            _unsigned(f"`{name}`", value, bits, ConfigError)


def _host_plan(tensors: list[FlatTensor]) -> list[tuple[int, int, int]] | None:
    """The save's copy as engine ranges ``(index, address, nbytes)`` when
    every tensor is contiguous host memory (or empty); else None."""
    host = []
    for index, t in enumerate(tensors):
        info = t.info
        if info.host is not None:
            host.append((index, info.host[0], info.nbytes))
        elif info.nbytes == 0:
            host.append((index, 0, 0))
        else:
            return None
    return host


def _fill(staging: _acp.Staging, tensors: list[FlatTensor]) -> None:
    """Copies every tensor into the slot; ``staging.entries()`` are in the
    order of ``tensors``."""
    direct = Transfer()  # contiguous host bytes: no adapter needed
    host = direct.host
    groups: dict[Any, list[tuple[int, object, Any]]] = {}
    for index, t in enumerate(tensors):
        info = t.info
        if info.host is not None:
            host.append((index, info.host[0], info.nbytes))
            continue
        items = groups.get(t.adapter)
        if items is None:
            items = groups[t.adapter] = []
        items.append((index, t.obj, info))
    transfers = [direct] + [adapter.stage(staging, items) for adapter, items in groups.items()]
    run_transfers(staging.copy_from, transfers)
