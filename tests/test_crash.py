"""A trainer killed with SIGKILL right after ``save`` returned: the next
process finds the checkpoint resident in shared memory, restores it, and
commits it."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

import acp

CHILD = textwrap.dedent(
    """
    import os, signal, sys, torch, acp
    root, shm, job = sys.argv[1:4]
    ckpt = acp.Checkpointer(root, job=job, shm_dir=shm, ring_bytes=32 << 20, mlock=False)
    ckpt.save(1, {"w": torch.full((1000,), 1.0), "step": 1}).wait()
    ckpt.save(2, {"w": torch.full((1000,), 2.0), "step": 2})  # returns after the copy
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_killed_after_save_restores_from_ram(tmp_path: Path, shm_dir: Path) -> None:
    root = tmp_path / "ckpt"
    job = "crash-test"
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(root), str(shm_dir), job],
        capture_output=True,
        text=True,
        check=False,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    with acp.Checkpointer(root, job=job, shm_dir=shm_dir, ring_bytes=32 << 20) as ckpt:
        report = ckpt.stats()["engine"]
        assert 2 in report["resident_steps"]
        state = ckpt.load()  # from RAM, while step 2 is committed in the background
        assert state["step"] == 2
        assert torch.equal(state["w"], torch.full((1000,), 2.0))
        assert ckpt.last_load is not None
        assert ckpt.last_load.source == "ram"
        ckpt.wait()
        assert ckpt.steps() == [1, 2]
