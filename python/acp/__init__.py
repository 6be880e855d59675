"""acp: asynchronous checkpoints.

``save`` stalls training only for a memory copy into a shared-memory ring;
background workers write, hash and commit the checkpoint; the newest one
stays resident in RAM, so a restarted process restores at memory speed::

    import acp

    with acp.Checkpointer("/mnt/ckpt/run1") as ckpt:
        h = ckpt.save(step, {"model": model.state_dict(), "optim": opt.state_dict()})
        ...
        h.wait()  # durable and committed
        ckpt.load(into={"model": model.state_dict()})

When training dies, ``ckpt.guard()`` (an exception escaping it) and
``ckpt.install_sigterm_handler()`` (SIGTERM) commit every completely staged
checkpoint before the process exits (``acp.guard`` documents the exit
statuses); after a SIGKILL, the restarted trainer commits what was staged.

``import acp`` imports no framework: torch support lives in ``acp.torch``,
loaded when a state holds a torch tensor.
"""

from acp._acp import (
    FORMAT_VERSION,
    AcpError,
    AcpTimeout,
    BusyError,
    CheckpointCorrupt,
    CheckpointExists,
    CheckpointNotFound,
    ConfigError,
    EngineClosed,
    InvalidInput,
    NoSpace,
    StorageError,
    Unsupported,
    __version__,
)
from acp.checkpointer import Checkpointer, LoadStats, SaveHandle, SaveStats, rank_and_world_size
from acp.guard import EXIT_SAVE_FAILED, EXIT_TERMINATED, DyingReport, Terminated

__all__ = [
    "EXIT_SAVE_FAILED",
    "EXIT_TERMINATED",
    "FORMAT_VERSION",
    "AcpError",
    "AcpTimeout",
    "BusyError",
    "CheckpointCorrupt",
    "CheckpointExists",
    "CheckpointNotFound",
    "Checkpointer",
    "ConfigError",
    "DyingReport",
    "EngineClosed",
    "InvalidInput",
    "LoadStats",
    "NoSpace",
    "SaveHandle",
    "SaveStats",
    "StorageError",
    "Terminated",
    "Unsupported",
    "__version__",
    "rank_and_world_size",
]
