"""A SIGTERM that reaches the ranks of a job a save apart: rank 1 staged
step 4, rank 0 only step 3. Each rank's dying checkpoint persisting its
own newest step left no step with every rank's file, and the ranks waited
``commit_timeout`` for files that never came, then exited 74. Now the
ranks agree through the store on the newest step they all hold, commit
it, give up the newer ones at once and exit 143."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

import acp
from tests.dist.dying_apart import state
from tests.helpers import start_staged_ranks

SCRIPT = Path(__file__).parent / "dist" / "dying_apart.py"


def run(tmp_path: Path, mode: str) -> tuple[dict[int, int], float, dict[int, str]]:
    """Starts both ranks, SIGTERMs them once both staged; returns their exit
    statuses, the seconds from the SIGTERM to the last exit and their
    stderr."""
    _, _, procs = start_staged_ranks(tmp_path, SCRIPT, 2, [mode])
    try:
        t0 = time.monotonic()
        for p in procs:
            p.send_signal(signal.SIGTERM)
        codes = {r: p.wait(150) for r, p in enumerate(procs)}
        secs = time.monotonic() - t0
    finally:
        for p in procs:
            p.kill()
    return codes, secs, {r: (tmp_path / f"stderr-{r}").read_text() for r in range(2)}


def report(tmp_path: Path, rank: int) -> dict[str, object]:
    got: dict[str, object] = json.loads((tmp_path / "out" / f"dying-{rank}.json").read_text())
    return got


@pytest.mark.parametrize("mode", ["persisted", "ram"])
def test_ranks_a_save_apart_commit_the_newest_step_they_all_hold(tmp_path: Path, mode: str) -> None:
    codes, secs, stderr = run(tmp_path, mode)
    assert codes == {0: 143, 1: 143}, stderr
    # Far below commit_timeout (60 s): nobody waits for a file never written.
    assert secs < 30, (secs, stderr)
    # Persisted saves: both ranks hold step 3 (rank 1's flush of it keeps
    # its slot until the commit). RAM snapshots: each holds only its
    # newest, so step 2 stays the newest committed.
    committed = 3 if mode == "persisted" else 2
    for r in range(2):
        got = report(tmp_path, r)
        assert got["ok"] is True, got
        assert got["committed_step"] == committed, got
        assert got["staged_step"] == 3 + r, got
    assert "is not held by every rank" in stderr[1], stderr[1]
    root = tmp_path / "ckpt"
    assert not (root / "step-000000000004").exists()
    assert (root / "step-000000000003").exists() == (mode == "persisted")
    ckpt = acp.Checkpointer(
        root, job="check", rank=1, world_size=2, shm_dir=tmp_path / "shm", mlock=False
    )
    try:
        got = ckpt.load(agree=False)
    finally:
        ckpt.close()
    assert got["step"] == committed
    assert bool((got["w"] == state(1, committed)["w"]).all())  # type: ignore[union-attr]
