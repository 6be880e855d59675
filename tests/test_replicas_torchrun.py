"""Peer replicas as a launcher runs them: two ``torchrun`` agents (``--nnodes
2 --nproc-per-node 2``, c10d rendezvous on 127.0.0.1), each "node" with its
own ``ACP_NODE_ID`` and shared-memory directory. Node B is lost (its
processes SIGKILLed, its shared memory deleted), the job is torn down and
restarted with a fresh node B: every rank resumes from the newest step,
B's ranks from A's replicas (``"peer"``), bit-exact."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.test_replicas import free_port

SCRIPT = Path(__file__).parent / "dist" / "replicas_torchrun.py"


class Node:
    """One torchrun agent: node ``name`` with shared memory ``shm``.
    Agents join the rendezvous with local addresses 127.0.0.1 (A) and
    127.0.0.2 (B); c10d ranks nodes by address, so A's ranks are 0 and 1."""

    def __init__(self, name: str, addr: str, shm: Path) -> None:
        self.name, self.addr, self.shm = name, addr, shm
        self.agent: subprocess.Popen[bytes] | None = None

    def start(self, tmp: Path, port: int, root: Path, out: Path, phase: str) -> None:
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", "2", "--nproc-per-node", "2",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", f"acp-{phase}", "--local-addr", self.addr,
            "--max-restarts", "0", "--monitor-interval", "0.2",
            str(SCRIPT), str(root), str(out), phase,
        ]  # fmt: skip
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "ACP_NODE_ID": self.name,
            "ACP_SHM_DIR": str(self.shm),
            "PYTHONPATH": str(Path(__file__).parents[1]),
        }
        with (tmp / f"agent-{self.name}-{phase}.log").open("wb") as log:
            self.agent = subprocess.Popen(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def ranks(self, out: Path) -> list[int]:
        return [r for r in range(4) if (out / f"node-{r}").read_text() == self.name]

    def kill(self, out: Path) -> None:
        """SIGKILLs the agent and its ranks (each rank has a session of
        its own under torchrun)."""
        assert self.agent is not None
        os.killpg(self.agent.pid, signal.SIGKILL)
        self.agent.wait(30)
        for r in self.ranks(out):
            pid = int((out / f"pid-{r}").read_text())
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            wait_gone(pid)

    def wait(self, tmp: Path, phase: str) -> None:
        assert self.agent is not None
        try:
            code = self.agent.wait(240)
        except subprocess.TimeoutExpired:
            os.killpg(self.agent.pid, signal.SIGKILL)
            raise
        log = (tmp / f"agent-{self.name}-{phase}.log").read_text()
        assert code == 0, log[-4000:]


def wait_gone(pid: int) -> None:
    """Waits until ``pid`` (killed, not our child) is gone."""
    deadline = time.monotonic() + 30
    while Path(f"/proc/{pid}").exists():
        stat = Path(f"/proc/{pid}/stat").read_text() if Path(f"/proc/{pid}").exists() else ""
        if ") Z " in stat:
            return  # a zombie holds no memory mapping and no lock
        assert time.monotonic() < deadline, f"pid {pid} still alive"
        time.sleep(0.02)


def wait_for(paths: list[Path], nodes: list[Node], tmp: Path, phase: str) -> None:
    deadline = time.monotonic() + 240
    while not all(p.exists() for p in paths):
        for n in nodes:
            assert n.agent is not None
            if n.agent.poll() is not None:
                log = (tmp / f"agent-{n.name}-{phase}.log").read_text()
                raise AssertionError(f"agent {n.name} ended: {log[-4000:]}")
        assert time.monotonic() < deadline, f"not all of {paths} appeared"
        time.sleep(0.05)


def test_two_torchrun_agents_a_lost_node_resumes_from_peer_replicas(tmp_path: Path) -> None:
    root, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    a = Node("a", "127.0.0.1", tmp_path / "shm-a")
    b = Node("b", "127.0.0.2", tmp_path / "shm-b")
    nodes = [a, b]
    for n in nodes:
        n.shm.mkdir()
    port = free_port()
    for n in nodes:
        n.start(tmp_path, port, root, out, "train")
    wait_for([out / f"trained-{r}" for r in range(4)], nodes, tmp_path, "train")
    assert a.ranks(out) == [0, 1]
    assert b.ranks(out) == [2, 3]
    # Node B is lost with its RAM; the launcher then tears the job down.
    b.kill(out)
    shutil.rmtree(b.shm)
    a.kill(out)
    # The job restarts with a fresh node B.
    b.shm.mkdir()
    for p in out.iterdir():
        p.unlink()
    port = free_port()
    for n in nodes:
        n.start(tmp_path, port, root, out, "resume")
    for n in nodes:
        n.wait(tmp_path, "resume")
    got = {r: json.loads((out / f"resume-{r}.json").read_text()) for r in range(4)}
    for r in range(4):
        assert got[r]["step"] == 2, got
        assert got[r]["exact"], got
    assert [got[r]["source"] for r in range(4)] == ["ram", "ram", "peer", "peer"], got
