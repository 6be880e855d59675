"""The figures of saves and loads, and the completion handle of a save."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from acp import _acp
from acp._acp import AcpError

if TYPE_CHECKING:
    from concurrent.futures import Future

__all__ = ["LoadStats", "SaveHandle", "SaveStats", "load_stats"]


@dataclass(frozen=True)
class SaveStats:
    """The figures of one save. Fields after ``tensor_bytes`` are None until
    the save has finished."""

    step: int
    skipped: bool
    done: bool
    stall_secs: float
    """The whole ``save()`` call: what training waited for."""
    flatten_secs: float
    """Walking the state and checking it (part of the stall)."""
    copy_secs: float
    """Copying tensors into the ring slot (part of the stall)."""
    tensors: int
    tensor_bytes: int
    bytes: int | None = None
    """The data file's size (the plain image: the bytes staged)."""
    stored_bytes: int | None = None
    """Bytes written to storage for it: ``bytes`` when written plain, the
    container's length when compressed or incremental (the chunks it
    references take none), 0 when not written."""
    compression_ratio: float | None = None
    """``stored_bytes / bytes`` of a persisted save (compression and
    reused chunks together); None otherwise."""
    reused_chunks: int | None = None
    """Chunks not written because the newest committed step already held
    them (an incremental step references them); 0 for a step written
    whole."""
    reused_bytes: int | None = None
    """The image bytes of those chunks: bytes not written."""
    engine_stall_secs: float | None = None
    slot_wait_secs: float | None = None
    queue_secs: float | None = None
    flush_secs: float | None = None
    replica_wait_secs: float | None = None
    """The part of ``flush_secs`` the persist waited for this step's replica
    exchange (replicas go first); 0 without replicas."""
    commit_secs: float | None = None
    total_secs: float | None = None
    """From the start of ``save()`` in the engine to committed."""
    flush_bytes_per_sec: float | None = None
    io: str | None = None
    direct: bool | None = None
    error: str | None = None
    outcome: str | None = None
    """``"persisted"`` (committed in storage), ``"resident"`` (a RAM
    snapshot: ``persist=False``, or the persist policy did not persist it),
    ``"superseded"`` (it waited for the persist in flight and a newer save
    took its place: never written) or ``"skipped"``; None until done."""
    persisted: bool | None = None
    """Whether the step was committed in storage; None until done."""
    overlap_copy_secs: float | None = None
    """An overlapped save (``overlap=True``): from ``save()`` returning to
    its background copy being sealed (or dropped); None otherwise, and
    until then. ``copy_secs`` is then the copy of its small tensors only."""
    overlap_wait_secs: float | None = None
    """An overlapped save: how long ``staged()`` (or whichever call sealed
    it) waited for its background copy: the part of the copy training
    waited for after all."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class LoadStats:
    """The figures of one load."""

    step: int
    source: str
    """``"ram"`` (a resident shared-memory slot) or ``"storage"``; ``"mixed"``
    when other ranks' files were read too (see ``ranks``) and not all from
    the same."""
    bytes: int
    verified: bool
    engine_secs: float
    """Finding, reading (from storage) and verifying the checkpoint; for a
    ``load(into=...)`` from storage, only finding it and reading its header
    (the read is then in ``copy_secs``)."""
    copy_secs: float
    """Copying the tensors out and rebuilding the state; for a
    ``load(into=...)`` from storage, also the read and its verification,
    done in the same pass as the copy."""
    total_secs: float
    copied_bytes: int
    bytes_per_sec: float
    ranks: dict[int, str] | None = None
    """When tensors came from other ranks' files too: where each file came
    from (``"ram"`` or ``"storage"``), by the rank that wrote it."""
    rejected: str | None = None
    """Why a copy in RAM was found but not used: it failed verification
    (the error names the slot file, or the peer's replica, and the
    tensor); the load took the next source (logged on the ``acp`` logger)."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def load_stats(
    report: dict[str, Any],
    t0: float,
    t1: float,
    t2: float,
    copied: int,
    *,
    ranks: dict[int, str] | None = None,
) -> LoadStats:
    """The ``LoadStats`` of a load that asked the engine at ``t0``, had the
    checkpoint at ``t1`` and its ``copied`` bytes out at ``t2``
    (``perf_counter`` times); ``report`` is the engine's ``Loaded.report()``."""
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
        ranks=ranks,
        rejected=report.get("rejected"),
    )


