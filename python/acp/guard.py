"""The dying checkpoint: when training raises or the process is told to
stop, every completely staged checkpoint is flushed and committed before
the process exits.

Two pieces, used alone or together::

    ckpt.install_sigterm_handler()  # opt in: SIGTERM → dying checkpoint → exit
    with ckpt.guard():  # an exception escaping → dying checkpoint
        for step in range(start, steps):
            train_step()
            if step % 100 == 0:
                ckpt.save(step, state)

What is persisted is what ``save()`` finished staging: the flushes already
queued, and the newest staged step whatever the persist policy chose for it
(a RAM snapshot, ``persist=False`` included, is queued now); the dying
checkpoint waits for the queue to drain (bounded by ``timeout`` and by the
engine's watchdog, ``stall_timeout``). Older RAM snapshots are not written, and
a restored step still being read again into RAM (``keep_restored``) is given
up: it is on storage already. A save that
was interrupted while staging (an exception inside ``save`` itself, or a
SIGTERM that arrives while tensors are being copied) is aborted, never
finished: its slot is freed and the checkpoint before it is the one that
counts. Python runs signal handlers in the main thread between bytecodes,
so a SIGTERM that arrives during a copy in Rust (GIL released) is handled
right after the copy returns, before ``save`` can seal the slot; acp's
handler raises there, and ``save`` aborts the staging on the way out.

Exit status after SIGTERM (with the handler installed) or an exception
escaping ``guard()``:

====================  ====================================================
status                meaning
====================  ====================================================
143 (128 + SIGTERM)   SIGTERM; every completely staged checkpoint is
                      committed (``EXIT_TERMINATED``); with several ranks
                      and a store, the newest step every rank holds (a
                      rank a save ahead of another gives up its newest:
                      ``acp.cover``)
1                     an exception escaped ``guard()``; every completely
                      staged checkpoint is committed; the exception is
                      re-raised unchanged, so Python prints it and exits 1
74 (``EX_IOERR``)     the dying checkpoint failed (storage error, or the
                      watchdog found the flush stuck): the newest staged
                      checkpoint is only resident in this node's RAM;
                      restart the trainer on this node (it commits it on
                      open) or run ``acp persist ROOT`` (``EXIT_SAVE_FAILED``)
====================  ====================================================

The previous SIGTERM handler is chained: a Python handler installed before
acp's is called after the dying checkpoint (and may exit as it likes); if it
returns, the process exits with the status above. A second SIGTERM while
the dying checkpoint runs is ignored, and so is one after it finished
while nothing was staged since (the process is exiting). SIGKILL cannot be
caught: the staged
slot stays in shared memory and the next ``Checkpointer`` opened on this
node for the same job commits it.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import traceback
import weakref
from dataclasses import asdict, dataclass
from time import perf_counter
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any, Callable, Union

from acp import checkpointer, cover
from acp._acp import AcpError

if TYPE_CHECKING:
    from acp import _acp
    from acp._stats import SaveHandle
    from acp.checkpointer import Checkpointer

__all__ = [
    "EXIT_SAVE_FAILED",
    "EXIT_TERMINATED",
    "ChainedSigterm",
    "DyingReport",
    "Guard",
    "SigtermHandler",
    "Terminated",
    "dying_checkpoint",
    "install_sigterm_handler",
]

log = logging.getLogger("acp")

EXIT_TERMINATED = 128 + signal.SIGTERM
"""Exit status after SIGTERM when every completely staged checkpoint is committed."""
EXIT_SAVE_FAILED = 74
"""Exit status when the dying checkpoint failed (``EX_IOERR`` of sysexits.h)."""

_Handler = Union[Callable[[int, Union[FrameType, None]], Any], int, signal.Handlers, None]


class Terminated(SystemExit):
    """Raised in the main thread by acp's SIGTERM handler while a ``guard()``
    block runs there, so the block unwinds (aborting a save caught half-way
    through staging) and the guard does the dying checkpoint. A
    ``SystemExit``, so ``except Exception`` in training code lets it pass."""

    def __init__(self, signum: int, frame: FrameType | None, handler: SigtermHandler) -> None:
        super().__init__(128 + signum)
        self.signum = signum
        self.frame = frame
        self.handler = handler


@dataclass(frozen=True)
class DyingReport:
    """What the dying checkpoint did."""

    cause: str
    """``"signal"``, ``"exception"`` or ``"call"``."""
    staged_step: int | None
    """The newest step whose ``save()`` finished staging, if any."""
    committed_step: int | None
    """The newest committed step once the flushes drained."""
    ok: bool
    """Every completely staged checkpoint is committed (with several ranks
    after SIGTERM: the newest step every rank holds, which may be older
    than ``staged_step``)."""
    error: str | None
    """Why not, naming the path and cause (or what the watchdog found stuck)."""
    secs: float
    dead: tuple[int, ...] = ()
    """Ranks that did not answer the roll call of a dying checkpoint after
    SIGTERM of a ``replicated=True`` save (``acp.cover``): taken as dead."""
    covered: tuple[int, ...] = ()
    """Of those, the ranks whose share of the staged step this rank wrote."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _settled(ckpt: Checkpointer, timeout: float | None) -> checkpointer.Internals:
    """``ckpt``'s internals, once an overlapped save whose copy may still
    run was sealed (or dropped, when its state changed), so that the newest
    snapshot is the one the training saved last. Never raises."""
    last = ckpt._last_save
    try:
        if ckpt.staged(timeout) is False and last is not None:
            _say(logging.WARNING, f"acp: dying checkpoint: {last.stats.error}")
    except AcpError as e:
        _say(logging.WARNING, f"acp: dying checkpoint: overlapped save not sealed: {e}")
    return checkpointer.internals(ckpt)


