"""The coalescing persist policy with several ranks: rank 0 decides, for
each save, whether it is persisted; every rank holds the save until it
learns the decision.

With one rank the engine coalesces by itself: at most one persist in
flight, the newest snapshot persisted once the previous persist has
finished. With several ranks every rank must persist the same steps, or the
step never commits (rank 0 waits ``commit_timeout`` for the missing files),
and "once the previous persist has finished" is a moment each rank sees at
its own time. So:

* Every rank stages each save the policy decides (``persist=None``)
  **held** (``Engine.begin_save(..., hold=True)``): resident in its ring
  slot, which no newer snapshot frees, until the rank decides it
  (``Engine.decide``). A rank that runs ahead of rank 0 still holds the
  step rank 0 chooses when the decision reaches it.
* Rank 0 decides each of its saves, in save order, on a background thread
  (never in the stall): **persist iff the previously chosen persist has
  finished** (its handle done: committed by every rank, or failed), the
  first save always. It posts the decision under the store key
  ``coalesce/{step}`` (in the coordinator's namespace: job and
  generation), then decides its own save.
* Every other rank, on a background thread, waits for the decision of each
  of its held saves in save order (polling the store, backing off from
  :data:`_POLL_MIN` to :data:`_POLL_MAX`; never the training's process
  group), decides its save the same way, and counts itself in
  ``coalesce/{step}/read``; the last rank to read deletes both keys, so the
  store holds the decisions not yet read by every rank, a few bytes each.
* A decision that does not come within the coordinator's timeout
  (``commit_timeout``) of the save (rank 0 is gone) releases the hold, with
  a log line: the snapshot stays resident as any snapshot the policy did
  not persist, and ``close()`` or the dying checkpoint persist the newest.
* A save that rank 0 skips (no free slot) or that fails is decided "not
  persisted"; a save another rank skips is only read.

A step is persisted at the first save after the previous persist finished
(the single-rank policy persists the newest snapshot already staged then:
at most one save fresher). The saves in between are RAM snapshots on every
rank, never written. ``close()`` first drains the decisions of the saves
still held, so a rank never lets go of a step that rank 0 chose to
persist.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Protocol

from acp import _acp
from acp._acp import AcpError
from acp.distributed import Coordinator

logger = logging.getLogger("acp")

_POLL_MIN = 0.002
_POLL_MAX = 0.05
# Decisions remembered for ``decisions`` (tests and figures).
_REMEMBERED = 4096


class _Handle(Protocol):
    """What the coalescer uses of a save handle."""

    def done(self) -> bool: ...


@dataclass
class _Held:
    step: int
    # None: the save was not staged on this rank (skipped or failed).
    handle: _Handle | None
    deadline: float


class Coalescer:
    """One rank's side of the agreement (see the module's text).

    :meth:`staged` is called once per save the policy decides, in save
    order, from the stall (a lock and an append: no I/O); a daemon thread
    does the rest until :meth:`close`.
    """

    def __init__(self, engine: _acp.Engine, coordinator: Coordinator) -> None:
        self._engine = engine
        self._coordinator = coordinator
        self._leader = coordinator.rank == 0
        self._timeout = coordinator.timeout
        self._cv = threading.Condition()
        self._queue: collections.deque[_Held] = collections.deque()
        self._closing = False
        # A save taken off the queue and not decided yet.
        self._busy = False
        # Rank 0: the handle of the persist chosen last.
        self._chosen: _Handle | None = None
        # Counts for ``stats()["coalesce"]`` (under ``_cv``).
        self._counts = {"persisted": 0, "not_persisted": 0, "released": 0, "not_staged": 0}
        self.decisions: collections.deque[tuple[int, bool]] = collections.deque(maxlen=_REMEMBERED)
        """The decisions applied on this rank, ``(step, persist)``, in save
        order (the newest few thousand); a save not staged here is left
        out. Rank 0's are the job's."""
        self._thread = threading.Thread(
            target=self._run, name=f"acp-coalesce-r{coordinator.rank}", daemon=True
        )
        self._thread.start()

    def staged(self, step: int, handle: _Handle | None) -> None:
        """Registers the save of ``step``, held on this rank (``handle``),
        or not staged here (None: skipped, or it failed)."""
        with self._cv:
            self._queue.append(_Held(step, handle, time.monotonic() + self._timeout))
            self._cv.notify_all()

    def stats(self) -> dict[str, int | bool]:
        """This rank's decisions so far: ``persisted`` and ``not_persisted``
        (as rank 0 decided them), ``released`` (holds let go without a
        decision: rank 0 silent past ``commit_timeout``, or the store
        failing), ``not_staged`` (saves this rank skipped or failed, whose
        decision is only read), ``waiting`` (saves held, not decided yet)
        and ``leader`` (whether this rank decides)."""
        with self._cv:
            out: dict[str, int | bool] = dict(self._counts)
            out["waiting"] = len(self._queue) + int(self._busy)
        out["leader"] = self._leader
        return out

    def drain(self, timeout: float | None = None) -> bool:
        """Waits until every save registered so far is decided on this rank
        (each wait for rank 0 bounded by its deadline), at most ``timeout``
        seconds; whether they are."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and not self._busy, timeout)

    def close(self) -> None:
        """Decides the saves still held (waiting at most until each one's
        deadline for rank 0's decision), then stops the thread."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._thread.join()

    # --- the thread -------------------------------------------------------

    def _key(self, step: int) -> str:
        return self._coordinator.key(f"coalesce/{step}")

    def _run(self) -> None:
        while True:
            with self._cv:
                self._busy = False
                self._cv.notify_all()
                while not self._queue and not self._closing:
                    self._cv.wait()
                if not self._queue:
                    return
                held = self._queue.popleft()
                self._busy = True
            try:
                if self._leader:
                    self._lead(held)
                else:
                    self._follow(held)
            except Exception as e:  # the store or the engine gone: let go
                logger.warning(
                    "acp: rank %d: coalescing: step %d: %s; the hold is released",
                    self._coordinator.rank,
                    held.step,
                    e,
                )
                self._apply(held, False, released=True)

    def _apply(self, held: _Held, persist: bool, *, released: bool = False) -> None:
        with self._cv:
            if held.handle is None:
                self._counts["not_staged"] += 1
            elif released:
                self._counts["released"] += 1
            else:
                self._counts["persisted" if persist else "not_persisted"] += 1
        if held.handle is None:
            return
        try:
            self._engine.decide(held.step, persist)
        except AcpError as e:  # closed meanwhile: its handle says so
            logger.warning(
                "acp: rank %d: step %d, decided %s, was not queued: %s",
                self._coordinator.rank,
                held.step,
                "persisted" if persist else "not persisted",
                e,
            )
        self.decisions.append((held.step, persist))

    def _lead(self, held: _Held) -> None:
        """Rank 0: the single-rank rule, decided in save order."""
        persist = held.handle is not None and (self._chosen is None or self._chosen.done())
        if persist:
            self._chosen = held.handle
        self._coordinator.store.set(self._key(held.step), "1" if persist else "0")
        self._apply(held, persist)

    def _follow(self, held: _Held) -> None:
        """Another rank: waits (bounded) for rank 0's decision, applies it."""
        store = self._coordinator.store
        key = self._key(held.step)
        pause = _POLL_MIN
        while not store.check([key]):
            if time.monotonic() >= held.deadline:
                logger.warning(
                    "acp: rank %d: no persist decision for step %d from rank 0 within %.3f s "
                    "(coalescing); the hold is released, the snapshot stays resident",
                    self._coordinator.rank,
                    held.step,
                    self._timeout,
                )
                self._apply(held, False, released=True)
                return
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX)
        persist = store.get(key) == b"1"
        self._apply(held, persist)
        if store.add(f"{key}/read", 1) >= self._coordinator.world_size - 1:
            _delete(store, key)
            _delete(store, f"{key}/read")


def _delete(store: object, key: str) -> None:
    delete = getattr(store, "delete_key", None)
    if delete is None:
        return
    with contextlib.suppress(RuntimeError, ValueError):  # a store without deletion
        delete(key)
