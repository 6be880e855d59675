"""2 nodes × 2 ranks with peer replicas, as 4 processes on one machine.

``python replicas.py ROOT OUT SHM_A SHM_B PORT PHASE`` starts 4 ranks
(torch.multiprocessing, a gloo group rendezvousing on 127.0.0.1:PORT):
ranks 0-1 are node "a" (``ACP_NODE_ID=a``, shared memory SHM_A), ranks 2-3
node "b". A launcher starts one agent per node; one process standing in for
both keeps the test to one command, and each rank still sees only its
node's id and directory.

- ``train``: saves steps 1 and 2 with ``replicas=1``, waits for each step
  to be replicated and committed.
- ``inflight``: ``train``, then step 3 as a RAM snapshot (``persist=False``)
  during whose replication node B dies: B's ranks exit (no cleanup, as if
  killed) after sending the header of their image and before its bytes.
  A's ranks write OUT/inflight-RANK.json (whether step 3 was replicated,
  and the error) and exit without closing: the launcher tears the job down.
- ``silent``: ``train``, then node A saves steps 3 and 4 while B's ranks,
  alive, never exchange them (``replica_timeout=3``): A's ranks write how
  each step's replication ended to OUT/silent-RANK.json; every rank exits
  without closing.
- ``resume``: loads (collective), writes each rank's step, source, whether
  the state is bit-exact, why a copy was rejected and the ``acp`` logger's
  warnings to OUT/resume-RANK.json, then saves the next two steps as a
  resumed trainer would, each replicated.
- ``train-dp`` / ``resume-dp``: the same with a data-parallel state, one
  state on every rank saved ``replicated=True`` (each rank's file holds
  about a quarter of its tensors): steps 1 and 2 persisted, then step 3 a
  RAM snapshot (``persist=False``), replicated, and every process ends
  without closing (a crash). ``resume-dp`` loads, checks every tensor
  against step 3's and saves two more steps the same way.
- ``train-hsdp`` / ``resume-hsdp``: the same with replica groups {0, 1}
  and {2, 3}, one per node (HSDP's replicated dimension within a node):
  each rank's file holds about half of its group's tensors.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import acp
from acp.replica import TorchReplicas


def state(rank: int, step: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(rank * 1000 + step)
    return {"w": torch.randn(64, 1024, generator=g), "step": step}


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def die_mid_send(replicas: TorchReplicas) -> None:
    """Makes this rank's next exchange send its image's header, then end
    the process before the image's bytes and digests: they are never
    posted (an isend posted before the exit may still land whole)."""

    def isend(to: int, image: Any, rank: int, step: int) -> list[Any]:
        r, s, n, chunk, _ = image.meta()
        header = torch.tensor([r, s, n, chunk, -(-n // chunk)], dtype=torch.int64)
        dist.isend(header, dst=to, group=replicas.group).wait()
        os._exit(0)

    replicas._isend = isend  # type: ignore[method-assign]


def train(ckpt: acp.Checkpointer, rank: int) -> None:
    for step in (1, 2):
        h = ckpt.save(step, state(rank, step))
        h.wait()
        assert h.wait_replicated(120) == [(rank + 2) % 4]
    # This rank's exchanges also received its source's images; the
    # previous one stays beside the newest.
    held = ckpt.stats()["replicas"]
    assert held["held"] == 2, held
    assert held["steps"] == {(rank + 2) % 4: [1, 2]}, held
    assert held["bytes"] > 2 * 64 * 1024 * 4, held
    # Sealed with their sums, a persisted step's replicas take its digests
    # after: step 1's came before step 2's exchange began.
    digests = {s: d for _, s, _, _, d in ckpt._engine.replicas()}
    assert len(digests[1]) > 0 and len(digests[1]) % 32 == 0, digests


def dp_state(step: int) -> dict[str, object]:
    """A data-parallel state: the same on every rank."""
    g = torch.Generator().manual_seed(7000 + step)
    w = {f"layer{i}": torch.randn(16 * (i + 1), 256, generator=g) for i in range(8)}
    return {"model": w, "step": step}


def dp_equal(got: Any, want: Any) -> bool:
    return got["step"] == want["step"] and all(
        torch.equal(got["model"][k], v) for k, v in want["model"].items()
    )


def train_dp(ckpt: acp.Checkpointer, rank: int) -> None:
    for step in (1, 2):
        h = ckpt.save(step, dp_state(step), replicated=True)
        h.wait()
        assert h.wait_replicated(120) == [(rank + 2) % 4]
    h = ckpt.save(3, dp_state(3), replicated=True, persist=False)
    assert h.wait_replicated(120) == [(rank + 2) % 4]
    # This rank's file holds its share of the tensors only.
    assert 0 < len(ckpt._engine.load(step=3).entries()) < 8
    os._exit(0)  # a crash: nothing closed, the RAM snapshot stays


def resume_dp(ckpt: acp.Checkpointer, rank: int, out: str, warned: Warnings) -> None:
    got = ckpt.load()
    stats = ckpt.last_load
    assert stats is not None
    result = {
        "step": got["step"],
        "source": stats.source,
        "exact": dp_equal(got, dp_state(int(got["step"]))),
        "ranks": {str(r): v for r, v in (stats.ranks or {}).items()},
        "rejected": stats.rejected,
        "warnings": warned.lines,
    }
    Path(out, f"resume-{rank}.json").write_text(json.dumps(result))
    for nxt in (int(got["step"]) + 1, int(got["step"]) + 2):
        h = ckpt.save(nxt, dp_state(nxt), replicated=True)
        h.wait()
        h.wait_replicated(120)


def outcome(h: acp.SaveHandle) -> Any:
    """The holders of ``h``'s step, or the error of its replication."""
    try:
        return h.wait_replicated(60)
    except Exception as e:  # noqa: BLE001 - recorded for the test
        return repr(e)


