"""Peer replicas (``Checkpointer(replicas=1)``): 2 nodes x 2 ranks on this
machine, node B lost (its processes gone, its shared memory deleted) and
replaced by an empty one: every rank resumes from the newest step, B's
ranks from A's replicas, bit-exact, also when storage lost that step."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from acp.replica import placement

SCRIPT = Path(__file__).parent / "dist" / "replicas.py"


def test_placement_puts_replicas_on_other_nodes() -> None:
    assert placement(["a", "a", "b", "b"], 1) == {0: [2], 1: [3], 2: [0], 3: [1]}
    assert placement(["a", "b", "c"], 2) == {0: [1, 2], 1: [2, 0], 2: [0, 1]}
    assert placement(["a", "a"], 1) == {0: [], 1: []}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(root: Path, out: Path, shm: list[Path], phase: str) -> None:
    cmd = [sys.executable, str(SCRIPT), root, out, *shm, free_port(), phase]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(
        list(map(str, cmd)), env=env, capture_output=True, text=True, timeout=240, check=False
    )
    assert p.returncode == 0, p.stderr[-4000:]


@pytest.mark.parametrize("storage_lost", [False, True])
def test_a_replaced_node_resumes_from_peer_replicas(tmp_path: Path, storage_lost: bool) -> None:
    root, out = tmp_path / "ckpt", tmp_path / "out"
    shm = [tmp_path / "shm-a", tmp_path / "shm-b"]
    for d in (out, *shm):
        d.mkdir()
    run(root, out, shm, "train")
    shutil.rmtree(shm[1])  # node B is lost with its RAM
    shm[1].mkdir()
    if storage_lost:
        shutil.rmtree(root / "step-000000000002")
    run(root, out, shm, "resume")
    got = {r: json.loads((out / f"resume-{r}.json").read_text()) for r in range(4)}
    for r in range(4):
        assert got[r]["step"] == 2, got
        assert got[r]["exact"], got
    assert [got[r]["source"] for r in range(4)] == ["ram", "ram", "peer", "peer"]