def dying_checkpoint(
    ckpt: Checkpointer, *, cause: str = "call", timeout: float | None = None
) -> DyingReport:
    """Waits (at most ``timeout`` seconds, and never past the engine's
    watchdog) until every completely staged checkpoint is flushed and
    committed; reports the outcome. Never raises an ``AcpError``: the
    failure is in the report. Takes no lock of the checkpointer, so a signal
    handler may call it while the main thread is anywhere."""
    t0 = perf_counter()
    inner = _settled(ckpt, timeout)
    last = inner.last_staged
    staged = None if last is None else last.step
    error: str | None = None
    committed: int | None = None
    dead: list[int] = []
    covered: list[int] = []
    engine = inner.engine
    if engine.closed:
        # close() already drained the queue; its error went to its caller.
        if last is not None and last.done():
            error = last.stats.error
        elif last is not None:
            error = f"step {staged}: engine closed before the flush finished"
    else:
        error, dead, covered = _drain(ckpt, engine, last, cause, timeout)
        try:
            committed = engine.latest()
        except AcpError as e:
            error = error or str(e)
    report = DyingReport(
        cause=cause,
        staged_step=staged,
        committed_step=committed,
        ok=error is None,
        error=error,
        secs=perf_counter() - t0,
        dead=tuple(dead),
        covered=tuple(covered),
    )
    ckpt.last_dying = report
    if report.ok:
        dead_note = (
            f"; dead ranks {list(dead)}, covered by this rank: {list(covered)}" if dead else ""
        )
        _say(
            logging.WARNING,
            f"acp: dying checkpoint ({cause}): newest committed step {committed} "
            f"(newest staged {staged}), {report.secs:.2f} s{dead_note}",
        )
    else:
        persist = f"acp persist {ckpt.root}" + (f" --job {ckpt.job}" if ckpt.job else "")
        _say(
            logging.ERROR,
            f"acp: dying checkpoint ({cause}) failed: {error}; step {staged} stays resident "
            f"in shared memory: restart on this node or run `{persist}`",
        )
    return report


def _drain(
    ckpt: Checkpointer,
    engine: _acp.Engine,
    last: SaveHandle | None,
    cause: str,
    timeout: float | None,
) -> tuple[str | None, list[int], list[int]]:
    """The dying checkpoint's work on an open engine: persists what is
    to be committed and waits for the flushes; returns the error (None
    when every completely staged step that can be committed is), the
    dead ranks and those whose share this rank wrote."""
    # The job is being stopped: every rank is in its dying checkpoint, and
    # they agree on the step to commit (acp.cover).
    agreed = _agree(ckpt, timeout) if cause == "signal" else None
    try:
        return _drain_agreed(ckpt, engine, last, agreed, cause=cause, timeout=timeout)
    finally:
        # A process that goes on (code that caught the exit) commits again.
        if agreed is not None:
            engine.clear_given_up()


