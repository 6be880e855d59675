"""A dying checkpoint that a dead rank cannot block (``acp.cover``): 4
ranks saving ``replicated=True`` in replica groups {0, 1} and {2, 3}; one
rank is SIGKILLed, then the others get SIGTERM. The survivor of the dead
rank's group writes its share, and the step commits, loadable and
bit-exact. With a whole group dead nobody can, and the step is not
committed."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import torch

import acp
from tests.dist.dying_cover import state
from tests.helpers import start_staged_ranks

SCRIPT = Path(__file__).parent / "dist" / "dying_cover.py"


def start(
    tmp_path: Path, timeout: float, mode: str = "default"
) -> tuple[Path, Path, list[subprocess.Popen[bytes]]]:
    """Starts the 4 ranks; returns once every one staged (tests/dist/dying_cover.py)."""
    return start_staged_ranks(tmp_path, SCRIPT, 4, [str(timeout), mode])


def stop(tmp_path: Path, procs: list[subprocess.Popen[bytes]], dead: list[int]) -> dict[int, int]:
    """SIGKILLs ``dead`` (waiting for them), then SIGTERMs the others;
    returns the survivors' exit statuses."""
    for r in dead:
        procs[r].kill()
        procs[r].wait(30)
    alive = [r for r in range(4) if r not in dead]
    for r in alive:
        procs[r].send_signal(signal.SIGTERM)
    codes = {}
    for r in alive:
        try:
            codes[r] = procs[r].wait(150)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
    return codes


def dying(out: Path, rank: int) -> dict[str, object]:
    report: dict[str, object] = json.loads((out / f"dying-{rank}.json").read_text())
    return report


def pick(report: dict[str, object]) -> tuple[object, ...]:
    """ok, the committed step, the dead ranks and those this rank covered."""
    return tuple(report[k] for k in ("ok", "committed_step", "dead", "covered"))


def test_survivors_write_a_dead_ranks_share_and_the_step_commits(tmp_path: Path) -> None:
    _, out, procs = start(tmp_path, 60)
    root = tmp_path / "ckpt"
    codes = stop(tmp_path, procs, dead=[3])
    stderr = {r: (tmp_path / f"stderr-{r}").read_text() for r in range(3)}
    assert codes == {0: 143, 1: 143, 2: 143}, stderr
    covering = dying(out, 2)
    assert pick(covering) == (True, 2, [3], [3]), covering
    assert "covered by this rank: [3]" in stderr[2], stderr[2]
    for r in (0, 1):
        other = dying(out, r)
        # A rank whose roll call sees the step committed (rank 2's cover
        # done) stops calling and names no dead rank (acp.cover.roll_call).
        assert pick(other) in ((True, 2, [3], []), (True, 2, [], [])), other
    index = json.loads((root / "step-000000000002" / "model.safetensors.index.json").read_text())
    assert sorted(index["metadata"]["acp"]["files"]) == [
        f"rank-{r:05}.safetensors" for r in range(4)
    ]
    # Loadable and bit-exact: each group's state, read by one of its ranks.
    for rank, group in ((0, 0), (3, 2)):
        ckpt = acp.Checkpointer(
            root,
            job="check",
            rank=rank,
            world_size=4,
            shm_dir=tmp_path / "shm",
            mlock=False,
            replica_group=[group, group + 1],
        )
        try:
            got = ckpt.load(step=2, agree=False)
        finally:
            ckpt.close()
        want = state(group, 2)
        for k in ("w", "b", "n"):
            assert torch.equal(got[k], want[k]), (rank, k)  # type: ignore[arg-type]
        assert got["step"] == 2


def test_with_every_rank_alive_nobody_is_covered(tmp_path: Path) -> None:
    _, out, procs = start(tmp_path, 60)
    codes = stop(tmp_path, procs, dead=[])
    assert codes == {0: 143, 1: 143, 2: 143, 3: 143}, codes
    for r in range(4):
        assert pick(dying(out, r)) == (True, 2, [], []), r


def test_a_dead_group_leaves_the_step_uncommitted(tmp_path: Path) -> None:
    _, out, procs = start(tmp_path, 8)
    root = tmp_path / "ckpt"
    codes = stop(tmp_path, procs, dead=[2, 3])
    assert codes == {0: 74, 1: 74}, codes
    for r in (0, 1):
        report = dying(out, r)
        assert pick(report) == (False, 1, [2, 3], []), report
    assert not (root / "step-000000000002").exists()
    assert (root / "step-000000000001").exists()


def test_an_older_commit_waiting_for_the_dead_rank_is_given_up(tmp_path: Path) -> None:
    """Step 2 (persisted) waits for rank 3's file, which never comes: the
    dying checkpoint gives it up at once instead of waiting out
    ``commit_timeout`` (60 s) behind it, and commits step 3 with rank 3's
    share written by rank 2."""
    _, out, procs = start(tmp_path, 60, "inflight")
    root = tmp_path / "ckpt"
    t0 = time.monotonic()
    codes = stop(tmp_path, procs, dead=[3])
    secs = time.monotonic() - t0
    stderr = {r: (tmp_path / f"stderr-{r}").read_text() for r in range(3)}
    assert codes == {0: 143, 1: 143, 2: 143}, stderr
    assert secs < 40, (secs, stderr)
    for r in range(3):
        report = dying(out, r)
        assert report["ok"] is True, report
        assert report["committed_step"] == 3, report
        assert report["dead"] == [3], report
    assert dying(out, 2)["covered"] == [3]
    assert not (root / "step-000000000002").exists()
    ckpt = acp.Checkpointer(
        root,
        job="check",
        rank=3,
        world_size=4,
        shm_dir=tmp_path / "shm",
        mlock=False,
        replica_group=[2, 3],
    )
    try:
        got = ckpt.load(step=3, agree=False)
    finally:
        ckpt.close()
    want = state(2, 3)
    for k in ("w", "b", "n"):
        assert torch.equal(got[k], want[k]), k  # type: ignore[arg-type]
