"""The extension module: bindings of the Rust engine (acp-core).

Pointer-taking methods (``Staging.copy_from``, ``Loaded.copy_into``) trust
their caller: each ``(index, address, nbytes)`` must be the live memory of a
contiguous tensor that nothing else touches until the call returns.
"""

import os
import pathlib
from collections.abc import Callable, Sequence
from typing import Any, final

__all__ = [
    "FORMAT_VERSION",
    "MAX_VALUES_DEPTH",
    "AcpError",
    "AcpTimeout",
    "BusyError",
    "CheckpointCorrupt",
    "CheckpointExists",
    "CheckpointNotFound",
    "CliProgress",
    "ConfigError",
    "Engine",
    "EngineClosed",
    "FaultInjector",
    "InvalidInput",
    "Loaded",
    "NoSpace",
    "ReplicaImage",
    "Report",
    "SaveHandle",
    "SavePlan",
    "Staging",
    "StorageError",
    "Unsupported",
    "__version__",
    "cli_main",
    "ops_export",
    "ops_inspect",
    "plain_values",
]

__version__: str
FORMAT_VERSION: int
MAX_VALUES_DEPTH: int
"""The deepest nesting of JSON arrays and objects in a checkpoint's values."""

class AcpError(Exception): ...
class CheckpointNotFound(AcpError, FileNotFoundError): ...
class CheckpointCorrupt(AcpError): ...
class CheckpointExists(AcpError, FileExistsError): ...
class InvalidInput(AcpError, ValueError): ...
class ConfigError(AcpError, ValueError): ...
class StorageError(AcpError, OSError): ...
class NoSpace(StorageError): ...
class BusyError(AcpError): ...
class AcpTimeout(AcpError, TimeoutError): ...
class EngineClosed(AcpError): ...
class Unsupported(AcpError): ...

@final
class FaultInjector:
    def __new__(
        cls, fail_at: int | None = None, errno: int = 5, sticky: bool = False
    ) -> FaultInjector: ...
    def arm(self, n: int, errno: int = 5, sticky: bool = False) -> None: ...
    def arm_stall(self, n: int, seconds: float) -> None: ...
    def throttle(self, bytes_per_sec: int, op_bytes: int) -> None: ...
    def heal(self) -> None: ...
    def ops(self) -> int: ...
    def log(self) -> list[str]: ...

@final
class Engine:
    def __new__(
        cls,
        root: str | os.PathLike[str],
        *,
        job: str | None = None,
        rank: int = 0,
        world_size: int = 1,
        ring_bytes: int | None = None,
        ring_slots: int | None = None,
        shm_dir: str | os.PathLike[str] | None = None,
        mlock: bool | None = None,
        copy_threads: int | None = None,
        chunk_bytes: int | None = None,
        queue_depth: int | None = None,
        io: str | None = None,
        direct_io: str | None = None,
        on_full: str | None = None,
        full_timeout: float | None = None,
        verify: str | None = None,
        keep_last: int | None = None,
        keep_every: int | None = None,
        persist_on_open: bool | None = None,
        stall_timeout: float | None = None,
        commit_timeout: float | None = None,
        faults: FaultInjector | None = None,
        release_on_close: bool | None = None,
        shm_ttl: float | None = None,
        persist_every: int | None = None,
        persist_interval: float | None = None,
        persist_policy: str | None = None,
        background_nice: int | None = None,
        replicas_held: int | None = None,
        compress: str | None = None,
        compress_level: int | None = None,
        incremental: bool | None = None,
    ) -> Engine: ...
    @property
    def root(self) -> pathlib.Path: ...
    @property
    def closed(self) -> bool: ...
    def open_report(self) -> dict[str, Any]: ...
    def begin_save(
        self,
        step: int,
        specs: list[tuple[str, str, tuple[int, ...]]],
        values_json: str,
        overwrite: bool = False,
        extra_metadata: dict[str, str] | None = None,
        persist: bool | None = None,
        hold: bool = False,
    ) -> Staging | None: ...
    def save_plan(
        self,
        specs: list[tuple[str, str, tuple[int, ...]]],
        values_json: str,
        host: list[tuple[int, int, int]] | None = None,
    ) -> SavePlan: ...
    def begin_save_planned(
        self,
        step: int,
        plan: SavePlan,
        overwrite: bool = False,
        extra_metadata: dict[str, str] | None = None,
        persist: bool | None = None,
        hold: bool = False,
    ) -> Staging | None: ...
    def reserve(self, specs: list[tuple[str, str, tuple[int, ...]]], values_json: str) -> int: ...
    def load(
        self,
        step: int | None = None,
        storage_only: bool = False,
        fallback: bool = False,
        rank: int | None = None,
        tensors: list[str] | None = None,
        defer: bool = False,
    ) -> Loaded: ...
    def steps(self) -> list[int]: ...
    def latest(self) -> int | None: ...
    def index_json(self, step: int) -> str: ...
    def read_values(self, step: int, rank: int) -> str: ...
    def persist_resident(self, step: int) -> SaveHandle: ...
    def decide(self, step: int, persist: bool) -> bool: ...
    def held(self) -> list[int]: ...
    def snapshots(self) -> list[int]: ...
    def persist_newest(self) -> SaveHandle | None: ...
    def persist_stats(self) -> dict[str, Any]: ...
    def retain(self, keep_last: int, keep_every: int | None = None) -> list[int]: ...
    def wait_idle(self, timeout: float | None = None) -> None: ...
    def close(self) -> list[int] | None: ...
    def resident_steps(self) -> list[int]: ...
    def resident_replica(self, step: int) -> ReplicaImage: ...
    def pin_replica(self, rank: int, step: int) -> ReplicaImage | None: ...
    def replicas(self) -> list[_ReplicaMeta]: ...
    # The caller guarantees that `nbytes` at `addr` are the live memory of a
    # contiguous tensor that nothing writes during the call.
    def receive_replica(self, meta: _ReplicaMeta, addr: int, nbytes: int) -> None: ...
    def offer_peer_image(self, peer: int, meta: _ReplicaMeta, addr: int, nbytes: int) -> None: ...

