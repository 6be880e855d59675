"""Peer replicas (``Checkpointer(replicas=1)``): 2 nodes x 2 ranks on this
machine, node B lost (its processes gone, its shared memory deleted) and
replaced by an empty one: every rank resumes from the newest step, B's
ranks from A's replicas, bit-exact, also when storage lost that step; a
replica that fails verification is skipped, naming it, for storage; a node
lost while a replica is in flight leaves the newest step complete
everywhere, never a torn one."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from acp import replica
from acp.replica import placement

SCRIPT = Path(__file__).parent / "dist" / "replicas.py"


def job_dirs(tmp_path: Path) -> tuple[Path, Path, list[Path]]:
    """The job's checkpoint root, the processes' report directory and one
    shared-memory directory per node (A, B), the last two created."""
    root, out = tmp_path / "ckpt", tmp_path / "out"
    shm = [tmp_path / "shm-a", tmp_path / "shm-b"]
    for d in (out, *shm):
        d.mkdir()
    return root, out, shm


def test_inventories_travel_as_json_and_a_bad_one_fails() -> None:
    """The ranks' node names and inventories are gathered as JSON (never
    pickle): plain values round-trip, an oversized claim and a value that
    is not a list of integers fail with a message naming the problem."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.new_group(backend="gloo")
        value = {"local": [3, 4], "held": [1, 3], "committed": [], "node": "a"}
        assert replica.all_gather_json(value, group) == [value]
        limit = replica.MAX_GATHERED
        replica.MAX_GATHERED = 8
        try:
            with pytest.raises(RuntimeError, match="claims"):
                replica.all_gather_json(value, group)
        finally:
            replica.MAX_GATHERED = limit
        with pytest.raises(RuntimeError, match="held is not a list of integers"):
            replica._ints(["1", 2], "held")
    finally:
        dist.destroy_process_group()


def test_placement_puts_replicas_on_other_nodes() -> None:
    assert placement(["a", "a", "b", "b"], 1) == {0: [2], 1: [3], 2: [0], 3: [1]}
    assert placement(["a", "b", "c"], 2) == {0: [1, 2], 1: [2, 0], 2: [0, 1]}
    assert placement(["a", "a"], 1) == {0: [], 1: []}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(root: Path, out: Path, shm: list[Path], phase: str) -> None:
    """Runs one phase of tests/dist/replicas.py (its docs say what each does)."""
    cmd = [sys.executable, str(SCRIPT), root, out, *shm, free_port(), phase]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(
        list(map(str, cmd)), env=env, capture_output=True, text=True, timeout=240, check=False
    )
    assert p.returncode == 0, p.stderr[-4000:]


@pytest.mark.parametrize("storage_lost", [False, True])
def test_a_replaced_node_resumes_from_peer_replicas(tmp_path: Path, storage_lost: bool) -> None:
    root, out, shm = job_dirs(tmp_path)
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


def lose_node_b(shm: list[Path]) -> None:
    shutil.rmtree(shm[1])
    shm[1].mkdir()


def resumed_exact(out: Path, step: int) -> dict[int, dict[str, Any]]:
    """Each rank's report of its ``resume`` phase, checked: it resumed
    from ``step``, bit-exact, no copy rejected."""
    got = {r: json.loads((out / f"resume-{r}.json").read_text()) for r in range(4)}
    for r in range(4):
        assert got[r]["step"] == step, got
        assert got[r]["exact"], got
        assert got[r]["rejected"] is None, got
    return got


@pytest.mark.parametrize("node_lost", [False, True])
def test_a_data_parallel_ram_snapshot_resumes_after_a_crash_and_a_node_loss(
    tmp_path: Path, node_lost: bool
) -> None:
    """A ``replicated=True`` state whose newest step is a RAM snapshot
    (never committed, so no index says which rank wrote which tensor):
    after every process crashed, and after node B is lost as well, every
    rank resumes from that step bit-exact; the tensors other ranks wrote
    come from their slots or replica slots on its node, or from a peer."""
    root, out, shm = job_dirs(tmp_path)
    run(root, out, shm, "train-dp")
    assert not (root / "step-000000000003").exists()
    if node_lost:
        lose_node_b(shm)
    run(root, out, shm, "resume-dp")
    got = resumed_exact(out, 3)
    if node_lost:
        # Step 3 is not committed: A's ranks read every file from RAM on
        # their node (the slots of the ranks beside them, B's images in
        # replica slots); B's ranks take every file from A's ranks.
        for r in range(4):
            where = "ram" if r < 2 else "peer"
            assert got[r]["source"] == where, got
            assert got[r]["ranks"] == {str(k): where for k in range(4)}, got
    else:
        # Every rank held step 3 after the crash: the collective open
        # committed it. The files of the ranks beside a rank come from
        # their slots, those of the other node's ranks from the replica
        # slots on this node (verified against the committed digests).
        assert (root / "step-000000000003").exists()
        for r in range(4):
            assert got[r]["source"] == "ram", got
            assert got[r]["ranks"] == {str(k): "ram" for k in range(4)}, got


