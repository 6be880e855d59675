"""Overlapped saves (``Checkpointer(overlap=True)``): the copy into the ring
slot runs in the background while training goes on, and the save is sealed
only if the state did not change meanwhile.

A training step reads its parameters and optimizer state in the forward
and backward passes and changes them only in the optimizer step. A save
made right after an optimizer step can therefore copy its tensors while
the next step's forward and backward run, if the copy is over before the
next optimizer step starts: ``save()`` then costs the walk of the state
and the copy of its small tensors, not the copy of all of it.

How a save is overlapped (a state of contiguous CPU torch tensors, not a
``replicated`` save; any other state is copied in the stall):

1. In the stall: the tensors under :data:`EAGER_BELOW` bytes (running
   statistics such as BatchNorm's, which the forward pass changes in place
   without telling anyone, counters, scalars), the tensors without a
   version counter (NumPy arrays) and the tensors a previous overlapped
   save found changed are copied, and the version counter of each other
   tensor is recorded (torch bumps it at every in-place change: an
   optimizer step, ``add_``, ``copy_``).
2. In the background: the other tensors are copied by half of the
   engine's copy threads (at least one: the training keeps the other
   cores; a thread of this module waits on them, without the GIL).
3. At the next ``ckpt.staged()`` (what the hook of
   ``ckpt.staged_before(optimizer)`` calls before each optimizer step), or
   at the next ``save``, ``load``, ``wait``, ``reserve``, ``close`` or
   dying checkpoint: the copy is waited for and every recorded counter is
   compared. All equal: the slot is sealed and the save goes on as any
   other (persisted by the policy, replicated). One differs: the slot is
   dropped, the previous checkpoint stays the newest, the save's handle
   raises an ``acp.InvalidInput`` naming the tensor, the failure is logged,
   and that tensor is copied in the stall from then on.

A process killed before step 3 loses the save (its slot was never sealed,
so the restart discards it and restores the previous one); a SIGTERM seals
it first (the dying checkpoint).

What the version counter does not see is not caught: writes through
``.data``, through NumPy views or raw pointers, and in-place changes made
inside a kernel (the reason small tensors are copied in the stall). Such
code must run after ``ckpt.staged()``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from time import perf_counter
from typing import Any

from acp import _acp
from acp._acp import InvalidInput

__all__ = ["EAGER_BELOW", "Copier", "Overlaps", "Pending", "Split"]

EAGER_BELOW = 1 << 20
"""Tensors of fewer bytes are copied in the stall of an overlapped save."""

HostRange = tuple[int, int, int]
"""``(entry index, address, nbytes)``: one tensor's copy (``Staging.copy_from``)."""


class Split:
    """Which tensors of a save are copied in the stall (``eager``) and which
    in the background (``lazy``), and where each lazy one is among the
    leaves a save hands over (``watch``: ``(leaf position, entry index)``),
    to read its version counter: the walk's leaves for a kept save plan,
    the flattened tensors (``objs`` itself) otherwise. ``eager_names``:
    the tensors to copy in the stall whatever their size (the
    checkpointer's set, which :meth:`copy_eagerly` adds to)."""

    __slots__ = ("eager", "forced", "host", "lazy", "names", "positions", "watch")

    def __init__(
        self,
        host: list[HostRange],
        leaves: list[object],
        objs: list[object],
        names: list[str],
        eager_names: set[str],
    ) -> None:
        self.host = host
        self.names = names
        # Each entry's position among the leaves (by identity: the walk and
        # the flatten of the same state see the same objects), when it is a
        # tensor with a version counter.
        at = {id(leaf): p for p, leaf in enumerate(leaves)}
        self.positions: dict[int, int] = {}
        for index, obj in enumerate(objs):
            p = at.get(id(obj))
            if p is not None and isinstance(getattr(obj, "_version", None), int):
                self.positions[index] = p
        self.forced = eager_names
        self.eager: list[HostRange] = []
        self.lazy: list[HostRange] = []
        self.watch: list[tuple[int, int]] = []
        self._divide()

    def _divide(self) -> None:
        forced, names = self.forced, self.names
        eager: list[HostRange] = []
        lazy: list[HostRange] = []
        watch: list[tuple[int, int]] = []
        for r in self.host:
            index, _, nbytes = r
            p = self.positions.get(index)
            if p is None or nbytes < EAGER_BELOW or (forced and names[index] in forced):
                eager.append(r)
            else:
                lazy.append(r)
                watch.append((p, index))
        self.eager, self.lazy, self.watch = eager, lazy, watch

    def copy_eagerly(self, indices: set[int]) -> None:
        """Copies the tensors of ``indices`` in the stall from now on (in
        every save of this checkpointer that names them)."""
        self.forced.update(self.names[i] for i in indices)
        self._divide()

    def versions(self, leaves: list[object]) -> list[int]:
        """The version counters of the lazy tensors, in ``watch`` order."""
        return [leaves[p]._version for p, _ in self.watch]  # type: ignore[attr-defined]

    def memory(self, leaves: list[object]) -> list[tuple[int, int]]:
        """The address and size of the lazy tensors' storages, in ``watch``
        order: a storage freed or resized under its tensor (``resize_(0)``,
        as FSDP frees parameters) changes them, and its version counter
        does not."""
        return [_memory_of(leaves[p]) for p, _ in self.watch]