class SaveHandle:
    """The completion handle of ``Checkpointer.save``."""

    def __init__(
        self,
        handle: _acp.SaveHandle | None,
        stats: SaveStats,
        *,
        pending: Callable[[], object] | None = None,
    ) -> None:
        # None while an overlapped save's copy may run (``pending`` seals
        # or drops it), or once it was dropped (``_error``).
        self._handle = handle
        self._stall = stats
        self._replicated: Future[list[int]] | None = None
        self._pending = pending
        self._error: BaseException | None = None

    def _sealed(
        self,
        handle: _acp.SaveHandle | None,
        error: BaseException | None,
        waited: float,
        copy_secs: float,
    ) -> None:
        """An overlapped save is sealed (``handle``) or dropped (``error``)."""
        self._stall = replace(self._stall, overlap_copy_secs=copy_secs, overlap_wait_secs=waited)
        self._handle = handle
        self._error = error
        self._pending = None

    def _settled(self) -> _acp.SaveHandle | None:
        """The engine's handle, once an overlapped save is sealed (sealing it
        now if its copy may still run); None when it was dropped."""
        if self._pending is not None:
            self._pending()
        return self._handle

    def wait_replicated(self, timeout: float | None = None) -> list[int]:
        """Blocks until this rank's image of the step is complete in the RAM
        of its holders on other nodes (``Checkpointer(replicas=N)``);
        returns their ranks (none without replicas)."""
        return [] if self._replicated is None else self._replicated.result(timeout)

    @property
    def step(self) -> int:
        return self._stall.step

    @property
    def skipped(self) -> bool:
        """True when the save was skipped (``on_full="skip"`` and no free slot)."""
        return self._stall.skipped

    @property
    def staged(self) -> bool:
        """Whether the save's image is sealed in the ring, so that it survives
        a crash of this process: at once for a save copied in its stall;
        for an overlapped one, once ``Checkpointer.staged()`` sealed it
        (False while its copy may run, and when it was dropped or skipped).
        Never blocks."""
        return self._pending is None and self._error is None and not self._stall.skipped

    def done(self) -> bool:
        """Whether the save has finished (committed, failed or skipped);
        False while an overlapped save is not sealed yet."""
        if self._error is not None:
            return True
        return self._handle is not None and self._handle.done()

    def wait(self, timeout: float | None = None) -> SaveStats:
        """Blocks until the step is durable and committed; returns its
        figures. Raises the save's error, or ``acp.AcpTimeout``. A save
        that is not persisted does not block: it returns at once with
        ``persisted=False`` and ``outcome="resident"`` (kept in RAM) or
        ``"superseded"`` (with the coalescing policy, when a newer save
        replaced it while it waited for the persist in flight; until then
        it waits for that persist and its own). An overlapped save not
        sealed yet is sealed first (``Checkpointer.staged``); one that was
        dropped raises its error."""
        handle = self._settled()
        if handle is None:
            if self._error is None:
                raise AcpError(f"save of step {self.step}: neither sealed nor dropped")
            raise self._error
        return self._with(handle.wait(timeout))

    @property
    def stats(self) -> SaveStats:
        """The figures so far; never blocks, never raises."""
        if self._error is not None:
            return replace(self._stall, done=True, error=str(self._error))
        if self._handle is None:
            return self._stall
        try:
            report = self._handle.report()
        except AcpError as e:
            return SaveStats(**{**self._stall.as_dict(), "done": True, "error": str(e)})
        return self._stall if report is None else self._with(report)

    def _with(self, r: dict[str, Any]) -> SaveStats:
        flush = r["flush_secs"]
        return SaveStats(
            **{
                **self._stall.as_dict(),
                "done": True,
                "skipped": r["skipped"],
                "bytes": r["bytes"],
                "stored_bytes": r["stored_bytes"],
                "compression_ratio": (
                    r["stored_bytes"] / r["bytes"]
                    if r["outcome"] == "persisted" and r["bytes"] > 0
                    else None
                ),
                "reused_chunks": r["reused_chunks"],
                "reused_bytes": r["reused_bytes"],
                "engine_stall_secs": r["stall_secs"],
                "slot_wait_secs": r["slot_wait_secs"],
                "queue_secs": r["queue_secs"],
                "flush_secs": flush,
                "replica_wait_secs": r["replica_wait_secs"],
                "commit_secs": r["commit_secs"],
                "total_secs": r["total_secs"],
                "flush_bytes_per_sec": r["bytes"] / flush if flush > 0 else None,
                "io": r["io"],
                "direct": r["direct"],
                "outcome": r["outcome"],
                "persisted": r["outcome"] == "persisted",
            }
        )

    def __repr__(self) -> str:
        return f"SaveHandle(step={self.step}, done={self.done()})"


def replicas_held(held: Sequence[tuple[int, int, int, int, bytes]]) -> dict[str, Any]:
    """``stats()["replicas"]``: the other ranks' images this rank holds
    (complete replica slots): how many, their bytes, and the steps held
    by source rank."""
    steps: dict[int, list[int]] = {}
    for rank, step, *_ in held:
        steps.setdefault(rank, []).append(step)
    return {
        "held": len(held),
        "bytes": sum(n for _, _, n, *_ in held),
        "steps": {r: sorted(s) for r, s in sorted(steps.items())},
    }
