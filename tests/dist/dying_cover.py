"""One rank of a 4-rank job whose replica groups are {0, 1} and {2, 3},
saving ``replicated=True``: ``python dying_cover.py RANK ROOT OUT SHM PORT
TIMEOUT [MODE]`` (TIMEOUT bounds the dying checkpoint, in seconds).

MODE ``inflight``: after step 1, ranks 0 to 2 save step 2 persisted
(without waiting: its commit waits for rank 3's file) and step 3 as a RAM
snapshot; rank 3 saves neither (the test kills it), so step 2 can never
commit, and step 3 only once its group's survivor covers it.

Joins a gloo group rendezvousing on 127.0.0.1:PORT (rank 0 hosts the
store), installs acp's SIGTERM handler, commits step 1, then saves step 2
as a RAM snapshot (``persist=False``: nothing of it reaches storage before
the dying checkpoint), touches OUT/staged-RANK and waits for a signal. The
test SIGKILLs one rank and SIGTERMs the others; each survivor writes its
``DyingReport`` to OUT/dying-RANK.json before exiting.
"""

from __future__ import annotations

import datetime
import json
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import acp
from tests.dist._common import report_dying_checkpoint


def state(group: int, step: int) -> dict[str, object]:
    """The state every rank of replica group ``group`` (its lowest rank)
    holds at ``step``: identical bytes within the group."""
    g = torch.Generator().manual_seed(group * 1000 + step)
    return {
        "w": torch.randn(256, 1024, generator=g),
        "b": torch.randn(4096, generator=g),
        "n": torch.arange(1000, dtype=torch.int64) * (step + group),
        "step": step,
    }


def main(argv: list[str]) -> None:
    rank, port, timeout = int(argv[0]), int(argv[4]), float(argv[5])
    mode = argv[6] if len(argv) > 6 else "default"
    root, out, shm = argv[1:4]
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=4,
        timeout=datetime.timedelta(seconds=60),
    )
    group = [0, 1] if rank < 2 else [2, 3]
    ckpt = acp.Checkpointer(
        root,
        job="cover",
        shm_dir=shm,
        ring_bytes=32 << 20,
        mlock=False,
        replica_group=group,
        commit_timeout=60,
    )
    report_dying_checkpoint(ckpt, out, rank, timeout)
    ckpt.save(1, state(group[0], 1), replicated=True).wait()
    if mode == "inflight":
        if rank != 3:
            ckpt.save(2, state(group[0], 2), replicated=True)
            ckpt.save(3, state(group[0], 3), replicated=True, persist=False)
    else:
        ckpt.save(2, state(group[0], 2), replicated=True, persist=False)
    Path(out, f"staged-{rank}").touch()
    while True:
        signal.pause()


if __name__ == "__main__":
    main(sys.argv[1:8])