def _drain_agreed(
    ckpt: Checkpointer,
    engine: _acp.Engine,
    last: SaveHandle | None,
    agreed: cover.Decision | None,
    *,
    cause: str,
    timeout: float | None,
) -> tuple[str | None, list[int], list[int]]:
    """:func:`_drain` once the ranks agreed (``agreed``), or without an
    agreement (None: one rank, no store, or not after SIGTERM)."""
    newest = None
    error: str | None = None
    dead: list[int] = [] if agreed is None else list(agreed.missing)
    covered: list[int] = []
    try:
        # A restored step being read again into RAM (keep_restored)
        # would hold the flush thread for seconds; it is on storage.
        engine.stop_keeping_restored()
        # Without an agreement, the newest snapshot is committed whatever
        # the persist policy chose for it at its save (a RAM-only step is
        # queued now).
        newest = engine.persist_newest() if agreed is None else _persist_agreed(engine, agreed)
    except AcpError as e:
        error = str(e)
    step = agreed.step if agreed is not None else None if last is None else last.step
    if cause == "signal" and step is not None and (agreed is None or agreed.missing):
        # Dead ranks' shares of the step are written by their groups'
        # survivors (acp.cover).
        found, covered, error_cover = _cover(
            ckpt, step, timeout, None if agreed is None else agreed.missing
        )
        dead = found or dead
        error = error or error_cover
    try:
        engine.wait_idle(timeout)
    except AcpError as e:
        error = error or str(e)
    if error is not None or agreed is None:
        return error or _outcome(last, newest), dead, covered
    if last is not None and agreed.step != last.step:
        _say(logging.WARNING, _apart_note(agreed, ckpt.rank, last.step))
    # Other steps' commits were given up: only the agreed one's outcome
    # counts, and it must be committed (a flush of it that failed, or
    # was under way before, has no handle here).
    same = last is not None and last.step == agreed.step
    error = _outcome(newest, last if same else None)
    if error is None and agreed.step is not None and agreed.step not in engine.steps():
        error = f"step {agreed.step}, the newest step every rank holds, was not committed"
    return error, dead, covered


def _apart_note(agreed: cover.Decision, rank: int, staged: int) -> str:
    newest = {r: max(a, default=None) for r, a in sorted(agreed.answers.items())}
    held = "no step" if agreed.step is None else f"step {agreed.step}"
    who = "every rank" if not agreed.missing else f"every live rank (dead: {agreed.missing})"
    return (
        f"acp: dying checkpoint: rank {rank}'s newest staged step {staged} is not held by "
        f"{who} (each rank's newest: {newest}); {held} is the newest they all hold"
    )


def _agree(ckpt: Checkpointer, timeout: float | None) -> cover.Decision | None:
    """The step to commit, as the ranks decided it by a roll call through
    the job's store (``acp.cover.agree_held``); None with one rank,
    without a store, or when the store is gone (each rank then persists
    its own newest step)."""
    inner = checkpointer.internals(ckpt)
    coord = inner.coordinator
    if coord is None or coord.world_size < 2:
        return None
    wait = cover.ROLL_CALL if timeout is None else min(cover.ROLL_CALL, timeout)
    engine = inner.engine
    held = engine.resident_steps()
    try:
        # The newest committed step counts as held: a rank may have
        # released it from its ring once committed.
        latest = engine.latest()
    except AcpError:
        latest = None  # storage trouble: this rank still answers
    if latest is not None:
        held.append(latest)
    try:
        decision = cover.agree_held(coord, held, wait)
    except Exception as e:  # the store is gone with its host
        _say(logging.WARNING, f"acp: dying checkpoint: the roll call failed: {e}")
        return None
    if decision.missing:
        _say(
            logging.WARNING,
            f"acp: dying checkpoint: ranks {decision.missing} did not answer the roll call "
            "and are taken as dead",
        )
    return decision


