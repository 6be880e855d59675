"""Several ranks, each a process: every rank writes its own file, rank 0
commits the step once all are durable; any rank can read another's file."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

CHILD = textwrap.dedent(
    """
    import sys, torch, acp
    root, shm, job = sys.argv[1:4]
    with acp.Checkpointer(root, job=job, shm_dir=shm, ring_bytes=16 << 20, mlock=False,
                          commit_timeout=60) as ckpt:
        assert (ckpt.rank, ckpt.world_size) == (int(sys.argv[4]), 2)
        ckpt.save(1, {"w": torch.full((8,), float(ckpt.rank)), "rank": ckpt.rank}).wait()
        assert ckpt.steps() == [1]
        mine = ckpt.load()
        assert mine["rank"] == ckpt.rank
        assert torch.equal(mine["w"], torch.full((8,), float(ckpt.rank)))
        other = 1 - ckpt.rank
        theirs = ckpt.load(1, rank=other)
        assert theirs["rank"] == other, theirs
        assert ckpt.last_load.source == "ram"  # its slot, on this node
        ckpt.load(1, rank=other, storage_only=True)
        assert ckpt.last_load.source == "storage"
    print("ok", ckpt.rank)
    """
)


def test_two_ranks_commit_one_step(tmp_path: Path, shm_dir: Path) -> None:
    root = tmp_path / "ckpt"
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2"}
        args = [sys.executable, "-c", CHILD, str(root), str(shm_dir), "ranks", str(rank)]
        procs.append(
            subprocess.Popen(
                args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    outs = [p.communicate(timeout=240) for p in procs]
    for rank, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {rank}: {err}"
        assert out.strip() == f"ok {rank}"
    from safetensors import safe_open

    with safe_open(str(next(root.glob("*1/rank-00001.safetensors"))), "pt") as f:
        assert list(f.keys()) == ["rank1.w"]
