"""One rank of a 2-rank job that SIGTERM reaches a save apart: ``python
dying_apart.py RANK ROOT OUT SHM PORT MODE``.

Joins a gloo group rendezvousing on 127.0.0.1:PORT (rank 0 hosts the
store), installs acp's SIGTERM handler (``commit_timeout`` 60 s) and
commits steps 1 and 2. Then rank 0 saves step 3 and rank 1 saves steps 3
and 4, without waiting: persisted saves (MODE ``persisted``: rank 1's
step 4 can never commit, rank 0 never saved it), or RAM snapshots (MODE
``ram``: each rank holds only its newest, 3 and 4, so no step newer than 2
is held by both). Each rank then touches OUT/staged-RANK and waits for
SIGTERM; the dying checkpoint's report goes to OUT/dying-RANK.json.
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


def state(rank: int, step: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(rank * 1000 + step)
    return {"w": torch.randn(256, 1024, generator=g), "step": step}


def main(argv: list[str]) -> None:
    rank, port, mode = int(argv[0]), int(argv[4]), argv[5]
    root, out, shm = argv[1:4]
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=60),
    )
    ckpt = acp.Checkpointer(
        root, job="apart", shm_dir=shm, ring_bytes=16 << 20, mlock=False, commit_timeout=60
    )
    report_dying_checkpoint(ckpt, out, rank)
    for step in (1, 2):
        ckpt.save(step, state(rank, step)).wait()
    for step in (3, 4) if rank == 1 else (3,):
        ckpt.save(step, state(rank, step), persist=mode == "persisted")
    Path(out, f"staged-{rank}").touch()
    while True:
        signal.pause()


if __name__ == "__main__":
    main(sys.argv[1:7])
