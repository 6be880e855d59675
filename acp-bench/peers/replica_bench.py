"""Peer replicas, figures: 2 nodes x 2 ranks on this machine (4 processes,
gloo on 127.0.0.1, each node its own ``ACP_NODE_ID`` and shared-memory
directory; ``--per-node`` sets the ranks per node), ``--mib`` MiB of fp32
tensors per rank (default 256).

One run measures, side by side:

- **the stall** of ``save`` with ``replicas=1`` and without (two
  checkpointers on two roots in the same processes, saves alternating);
- **replication throughput**: bytes of a rank's image over the time from
  ``save`` returning to ``wait_replicated`` returning (hashing the image
  and the gloo exchange: every rank sends its image and receives its
  source's), against a **raw gloo send** of the same bytes in the same
  processes (every rank ``isend``s a buffer of the image's size to its
  holder and ``recv``s its source's, on a gloo group of its own, with
  nothing else running), **paired**: each measured replication is
  followed, once its save's background work has ended, by one raw
  exchange, and the figure is the median of the per-pair ratios (the
  host's load changes by the minute; a block of raw exchanges at the end
  of the run is reported too). Measured three ways in the same run: over the
  persisted saves from the second on (the save's own flush writes the
  image while it is replicated; as in the first version of this bench,
  so the second save, the first into the second replica slot, pays for
  faulting that slot's pages in); over the persisted saves from the
  third on (every replica slot warm: the steady state); and over
  ``persist=False`` saves (RAM snapshots, the RAM tier: no flush runs
  beside the exchange, the snapshot's background hash does, and the
  exchange shares it), after as many unmeasured ones;
- **restore of a replaced node**: node B is lost (its processes end, its
  shared memory is deleted) and the job restarts with an empty B; B's ranks
  restore the newest step from A's replicas (``load()``, source "peer"),
  then read the same step from storage (``load(step, storage_only=True)``:
  O_DIRECT reads where the file system takes them, so from the device,
  not the page cache; on tmpfs they are page-cache reads), unthrottled and
  with storage capped at ``--throttle-mbps`` per node (default 500 MB/s,
  a shared file system's per-node share), shared by the node's ranks.

The throttle is ``acp._acp.FaultInjector.throttle`` (the fault-injecting probe
of test-util builds, which ``make build-dev`` builds): each chunk read or
write of the engine waits for its share of the capped pipe. Each rank caps
its engine at ``throttle / ranks per node``.

    python acp-bench/peers/replica_bench.py --mib 256 --dir /path/on/disk --json out.json

Prints a table; ``--json`` writes every figure. Medians over ``--saves``
saves (after one unmeasured) and ``--restores`` restores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import acp
from acp.replica import placement

PER_NODE = 2
"""Ranks per node by default (``--per-node``); two nodes."""
CHUNK = 4 << 20
"""The engine's chunk: the unit of its storage I/O, and of the throttle."""


def state(rank: int, step: int, mib: int) -> dict[str, object]:
    """``mib`` MiB of fp32 in 4 tensors, different per rank and step."""
    g = torch.Generator().manual_seed(rank * 1000 + step)
    n = (mib << 20) // 4 // 4
    return {f"w{i}": torch.randn(n, generator=g) for i in range(4)} | {"step": step}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


class RawExchange:
    """The baseline: a raw gloo exchange on a group of its own, as the
    replica exchange does it (``isend`` ``nbytes`` to the holder, ``recv``
    the source's), from buffers allocated and written once."""

    def __init__(self, rank: int, a: argparse.Namespace) -> None:
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=600))
        holders = placement(["a"] * a.per_node + ["b"] * a.per_node, 1)
        self.to = holders[rank][0]
        self.src = next(r for r, hs in holders.items() if rank in hs)
        self.out = torch.empty(0, dtype=torch.uint8)
        self.data = torch.empty(0, dtype=torch.uint8)

    def once(self, nbytes: int, beside: Any = None) -> float:
        """Seconds of one exchange, every rank starting together.
        ``beside``: called right before the exchange is timed, it starts
        background work and returns what waits for that work after it."""
        if self.data.numel() != nbytes:
            self.out = torch.ones(nbytes, dtype=torch.uint8)
            self.data = torch.ones(nbytes, dtype=torch.uint8)
        dist.barrier(group=self.group)
        done = beside() if beside is not None else None
        t = time.perf_counter()
        w = dist.isend(self.data, dst=self.to, group=self.group)
        dist.recv(self.out, src=self.src, group=self.group)
        w.wait()
        secs = time.perf_counter() - t
        if done is not None:
            done()
        return secs