def test_a_replica_group_lost_with_its_node_resumes_from_the_peers(tmp_path: Path) -> None:
    """HSDP: replica groups {0, 1} and {2, 3}, one per node; node B is
    lost, with the whole of group {2, 3} and every slot of its RAM-only
    step 3. B's ranks take their own files and each other's from A's
    replicas, and every rank resumes from step 3, bit-exact."""
    root, out, shm = job_dirs(tmp_path)
    run(root, out, shm, "train-hsdp")
    lose_node_b(shm)
    run(root, out, shm, "resume-hsdp")
    got = resumed_exact(out, 3)
    assert got[0]["ranks"] == got[1]["ranks"] == {"0": "ram", "1": "ram"}, got
    assert got[2]["ranks"] == got[3]["ranks"] == {"2": "peer", "3": "peer"}, got


def test_a_replica_that_fails_verification_is_skipped_for_storage(tmp_path: Path) -> None:
    root, out, shm = job_dirs(tmp_path)
    run(root, out, shm, "train")
    # One byte of each of B's images of step 2 changes in A's replica slots.
    hit = 0
    for r in (2, 3):
        g = torch.Generator().manual_seed(r * 1000 + 2)
        needle = torch.randn(64, 1024, generator=g).numpy().tobytes()[:4096]
        for slot in shm[0].rglob(f"*-replica-r{r:05}-on-r*"):
            data = bytearray(slot.read_bytes())
            at = data.find(needle)
            if at >= 0:
                data[at + 100] ^= 0xFF
                slot.write_bytes(bytes(data))
                hit += 1
    assert hit == 2
    lose_node_b(shm)
    run(root, out, shm, "resume")
    got = {r: json.loads((out / f"resume-{r}.json").read_text()) for r in range(4)}
    for r in range(4):
        assert got[r]["step"] == 2, got
        assert got[r]["exact"], got
    assert [got[r]["source"] for r in range(4)] == ["ram", "ram", "storage", "storage"]
    for r in (2, 3):
        holder = r - 2
        named = f"rank {r}'s image of step 2 in rank {holder}'s replica"
        assert named in got[r]["rejected"], got[r]
        assert "digest mismatch" in got[r]["rejected"], got[r]
        assert any(named in line for line in got[r]["warnings"]), got[r]
    for r in (0, 1):
        assert got[r]["rejected"] is None, got[r]


def test_a_node_lost_while_a_replica_is_in_flight_restores_a_complete_step(
    tmp_path: Path,
) -> None:
    root, out, shm = job_dirs(tmp_path)
    run(root, out, shm, "inflight")
    for r in (0, 1):
        # A's exchange of step 3 broke off with B: step 3 is not replicated.
        inflight = json.loads((out / f"inflight-{r}.json").read_text())
        assert not isinstance(inflight["replicated"], list), inflight
    assert not (out / "inflight-2.json").exists()
    lose_node_b(shm)
    run(root, out, shm, "resume")
    got = {r: json.loads((out / f"resume-{r}.json").read_text()) for r in range(4)}
    # Step 3 is in A's RAM only (B's image of it never landed anywhere):
    # every rank resumes from step 2, B's ranks from A's replicas.
    for r in range(4):
        assert got[r]["step"] == 2, got
        assert got[r]["exact"], got
        assert got[r]["rejected"] is None, got
    assert [got[r]["source"] for r in range(4)] == ["ram", "ram", "peer", "peer"], got


def test_a_silent_peer_fails_replication_after_the_timeout(tmp_path: Path) -> None:
    root, out, shm = job_dirs(tmp_path)
    run(root, out, shm, "silent")
    for r in (0, 1):
        got = json.loads((out / f"silent-{r}.json").read_text())
        # Step 3's exchange waited replica_timeout for B, then failed...
        assert isinstance(got["3"], str), got
        assert "timed out" in got["3"].lower() or "timeout" in got["3"].lower(), got
        # ... and replication is off after it, naming that failure.
        assert isinstance(got["4"], str), got
        assert "off after step 3's exchange failed" in got["4"], got


@pytest.mark.parametrize(
    "header",
    [
        [3, 10, 4096, 4096, 1],  # another rank's image
        [2, 9, 4096, 4096, 1],  # another step's (a stream out of step)
        [2, 10, 4096, 4096, 1 << 40],  # a digest count that sizes a terabyte
        [2, 10, -5, 0, 0],  # neither an image nor "nothing"
        [3, 10, -1, 0, 0],  # another rank's "nothing"
    ],
)
def test_a_replica_header_that_is_not_the_expected_image_is_refused(
    monkeypatch: pytest.MonkeyPatch, header: list[int]
) -> None:
    """The header a peer sends is checked against the image expected from
    it (its source rank and the step of the exchange) before a replica
    slot or any memory is sized by it."""
    from acp import replica

    def recv(t: torch.Tensor, src: int, group: object) -> None:
        t.copy_(torch.tensor(header, dtype=torch.int64))

    def begin(*args: object) -> None:
        raise AssertionError(f"a receipt was begun for {args}")

    monkeypatch.setattr(replica.dist, "recv", recv)
    tr = object.__new__(replica.TorchReplicas)
    tr.rank, tr.group = 0, None  # type: ignore[assignment]
    with pytest.raises(RuntimeError, match="from rank 2 says"):
        tr._irecv(2, begin, 2, 10)
    # The expected header still passes.
    header[:] = [2, 10, -1, 0, 0]
    assert tr._irecv(2, begin, 2, 10) is None
