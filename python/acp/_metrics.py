"""Figures of a checkpointer's saves and loads: aggregates for
``Checkpointer.stats()``, log lines on the ``acp`` logger, and the
Prometheus text exposition format.

Per save: the stall (what training waited for), bytes, staging throughput
(tensor bytes over the copy into the ring), queue wait, flush time and
throughput, commit time, the time from ``save()`` to committed, and its
outcome (persisted, or kept resident in RAM, or superseded before its
persist). From the engine: steps staged, persisted, resident and
superseded, bytes written to storage, the persist queue's depth, and how
far the newest persisted step lags the newest snapshot. Per
load: the source (``ram`` or ``storage``), bytes and throughput.

A save finishes in the background; its figures are collected when the
checkpointer next looks (``save``, ``load``, ``wait``, ``stats``,
``close``), which is also when its log line is written.

Log levels on the ``acp`` logger: DEBUG for each save's stall, INFO for
commits, loads and what opening found, WARNING for skipped saves and
discarded half-staged slots, ERROR for failed saves.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from acp._acp import AcpError

if TYPE_CHECKING:
    from acp.checkpointer import LoadStats, SaveHandle, SaveStats

__all__ = ["Metrics", "logger", "prometheus_text"]

logger = logging.getLogger("acp")
logger.addHandler(logging.NullHandler())

_live: weakref.WeakSet[Metrics] = weakref.WeakSet()
_live_lock = threading.Lock()


def _mib(n: float) -> str:
    """Bytes for people: ``"1.5 MiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _rate(n: float, secs: float | None) -> float | None:
    return n / secs if secs and secs > 0 else None


@dataclass
class _Sum:
    """Count, sum, max and last of one figure."""

    count: int = 0
    total: float = 0.0
    max: float = 0.0
    last: float | None = None

    def add(self, v: float | None) -> None:
        if v is None:
            return
        self.count += 1
        self.total += v
        self.max = max(self.max, v)
        self.last = v

    def as_dict(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "sum": self.total,
            "max": self.max,
            "mean": self.total / self.count if self.count else None,
            "last": self.last,
        }


@dataclass
class _Loads:
    count: int = 0
    bytes: int = 0
    secs: float = 0.0
    last_bytes_per_sec: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "bytes": self.bytes,
            "secs": self.secs,
            "bytes_per_sec": _rate(self.bytes, self.secs),
            "last_bytes_per_sec": self.last_bytes_per_sec,
        }


@dataclass
class _Figures:
    committed: int = 0
    failed: int = 0
    skipped: int = 0
    resident: int = 0
    superseded: int = 0
    bytes: int = 0
    tensor_bytes: int = 0
    last_committed_step: int | None = None
    stall: _Sum = field(default_factory=_Sum)
    copy: _Sum = field(default_factory=_Sum)
    slot_wait: _Sum = field(default_factory=_Sum)
    queue: _Sum = field(default_factory=_Sum)
    flush: _Sum = field(default_factory=_Sum)
    commit: _Sum = field(default_factory=_Sum)
    to_commit: _Sum = field(default_factory=_Sum)
    staging_bps: _Sum = field(default_factory=_Sum)
    flush_bps: _Sum = field(default_factory=_Sum)
    loads: dict[str, _Loads] = field(default_factory=dict)