def raw_gloo(
    raw: RawExchange, nbytes: int, a: argparse.Namespace, beside: Any = None
) -> list[float]:
    """Seconds of ``a.saves`` raw exchanges, one after another. ``beside``
    (see ``RawExchange.once``): the bench passes a save of the checkpointer
    without replicas, so that the exchange runs beside that save's flush,
    or its RAM snapshot's hash, as a replica exchange does; that figure
    explains the replication one, it is not its baseline."""
    return [raw.once(nbytes, beside) for _ in range(a.saves)]


def baselines(
    raw: RawExchange, rank: int, a: argparse.Namespace, nbytes: int, without: Any, *, last: int
) -> dict[str, list[float]]:
    """The raw gloo exchanges, one after another at the end of the run,
    alone and beside a save of ``without`` (the checkpointer without
    replicas; its steps after ``last``)."""
    steps = iter(range(last + 1, last + 1 + 2 * a.saves))
    s = state(rank, last, a.mib)

    def save_beside(persist: bool) -> Any:
        def start() -> Any:
            h = without.save(next(steps), s, persist=persist)
            # Committed, or (a RAM snapshot) hashed.
            return lambda: (h.wait(), without.wait())

        return start

    return {
        "raw_gloo_secs": raw_gloo(raw, nbytes, a),
        "raw_gloo_beside_flush_secs": raw_gloo(raw, nbytes, a, save_beside(True)),
        "raw_gloo_beside_snapshot_secs": raw_gloo(raw, nbytes, a, save_beside(False)),
    }