# (rank, step, len, chunk_bytes, digests: 32 bytes per chunk)
_ReplicaMeta = tuple[int, int, int, int, bytes]

@final
class ReplicaImage:
    def meta(self) -> _ReplicaMeta: ...
    def buffer(self) -> memoryview: ...

@final
class Staging:
    @property
    def step(self) -> int: ...
    @property
    def image_bytes(self) -> int: ...
    def entries(self) -> list[tuple[str, str, tuple[int, ...], int]]: ...
    def copy_from(self, items: list[tuple[int, int, int]]) -> None: ...
    # The caller guarantees, as for copy_from, that the plan's host ranges
    # are still the live memory of contiguous tensors.
    def copy_planned(self, plan: SavePlan) -> None: ...
    def buffer(self, i: int) -> memoryview: ...
    def finish(self) -> SaveHandle: ...
    def abort(self) -> None: ...

@final
class SavePlan:
    def __len__(self) -> int: ...

@final
class SaveHandle:
    @staticmethod
    def skipped(step: int) -> SaveHandle: ...
    @property
    def step(self) -> int: ...
    def done(self) -> bool: ...
    def wait(self, timeout: float | None = None) -> dict[str, Any]: ...
    def report(self) -> dict[str, Any] | None: ...

@final
class Loaded:
    @property
    def step(self) -> int: ...
    @property
    def source(self) -> str: ...
    @property
    def values_json(self) -> str: ...
    @property
    def pending(self) -> bool: ...
    @property
    def failed(self) -> bool: ...
    def report(self) -> dict[str, Any]: ...
    def entries(self) -> list[tuple[str, str, tuple[int, ...], int]]: ...
    def buffer(self, i: int) -> memoryview: ...
    def protect(self) -> bool: ...
    def copy_into(self, items: list[tuple[int, int, int]]) -> None: ...

# --- the back end of the `acp` command line (acp_core::ops) ---------------

_Path = str | os.PathLike[str]
_Progress = Callable[[str, int, int], object]

@final
class Report:
    """An operation's outcome: ``json`` (the report) and ``text`` (for people)."""

    @property
    def json(self) -> str: ...
    @property
    def text(self) -> str: ...

def ops_inspect(root: _Path, step: int | None = None) -> Report: ...
def ops_export(
    root: _Path,
    out: _Path,
    step: int | None = None,
    rank: int | None = None,
    overwrite: bool = False,
    progress: _Progress | None = None,
) -> Report: ...
def plain_values(values_json: str, describe: bool = True) -> str:
    """The plain-values view of a values tree, as JSON text: leaves plain
    JSON cannot hold (tensors, bytes, non-finite floats, big ints, framework
    values) described for people, or ``null`` when ``describe`` is false."""

@final
class CliProgress:
    """The command line's progress bar, as ``progress(phase, done, total)``."""

    def __call__(self, phase: str, done: int, total: int) -> None: ...

def cli_main(argv: Sequence[str]) -> int:
    """Runs the ``acp`` command line on ``argv`` (the program name first)."""