class Metrics:
    """The figures of one checkpointer. Thread-safe."""

    def __init__(self, root: str, job: str | None, rank: int) -> None:
        self.root = root
        self.job = job
        self.rank = rank
        self._lock = threading.Lock()
        self._pending: list[SaveHandle] = []
        self._f = _Figures()
        self.persist_source: Callable[[], dict[str, Any]] | None = None
        """The engine's persist figures (``Engine.persist_stats``), set by
        the checkpointer while its engine is open."""
        with _live_lock:
            _live.add(self)

    # --- events -----------------------------------------------------------

    def opened(self, report: dict[str, Any]) -> None:
        """Logs what opening the engine found."""
        logger.info(
            "acp: opened %s (rank %d): io=%s, ring locked in RAM: %s",
            self.root,
            self.rank,
            report.get("io"),
            report.get("mlocked"),
        )
        if report.get("mlock_error"):
            logger.info("acp: ring not locked in RAM: %s", report["mlock_error"])
        if report.get("resident_steps"):
            logger.info(
                "acp: resident checkpoints found in shared memory: steps %s; persisting %s",
                report["resident_steps"],
                report.get("persisting_steps") or "none",
            )
        if report.get("shm_in_ram") is False:
            logger.warning(
                "acp: shm_dir %s is not in memory (not a tmpfs): every image saved there "
                "is also written back to its disk, which slows saves, flushes and "
                "replicas; point shm_dir (ACP_SHM_DIR) at /dev/shm or another tmpfs",
                report.get("shm_dir"),
            )
        if report.get("discarded_half_staged"):
            logger.warning(
                "acp: discarded %d half-staged slot(s) left by a dead process",
                report["discarded_half_staged"],
            )

    def saved(self, handle: SaveHandle) -> None:
        """A save returned from its stall."""
        s = handle.stats
        with self._lock:
            f = self._f
            f.stall.add(s.stall_secs)
            if s.skipped:
                f.skipped += 1
            else:
                # An overlapped save's copy ran mostly after save() returned.
                copy = s.copy_secs if s.overlap_copy_secs is None else s.overlap_copy_secs
                f.copy.add(copy)
                f.tensor_bytes += s.tensor_bytes
                f.staging_bps.add(_rate(s.tensor_bytes, copy))
                self._pending.append(handle)
        if s.skipped:
            logger.warning("acp: step %d skipped: no free ring slot (on_full='skip')", s.step)
        else:
            logger.debug(
                "acp: step %d staged: %s in a %.1f ms stall (copy %.1f ms)",
                s.step,
                _mib(s.tensor_bytes),
                s.stall_secs * 1e3,
                s.copy_secs * 1e3,
            )
        self.collect()

    def collect(self) -> None:
        """Takes in the figures of saves that have finished since last time."""
        with self._lock:
            done = [h for h in self._pending if h.done()]
            self._pending = [h for h in self._pending if h not in done]
        for h in done:
            self._finished(h.stats)

    def _finished(self, s: SaveStats) -> None:
        if s.error is not None:
            with self._lock:
                self._f.failed += 1
            logger.error("acp: step %d failed: %s", s.step, s.error)
            return
        if s.outcome in ("resident", "superseded"):
            with self._lock:
                if s.outcome == "resident":
                    self._f.resident += 1
                else:
                    self._f.superseded += 1
            logger.debug("acp: step %d %s in RAM, not persisted", s.step, s.outcome)
            return
        with self._lock:
            f = self._f
            f.committed += 1
            f.bytes += s.bytes or 0
            f.last_committed_step = max(f.last_committed_step or 0, s.step)
            f.slot_wait.add(s.slot_wait_secs)
            f.queue.add(s.queue_secs)
            f.flush.add(s.flush_secs)
            f.commit.add(s.commit_secs)
            f.to_commit.add(s.total_secs)
            f.flush_bps.add(s.flush_bytes_per_sec)
        logger.info(
            "acp: step %d committed: %s, stall %.1f ms, queue %.3f s, flush %.3f s (%s/s), "
            "commit %.3f s, %.3f s from save to commit",
            s.step,
            _mib(s.bytes or 0),
            s.stall_secs * 1e3,
            s.queue_secs or 0.0,
            s.flush_secs or 0.0,
            _mib(s.flush_bytes_per_sec or 0.0),
            s.commit_secs or 0.0,
            s.total_secs or 0.0,
        )

    def loaded(self, s: LoadStats) -> None:
        with self._lock:
            ld = self._f.loads.setdefault(s.source, _Loads())
            ld.count += 1
            ld.bytes += s.bytes
            ld.secs += s.total_secs
            ld.last_bytes_per_sec = s.bytes_per_sec
        logger.info(
            "acp: step %d loaded from %s: %s in %.3f s (%s/s)%s",
            s.step,
            s.source,
            _mib(s.bytes),
            s.total_secs,
            _mib(s.bytes_per_sec),
            "" if s.verified else " (not re-verified)",
        )
        if s.rejected is not None:
            logger.warning(
                "acp: step %d: a copy was skipped, loaded from %s instead: %s",
                s.step,
                s.source,
                s.rejected,
            )
        self.collect()

    def close(self) -> None:
        self.collect()
        with _live_lock:
            _live.discard(self)

    # --- output -----------------------------------------------------------

    def _persist(self) -> dict[str, Any] | None:
        source = self.persist_source
        if source is None:
            return None
        try:
            return source()
        except AcpError:  # a closed engine has no figures
            return None

    def summary(self) -> dict[str, Any]:
        """The aggregates, as ``Checkpointer.stats()["figures"]``."""
        self.collect()
        persist = self._persist()
        with self._lock:
            f = self._f
            return {
                "saves_committed": f.committed,
                "saves_failed": f.failed,
                "saves_skipped": f.skipped,
                "saves_resident": f.resident,
                "saves_superseded": f.superseded,
                "persist": persist,
                "saves_in_flight": len(self._pending),
                "bytes_committed": f.bytes,
                "last_committed_step": f.last_committed_step,
                "stall_secs": f.stall.as_dict(),
                "copy_secs": f.copy.as_dict(),
                "slot_wait_secs": f.slot_wait.as_dict(),
                "queue_secs": f.queue.as_dict(),
                "flush_secs": f.flush.as_dict(),
                "commit_secs": f.commit.as_dict(),
                "save_to_commit_secs": f.to_commit.as_dict(),
                "staging_bytes_per_sec": {
                    "last": f.staging_bps.last,
                    "mean": _rate(f.tensor_bytes, f.copy.total),
                },
                "flush_bytes_per_sec": {
                    "last": f.flush_bps.last,
                    "mean": _rate(f.bytes, f.flush.total),
                },
                "loads": {src: ld.as_dict() for src, ld in sorted(f.loads.items())},
            }

    def prometheus(self) -> str:
        """The figures in the Prometheus text exposition format."""
        return prometheus_text([self])