def train(rank: int, a: argparse.Namespace, port: int, out: Path) -> None:
    node = rank // a.per_node
    os.environ["ACP_NODE_ID"] = "ab"[node]
    shm = Path(a.shm, "ab"[node])
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2 * a.per_node,
        timeout=timedelta(seconds=600),
    )
    common: dict[str, Any] = {
        "shm_dir": shm,
        "ring_bytes": (a.mib << 20) * 8 + (64 << 20),
        "mlock": False,
        "commit_timeout": 600,
        "chunk_bytes": CHUNK,
        # Two steps per root on disk (the newest and its incremental base),
        # not every step: 12 GiB for the default run otherwise.
        "keep_last": 2,
    }
    with_rep = acp.Checkpointer(
        Path(a.work, "root"), job="bench", replicas=1, replica_timeout=600, **common
    )
    without = acp.Checkpointer(Path(a.work, "root-plain"), job="bench-plain", **common)
    stall: dict[str, list[float]] = {"replicas": [], "none": []}
    repl: list[float] = []
    # The raw exchange paired with each measured replication: run right
    # after it, once its save's background work has ended, so that both
    # see the same host (this machine's load changes by the minute).
    raw = RawExchange(rank, a)
    paired: list[float] = []
    nbytes = 0
    for step in range(a.saves + 1):
        s = state(rank, step, a.mib)
        dist.barrier()
        h = with_rep.save(step, s)
        t = time.perf_counter()
        h.wait_replicated(600)
        secs = time.perf_counter() - t
        h.wait()
        nbytes = int(h.stats.tensor_bytes)
        dist.barrier()
        h0 = without.save(step, s)
        h0.wait()
        if step > 0:  # the first save of each ring faults its memory in
            stall["replicas"].append(h.stats.stall_secs)
            stall["none"].append(h0.stats.stall_secs)
            repl.append(secs)
            paired.append(raw.once(nbytes))
    # RAM snapshots: replicated with no flush beside them.
    ram: list[float] = []
    paired_ram: list[float] = []
    first = a.saves + 1
    for step in range(first, first + 2 * a.saves):
        s = state(rank, step, a.mib)
        dist.barrier()
        h = with_rep.save(step, s, persist=False)
        t = time.perf_counter()
        h.wait_replicated(600)
        if step >= first + a.saves:
            ram.append(time.perf_counter() - t)
            with_rep.wait()  # the snapshot's own sum
            paired_ram.append(raw.once(nbytes))
    # The newest step is committed, as the restore phase reads it from
    # storage too.
    last = first + 2 * a.saves
    dist.barrier()
    h = with_rep.save(last, state(rank, last, a.mib), persist=True)
    h.wait_replicated(600)
    h.wait()
    result = {
        "stall": stall,
        "replicate_secs": repl,
        "replicate_ram_only_secs": ram,
        "raw_gloo_paired_secs": paired,
        "raw_gloo_paired_ram_only_secs": paired_ram,
        "bytes": nbytes,
        **baselines(raw, rank, a, nbytes, without, last=last),
    }
    Path(out, f"train-{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    # The job ends without closing (as if killed): node B's RAM is then lost.
    os._exit(0)


def restore(rank: int, a: argparse.Namespace, port: int, out: Path) -> None:
    node = rank // a.per_node
    os.environ["ACP_NODE_ID"] = "ab"[node]
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2 * a.per_node,
        timeout=timedelta(seconds=600),
    )
    faults = acp._acp.FaultInjector()
    ckpt = acp.Checkpointer(
        Path(a.work, "root"),
        job="bench",
        shm_dir=Path(a.shm, "ab"[node]),
        ring_bytes=(a.mib << 20) * 8 + (64 << 20),
        mlock=False,
        commit_timeout=600,
        chunk_bytes=CHUNK,
        replicas=1,
        replica_timeout=600,
        faults=faults,
        # The storage restores below are timed one after another: a step
        # read again into the ring after one of them would run beside the
        # next (and put the next ones into its slot).
        keep_restored=False,
    )
    dist.barrier()
    t = time.perf_counter()
    got = ckpt.load()
    peer = time.perf_counter() - t
    stats = ckpt.last_load
    assert stats is not None
    step = int(got["step"])
    del got
    result: dict[str, Any] = {"step": step, "source": stats.source, "peer_secs": peer}
    chunk = CHUNK
    for name, cap in (("storage_secs", 0), ("storage_throttled_secs", a.throttle_mbps)):
        faults.throttle(int(cap * 1e6) // a.per_node, chunk)
        secs = []
        for _ in range(a.restores):
            dist.barrier()
            t = time.perf_counter()
            ckpt.load(step=step, storage_only=True, agree=False)
            secs.append(time.perf_counter() - t)
        result[name] = secs
    faults.throttle(0, chunk)
    Path(out, f"restore-{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    ckpt.close()
    dist.destroy_process_group()


def worker(rank: int, phase: str, a: argparse.Namespace, port: int, out: Path) -> None:
    torch.set_num_threads(1)
    (train if phase == "train" else restore)(rank, a, port, out)


def spawn(fn: Any, args: tuple[Any, ...], nprocs: int) -> None:
    """Runs ``fn(rank, *args)`` in ``nprocs`` processes forked by a server
    that imported torch and acp once (a spawned rank would import torch
    again: 4 s of CPU each on a 2-core host; nothing timed here includes
    it, but the run is that much shorter)."""
    mp.set_forkserver_preload(["torch", "torch.distributed", "acp", "acp.torch"])
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=256, help="MiB per rank (default 256)")
    p.add_argument("--saves", type=int, default=3, help="measured saves (default 3)")
    p.add_argument("--restores", type=int, default=2, help="storage reads (default 2)")
    p.add_argument("--throttle-mbps", type=float, default=500.0, help="storage cap per node, MB/s")
    p.add_argument(
        "--per-node", type=int, default=PER_NODE, help=f"ranks per node (default {PER_NODE})"
    )
    p.add_argument("--dir", default=None, help="where the roots go (a disk, not tmpfs)")
    p.add_argument("--json", default=None, help="write the figures here")
    a = p.parse_args(argv)
    a.work = tempfile.mkdtemp(prefix="acp-replica-bench-", dir=a.dir)
    # Each node's rings in RAM, as on a real node (a ring in a directory on
    # disk would write every image back to the disk: page-cache writeback
    # competing with the exchange and the storage reads).
    a.shm = tempfile.mkdtemp(prefix="acp-replica-bench-", dir="/dev/shm")
    load_before = os.getloadavg()[0]
    try:
        out = Path(a.work, "out")
        out.mkdir()
        for n in "ab":
            Path(a.shm, n).mkdir()
        spawn(worker, ("train", a, free_port(), out), 2 * a.per_node)
        shutil.rmtree(Path(a.shm, "b"))  # node B is lost with its RAM
        Path(a.shm, "b").mkdir()
        spawn(worker, ("restore", a, free_port(), out), 2 * a.per_node)
        report = summarise(a, out)
        report["loadavg"] = [load_before, os.getloadavg()[0]]
    finally:
        shutil.rmtree(a.work, ignore_errors=True)
        shutil.rmtree(a.shm, ignore_errors=True)
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    print_table(report)
    return report


def summarise(a: argparse.Namespace, out: Path) -> dict[str, Any]:
    ranks = range(2 * a.per_node)
    train = [json.loads(Path(out, f"train-{r}.json").read_text()) for r in ranks]
    rest = [json.loads(Path(out, f"restore-{r}.json").read_text()) for r in ranks]
    nbytes = train[0]["bytes"]
    b = range(a.per_node, 2 * a.per_node)  # node B's ranks
    repl = median([s for t in train for s in t["replicate_secs"]])
    # Saves from the third on: both replica slots were written once.
    warm = median([s for t in train for s in t["replicate_secs"][1:]])
    ram = median([s for t in train for s in t["replicate_ram_only_secs"]])
    raw = median([s for t in train for s in t["raw_gloo_secs"]])
    # Each replication over the raw exchange run right after it (a ratio
    # of throughputs: raw seconds over replication seconds).
    pairs = [p / x for t in train for p, x in zip(t["raw_gloo_paired_secs"], t["replicate_secs"])]
    pairs_ram = [
        p / x
        for t in train
        for p, x in zip(t["raw_gloo_paired_ram_only_secs"], t["replicate_ram_only_secs"])
    ]
    paired = median([s for t in train for s in t["raw_gloo_paired_secs"]])
    paired_ram = median([s for t in train for s in t["raw_gloo_paired_ram_only_secs"]])
    flush = median([s for t in train for s in t["raw_gloo_beside_flush_secs"]])
    snap = median([s for t in train for s in t["raw_gloo_beside_snapshot_secs"]])
    # A node's restore ends when its slowest rank has its state.
    peer = max(rest[r]["peer_secs"] for r in b)
    cold = max(median(rest[r]["storage_secs"]) for r in b)
    slow = max(median(rest[r]["storage_throttled_secs"]) for r in b)
    return {
        "args": {k: v for k, v in vars(a).items() if k != "work"},
        "bytes_per_rank": nbytes,
        "sources": [r["source"] for r in rest],
        "stall_ms": {
            "replicas": 1e3 * median([s for t in train for s in t["stall"]["replicas"]]),
            "none": 1e3 * median([s for t in train for s in t["stall"]["none"]]),
        },
        "replicate_gb_per_sec": nbytes / repl / 1e9,
        "replicate_warm_gb_per_sec": nbytes / warm / 1e9,
        "replicate_ram_only_gb_per_sec": nbytes / ram / 1e9,
        "raw_gloo_gb_per_sec": nbytes / raw / 1e9,
        "raw_gloo_paired_gb_per_sec": nbytes / paired / 1e9,
        "raw_gloo_paired_ram_only_gb_per_sec": nbytes / paired_ram / 1e9,
        "replicate_over_paired_raw": median(pairs),
        "replicate_ram_only_over_paired_raw": median(pairs_ram),
        "replicate_over_raw": raw / repl,
        "replicate_warm_over_raw": raw / warm,
        "replicate_ram_only_over_raw": raw / ram,
        "raw_beside_flush_gb_per_sec": nbytes / flush / 1e9,
        "raw_beside_snapshot_gb_per_sec": nbytes / snap / 1e9,
        "replicate_over_raw_beside_flush": flush / repl,
        "replicate_ram_only_over_raw_beside_snapshot": snap / ram,
        "restore_node_b_secs": {
            "peer": peer,
            "storage": cold,
            "storage_throttled": slow,
        },
        "storage_over_peer": cold / peer,
        "throttled_over_peer": slow / peer,
        "ranks": {"train": train, "restore": rest},
    }


def print_table(r: dict[str, Any]) -> None:
    mib = r["bytes_per_rank"] / (1 << 20)
    cap = r["args"]["throttle_mbps"]
    per = r["args"]["per_node"]
    print(
        f"2 nodes x {per} ranks, {mib:.0f} MiB per rank; "
        f"B's ranks restored from {r['sources'][per:]}"
    )
    load = r.get("loadavg")
    if load:
        print(f"load average before / after: {load[0]:.2f} / {load[1]:.2f}")
    print(f"{'figure':<44} {'value':>12}")
    restore = r["restore_node_b_secs"]
    rows = [
        ("stall with replicas=1 (ms, median)", r["stall_ms"]["replicas"]),
        ("stall without replicas (ms, median)", r["stall_ms"]["none"]),
        ("replication (GB/s, save -> replicated)", r["replicate_gb_per_sec"]),
        ("  the same, replica slots warm (GB/s)", r["replicate_warm_gb_per_sec"]),
        ("  persist=False saves, no flush (GB/s)", r["replicate_ram_only_gb_per_sec"]),
        ("raw gloo right after each (GB/s)", r["raw_gloo_paired_gb_per_sec"]),
        ("replication / raw gloo, per pair", r["replicate_over_paired_raw"]),
        ("raw gloo right after each persist=False (GB/s)",
         r["raw_gloo_paired_ram_only_gb_per_sec"]),
        ("persist=False / raw gloo, per pair", r["replicate_ram_only_over_paired_raw"]),
        ("raw gloo at the end of the run (GB/s)", r["raw_gloo_gb_per_sec"]),
        ("replication / raw gloo at the end", r["replicate_over_raw"]),
        ("  replica slots warm / raw gloo at the end", r["replicate_warm_over_raw"]),
        ("  persist=False / raw gloo at the end", r["replicate_ram_only_over_raw"]),
        ("raw gloo beside a save's flush (GB/s)", r["raw_beside_flush_gb_per_sec"]),
        ("raw gloo beside a RAM snapshot's hash (GB/s)", r["raw_beside_snapshot_gb_per_sec"]),
        ("replication / raw gloo beside a flush", r["replicate_over_raw_beside_flush"]),
        ("  persist=False / raw beside a snapshot",
         r["replicate_ram_only_over_raw_beside_snapshot"]),
        ("restore node B from peer RAM (s)", restore["peer"]),
        ("restore node B from storage (s)", restore["storage"]),
        (f"restore node B, storage at {cap:g} MB/s/node (s)", restore["storage_throttled"]),
        ("storage / peer", r["storage_over_peer"]),
        (f"storage at {cap:g} MB/s / peer", r["throttled_over_peer"]),
    ]  # fmt: skip
    for name, v in rows:
        print(f"{name:<44} {v:>12.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