def _persist_agreed(engine: _acp.Engine, agreed: cover.Decision) -> _acp.SaveHandle | None:
    """Gives up the commits of steps newer than the agreed one (no rank
    can commit a step another does not hold), and those of other steps
    that wait for a dead rank, then persists the agreed step when it is
    not persisted already."""
    if agreed.missing:
        engine.give_up_commits_waiting_for(agreed.missing, agreed.step)
    if agreed.step is None:
        try:
            latest = engine.latest()
        except AcpError:
            latest = None
        engine.give_up_commits_from(0 if latest is None else latest + 1)
        return None
    engine.give_up_commits_from(agreed.step + 1)
    return engine.persist_step(agreed.step)


def _outcome(*handles: SaveHandle | _acp.SaveHandle | None) -> str | None:
    """The error of the first of the drained saves ``handles`` that failed."""
    for h in handles:
        if h is not None:
            try:
                h.wait(0)
            except AcpError as e:
                return str(e)
    return None


def _cover(
    ckpt: Checkpointer, step: int, timeout: float | None, dead: list[int] | None
) -> tuple[list[int], list[int], str | None]:
    """The dead ranks, those whose share of ``step`` this rank wrote, and
    an error naming the ones it could not (``acp.cover``); nothing to do
    unless ``step`` was saved ``replicated=True`` by coordinated ranks and
    is not committed yet."""
    inner = checkpointer.internals(ckpt)
    saved, setup, coord = inner.saved, inner.cover_setup, inner.coordinator
    if saved is None or setup is None or coord is None or saved.step != step:
        return [], [], None
    engine = inner.engine

    def committed() -> bool:
        try:
            return step in engine.steps()
        except AcpError:
            return False

    # Every rank posts to the roll call, even one that sees the step
    # committed already: the others would take it for dead.
    return cover.cover_dead_ranks(
        setup, coord, saved, inner.adapters, timeout=timeout, committed=committed, dead=dead
    )


def _say(level: int, text: str) -> None:
    """Logs on the ``acp`` logger; when the application configured no
    handler for it (acp's own is a NullHandler), also writes to stderr: the
    process is about to exit and its operator must see the outcome."""
    log.log(level, "%s", text)
    if not _handled(log):
        print(text, file=sys.stderr, flush=True)


def _handled(logger: logging.Logger) -> bool:
    current: logging.Logger | None = logger
    while current is not None:
        if any(not isinstance(h, logging.NullHandler) for h in current.handlers):
            return True
        if not current.propagate:
            return False
        current = current.parent
    return False


class ChainedSigterm:
    """A SIGTERM handler that takes the place of the current one, keeps it
    as ``previous`` to chain, and can put it back: what acp's handler here
    and ``acp.mindspore.AcpCheckpoint``'s share. Construct it in the main
    thread; subclasses say what a SIGTERM does."""

    def __init__(self) -> None:
        self.previous: _Handler = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, self)

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        raise NotImplementedError

    def call_previous(self, signum: int, frame: FrameType | None) -> bool:
        """Calls the handler this one replaced when it is a Python callable;
        False when there is none to call (``SIG_DFL``, ``SIG_IGN``, or one
        installed outside Python)."""
        previous = self.previous
        if not callable(previous):
            return False
        previous(signum, frame)
        return True

    def restore(self) -> None:
        """Puts back the handler this one replaced, if this one is still the
        current one."""
        previous = self.previous
        if signal.getsignal(signal.SIGTERM) is self:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


