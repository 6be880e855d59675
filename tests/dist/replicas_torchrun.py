"""A rank of a job with peer replicas, as a ``torchrun`` agent starts it:
``python -m torch.distributed.run ... replicas_torchrun.py ROOT OUT PHASE``.

The agent's environment says which node it is: ``ACP_NODE_ID`` and
``ACP_SHM_DIR`` (its shared-memory directory). Each rank writes its pid
to OUT/pid-RANK and its node to OUT/node-RANK, so a test can kill a
node's processes.

- ``train``: saves steps 1 and 2 with ``replicas=1``, waits for each to be
  committed and replicated, touches OUT/trained-RANK and waits to be
  killed (a node is lost, or the launcher tears the job down).
- ``resume``: loads (collective) and writes the step, its source and
  whether the state is bit-exact to OUT/resume-RANK.json, then closes.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import acp


def state(rank: int, step: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(rank * 1000 + step)
    return {"w": torch.randn(64, 1024, generator=g), "step": step}


def main(root: str, out: str, phase: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    Path(out, f"pid-{rank}").write_text(str(os.getpid()))
    Path(out, f"node-{rank}").write_text(os.environ["ACP_NODE_ID"])
    ckpt = acp.Checkpointer(
        root,
        job="replicas-torchrun",
        shm_dir=os.environ["ACP_SHM_DIR"],
        ring_bytes=32 << 20,
        mlock=False,
        replicas=1,
        replica_timeout=30,
        commit_timeout=60,
    )
    if phase == "train":
        for step in (1, 2):
            h = ckpt.save(step, state(rank, step))
            h.wait()
            h.wait_replicated(120)
        Path(out, f"trained-{rank}").touch()
        while True:
            signal.pause()
    got = ckpt.load()
    stats = ckpt.last_load
    assert stats is not None
    want = state(rank, int(got["step"]))
    result = {
        "step": got["step"],
        "source": stats.source,
        "exact": bool(torch.equal(got["w"], want["w"])),  # type: ignore[arg-type]
    }
    Path(out, f"resume-{rank}.json").write_text(json.dumps(result))
    ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