def main(rank: int, root: str, out: str, shms: list[str], port: int, phase: str) -> None:
    node = rank // 2
    os.environ["ACP_NODE_ID"] = "ab"[node]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    warned = Warnings()
    logging.getLogger("acp").addHandler(warned)
    ckpt = acp.Checkpointer(
        root,
        job="replicas",
        shm_dir=shms[node],
        ring_bytes=64 << 20,
        replicas=1,
        replica_timeout=3 if phase == "silent" else 30,
        replica_group=[2 * node, 2 * node + 1] if phase.endswith("hsdp") else None,
    )
    if phase == "train":
        train(ckpt, rank)
    elif phase in ("train-dp", "train-hsdp"):
        train_dp(ckpt, rank)
    elif phase in ("resume-dp", "resume-hsdp"):
        resume_dp(ckpt, rank, out, warned)
    elif phase == "inflight":
        train(ckpt, rank)
        if node == 1:
            assert ckpt._replicas is not None
            die_mid_send(ckpt._replicas)
        h = ckpt.save(3, state(rank, 3), persist=False)
        got = outcome(h)
        Path(out, f"inflight-{rank}.json").write_text(json.dumps({"replicated": got}))
        os._exit(0)
    elif phase == "silent":
        # Node B's ranks live on but never exchange step 3: A's exchange
        # gives up after replica_timeout, and replication stays off.
        train(ckpt, rank)
        if node == 0:
            h3 = ckpt.save(3, state(rank, 3), persist=False)
            h4 = ckpt.save(4, state(rank, 4), persist=False)
            got = {"3": outcome(h3), "4": outcome(h4)}
            Path(out, f"silent-{rank}.json").write_text(json.dumps(got))
        dist.barrier()  # B outlives A's wait
        os._exit(0)
    else:
        got = ckpt.load()
        stats = ckpt.last_load
        assert stats is not None
        want = state(rank, got["step"])
        exact = bool(torch.equal(got["w"], want["w"]))  # type: ignore[arg-type]
        result = {
            "step": got["step"],
            "source": stats.source,
            "exact": exact,
            "rejected": stats.rejected,
            "warnings": warned.lines,
        }
        Path(out, f"resume-{rank}.json").write_text(json.dumps(result))
        # Training goes on: the next step replaces any newer snapshot a
        # rank still holds from before the restart. Two steps: the second
        # needs the replica slot the restore pinned to send from.
        for nxt in (int(got["step"]) + 1, int(got["step"]) + 2):
            h = ckpt.save(nxt, state(rank, nxt))
            h.wait()
            h.wait_replicated(120)
    ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    root, out, shm_a, shm_b, port, phase = sys.argv[1:7]
    # Forked by a server that imported torch and acp once (each rank is
    # still a process of its own, with its own engine and group): a spawned
    # rank would import torch again, 4 s of CPU each on this 2-core host.
    mp.set_forkserver_preload(["torch", "torch.distributed", "acp", "acp.torch"])
    mp.start_processes(
        main,
        args=(root, out, [shm_a, shm_b], int(port), phase),
        nprocs=4,
        start_method="forkserver",
    )