def _labels(m: Metrics, **extra: str) -> str:
    pairs = {"root": m.root, "rank": str(m.rank), "job": m.job or "", **extra}
    body = ",".join(f'{k}="{_escape(v)}"' for k, v in pairs.items())
    return "{" + body + "}"


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


_FAMILIES: list[tuple[str, str, str]] = [
    (
        "acp_saves_total",
        "counter",
        "Saves by result (committed, failed, skipped, resident, superseded).",
    ),
    (
        "acp_storage_bytes_written_total",
        "counter",
        "Image bytes of the committed persists (their plain size, reused chunks included).",
    ),
    (
        "acp_storage_bytes_stored_total",
        "counter",
        "Bytes those persists' files take in storage (less when compressed or incremental).",
    ),
    ("acp_persist_queue_depth", "gauge", "Persists queued, deferred or running."),
    (
        "acp_persist_lag_seconds",
        "gauge",
        "How much older the newest persisted step's snapshot is than the newest snapshot.",
    ),
    ("acp_save_bytes_total", "counter", "Bytes of committed checkpoint files."),
    ("acp_save_stall_seconds", "summary", "What training waited for in save()."),
    ("acp_save_stall_seconds_max", "gauge", "The longest save() stall."),
    ("acp_save_queue_seconds", "summary", "Time queued behind earlier flushes."),
    ("acp_save_flush_seconds", "summary", "Writing, hashing and fsyncing a checkpoint."),
    ("acp_save_commit_seconds", "summary", "Writing the index and publishing the step."),
    ("acp_save_to_commit_seconds", "summary", "From save() to committed."),
    ("acp_save_staging_bytes_per_second", "gauge", "Copy into the ring, latest save."),
    ("acp_save_flush_bytes_per_second", "gauge", "Flush throughput, latest save."),
    ("acp_last_committed_step", "gauge", "The newest step this process committed."),
    ("acp_loads_total", "counter", "Loads by source (ram, storage)."),
    ("acp_load_bytes_total", "counter", "Bytes loaded, by source."),
    ("acp_load_seconds", "summary", "Load time, by source."),
]


def prometheus_text(metrics: Iterable[Metrics] | None = None) -> str:
    """The figures of ``metrics`` (default: every open checkpointer of this
    process) in the Prometheus text exposition format (version 0.0.4)."""
    if metrics is None:
        with _live_lock:
            chosen = list(_live)
    else:
        chosen = list(metrics)
    samples: dict[str, list[str]] = {name: [] for name, _, _ in _FAMILIES}
    for m in chosen:
        s = m.summary()
        lb = _labels(m)

        def put(name: str, value: float | None, labels: str = lb) -> None:
            if value is not None:
                samples[name].append(f"{name}{labels} {float(value)!r}")

        for result in ("committed", "failed", "skipped", "resident", "superseded"):
            put("acp_saves_total", s[f"saves_{result}"], _labels(m, result=result))
        persist = s["persist"]
        if persist is not None:
            put("acp_storage_bytes_written_total", persist["bytes_written"])
            put("acp_storage_bytes_stored_total", persist["bytes_stored"])
            put("acp_persist_queue_depth", persist["queue_depth"])
            put("acp_persist_lag_seconds", persist["persisted_lag_secs"])
        put("acp_save_bytes_total", s["bytes_committed"])
        for fam, key in (
            ("acp_save_stall_seconds", "stall_secs"),
            ("acp_save_queue_seconds", "queue_secs"),
            ("acp_save_flush_seconds", "flush_secs"),
            ("acp_save_commit_seconds", "commit_secs"),
            ("acp_save_to_commit_seconds", "save_to_commit_secs"),
        ):
            samples[fam].append(f"{fam}_sum{lb} {float(s[key]['sum'])!r}")
            samples[fam].append(f"{fam}_count{lb} {s[key]['count']}")
        put("acp_save_stall_seconds_max", s["stall_secs"]["max"])
        put("acp_save_staging_bytes_per_second", s["staging_bytes_per_sec"]["last"])
        put("acp_save_flush_bytes_per_second", s["flush_bytes_per_sec"]["last"])
        put("acp_last_committed_step", s["last_committed_step"])
        for src, ld in s["loads"].items():
            put("acp_loads_total", ld["count"], _labels(m, source=src))
            put("acp_load_bytes_total", ld["bytes"], _labels(m, source=src))
            fam, sl = "acp_load_seconds", _labels(m, source=src)
            samples[fam].append(f"{fam}_sum{sl} {float(ld['secs'])!r}")
            samples[fam].append(f"{fam}_count{sl} {ld['count']}")
    lines: list[str] = []
    for name, kind, help_text in _FAMILIES:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(samples[name])
    return "\n".join(lines) + "\n"