class SigtermHandler(ChainedSigterm):
    """acp's SIGTERM handler for one checkpointer (see the module docs).
    Calling ``uninstall()`` puts the previous handler back."""

    def __init__(self, ckpt: Checkpointer, timeout: float | None) -> None:
        self._ckpt = weakref.ref(ckpt)
        self.timeout = timeout
        self._busy = False
        # The newest staged save when a dying checkpoint last finished (a
        # list, so that "none staged" is told from "never finished").
        self._done_for: list[object] = []
        super().__init__()

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self._busy:
            log.warning("acp: SIGTERM again while the dying checkpoint runs; ignored")
            return
        ckpt = self._ckpt()
        if self._done_for and (ckpt is None or self.done_already(ckpt)):
            # The process is exiting after its dying checkpoint (the
            # scheduler repeats SIGTERM): nothing new to commit.
            log.warning(
                "acp: SIGTERM again after the dying checkpoint, nothing staged since; ignored"
            )
            return
        if ckpt is not None and checkpointer.internals(ckpt).main_guards > 0:
            # The guard unwinds the block (aborting a half-staged save) and
            # does the rest in its __exit__.
            raise Terminated(signum, frame, self)
        self._busy = True
        try:
            ok = True
            if ckpt is not None:
                ok = dying_checkpoint(ckpt, cause="signal", timeout=self.timeout).ok
                self.finished(ckpt)
            self.exit(signum, frame, ok)
        finally:
            self._busy = False

    def finished(self, ckpt: Checkpointer) -> None:
        """Records that a dying checkpoint of ``ckpt`` has just finished."""
        self._done_for = [checkpointer.internals(ckpt).last_staged]

    def done_already(self, ckpt: Checkpointer) -> bool:
        """Whether a dying checkpoint finished with nothing staged since
        (a save staged after it, by code that caught the exit and went on,
        makes the next SIGTERM run one again). A checkpointer already
        collected (the interpreter exiting) has nothing staged since."""
        return (
            bool(self._done_for) and self._done_for[0] is checkpointer.internals(ckpt).last_staged
        )

    def exit(self, signum: int, frame: FrameType | None, ok: bool) -> None:
        """Chains the previous handler, then exits with the status for ``ok``."""
        self.call_previous(signum, frame)
        raise SystemExit(EXIT_TERMINATED if ok else EXIT_SAVE_FAILED)

    def uninstall(self) -> None:
        """Restores the handler that was there before, if acp's is still the
        current one."""
        self.restore()
        ckpt = self._ckpt()
        if ckpt is not None:
            inner = checkpointer.internals(ckpt)
            if inner.sigterm is self:
                inner.sigterm = None


def install_sigterm_handler(ckpt: Checkpointer, *, timeout: float | None = None) -> SigtermHandler:
    """Installs acp's SIGTERM handler for ``ckpt`` (from the main thread).
    Returns it; ``handler.uninstall()`` restores the previous one."""
    if threading.current_thread() is not threading.main_thread():
        raise ValueError("install_sigterm_handler: call it from the main thread")
    handler = SigtermHandler(ckpt, timeout)
    checkpointer.internals(ckpt).sigterm = handler
    return handler


class Guard:
    """The context manager ``Checkpointer.guard()`` returns."""

    def __init__(self, ckpt: Checkpointer, *, timeout: float | None, sigterm: bool) -> None:
        self._ckpt = ckpt
        self._timeout = timeout
        self._sigterm = sigterm
        self._installed: SigtermHandler | None = None
        self._main = False

    def __enter__(self) -> Checkpointer:
        ckpt = self._ckpt
        inner = checkpointer.internals(ckpt)
        self._main = threading.current_thread() is threading.main_thread()
        if self._sigterm and inner.sigterm is None:
            self._installed = install_sigterm_handler(ckpt, timeout=self._timeout)
        if self._main:
            inner.main_guards += 1
        return ckpt

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        ckpt = self._ckpt
        if self._main:
            checkpointer.internals(ckpt).main_guards -= 1
        try:
            if exc is None:
                return
            if isinstance(exc, Terminated):
                handler = exc.handler
                handler._busy = True
                try:
                    report = dying_checkpoint(ckpt, cause="signal", timeout=handler.timeout)
                    handler.finished(ckpt)
                    handler.exit(exc.signum, exc.frame, report.ok)
                finally:
                    handler._busy = False
            report = dying_checkpoint(ckpt, cause="exception", timeout=self._timeout)
            if report.ok:
                _note(exc, f"acp: dying checkpoint committed step {report.committed_step}")
                return
            # The exit status must say that the newest state is not safe.
            traceback.print_exception(type(exc), exc, tb, file=sys.stderr)
            print(
                f"acp: dying checkpoint failed: {report.error}; exiting with {EXIT_SAVE_FAILED}",
                file=sys.stderr,
            )
            raise SystemExit(EXIT_SAVE_FAILED) from exc
        finally:
            # After a SIGTERM the process is exiting: the handler stays, so
            # that the scheduler's repeated SIGTERM is ignored rather than
            # kill it mid-teardown (SIG_DFL) with a signal for its status.
            if self._installed is not None and not isinstance(exc, Terminated):
                self._installed.uninstall()
                self._installed = None


def _note(exc: BaseException, text: str) -> None:
    add_note = getattr(exc, "add_note", None)  # Python 3.11+
    if add_note is not None:
        add_note(text)