def _memory_of(t: Any) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


class Copier:
    """The thread that waits on the background copies (the copy itself runs
    on the engine's copy threads, without the GIL)."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._closed = False

    def submit(
        self, fn: Callable[..., None], ranges: list[HostRange], **kwargs: Any
    ) -> Future[None]:
        with self._lock:
            if self._closed:
                raise _acp.EngineClosed("overlapped save: the checkpointer is closed")
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="acp-overlap")
            return self._pool.submit(fn, ranges, **kwargs)

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
            self._closed = True
        if pool is not None:
            pool.shutdown(wait=True)


class Pending:
    """An overlapped save whose background copy may still run: sealed or
    dropped by :meth:`settle`, once."""

    def __init__(
        self,
        *,
        step: int,
        staging: _acp.Staging,
        split: Split,
        leaves: list[object],
        alive: list[object],
        copy: Future[None],
        seal: Callable[[_acp.SaveHandle | None, BaseException | None, float, float], None],
    ) -> None:
        self.step = step
        self.staging = staging
        self.split = split
        self.leaves = leaves
        self.alive = alive  # the memory the copy reads, until it is done
        self.versions = split.versions(leaves)
        self.memory = split.memory(leaves)
        self.watch = list(split.watch)
        self.copy = copy
        self.started = perf_counter()
        self.seal = seal
        self.sealed = False  # set once ``seal`` is called, by settle or cancel

    def _seal(
        self, handle: _acp.SaveHandle | None, error: BaseException | None, waited: float
    ) -> None:
        self.sealed = True
        self.leaves = self.alive = []
        self.seal(handle, error, waited, perf_counter() - self.started)

    def cancel(self, error: BaseException) -> None:
        """Drops the save with ``error`` once its copy has ended (the copy
        writes into the slot until then): a save that lost a race with
        ``close()``."""
        if self.sealed:
            return
        t0 = perf_counter()
        _done(self.copy, None)
        self.staging.abort()
        self._seal(None, error, perf_counter() - t0)

    def settle(self, timeout: float | None = None) -> bool:
        """Waits for the copy, compares the version counters, then seals the
        slot (True) or drops it (False), and calls ``seal(handle, error,
        secs waited, secs since save() returned)``. ``timeout``: at most
        that many seconds for the copy (``acp.AcpTimeout`` past it; the save
        stays pending)."""
        t0 = perf_counter()
        if not _done(self.copy, timeout):
            raise _acp.AcpTimeout(
                f"save of step {self.step}: the overlapped copy did not end within {timeout:.3f} s"
            )
        waited = perf_counter() - t0
        error = self.copy.exception()
        if error is None:
            changed = [
                index
                for (p, index), v, m in zip(self.watch, self.versions, self.memory, strict=True)
                if self.leaves[p]._version != v  # type: ignore[attr-defined]
                or _memory_of(self.leaves[p]) != m
            ]
            if changed:
                self.split.copy_eagerly(set(changed))
                names = ", ".join(f"`{self.split.names[i]}`" for i in changed[:3])
                more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
                error = InvalidInput(
                    f"save of step {self.step} (overlap): tensor {names}{more} changed "
                    "(or its storage was freed or resized) while it was being copied, "
                    "after save() returned; the step was not "
                    "saved (the previous checkpoint stays the newest). Call ckpt.staged() "
                    "(or register ckpt.staged_before(optimizer)) before changing the "
                    "state; from now on this tensor is copied in the stall"
                )
        if error is not None:
            # Logged as the save's failure (acp._metrics), once.
            self.staging.abort()
            self._seal(None, error, waited)
            return False
        try:
            handle = self.staging.finish()
        except BaseException as e:
            self.staging.abort()
            self._seal(None, e, waited)
            raise
        self._seal(handle, None, waited)
        return True


def _done(fut: Future[Any], timeout: float | None) -> bool:
    """Whether ``fut`` ended (well or not) within ``timeout`` seconds."""
    try:
        fut.exception(timeout)
    except TimeoutError:
        return False
    return True


class Overlaps:
    """A checkpointer's overlapped saves: whether its saves overlap by
    default, the thread that waits on their copies, and the one save whose
    copy may still run (``pending``)."""

    def __init__(self, default: bool) -> None:
        self.default = default
        self.copier = Copier()
        self.pending: Pending | None = None
        # Re-entrant: the dying checkpoint, run by a signal handler in the
        # thread that may be sealing, finds nothing pending and goes on.
        self._lock = threading.RLock()

    def settle(self, timeout: float | None = None) -> bool | None:
        """Seals or drops the pending save (``Pending.settle``), by one
        thread: another waits, then finds nothing pending; None when
        nothing was pending."""
        with self._lock:
            pending, self.pending = self.pending, None
            if pending is None:
                return None
            try:
                return pending.settle(timeout)
            except BaseException:
                # Not sealed (a timeout, or KeyboardInterrupt while the
                # copy ran): still pending, for the next staged() or wait().
                if not pending.sealed:
                    self.pending = pending
                raise

    def close(self) -> None:
        self.copier.close()
