"""2 nodes × 2 ranks with peer replicas, as 4 processes on one machine.

``python replicas.py ROOT OUT SHM_A SHM_B PORT PHASE`` starts 4 ranks
(torch.multiprocessing, a gloo group rendezvousing on 127.0.0.1:PORT):
ranks 0-1 are node "a" (``ACP_NODE_ID=a``, shared memory SHM_A), ranks 2-3
node "b". A launcher starts one agent per node; one process standing in for
both keeps the test to one command, and each rank still sees only its
node's id and directory.

- ``train``: saves steps 1 and 2 with ``replicas=1``, waits for each step
  to be replicated and committed.
- ``resume``: loads (collective), writes each rank's step, source and
  whether the state is bit-exact to OUT/resume-RANK.json.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import acp


def state(rank: int, step: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(rank * 1000 + step)
    return {"w": torch.randn(64, 1024, generator=g), "step": step}


def main(rank: int, root: str, out: str, shms: list[str], port: int, phase: str) -> None:
    node = rank // 2
    os.environ["ACP_NODE_ID"] = "ab"[node]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4
    )
    ckpt = acp.Checkpointer(
        root, job="replicas", shm_dir=shms[node], ring_bytes=64 << 20, replicas=1
    )
    if phase == "train":
        for step in (1, 2):
            h = ckpt.save(step, state(rank, step))
            h.wait()
            assert h.wait_replicated(120) == [(rank + 2) % 4]
    else:
        got = ckpt.load()
        stats = ckpt.last_load
        assert stats is not None
        want = state(rank, got["step"])
        exact = bool(torch.equal(got["w"], want["w"]))  # type: ignore[arg-type]
        Path(out, f"resume-{rank}.json").write_text(
            json.dumps({"step": got["step"], "source": stats.source, "exact": exact})
        )
    ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    root, out, shm_a, shm_b, port, phase = sys.argv[1:7]
    mp.spawn(main, args=(root, out, [shm_a, shm_b], int(port), phase), nprocs=4)
