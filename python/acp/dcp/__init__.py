"""torch.distributed.checkpoint (DCP) storage plugins backed by acp.

``StorageWriter`` and ``StorageReader`` let ``dcp.save``, ``dcp.async_save``
and ``dcp.load`` keep their planners, resharding and state-dict handling while
acp does the storage: tensors are copied into a shared-memory ring slot, the
engine flushes, hashes and commits the step in the background, and a load
restores from the resident slot (RAM) when one holds the step, else from
storage::

    import torch.distributed.checkpoint as dcp
    import acp
    import acp.dcp

    ckpt = acp.Checkpointer("/mnt/ckpt/run1")
    writer = acp.dcp.StorageWriter(ckpt)
    dcp.save(state_dict, checkpoint_id=100, storage_writer=writer, no_dist=True)

    # async: the staging copy *is* the copy into the ring slot
    writer.reset(200)  # async_save hands checkpoint_id to the writer only after staging
    future = dcp.async_save(state_dict, storage_writer=writer, async_stager=acp.dcp.Stager(writer))
    future.result()  # committed

    reader = acp.dcp.StorageReader(ckpt)
    dcp.load(state_dict, checkpoint_id=200, storage_reader=reader, no_dist=True)

``checkpoint_id`` is the step: an ``int``, a string of digits, or the path of
a step directory under the checkpoint root (``<root>/step-000000000200``).

**Metadata without pickle.** DCP's ``FileSystemWriter`` pickles its
``Metadata``; this writer stores it as JSON among the checkpoint's values
(dtypes, sizes, chunks, tensor properties, the planner's flattening map and
the storage map), and the reader rebuilds the dataclasses from it. A value
JSON cannot hold (a custom planner's ``planner_data``, say) is refused at
save time with its key named.

**Non-tensor values are DCP's pickles, read with ``weights_only=True``.**
DCP's planner turns every non-tensor value of the state dict (``epoch``, an
optimizer's ``param_groups`` entries, ...) into ``torch.save`` bytes before
the storage layer sees it; acp stores those bytes as opaque ``uint8``
tensors. DCP's own planner would load them back with
``torch.load(weights_only=False)``, which runs whatever code a crafted
pickle names. So by default the reader first decodes each such entry itself
with ``torch.load(weights_only=True, map_location="cpu")`` (plain values,
containers and tensors only; anything else is refused with an error naming
the key) and hands the planner a fresh ``torch.save`` of that decoded value,
never the stored bytes: what the planner unpickles can hold only what
``weights_only`` allowed. Tensors inside such values come back on the CPU.
``StorageReader(..., load_bytes=False)`` refuses every such entry;
``StorageReader(..., allow_pickle=True)`` hands the stored bytes to the
planner unchanged, as DCP's ``FileSystemReader`` does: a checkpoint that
someone else could have written can then run arbitrary code in this process,
so pass it only for checkpoints you trust. ``acp.Checkpointer.save`` stores
plain values as JSON and needs neither.

**Several ranks, and resharding.** With a process group, give each rank a
writer on its own ``acp.Checkpointer`` (whose rank and world size come from
torch.distributed), and name the step with ``checkpoint_id``. Each rank's
``write_data`` copies its items (its shards; DCP's planner has already
given each replicated item to one rank) into its own acp file, whose values
hold the DCP metadata of those items; the engine commits the step once
every rank's file is durable (rank 0 assembles the index; coordination goes
through the checkpoint directory, never the process group). The reader
merges every rank's metadata (read from the verified headers only) and reads
each item from whichever rank's file holds it: its own from its ring slot,
another rank's from that rank's slot when it is resident on this node, else
from storage. So a checkpoint saved with one world size or sharding (FSDP,
DTensor, ...) loads into another, as DCP's planners arrange. Each item is
named ``rank{N}/`` + its key in the files. ``async_save`` stages each rank's
whole local state before DCP's planning runs, so replicated items are
written by every rank there (the reader takes one).

``AsyncCheckpointerType.PROCESS`` cannot carry the writer (its engine) to
another process; DCP's thread executor works.
"""

from __future__ import annotations

from acp.dcp.metadata import METADATA_KEY, metadata_from_json, metadata_to_json
from acp.dcp.reader import StorageReader
from acp.dcp.writer import Stager, StorageWriter

__all__ = [
    "METADATA_KEY",
    "Stager",
    "StorageReader",
    "StorageWriter",
    "metadata_from_json",
    "metadata_to_json",
]
